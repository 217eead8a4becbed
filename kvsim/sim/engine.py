"""The simpy model: requests, continuous batching with HBM and host admission, prefill and decode
on a GPU stream, KV transfers on the host link.

Granularity: one simpy event per *change of the batch* (an arrival that can be admitted, a
completion), not per layer or per step. Between two such events the batch is fixed, so the times
of its next k decode steps are computed at once, vectorised over steps and sequences (each step's
context grows by one token). Per layer, a decode step costs

    c = GEMMs(batch) + attention(KV read from HBM)  [+ decide, for policies that decide]
    x = transfer of that layer's KV over the host link

and the layers of a step form the pipeline of :mod:`kvsim.sim.pipeline` (overlapped: double
buffering; serial: decide, fetch, compute), plus the LM head once per step. Prefill is
compute-bound (and, for policies that keep the cache in host memory, overlapped with writing it
there).

Why the GPU and the link are not simpy resources: one scheduler process drives one GPU stream,
and within a step the link's work is placed by the pipeline's closed form, so no two processes
ever contend for either; a queueing resource would only add events. HBM and host memory are
``simpy.Container`` s: admission puts a request's bytes for its whole length (prompt + output),
completion gets them back, so admitted requests are never preempted. Bytes are whole numbers
(rounded up per request), so a container's level is exact.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np
import simpy

from kvsim.contract import DecodeCost
from kvsim.errors import Infeasible
from kvsim.hw.catalog import GiB, ModelSpec
from kvsim.hw.costs import CostModel
from kvsim.sim.pipeline import step_time
from kvsim.sim.workload import Workload

MAX_CHUNK = 2048  # decode steps computed at once (bounds the size of the vectorised arrays)


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
class Chunk:
    """k decode steps (or one prefill, k = 0) of a fixed batch, for timelines and utilisation."""
    start: float
    duration: float
    steps: int
    batch: int
    gpu_busy: float
    link_busy: float
    kind: str  # "decode" | "prefill"
    ctx: np.ndarray | None = None  # tokens per sequence at the chunk's first step (decode)


@dataclass
class SimResult:
    arrival: np.ndarray
    first_token: np.ndarray
    finish: np.ndarray
    output: np.ndarray
    chunks: list[Chunk]
    peak_hbm_bytes: float
    peak_host_bytes: float
    in_system_area: float  # integral of the number of requests in the system over time
    max_batch_fit: int  # how many requests of the largest size fit in memory at once


@dataclass
class Simulator:
    model: ModelSpec
    costs: CostModel
    policy: DecodeCost
    memory: Memory
    max_batch: int
    chunks: list[Chunk] = field(default_factory=list)

    # ----------------------------------------------------------------------- memory
    def hbm_need(self, tokens: np.ndarray) -> np.ndarray:
        """HBM bytes reserved by requests of ``tokens`` total length (state + transfer
        staging), whole bytes."""
        p = self.policy
        staging = p.staging_layers / self.model.layers * p.host_read_frac
        return np.ceil((p.resident_frac + staging) * self.model.kv_bytes_per_token
                       * np.asarray(tokens, float)).astype(np.int64)

    def host_need(self, tokens: np.ndarray) -> np.ndarray:
        return np.ceil(self.policy.host_frac * self.model.kv_bytes_per_token
                       * np.asarray(tokens, float)).astype(np.int64)

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

    # ------------------------------------------------------------------------ costs
    def layer_costs(self, ctx: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per-layer (compute, decide, link) seconds of the next ``k`` decode steps, each (k,).

        ``ctx``: tokens held by each sequence of the batch; each step adds one per sequence.
        """
        m, c, p = self.model, self.costs, self.policy
        B = len(ctx)
        j = np.arange(k, dtype=float)
        tokens = float(ctx.sum()) + B * j  # KV tokens of the batch at each step
        kv_layer = m.kv_bytes_per_token / m.layers * tokens  # bytes of one layer's KV
        compute = c.gemm_time(B, m) + c.attention_time(p.hbm_read_frac * kv_layer,
                                                       p.hbm_read_frac * tokens)
        link = c.link_time(p.host_read_frac * kv_layer, p.path, copies=p.copies_per_layer * B) \
            if p.host_read_frac > 0 else np.zeros(k)
        decide = np.zeros(k)
        if p.decide_bytes_per_token > 0:
            per_seq = c.decide_time(ctx[None, :] + j[:, None], m, p.decide_bytes_per_token)
            decide = per_seq.sum(axis=1)
        return compute + np.zeros(k), decide, link

    def decode_steps(self, ctx: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Times of the next ``k`` decode steps: (step, GPU-busy, link-busy) seconds, each (k,)."""
        L = self.model.layers
        compute, decide, link = self.layer_costs(ctx, k)
        layer_total = step_time(compute, decide, link, L, self.policy.overlap)
        head = self.costs.head_time(len(ctx), self.model)
        return layer_total + head, L * (compute + decide) + head, L * link

    def prefill(self, prompts: np.ndarray) -> tuple[float, float]:
        """(seconds, link-busy seconds) to prefill ``prompts`` together."""
        m, c = self.model, self.costs
        compute = float(c.prefill_time(prompts.sum(), (prompts.astype(float) ** 2).sum() / 2, m))
        write = float(c.link_time(self.host_need(prompts).sum(), "d2h",
                                  copies=2 * m.layers * len(prompts))) \
            if self.policy.host_frac > 0 else 0.0
        return max(compute, write), write

    # ------------------------------------------------------------------------- run
    def run(self, workload: Workload) -> SimResult:
        max_fit = self.check_feasible(workload)
        env = simpy.Environment()
        cap_hbm, cap_host = self.capacity()
        hbm = simpy.Container(env, capacity=max(cap_hbm, 1))
        host = simpy.Container(env, capacity=max(cap_host, 1))
        n = workload.n
        first_token = np.full(n, np.nan)
        finish = np.full(n, np.nan)
        arrival = workload.arrival.astype(float).copy()
        lengths = workload.prompt + workload.output
        hbm_need, host_need = self.hbm_need(lengths), self.host_need(lengths)
        waiting: deque[int] = deque()
        st = {"next": 0, "in_system": 0, "area": 0.0, "t": 0.0, "peak_hbm": 0, "peak_host": 0,
              "wake": env.event()}

        def mark(delta: int) -> None:  # integrate the number in system, then change it
            st["area"] += st["in_system"] * (env.now - st["t"])
            st["t"], st["in_system"] = env.now, st["in_system"] + delta

        def arrive(i: int) -> None:
            arrival[i] = env.now
            waiting.append(i)
            mark(+1)
            if not st["wake"].triggered:
                st["wake"].succeed()

        def open_arrivals():
            for i in range(n):
                yield env.timeout(max(arrival[i] - env.now, 0.0))
                st["next"] = i + 1
                arrive(i)

        def fits(i: int) -> bool:
            return (hbm.level + hbm_need[i] <= cap_hbm
                    and host.level + host_need[i] <= cap_host)

        if workload.concurrency is None:
            env.process(open_arrivals())
        else:
            for i in range(min(workload.concurrency, n)):
                arrive(i)
            st["next"] = min(workload.concurrency, n)

        def scheduler():
            run_ids = np.zeros(0, dtype=np.int64)
            ctx = np.zeros(0)
            left = np.zeros(0, dtype=np.int64)
            done = 0
            while done < n:
                # admit in arrival order while slots and memory allow (puts that fit succeed at
                # once: a container's level changes when put is called)
                new = []
                while waiting and len(run_ids) + len(new) < self.max_batch and fits(waiting[0]):
                    i = waiting.popleft()
                    for box, need in ((hbm, hbm_need[i]), (host, host_need[i])):
                        if need:
                            box.put(int(need))
                    new.append(i)
                st["peak_hbm"] = max(st["peak_hbm"], hbm.level)
                st["peak_host"] = max(st["peak_host"], host.level)
                if new:
                    new = np.array(new)
                    seconds, link_s = self.prefill(workload.prompt[new])
                    self.chunks.append(Chunk(env.now, seconds, 0, len(new), seconds, link_s,
                                             "prefill"))
                    yield env.timeout(seconds)
                    first_token[new] = env.now
                    run_ids = np.concatenate([run_ids, new])
                    ctx = np.concatenate([ctx, workload.prompt[new] + 1.0])
                    left = np.concatenate([left, workload.output[new] - 1])
                elif len(run_ids) == 0:  # idle until the next arrival
                    st["wake"] = env.event()
                    yield st["wake"]
                    continue
                else:
                    k = int(min(left.min(), MAX_CHUNK))
                    steps, gpu_s, link_s = self.decode_steps(ctx, k)
                    ends = np.cumsum(steps)
                    nxt = st["next"]
                    if workload.concurrency is None and nxt < n and not waiting:
                        # stop at the step boundary after the next arrival (it may be admitted)
                        k = min(k, int(np.searchsorted(ends, arrival[nxt] - env.now)) + 1)
                    self.chunks.append(Chunk(env.now, float(ends[k - 1]), k, len(run_ids),
                                             float(gpu_s[:k].sum()), float(link_s[:k].sum()),
                                             "decode", ctx.copy()))
                    yield env.timeout(float(ends[k - 1]))
                    ctx += k
                    left -= k
                # release finished requests (also those whose only token came from prefill)
                fin = left <= 0
                if fin.any():
                    ids = run_ids[fin]
                    finish[ids] = env.now
                    for box, need in ((hbm, hbm_need[ids].sum()), (host, host_need[ids].sum())):
                        if need:
                            box.get(int(need))
                    run_ids, ctx, left = run_ids[~fin], ctx[~fin], left[~fin]
                    done += len(ids)
                    mark(-len(ids))
                    if workload.concurrency is not None:  # closed loop: replace each at once
                        for _ in ids:
                            if st["next"] < n:
                                arrive(st["next"])
                                st["next"] += 1

        proc = env.process(scheduler())
        env.run(until=proc)
        mark(0)
        return SimResult(arrival, first_token, finish, workload.output, self.chunks,
                         self.memory.weights_bytes + self.memory.workspace_bytes + st["peak_hbm"],
                         float(st["peak_host"]), st["area"], max_fit)
