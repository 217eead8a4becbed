"""The simpy model: requests, continuous batching with HBM and host admission, prefill and decode
on a GPU stream, KV transfers on the host link.

Scheduling, as vLLM does it (``chunked``, the default): every step has a token budget
(``max_batched_tokens``); each running sequence spends one token on its next decode first, then
prompts take chunks of what is left, in arrival order (new requests are admitted while the budget,
the batch slots and memory allow). ``prefill-first`` is the earlier model: newly admitted prompts
prefill together, whole, while every decode waits. What a step costs is :mod:`kvsim.sim.steps`.

Granularity: while prompts are being prefilled, one simpy event per step; between two changes of
a batch that only decodes (an arrival that can be admitted, a completion), the times of its next
k steps are computed at once: in closed form where a step's time is affine in its tokens (roofline
costs), else vectorised over steps and sequences (:meth:`kvsim.sim.steps.StepCosts.decode_run`).

Memory: HBM and host memory are counts of whole bytes held (a request is admitted only where its
bytes fit, so nothing ever waits on memory: no simpy container is needed). ``reserve`` admission
(the default) holds a request's bytes for its whole length (prompt + output) and gives them back
when it completes, so nothing is ever preempted. ``grow`` admission (vLLM's) holds the prompt's
bytes and one token's more at every decode step; when a step does not fit, the most recently
admitted running request is preempted: ``recompute`` drops its KV and prefills prompt and generated tokens
again later, ``swap`` copies its HBM state to host memory over the link and back when it resumes.

Per request the run keeps state only while the request is in the system (slots reused), and the
finished requests' metrics stream into :mod:`kvsim.sim.metrics`, so memory does not grow with the
workload's length.

Why the GPU and the link are not simpy resources: one scheduler process drives one GPU stream,
and within a step the link's work is placed by the pipeline's closed form, so no two processes
ever contend for either; a queueing resource would only add events.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvsim.contract import DecodeCost, PrefillWork
from kvsim.errors import Infeasible, KvsimError
from kvsim.hw.catalog import GiB, ModelSpec
from kvsim.hw.costs import CostModel
from kvsim.sim.metrics import Requests
from kvsim.sim.steps import StepCosts
from kvsim.sim.workload import Workload

MAX_CHUNK = 2048  # decode steps computed at once (bounds the size of the vectorised arrays)
SCHEDULERS = ("chunked", "prefill-first")
ADMISSIONS = ("reserve", "grow")
PREEMPTIONS = ("recompute", "swap")
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


@dataclass
class Scheduling:
    scheduler: str = "chunked"
    max_batched_tokens: int = 8192  # chunked: tokens per step, decodes and prefill chunks
    admission: str = "reserve"
    preemption: str = "recompute"

    def check(self) -> None:
        for name, allowed in (("scheduler", SCHEDULERS), ("admission", ADMISSIONS),
                              ("preemption", PREEMPTIONS)):
            if getattr(self, name) not in allowed:
                raise KvsimError(f"--{name} must be one of {', '.join(allowed)}; "
                                 f"got {getattr(self, name)!r}")
        if int(self.max_batched_tokens) != self.max_batched_tokens or self.max_batched_tokens < 1:
            raise KvsimError(f"--max-batched-tokens must be a whole number >= 1; got "
                             f"{self.max_batched_tokens}")


@dataclass
class Chunk:
    """k decode steps, one mixed step (decodes + prefill chunks) or one prefill of a batch, for
    timelines and utilisation; ``batch`` sequences emit a decode token per step."""
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
        if self.count <= self.keep:
            self.kept.append(Chunk(start, duration, steps, batch, gpu_busy, link_busy, kind, ctx,
                                   prefill_tokens, decode_time))
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
    def merged(logs: list["ChunkLog"]) -> "ChunkLog":
        """The replicas' logs as one: sums added, the first replica's chunks kept."""
        out = ChunkLog(keep=logs[0].keep, kept=list(logs[0].kept))
        for name in ("count", "decode_seconds", "decode_tokens", "decode_steps",
                     "batch_seconds", "gpu_busy", "link_busy"):
            setattr(out, name, sum(getattr(g, name) for g in logs))
        return out


@dataclass
class SimResult:
    requests: Requests  # the finished requests' metrics (kvsim.sim.metrics)
    chunks: ChunkLog
    peak_hbm_bytes: float
    peak_host_bytes: float
    in_system_area: float  # integral of the number of requests in the system over time
    max_batch_fit: int  # how many requests of the largest size fit in memory at once
    preemptions: int = 0
    replicas: int = 1  # data-parallel replicas merged into this result (kvsim.sim.replicas)
    pieces: int = 1  # simulated in pieces cut where the server was empty (kvsim.sim.segments)


@dataclass
class Simulator:
    model: ModelSpec
    costs: CostModel
    policy: DecodeCost
    memory: Memory
    max_batch: int
    scheduling: Scheduling = field(default_factory=Scheduling)
    prefill_work: PrefillWork = field(default_factory=PrefillWork)
    chunks: ChunkLog = field(default_factory=ChunkLog)
    jobs: int | None = None  # processes for a long open loop (kvsim.sim.segments); None: the CPUs

    def __post_init__(self):
        self.scheduling.check()
        self.steps = StepCosts(self.model, self.costs, self.policy, self.prefill_work)
        p, kv = self.policy, self.model.kv_bytes_per_token
        staging = p.staging_layers / self.model.layers * p.host_read_frac
        self.hbm_per_token = (p.resident_frac + staging) * kv  # state + transfer staging
        self.host_per_token = p.host_frac * kv

    # ----------------------------------------------------------------------- memory
    def hbm_need(self, tokens) -> np.ndarray:
        """HBM bytes held by requests of ``tokens`` tokens (state + transfer staging), whole
        bytes (``math.ceil(hbm_per_token * tokens)`` for one request, the same figure)."""
        return np.ceil(self.hbm_per_token * np.asarray(tokens, float)).astype(np.int64)

    def host_need(self, tokens) -> np.ndarray:
        return np.ceil(self.host_per_token * np.asarray(tokens, float)).astype(np.int64)

    def capacity(self) -> tuple[int, int]:
        """Whole bytes of HBM left for KV state, and of host memory."""
        return int(self.memory.kv_hbm_bytes), int(self.memory.host_bytes)

    def check_feasible(self, workload: Workload) -> int:
        """Raise :class:`Infeasible` if not even one request fits; return how many fit at once."""
        m = self.memory
        if m.kv_hbm_bytes <= 0:
            raise Infeasible(
                f"infeasible: {self.model.name} weights ({m.weights_bytes / GiB:.1f} GiB) plus "
                f"workspace ({m.workspace_bytes / GiB:.1f} GiB) exceed HBM "
                f"({m.hbm_bytes / GiB:.1f} GiB) on {self.costs.gpu_name}")
        longest = float((workload.prompt + workload.output).max())
        hbm, host = int(self.hbm_need(longest)), int(self.host_need(longest))
        cap_hbm, cap_host = self.capacity()
        if hbm > cap_hbm:
            raise Infeasible(
                f"infeasible: one {longest:.0f}-token request needs {hbm / GiB:.1f} GiB of HBM for "
                f"its KV state but only {m.kv_hbm_bytes / GiB:.1f} GiB are left after weights and "
                f"workspace on {self.costs.gpu_name}; try an offloading or compressing policy")
        if host > cap_host:
            raise Infeasible(
                f"infeasible: one {longest:.0f}-token request needs {host / GiB:.1f} GiB of host "
                f"memory but only {m.host_bytes / GiB:.1f} GiB are available (--host-gib)")
        fit_hbm = cap_hbm // hbm if hbm > 0 else np.inf
        fit_host = cap_host // host if host > 0 else np.inf
        return int(min(fit_hbm, fit_host, 1e9))

    # ------------------------------------------------------------------------- run
    def run(self, workload: Workload, requests: Requests | None = None) -> SimResult:
        """Simulate ``workload``; ``requests``: where the finished requests' metrics go (its SLO
        and measured window), a plain one if not given. A long open loop runs in pieces over
        ``jobs`` processes, with the same result (:mod:`kvsim.sim.segments`)."""
        from kvsim.sim import segments
        requests = requests if requests is not None else Requests()
        if workload.concurrency is None and workload.n >= 2 * segments.PIECE:
            self.check_feasible(workload)  # before any process starts
            return segments.run(self, workload, requests, self.jobs)
        return self.run_whole(workload, requests)

    def run_whole(self, workload: Workload, requests: Requests) -> SimResult:
        """:meth:`run` in this process, in one piece."""
        from kvsim.sim.batching import Run
        max_fit = self.check_feasible(workload)
        r = Run(self, workload, requests=requests)
        r.env.run(until=r.env.process(r.scheduler()))
        r.mark(0)
        return SimResult(r.requests, self.chunks,
                         self.memory.weights_bytes + self.memory.workspace_bytes + r.peak_hbm,
                         float(r.peak_host), r.area, max_fit, r.preemptions)
