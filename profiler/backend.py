"""The measured device: CUDA (events, copy streams, pinned host memory) or the CPU (perf_counter,
memcpy between two buffers as the "link"). Everything that differs between the two lives here.
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from kvsim.errors import KvsimError


def runqueue_wait() -> float | None:
    """Seconds the calling thread has spent runnable but waiting for a core (Linux schedstat);
    None where the kernel does not say."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
            return int(f.read().split()[1]) * 1e-9
    except (OSError, ValueError, IndexError):
        return None


def is_oom(exc: BaseException) -> bool:
    """Out of device (or pinned host) memory, as raised by torch or the allocator."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


@dataclass
class Backend:
    kind: str  # "cuda" or "cpu"
    index: int | None  # CUDA device index (None on the CPU)
    dtype: torch.dtype  # dtype of weights, activations and KV cache
    threads: int | None = None  # CPU: torch intra-op threads used for kernels
    shrunk: list[str] = field(default_factory=list)  # sweeps cut short by memory

    @property
    def flush_bytes(self) -> int:
        """A working set well beyond the last-level cache (GPU L2 <= 60 MiB; CPU L3 <= 32 MiB
        here): sweeps rotate over this much memory, so each call finds its operands as cold as
        in a real decode step, where every layer has its own weights and KV."""
        return (512 if self.kind == "cuda" else 128) * 1024**2

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self.index) if self.kind == "cuda" else torch.device("cpu")

    @property
    def dtype_bytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    # ------------------------------------------------------------------------------ memory
    def host_buffer(self, nbytes: int, pinned: bool = True) -> torch.Tensor:
        """Host memory the link reads from / writes to (pinned on CUDA when asked)."""
        t = torch.empty(int(nbytes), dtype=torch.uint8, pin_memory=pinned and self.kind == "cuda")
        return t

    def device_buffer(self, nbytes: int) -> torch.Tensor:
        return self.alloc(int(nbytes), torch.uint8)

    def alloc(self, numel: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Every large device allocation of a sweep goes through here (tests fake OOM here)."""
        return torch.empty(int(numel), dtype=dtype or self.dtype, device=self.device)

    def free(self) -> None:
        if self.kind == "cuda":
            torch.cuda.synchronize(self.index)
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------------------ copies
    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """One link copy. CUDA: an asynchronous DMA; CPU: a single-threaded memcpy (numpy), so
        the "copy engine" and the kernels each hold one core when they overlap."""
        if self.kind == "cuda":
            dst.copy_(src, non_blocking=True)
        else:
            np.copyto(dst.numpy(), src.numpy())

    def sync(self) -> None:
        if self.kind == "cuda":
            torch.cuda.synchronize(self.index)

    # ------------------------------------------------------------------------------ timing
    def time(self, fn, warmup: int = 2, repeats: int = 10, target_s: float = 0.05,
             max_repeats: int | None = None, wall: bool = False, before=None) -> float:
        """Median seconds of ``fn()`` (CUDA events on the current stream; perf_counter on CPU).

        After ``warmup`` runs the repeat count adapts so one point takes about ``target_s``
        (never fewer than 5 repeats, never more than ``max_repeats``). ``wall``: on CUDA, time
        each call from the host, synchronised before and after (for copies whose host-side
        staging the device's events would not see, e.g. from pageable memory). ``before``: run
        before each call, outside the timed window (e.g. to evict the caches).
        """
        for _ in range(warmup):
            fn()
        self.sync()
        once = self._wall if wall and self.kind == "cuda" else self._once
        first = once(fn, before)
        n = int(min(max(target_s / max(first, 1e-7), 5), max(max_repeats or repeats, 5)))
        if self.kind == "cuda" and not wall:
            rest = self._events(fn, n - 1, before)
        else:
            rest = [once(fn, before) for _ in range(n - 1)]
        return statistics.median([first] + rest)

    def _events(self, fn, n: int, before=None) -> list[float]:
        """n calls enqueued back to back, each between two CUDA events."""
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(n)]
        for a, b in ev:
            if before is not None:
                before()
            a.record()
            fn()
            b.record()
        torch.cuda.synchronize(self.index)
        return [a.elapsed_time(b) * 1e-3 for a, b in ev]

    def _wall(self, fn, before=None) -> float:
        if before is not None:
            before()
        self.sync()
        t0 = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - t0

    def _once(self, fn, before=None) -> float:
        """One timed call. On the CPU the time the thread spent waiting for a core (other
        processes' load, Linux schedstat) is taken out, so the profile records the machine,
        not its momentary contention."""
        if self.kind == "cuda":
            return self._events(fn, 1, before)[0]
        if before is not None:
            before()
        w0 = runqueue_wait()
        t0 = time.perf_counter()
        fn()
        t = time.perf_counter() - t0
        w1 = runqueue_wait()
        if w0 is None or w1 is None or not 0 < w1 - w0 < t:
            return t  # no schedstat, no wait, or a wait outside the timed window
        return t - (w1 - w0)

    def evictor(self):
        """A callable that overwrites ``flush_bytes`` of device memory (evicting the caches);
        a smaller buffer (recorded) if memory is short."""
        n = self.flush_bytes // 4
        while n >= 1024:
            try:
                buf = self.alloc(n, torch.float32)
                if 4 * n < self.flush_bytes:
                    self.shrunk.append(f"cache evictor: out of memory at "
                                       f"{self.flush_bytes >> 20} MiB; using {4 * n >> 10} KiB")
                return lambda: buf.fill_(1.0)
            except Exception as e:
                if not is_oom(e):
                    raise
                self.free()
                n //= 2
        return lambda: None


def make_backend(gpu: int | None, device: str | None, threads: int | None = None) -> Backend:
    """The backend for ``--gpu N`` or ``--device cpu|cuda``; every refusal is one line."""
    if device not in (None, "cpu", "cuda"):
        raise KvsimError(f"--device {device!r}: expected cpu or cuda")
    if device == "cpu":
        if gpu is not None:
            raise KvsimError("--gpu and --device cpu exclude each other")
        if threads:
            torch.set_num_threads(threads)
        return Backend("cpu", None, torch.float32, threads=torch.get_num_threads())
    index = 0 if gpu is None else int(gpu)
    if not torch.cuda.is_available():
        raise KvsimError(f"--gpu {index}: CUDA is not available on this machine (torch "
                         f"{torch.__version__}); profile the CPU with --device cpu, or plan with "
                         "a catalog GPU (kvsim replay --gpu h100-sxm)")
    n = torch.cuda.device_count()
    if not 0 <= index < n:
        raise KvsimError(f"--gpu {index}: no such GPU; this machine has {n} "
                         f"(indices 0..{n - 1})")
    torch.cuda.set_device(index)
    return Backend("cuda", index, torch.bfloat16)
