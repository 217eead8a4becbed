"""Long open-loop workloads simulated in pieces, in parallel processes, with the serial answer.

An open loop's server empties now and then: when every request before an arrival has finished
by the time it comes, the run from that arrival on depends on nothing before it (the scheduler
starts from an empty system either way). So the workload is cut into pieces at arrivals that
follow its longest gaps, each piece is simulated alone from an empty system, and the cut is
checked afterwards: the piece before it must have finished its last request by the arrival
that starts the next. A cut that fails the check is dropped and the two pieces around it are
simulated again as one, until every cut holds. Each piece's start then holds by induction from
the first, so the merged result is the serial run's: the same requests at the same times, every
count and percentile equal, sums equal to rounding (they are added in another order).

The cuts depend on the workload alone, not on the number of processes, so the same command
gives the same JSON on any machine. A loaded server that never empties keeps one piece.

With prefix caching (:func:`run_cached`) the pieces run one after another in this process,
each from the cache the one before left: the server is empty at a cut that holds, so nothing
is pinned and the cache, which keeps no time, is the serial run's there. Before each piece the
cache is copied (it is bounded by its tiers' capacities), so a cut that fails runs again, as
one piece with the next, from that copy.
Workers are forked (Linux; elsewhere the pieces run here, one after another): they run only the
simulator, never torch, so a fork after torch was imported is safe, and no script needs a
``__main__`` guard.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import gc
import multiprocessing as mp
import os
import sys
from itertools import pairwise

import numpy as np

from kvsim.sim import metrics, replicas
from kvsim.sim.metrics import Requests
from kvsim.sim.records import ChunkLog, SimResult
from kvsim.sim.workload import Workload

PIECE = 50_000  # requests per piece (workloads of fewer than 2 pieces run whole)


def cuts(arrival: np.ndarray, piece: int) -> list[int]:
    """Where to cut: near every ``piece`` requests, the arrival after the longest gap within
    2% of a piece either side (the likeliest to find the server empty; pieces of about equal
    size keep the workers equally busy); 0 and n at the ends."""
    n = len(arrival)
    if n < 2 * piece:
        return [0, n]
    gaps = np.diff(arrival)
    out, w = [0], max(piece // 50, 1)
    for c in range(piece, n - piece // 2, piece):
        lo, hi = max(c - w, out[-1] + 1), min(c + w, n - 1)
        if lo < hi:
            out.append(int(lo + np.argmax(gaps[lo - 1:hi - 1])))
    return out + [n]


_RUN: tuple | None = None  # (sim, workload, requests, sketched) of the run in progress


def _simulate(piece: tuple[int, int]) -> SimResult:
    """Requests ``a:b`` of the run in progress, from an empty system (in a worker forked with
    the run in its memory, or here); its metrics folded into their sketches where the whole
    run's will be, so that what comes back is small."""
    sim, work, requests, sketched = _RUN
    sim.chunks = ChunkLog(keep=sim.chunks.keep)
    res = sim.run_whole(replicas.take(work, slice(*piece)), requests.fresh())
    if sketched:
        res.requests.fold()
    return res


def run(sim, work: Workload, requests: Requests, jobs: int | None = None,
        piece: int | None = None) -> SimResult:
    """The serial run's result of ``work`` on ``sim``, simulated in pieces over ``jobs``
    processes (default: the CPUs); its ``pieces``: how many the cuts that held left."""
    global _RUN
    bounds = cuts(work.arrival, piece or PIECE)
    done: dict[tuple[int, int], SimResult] = {}
    if not jobs:
        jobs = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
            os.cpu_count() or 1
    _RUN, pool, log = (sim, work, requests, work.n > metrics.EXACT), None, sim.chunks
    try:
        while True:
            todo = [(a, b) for a, b in pairwise(bounds) if (a, b) not in done]
            if jobs > 1 and len(todo) > 1 and sys.platform == "linux":
                if pool is None:  # forked: the workers run no torch, only this module's code
                    gc.freeze()  # the workers' collector then leaves the inherited pages shared
                    pool = cf.ProcessPoolExecutor(min(jobs, len(todo)),
                                                  mp_context=mp.get_context("fork"))
                fresh = pool.map(_simulate, todo)  # in order, as they finish
            else:
                fresh = map(_simulate, todo)
            seen = 0  # chunks before each piece: only the run's first ``keep`` are kept
            for ab in pairwise(bounds):
                if ab not in done:
                    done[ab] = next(fresh)
                if seen >= sim.chunks.keep:
                    done[ab].chunks.kept = []
                seen += done[ab].chunks.count
            held = [bounds[0]] + [c for p, c in pairwise(bounds[:-1]) if
                                  done[(p, c)].requests.last_finish <= work.arrival[c]] + [work.n]
            if held == bounds:
                break
            bounds = held  # drop the cuts that failed; their neighbours run again as one
    finally:
        _RUN, sim.chunks = None, log  # (pieces run here replaced it)
        if pool is not None:
            pool.shutdown()
            gc.unfreeze()
    parts = [done[(a, b)] for a, b in pairwise(bounds)]
    return merge(parts)


def run_cached(sim, work: Workload, requests: Requests, piece: int | None = None) -> SimResult:
    """:func:`run`'s result for a simulator that caches prefixes: the pieces in order, each
    from the cache the one before left (the module's docstring)."""
    import copy

    from kvsim.sim.batching import Run
    from kvsim.sim.prefix import Counts
    from kvsim.sim.single import result
    fit = sim.check_feasible(work)
    bounds, cache, log = cuts(work.arrival, piece or PIECE), sim.prefix_cache(work), sim.chunks
    parts, start, end = [], 0, 1
    sketched = work.n > metrics.EXACT
    try:
        while start < len(bounds) - 1:
            a, b = bounds[start], bounds[end]
            before = copy.deepcopy(cache)
            cache.counts, sim.chunks = Counts(), ChunkLog(keep=log.keep)
            run = Run(sim, replicas.take(work, slice(a, b)), requests=requests.fresh(),
                      cache=cache)
            run.env.run(run.scheduler())
            res = result(sim, run, fit)
            if b < work.n and res.requests.last_finish > work.arrival[b]:
                cache, end = before, end + 1  # the cut failed: again, through the next one
                continue
            if sketched:
                res.requests.fold()
            parts.append(res)
            start, end = end, end + 1
    finally:
        sim.chunks = log
    seen = 0
    for res in parts:  # only the run's first ``keep`` chunks are kept
        if seen >= log.keep:
            res.chunks.kept = []
        seen += res.chunks.count
    return merge(parts)


def merge(parts: list[SimResult]) -> SimResult:
    """One run from its pieces, in time order (:func:`kvsim.sim.replicas.merge`, but of one
    server): the first ``keep`` chunks across them."""
    out = dataclasses.replace(replicas.merge(parts), replicas=1, pieces=len(parts))
    log = out.chunks
    for p in parts[1:]:
        log.kept.extend(p.chunks.kept[:log.keep - len(log.kept)])
    return out
