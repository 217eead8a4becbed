"""Data-parallel replicas behind a router, merged into one result whose request metrics cover
every request and whose utilisations are per replica.

* ``round-robin``: request ``i`` goes to replica ``i mod R`` (a closed loop's concurrency splits
  as evenly). It needs no state from the replicas, so each is simulated alone on its share.
* ``least-loaded``: each arrival goes to the replica with the fewest requests in its system
  (waiting, prefilling, decoding or swapped out; the lowest index on a tie), decided at the
  arrival from the replicas' state then, so all replicas run on one simpy clock
  (:func:`least_loaded`). A closed loop keeps round-robin: each completion's replacement
  arrives where the completion freed its seat, which is what the even split of the
  concurrency already does."""

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
        changes["prefix_hashes"] = h[idx] if isinstance(idx, slice) else [h[i] for i in idx]
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


def least_loaded(sims: list, work: Workload, requests: Requests) -> list[SimResult]:
    """The result of each replica of an open-loop ``work`` routed least-loaded; ``requests``:
    the metrics' SLO and window (each replica gets its own)."""
    import simpy

    env = simpy.Environment()
    fits = [s.check_feasible(work) for s in sims]
    runs = [Run(s, work, env=env, routed=True, requests=requests.fresh()) for s in sims]

    def router():
        for i in range(work.n):
            yield env.timeout(max(float(work.arrival[i]) - env.now, 0.0))
            r = min(range(len(runs)), key=lambda j: (runs[j].in_system, j))
            for run in runs:
                run.next = i + 1  # the next arrival any replica may look ahead to
            runs[r].assigned += 1
            runs[r].arrive(i)
        for run in runs:
            run.router_done = True
            if not run.wake.triggered:
                run.wake.succeed()

    env.process(router())
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
        sum(r.preemptions for r in results), replicas=len(results))
