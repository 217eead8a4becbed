"""What the simulator's parts hand each other: memory sizes, the per-step plan of a run, the
chunks of work a run logs, a run's result, deployment options, and the constants they share.

The leaf of :mod:`kvsim.sim`: it imports nothing else of the package, so every other module may
import it (``tests/test_sim_layout.py`` holds the package's imports one way).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from kvsim.checks import rate_gbps, size_gib
from kvsim.errors import KvsimError
from kvsim.hw.catalog import GiB

MAX_CHUNK = 2048  # decode steps computed at once (bounds the size of the vectorised arrays)
ROUTERS = ("round-robin", "least-loaded", "prefix-aware")
CACHE_MODES = ("auto", "on", "off")
# stated public figures for the tiers below host memory (each a flag to override):
DISK_GBPS = 7.0  # one PCIe 4.0 x4 NVMe SSD, sequential read (Samsung 990 PRO: 7,450 MB/s)
POOL_GBPS = 25.0  # one 200 Gb/s RDMA NIC (ConnectX-6/7 HDR/NDR200) per replica
KV_DTYPES = {"bf16": 2, "fp16": 2, "fp8": 1}
WEIGHT_DTYPES = {"bf16": 2, "fp16": 2, "fp8": 1, "int4": 0.5}
DEFAULT_HOST_GIB = 256.0  # a 2 TiB host shared by 8 GPUs
DEFAULT_WORKSPACE_GIB = 4.0  # CUDA context, activations, allocator slack


def default_token_budget(gpu_name: str, hbm_bytes: float) -> int:
    """vLLM's default token budget for its OpenAI server (``EngineArgs.get_batch_defaults``):
    8192 on GPUs with at least 70 GiB that are not A100s, 2048 on the others."""
    return 8192 if hbm_bytes >= 70 * GiB and "a100" not in gpu_name.lower() else 2048


@dataclass
class Memory:
    hbm_bytes: float
    host_bytes: float
    weights_bytes: float
    workspace_bytes: float

    @property
    def kv_hbm_bytes(self) -> float:
        return self.hbm_bytes - self.weights_bytes - self.workspace_bytes


def _whole(name: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise KvsimError(f"--{name} must be a whole number >= 1, got {v!r}")


@dataclass(frozen=True)
class Deployment:
    """How many GPUs serve and in which element types; each field is also a command-line flag
    of ``kvsim replay`` and ``kvsim plan`` (:mod:`kvsim.commands._option_flags`)."""
    kv_dtype: str | None = field(default=None, metadata={
        "choices": list(KV_DTYPES), "help": "KV-cache element type [default: the model's]"})
    weight_dtype: str | None = field(default=None, metadata={
        "choices": list(WEIGHT_DTYPES), "help": "layer weights' element type (not embeddings "
        "and LM head) [default: the model's]"})
    tp: int = field(default=1, metadata={
        "metavar": "N", "help": "tensor parallelism: N GPUs of a node serve one replica (1/N "
        "of weights and KV heads each, all-reduces over the peer link; figures per GPU) "
        "[default: 1]"})
    router: str = field(default="round-robin", metadata={
        "choices": list(ROUTERS), "help": "how --replicas share the requests: round-robin; "
        "least-loaded (fewest requests in the system); prefix-aware (the longest cached "
        "prefix unless loads are out of balance, as SGLang's) [default: round-robin]"})
    replicas: int = field(default=1, metadata={
        "metavar": "R", "help": "data-parallel replicas of --tp GPUs behind the --router; "
        "latencies over all, utilisation and memory per replica [default: 1]"})
    tp_link: str = field(default="own", metadata={
        "choices": ["own", "shared"], "help": "with --tp: each GPU on its own host link, or "
        "one shared by the group [default: own]"})
    host_gib: float | None = field(default=None, metadata={
        "kind": float, "help": f"host memory for the KV cache (default {DEFAULT_HOST_GIB:g})"})
    workspace_gib: float | None = field(default=None, metadata={
        "kind": float, "help": f"HBM for activations etc. (default {DEFAULT_WORKSPACE_GIB:g})"})

    def check(self) -> None:
        for flag, value, table in (("--kv-dtype", self.kv_dtype, KV_DTYPES),
                                   ("--weight-dtype", self.weight_dtype, WEIGHT_DTYPES)):
            if value is not None and value not in table:
                raise KvsimError(f"{flag} {value!r}: one of {', '.join(table)}")
        _whole("tp", self.tp)
        _whole("replicas", self.replicas)
        if self.router not in ROUTERS:
            raise KvsimError(f"--router must be one of {', '.join(ROUTERS)}, got "
                             f"{self.router!r}")
        if self.tp_link not in ("own", "shared"):
            raise KvsimError(f"--tp-link must be own or shared, got {self.tp_link!r}")
        for name in ("host_gib", "workspace_gib"):
            if getattr(self, name) is not None:  # (None: the default)
                size_gib(getattr(self, name), "--" + name.replace("_", "-"))


@dataclass(frozen=True)
class PrefixCaching:
    """Prefix caching and the tiers of the KV cache below the GPU (:mod:`kvsim.sim.prefix`);
    each field is also a command-line flag of ``kvsim replay`` and ``kvsim plan``."""
    prefix_caching: str = field(default="auto", metadata={
        "choices": list(CACHE_MODES), "help": "auto (on where the workload names prefix "
        "blocks, as engines do by default), on, off [default: auto]"})
    cache_host_gib: float = field(default=0.0, metadata={
        "metavar": "GIB", "help": "host memory per GPU [default: 0]"})
    cache_disk_gib: float = field(default=0.0, metadata={
        "metavar": "GIB", "help": "local SSD per GPU [default: 0]"})
    cache_pool_gib: float = field(default=0.0, metadata={
        "metavar": "GIB", "help": "DRAM pool shared by the replicas, in all [default: 0]"})
    cache_disk_gbps: float = field(default=DISK_GBPS, metadata={
        "metavar": "GB/S", "help": f"SSD rate per replica [default: {DISK_GBPS:g}, PCIe 4 NVMe]"})
    cache_pool_gbps: float = field(default=POOL_GBPS, metadata={
        "metavar": "GB/S", "help": f"pool rate per replica [default: {POOL_GBPS:g}, 200 Gb/s "
        "RDMA]"})

    def check(self) -> None:
        if self.prefix_caching not in CACHE_MODES:
            raise KvsimError(f"--prefix-caching must be one of {', '.join(CACHE_MODES)}, got "
                             f"{self.prefix_caching!r}")
        for name in ("cache_host_gib", "cache_disk_gib", "cache_pool_gib"):
            size_gib(getattr(self, name), "--" + name.replace("_", "-"))
        for name in ("cache_disk_gbps", "cache_pool_gbps"):
            rate_gbps(getattr(self, name), "--" + name.replace("_", "-"))
        if self.prefix_caching == "off" and any(
                getattr(self, n) for n in ("cache_host_gib", "cache_disk_gib",
                                           "cache_pool_gib")):
            raise KvsimError("--cache-host-gib, --cache-disk-gib and --cache-pool-gib hold "
                             "prefix blocks: they need --prefix-caching on or auto")

    def tiers(self) -> bool:
        """Whether any tier below the GPU is configured."""
        return bool(self.cache_host_gib or self.cache_disk_gib or self.cache_pool_gib)


class StepPlan(NamedTuple):
    """One planned engine step: its decodes, the prompt chunks riding along and the prompts
    that finish. Made by a scheduler rule (:mod:`kvsim.sim.rules`), costed by
    :class:`kvsim.sim.steps.StepCosts` and carried out by :class:`kvsim.sim.batching.Run`."""
    decodes: int  # sequences that emit a decode token
    decode_tokens: float  # KV tokens they hold
    chunk_tokens: int  # prompt tokens prefilled
    chunk_flops: float  # their causal attention FLOPs, all layers
    assign: list  # (slot, tokens) of each chunk
    done: list  # slots of the prompts that finish (each emits a token)
    done_lengths: list  # their lengths, floats
    work_flops: float  # the policy's prefill work for those prompts
    work_bytes: float
    read_tokens: float | None = None  # the decodes' charged KV read (policies with fixed terms)
    fetch_tokens: float | None = None  # and their charged host-link read
    written_tokens: float | None = None  # and the chunks' growth of the host-memory term


@dataclass
class Chunks:
    """Per step of a run of steps: the prefill work riding along, each (S,)."""
    tokens: np.ndarray  # prompt tokens prefilled
    attn_flops: np.ndarray  # their causal attention FLOPs, all layers
    count: np.ndarray  # chunks
    done: np.ndarray  # prompts that finish (each emits a token)
    work_flops: np.ndarray  # the policy's prefill work for those prompts
    work_bytes: np.ndarray
    written: np.ndarray | None = None  # tokens' worth of KV written to host memory, if not
    # the policy's share of ``tokens`` (a fixed host term)

    @classmethod
    def of(cls, plans: list[StepPlan]) -> Chunks:
        def col(f):
            return np.array([f(p) for p in plans], float)
        return cls(col(lambda p: p.chunk_tokens), col(lambda p: p.chunk_flops),
                   col(lambda p: len(p.assign)), col(lambda p: len(p.done)),
                   col(lambda p: p.work_flops), col(lambda p: p.work_bytes),
                   None if plans[0].written_tokens is None else
                   col(lambda p: p.written_tokens))


class Chunk(NamedTuple):
    """k decode steps, one mixed step (decodes + prefill chunks) or one prefill of a batch, for
    timelines and utilisation; ``batch`` sequences emit a decode token per step (a tuple: the
    simulator makes thousands)."""
    start: float
    duration: float
    steps: int
    batch: int
    gpu_busy: float
    link_busy: float
    kind: str  # "decode" | "mixed" | "prefill"
    ctx: np.ndarray | None = None  # tokens per decoding sequence at the chunk's first step
    prefill_tokens: int = 0
    decode_time: float | None = None  # of ``duration``, what its decodes alone would take

    @property
    def decode_seconds(self) -> float:
        return self.duration if self.decode_time is None else self.decode_time


@dataclass
class ChunkLog:
    """What the report needs of every chunk, summed as the run goes, and the first ``keep``
    chunks themselves (for timelines): memory stays bounded however long the workload."""
    keep: int = 4096
    kept: list = field(default_factory=list)
    count: int = 0
    decode_seconds: float = 0.0  # decode and mixed chunks: their decodes' share of the time
    decode_tokens: float = 0.0  # sequences x steps of those chunks
    decode_steps: int = 0
    batch_seconds: float = 0.0  # batch x decode seconds (the mean batch's numerator)
    gpu_busy: float = 0.0
    link_busy: float = 0.0

    def add(self, start: float, duration: float, steps: int, batch: int, gpu_busy: float,
            link_busy: float, kind: str, ctx: np.ndarray | None = None, prefill_tokens: int = 0,
            decode_time: float | None = None) -> None:
        """Count a :class:`Chunk` of these fields (built only while chunks are kept)."""
        self.count += 1
        if self.count <= self.keep:  # (tuple.__new__: a NamedTuple's own is a Python call)
            self.kept.append(tuple.__new__(Chunk, (start, duration, steps, batch, gpu_busy,
                                                   link_busy, kind, ctx, prefill_tokens,
                                                   decode_time)))
        if steps:  # decode and mixed chunks
            seconds = duration if decode_time is None else decode_time
            self.decode_seconds += seconds
            self.decode_tokens += batch * steps
            self.decode_steps += steps
            self.batch_seconds += batch * seconds
        self.gpu_busy += gpu_busy
        self.link_busy += link_busy

    @property
    def keeping(self) -> bool:
        """Whether the next chunk is kept whole (else only summed)."""
        return len(self.kept) < self.keep

    def __iter__(self):
        return iter(self.kept)

    def __len__(self) -> int:
        return self.count

    @staticmethod
    def merged(logs: list[ChunkLog]) -> ChunkLog:
        """The replicas' logs as one: sums added, the first replica's chunks kept."""
        out = ChunkLog(keep=logs[0].keep, kept=list(logs[0].kept))
        for name in ("count", "decode_seconds", "decode_tokens", "decode_steps",
                     "batch_seconds", "gpu_busy", "link_busy"):
            setattr(out, name, sum(getattr(g, name) for g in logs))
        return out


@dataclass
class SimResult:
    requests: object  # the finished requests' metrics (kvsim.sim.metrics.Requests)
    chunks: ChunkLog
    peak_hbm_bytes: float
    peak_host_bytes: float
    in_system_area: float  # integral of the number of requests in the system over time
    max_batch_fit: int  # how many requests of the largest size fit in memory at once
    preemptions: int = 0
    replicas: int = 1  # data-parallel replicas merged into this result (kvsim.sim.replicas)
    pieces: int = 1  # simulated in pieces cut where the server was empty (kvsim.sim.segments)
    cache: object = None  # with prefix caching: what it did (kvsim.sim.prefix.Counts)
