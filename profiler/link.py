"""Host-link sweeps: bandwidth vs size (pinned/pageable, H2D/D2H, both at once), per-copy latency,
and scattered-row gathers at KV-row granularity (a device gather over pinned host memory, and
pack-then-copy).

On CUDA the "host" is (pinned or pageable) CPU memory and copies are DMAs timed with CUDA events.
On the CPU the "link" is a single-threaded memcpy between two buffers; "pageable" copies into
freshly allocated (not yet faulted-in) memory, the closest CPU analogue of staging through pageable
pages.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from profiler.backend import Backend, is_oom

KiB, MiB, GiB = 1024, 1024**2, 1024**3
ROW_SIZES = (256, 512, 1024, 2048)


def sizes(lo: int, hi: int, step: int) -> list[int]:
    out, n = [], lo
    while n <= hi:
        out.append(n)
        n *= step
    return out


def _alloc(be: Backend, nbytes: int, what: str, make) -> tuple[torch.Tensor | None, int]:
    """Allocate ``make(n)`` for n = nbytes, halving on out-of-memory; records each shrink."""
    n = nbytes
    while n >= 4 * KiB:
        try:
            return make(n), n
        except Exception as e:
            if not is_oom(e):
                raise
            be.free()
            n //= 2
    be.shrunk.append(f"{what}: out of memory even at 4 KiB")
    return None, 0


def _shrink_note(be: Backend, what: str, asked: int, got: int) -> None:
    if got < asked:
        be.shrunk.append(f"{what}: out of memory at {asked / MiB:.0f} MiB; "
                         f"measured up to {got / MiB:.0f} MiB")


class LinkBuffers:
    """The largest buffers once; sweeps use slices. Shrinks (and records it) on OOM."""

    def __init__(self, be: Backend, max_bytes: int, bidir: bool = True):
        self.be = be
        size = max(max_bytes, be.flush_bytes)
        self.host, a = _alloc(be, size, "link host pinned buffer",
                              lambda n: be.host_buffer(n, pinned=True))
        self.dev, b = _alloc(be, a, "link device buffer", be.device_buffer)
        self.page, c = _alloc(be, b, "link host pageable buffer",
                              lambda n: be.host_buffer(n, pinned=False))
        n = min(a, b, c)
        if bidir:
            self.host2, d = _alloc(be, n, "link second host buffer",
                                   lambda n: be.host_buffer(n, pinned=True))
            self.dev2, e = _alloc(be, d, "link second device buffer", be.device_buffer)
            n = min(n, d, e)
        _shrink_note(be, "link buffers (sizes above are not measured; below, fewer slices "
                     "rotate)", size, n)
        self.max = min(n, max_bytes)


def _slices(t: torch.Tensor, n: int, k: int = 16) -> list[torch.Tensor]:
    """Up to ``k`` disjoint ``n``-byte slices of ``t``: calls rotate over them (cold caches)."""
    return [t[i * n:(i + 1) * n] for i in range(max(1, min(k, t.numel() // n)))]


def _cycle(fns: list):
    state = [0]

    def fn():
        f = fns[state[0] % len(fns)]
        state[0] += 1
        f()
    return fn


def _copy_fn(be: Backend, direction: str, pinned: bool, buf: LinkBuffers, n: int):
    hosts = _slices(buf.host if pinned else buf.page, n)
    devs = _slices(buf.dev, n)
    pairs = list(zip(hosts, devs[1:] + devs[:1]))
    if be.kind == "cpu" and not pinned:  # into fresh, unfaulted memory each time
        fresh = lambda: torch.empty(n, dtype=torch.uint8).numpy()  # noqa: E731
        i = 0 if direction == "h2d" else 1
        return _cycle([lambda p=p: np.copyto(fresh(), p[i].numpy()) for p in pairs])
    if direction == "h2d":
        return _cycle([lambda h=h, d=d: be.copy(d, h) for h, d in pairs])
    return _cycle([lambda h=h, d=d: be.copy(h, d) for h, d in pairs])


def sweep_copies(be: Backend, buf: LinkBuffers, points: list[int], progress) -> dict:
    """Tables link_{h2d,d2h}_{pinned,pageable}: (bytes, seconds) per copy."""
    tables = {}
    for pinned in (True, False):
        for direction in ("h2d", "d2h"):
            name = f"link_{direction}_{'pinned' if pinned else 'pageable'}"
            xs, ts = [], []
            for n in points:
                if n > buf.max:
                    continue
                ts.append(be.time(_copy_fn(be, direction, pinned, buf, n), warmup=2,
                                  repeats=30, target_s=0.03, wall=not pinned))
                xs.append(n)
                progress()
            tables[name] = {"bytes": np.array(xs, np.int64), "seconds": np.array(ts)}
    return tables


def _quads(buf: LinkBuffers, n: int) -> list:
    """(host, device) for H2D and (host, device) for D2H, rotating over disjoint slices."""
    return list(zip(*(_slices(t, n, 8) for t in (buf.host, buf.dev, buf.host2, buf.dev2))))


def sweep_bidir(be: Backend, buf: LinkBuffers, points: list[int], progress) -> dict:
    """Table link_bidir_pinned: H2D and D2H of ``bytes`` each, at the same time."""
    xs, ts = [], []
    if be.kind == "cuda":
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

        def make(n):
            def one(a, b, c, d):
                cur = torch.cuda.current_stream()
                s1.wait_stream(cur)
                s2.wait_stream(cur)
                with torch.cuda.stream(s1):
                    b.copy_(a, non_blocking=True)
                with torch.cuda.stream(s2):
                    c.copy_(d, non_blocking=True)
                cur.wait_stream(s1)
                cur.wait_stream(s2)
            return _cycle([lambda q=q: one(*q) for q in _quads(buf, n)])
        pool = None
    else:
        pool = ThreadPoolExecutor(1)

        def make(n):
            def one(a, b, c, d):
                f = pool.submit(np.copyto, c.numpy(), d.numpy())
                np.copyto(b.numpy(), a.numpy())
                f.result()
            return _cycle([lambda q=q: one(*q) for q in _quads(buf, n)])
    try:
        for n in points:
            if n > buf.max:
                continue
            ts.append(be.time(make(n), warmup=2, repeats=20, target_s=0.03))
            xs.append(n)
            progress()
    finally:
        if pool is not None:
            pool.shutdown()
    return {"link_bidir_pinned": {"bytes": np.array(xs, np.int64), "seconds": np.array(ts)}}


def sweep_latency(be: Backend, buf: LinkBuffers, progress, counts=(1, 4, 16, 64, 256)) -> dict:
    """Table link_copy_latency: ``copies`` back-to-back 4 KiB H2D copies, total seconds."""
    n = min(4 * KiB, buf.max)
    xs, ts = [], []
    for c in counts:
        def fn(c=c):
            for _ in range(c):
                be.copy(buf.dev[:n], buf.host[:n])
        ts.append(be.time(fn, warmup=1, repeats=10, target_s=0.02, wall=True))
        xs.append(c)
        progress()
    return {"link_copy_latency": {"copies": np.array(xs, np.int64),
                                  "bytes": np.full(len(xs), n, np.int64),
                                  "seconds": np.array(ts)}}


def uva_view(be: Backend, host: torch.Tensor) -> torch.Tensor:
    """A device tensor aliasing pinned host memory (CUDA unified addressing): kernels that read it
    fetch over the link row by row. On the CPU the host buffer itself."""
    if be.kind == "cpu":
        return host
    if not host.is_contiguous():
        raise ValueError("uva_view needs a contiguous pinned tensor")
    nbytes = host.numel() * host.element_size()

    class _Iface:  # raw bytes: the interface has no bfloat16 type string
        __cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                    "data": (host.data_ptr(), False), "version": 2,
                                    "strides": None}
    view = torch.as_tensor(_Iface(), device=be.device)
    if view.data_ptr() != host.data_ptr():
        raise RuntimeError("torch copied instead of aliasing the pinned buffer")
    return view.view(host.dtype).view(host.shape)


class GatherPool:
    """Pinned host rows, a device view of them, and device/staging destinations."""

    def __init__(self, be: Backend, pool_bytes: int, max_gather: int):
        self.be = be
        pool_bytes = max(pool_bytes, be.flush_bytes)
        self.host, got = _alloc(be, pool_bytes, "gather host pool",
                                lambda n: be.host_buffer(n, pinned=True))
        _shrink_note(be, "gather pool", pool_bytes, got)
        self.max = min(max_gather, got // 2)
        self.dst, d = _alloc(be, self.max, "gather device destination", be.device_buffer)
        self.stage, s = _alloc(be, d, "gather pinned staging buffer",
                               lambda n: be.host_buffer(n, pinned=True))
        self.max = min(self.max, d, s)
        _shrink_note(be, "gather sweep", max_gather, self.max)
        self.uva_error = None
        try:
            self.uva = uva_view(be, self.host)
        except Exception as e:
            self.uva, self.uva_error = None, f"{type(e).__name__}: {e}"

    def indices(self, row_bytes: int, rows: int, gen: torch.Generator) -> torch.Tensor:
        """``rows`` distinct rows of the pool, sorted (as a fetch set would be)."""
        pool_rows = self.host.numel() // row_bytes
        return torch.randperm(pool_rows, generator=gen)[:rows].sort().values

    def rows_view(self, t: torch.Tensor, row_bytes: int) -> torch.Tensor:
        """Rows as int64 words, so each thread of a gather reads 8 bytes."""
        n = t.numel() // row_bytes * row_bytes
        return t[:n].view(torch.int64).view(-1, row_bytes // 8)


def sweep_gathers(be: Backend, pool: GatherPool, totals: list[int], model_row: int, progress,
                  seed: int = 0) -> tuple[dict, list[str]]:
    """Tables link_gather_gpu (the model's KV row size, consumed by the simulator),
    link_gather_gpu_rows (every row size) and link_gather_pack (pack on the host, then one copy)."""
    gen = torch.Generator().manual_seed(seed)
    missing = []
    gpu = {k: [] for k in ("bytes", "row_bytes", "rows", "seconds")}
    pack = {k: [] for k in ("bytes", "row_bytes", "rows", "seconds", "pack_seconds",
                            "copy_seconds")}
    row_sizes = sorted(set(ROW_SIZES) | {model_row})
    if pool.uva is None:
        missing.append(f"link_gather_gpu (no device view of pinned memory: {pool.uva_error})")
    for rb in row_sizes:
        src_rows = pool.rows_view(pool.host, rb)
        uva_rows = pool.rows_view(pool.uva, rb) if pool.uva is not None else None
        for total in totals:
            rows = total // rb
            if total > pool.max or rows < 1:
                continue
            # several index sets, rotated, so repeats do not find the rows in the CPU caches
            sets = [pool.indices(rb, rows, gen) for _ in range(4)]
            sets_dev = [i.to(be.device) for i in sets]
            dst = pool.dst[:rows * rb].view(torch.int64).view(rows, rb // 8)
            stage = pool.stage[:rows * rb].view(torch.int64).view(rows, rb // 8)
            if uva_rows is not None:
                t = be.time(_cycle([lambda i=i: torch.index_select(uva_rows, 0, i, out=dst)
                                    for i in sets_dev]), warmup=2, repeats=20, target_s=0.03)
                for k, v in zip(gpu, (rows * rb, rb, rows, t)):
                    gpu[k].append(v)
            pk = be.time(_cycle([lambda i=i: torch.index_select(src_rows, 0, i, out=stage)
                                 for i in sets]), warmup=1, repeats=20, target_s=0.02, wall=True)
            cp = be.time(lambda: be.copy(dst, stage), warmup=1, repeats=20, target_s=0.02)

            def both(i):
                torch.index_select(src_rows, 0, i, out=stage)
                be.copy(dst, stage)
                be.sync()
            tot = be.time(_cycle([lambda i=i: both(i) for i in sets]), warmup=1, repeats=20,
                          target_s=0.03, wall=True)
            for k, v in zip(pack, (rows * rb, rb, rows, tot, pk, cp)):
                pack[k].append(v)
            progress()
    arr = lambda d: {k: np.array(v, np.int64 if k in ("bytes", "row_bytes", "rows")  # noqa: E731
                                 else np.float64) for k, v in d.items()}
    tables = {"link_gather_pack": arr(pack)}
    if gpu["bytes"]:
        g = arr(gpu)
        tables["link_gather_gpu_rows"] = g
        sel = g["row_bytes"] == model_row
        tables["link_gather_gpu"] = {k: v[sel] for k, v in g.items()}
    return tables, missing
