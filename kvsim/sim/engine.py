"""The simulator's front: :class:`Simulator`, what other packages import. The simpy model:
requests, continuous batching with HBM and host admission, prefill and decode on a GPU stream,
KV transfers on the host link.

The package, in the direction of its imports (``tests/test_sim_layout.py`` holds it so):

* :mod:`~kvsim.sim.records`: the types and constants every part shares (the leaf);
* the pieces of one run: :mod:`~kvsim.sim.steps` (what a step costs, with
  :mod:`~kvsim.sim.pipeline`), :mod:`~kvsim.sim.rules` (what it schedules by: admission order,
  chunk planning, admission, preemption; each registered by name), :mod:`~kvsim.sim.batching`
  (the run), :mod:`~kvsim.sim.metrics` and :mod:`~kvsim.sim.workload`;
* topologies of runs: one run (:func:`~kvsim.sim.single.run_one`), a long open loop in pieces
  (:mod:`~kvsim.sim.segments`), data-parallel replicas (:mod:`~kvsim.sim.replicas`). A
  disaggregated prefill/decode pair belongs here too, as a module beside ``replicas.py``: two
  runs on one simpy clock, prefill-only and decode-only, a request handed from the first to
  the second with its KV over the interconnect (not built yet);
* this front, and :mod:`~kvsim.sim.timeline` (which reads a run's result).

Scheduling, as vLLM does it (``chunked``, the default): every step has a token budget
(``max_batched_tokens``); each running sequence spends one token on its next decode first, then
prompts take chunks of what is left, in admission order (arrival order unless
``admission_order`` says otherwise; new requests are admitted while the budget, the batch slots
and memory allow). ``prefill-first`` is the earlier model: newly admitted prompts prefill
together, whole, while every decode waits. What a step costs is :mod:`kvsim.sim.steps`; the rules
are :mod:`kvsim.sim.rules`.

Granularity: while prompts are being prefilled, one event per step (a run alone keeps its time
on a plain clock, :class:`kvsim.sim.batching.Clock`: its one process needs no event queue; runs
that share a router share a simpy Environment); between two changes of
a batch that only decodes (an arrival that can be admitted, a completion), the times of its next
k steps are computed at once: in closed form where a step's time is affine in its tokens (roofline
costs), else vectorised over steps and sequences (:meth:`kvsim.sim.steps.StepCosts.decode_run`).

Memory: HBM and host memory are counts of whole bytes held (a request is admitted only where its
bytes fit, so nothing ever waits on memory: no simpy container is needed); a request of ``n``
tokens holds ``DecodeCost.tokens(term, n)`` tokens' worth of KV per term
(:class:`kvsim.sim.steps.KvBytes`). ``reserve`` admission
(the default) holds a request's bytes for its whole length (prompt + output) and gives them back
when it completes, so nothing is ever preempted. ``grow`` admission (vLLM's) holds the prompt's
bytes and one token's more at every decode step; when a step does not fit, the most recently
admitted running request is preempted: ``recompute`` drops its KV and prefills prompt and
generated tokens again later, ``swap`` copies its HBM state to host memory over the link and
back when it resumes.

Per request the run keeps state only while the request is in the system (slots reused), and the
finished requests' metrics stream into :mod:`kvsim.sim.metrics`, so memory does not grow with the
workload's length.

Why the GPU and the link are not simpy resources: one scheduler process drives one GPU stream,
and within a step the link's work is placed by the pipeline's closed form, so no two processes
ever contend for either; a queueing resource would only add events.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from kvsim.contract import DecodeCost, PrefillWork
from kvsim.errors import Infeasible, KvsimError
from kvsim.hw.catalog import GiB, ModelSpec
from kvsim.hw.costs import CostModel
from kvsim.sim import segments
from kvsim.sim.metrics import Requests
from kvsim.sim.records import ChunkLog, Memory, PrefixCaching, SimResult, default_token_budget
from kvsim.sim.rules import Scheduling
from kvsim.sim.single import run_one
from kvsim.sim.steps import KvBytes, StepCosts
from kvsim.sim.workload import Workload


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
    caching: PrefixCaching = field(default_factory=PrefixCaching)

    def __post_init__(self):
        self.scheduling.check()
        if self.scheduling.max_batched_tokens is None:  # vLLM's for the GPU
            self.scheduling = dataclasses.replace(self.scheduling, max_batched_tokens=(
                default_token_budget(self.costs.gpu_name, self.costs.hbm_bytes)))
        self.steps = StepCosts(self.model, self.costs, self.policy, self.prefill_work)
        self.kv = KvBytes(self.model, self.policy)  # what a request of n tokens holds
        self.hbm_need, self.host_need = self.kv.hbm_need, self.kv.host_need

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

    def caches(self, workload: Workload) -> bool:
        """Whether runs of ``workload`` cache prefixes: ``--prefix-caching`` on, or auto where
        the workload names its prefix blocks; only where the policy keeps the whole KV cache
        in HBM (:meth:`caching_refused` says why not)."""
        mode = self.caching.prefix_caching
        if mode == "off" or (mode == "auto" and workload.prefix_hashes is None):
            return False
        why = self.caching_refused(workload)
        if why and mode == "on":
            raise KvsimError(f"--prefix-caching on: {why}")
        return not why

    def caching_refused(self, workload: Workload) -> str | None:
        """Why this simulator cannot cache ``workload``'s prefixes (None: it can)."""
        if workload.prefix_hashes is None:
            return ("the workload names no prefix blocks: give a Mooncake trace (hash_ids) "
                    "or --reuse")
        p = self.policy
        if p.fixed or p.resident_frac != 1 or p.host_frac or p.host_read_frac:
            return ("prefix caching is modelled for policies that keep the whole KV cache in "
                    "HBM (dense-resident), not for one that offloads or compresses it")
        return None

    def prefix_cache(self, workload: Workload, pool=None):
        """A run's prefix cache (:mod:`kvsim.sim.prefix`), or None where it caches nothing."""
        if not self.caches(workload):
            return None
        from kvsim.sim import prefix
        block = workload.prefix_block
        if pool is None:  # (replicas pass the one they share)
            pool = prefix.pool_tier(self, self.caching, block)
        return prefix.build(self, self.caching, block, pool)

    # ------------------------------------------------------------------------- run
    def run(self, workload: Workload, requests: Requests | None = None) -> SimResult:
        """Simulate ``workload``; ``requests``: where the finished requests' metrics go (its SLO
        and measured window), a plain one if not given. A long open loop runs in pieces over
        ``jobs`` processes, with the same result (:mod:`kvsim.sim.segments`)."""
        requests = requests if requests is not None else Requests()
        if workload.concurrency is None and workload.n >= 2 * segments.PIECE:
            if self.caches(workload):  # in order: each piece from the cache the last left
                return segments.run_cached(self, workload, requests)
            self.check_feasible(workload)  # before any process starts
            return segments.run(self, workload, requests, self.jobs)
        return self.run_whole(workload, requests)

    def run_whole(self, workload: Workload, requests: Requests) -> SimResult:
        """:meth:`run` in this process, in one piece."""
        return run_one(self, workload, requests)
