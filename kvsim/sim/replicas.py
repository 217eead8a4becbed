"""Data-parallel replicas behind a router, merged into one result whose request metrics cover
every request and whose utilisations are per replica.

* ``round-robin``: request ``i`` goes to replica ``i mod R`` (a closed loop's concurrency splits
  as evenly). It needs no state from the replicas, so each is simulated alone on its share.
* ``least-loaded``: each arrival goes to the replica with the fewest requests in its system
  (waiting, prefilling, decoding or swapped out; the lowest index on a tie), decided at the
  arrival from the replicas' state then, so all replicas run on one simpy clock
  (:func:`routed`). A closed loop keeps round-robin: each completion's replacement
  arrives where the completion freed its seat, which is what the even split of the
  concurrency already does.
* ``prefix-aware`` (with prefix caching): SGLang's cache-aware router. While loads are in
  balance, an arrival goes to the replica whose own cache (GPU and the tiers below, not a pool
  they share) holds the longest prefix of its prompt, if that is more than ``CACHE_THRESHOLD``
  of the prompt (ties: the least loaded); else to the least loaded. Loads are out of balance
  when the most loaded replica has more than ``BALANCE_ABS`` requests more than the least and
  more than ``BALANCE_REL`` times as many: then it goes to the least loaded.

With prefix caching every router runs the replicas on one clock (a pool of cached blocks is
shared in time order; round-robin still assigns request ``i`` to replica ``i mod R``)."""

from __future__ import annotations

import dataclasses

import numpy as np

from kvsim.sim.batching import Run, on_simpy
from kvsim.sim.metrics import Requests
from kvsim.sim.records import ROUTERS, ChunkLog, SimResult  # noqa: F401
from kvsim.sim.single import result
from kvsim.sim.workload import Workload


def take(work: Workload, idx, **changes) -> Workload:
    """Requests ``idx`` (a slice or an index array) of ``work``, ``changes`` replaced (a
    replica's share here, a piece in :mod:`kvsim.sim.segments`)."""
    h = work.prefix_hashes
    if h is not None:
        changes["prefix_hashes"] = h[idx]
    return dataclasses.replace(work, arrival=work.arrival[idx], prompt=work.prompt[idx],
                               output=work.output[idx], **changes)


def split(work: Workload, replicas: int) -> list[Workload]:
    """The workload of each replica (round-robin)."""
    out = []
    for r in range(replicas):
        idx = np.arange(r, work.n, replicas)
        conc = None if work.concurrency is None else \
            work.concurrency // replicas + (r < work.concurrency % replicas)
        if len(idx) == 0 or conc == 0:
            continue
        about = f"{work.description}; replica {r + 1} of {replicas} (round-robin)"
        out.append(take(work, idx, concurrency=conc, description=about))
    return out


# SGLang's router defaults (sgl-router: cache_threshold, balance_abs_threshold,
# balance_rel_threshold)
CACHE_THRESHOLD, BALANCE_ABS, BALANCE_REL = 0.3, 64, 1.5


def choose(router: str, runs: list, i: int) -> int:
    """The replica that request ``i`` goes to (``router``: one of ``ROUTERS``)."""
    if router == "round-robin":
        return i % len(runs)
    loads = [run.in_system for run in runs]
    least = min(range(len(runs)), key=lambda j: (loads[j], j))
    if router == "least-loaded" or runs[0].cache is None:
        return least
    lo, hi = loads[least], max(loads)
    if hi - lo > BALANCE_ABS and hi > BALANCE_REL * lo:
        return least
    ids = runs[0].hashes[i]
    matched = [run.cache.match(ids) for run in runs]
    best = max(range(len(runs)), key=lambda j: (matched[j], -loads[j], -j))
    block, prompt = runs[0].cache.block, runs[0].prompts[i]
    return best if min(matched[best] * block, prompt) > CACHE_THRESHOLD * prompt else least


def routed(sims: list, work: Workload, requests: Requests,
           router: str = "least-loaded") -> list[SimResult]:
    """The result of each replica of an open-loop ``work`` behind ``router`` on one simpy clock;
    ``requests``: the metrics' SLO and window (each replica gets its own)."""
    import simpy

    env = simpy.Environment()
    fits = [s.check_feasible(work) for s in sims]
    pool = None
    if sims[0].caches(work) and sims[0].caching.cache_pool_gib:
        from kvsim.sim import prefix
        pool = prefix.pool_tier(sims[0], sims[0].caching, work.prefix_block)
    runs = [Run(s, work, env=env, routed=True, requests=requests.fresh(),
                cache=s.prefix_cache(work, pool)) for s in sims]

    def route():
        for i in range(work.n):
            yield env.timeout(max(float(work.arrival[i]) - env.now, 0.0))
            r = choose(router, runs, i)
            for run in runs:
                run.next = i + 1  # the next arrival any replica may look ahead to
            runs[r].assigned += 1
            runs[r].arrive(i)
        for run in runs:
            run.router_done = True
            if not run.wake.triggered:
                run.wake.succeed()

    env.process(route())
    env.run(until=simpy.AllOf(env, [env.process(on_simpy(env, run.scheduler()))
                                    for run in runs]))
    return [result(sim, run, fit) for run, sim, fit in zip(runs, sims, fits) if run.assigned]


def merge(results: list[SimResult]) -> SimResult:
    """One result from the replicas' results."""
    return SimResult(
        Requests.merged([r.requests for r in results]),
        ChunkLog.merged([r.chunks for r in results]),
        max(r.peak_hbm_bytes for r in results), max(r.peak_host_bytes for r in results),
        sum(r.in_system_area for r in results), min(r.max_batch_fit for r in results),
        sum(r.preemptions for r in results), replicas=len(results),
        cache=merged_counts([r.cache for r in results]))


def merged_counts(counts: list):
    """The replicas' prefix-cache counts summed (None without caching)."""
    counts = [c for c in counts if c is not None]
    if not counts:
        return None
    from kvsim.sim.prefix import Counts
    out = Counts()
    for c in counts:
        out.add(c)
    return out
