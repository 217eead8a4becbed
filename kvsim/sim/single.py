"""One run of a workload on one server, in this process: the simplest topology, which the
others (:mod:`kvsim.sim.segments`, :mod:`kvsim.sim.replicas`) are made of."""

from __future__ import annotations

from kvsim.sim.batching import Run
from kvsim.sim.metrics import Requests
from kvsim.sim.records import SimResult
from kvsim.sim.workload import Workload


def result(sim, run: Run, max_fit: int) -> SimResult:
    """What a finished ``run`` on ``sim`` amounts to (its clock integrated up to its end)."""
    run.mark(0)
    m = sim.memory
    return SimResult(run.requests, sim.chunks, m.weights_bytes + m.workspace_bytes + run.peak_hbm,
                     float(run.peak_host), run.area, max_fit, run.preemptions,
                     cache=None if run.cache is None else run.cache.counts)


def run_one(sim, work: Workload, requests: Requests) -> SimResult:
    """``work`` served by ``sim`` (a :class:`kvsim.sim.engine.Simulator`) in one piece."""
    max_fit = sim.check_feasible(work)
    r = Run(sim, work, requests=requests, cache=sim.prefix_cache(work))
    r.env.run(r.scheduler())
    return result(sim, r, max_fit)
