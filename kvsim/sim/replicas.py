"""Data-parallel replicas behind a round-robin router: request ``i`` goes to replica
``i mod R`` (a closed loop's concurrency splits as evenly), each replica is simulated on its own
share, and the runs merge into one result whose per-request metrics cover every request and
whose utilisations are per replica. Round-robin needs no state from the replicas, so the split
is exact; a least-loaded router (which does) is not modelled."""

from __future__ import annotations

import dataclasses

import numpy as np

from kvsim.sim.engine import ChunkLog, SimResult
from kvsim.sim.workload import Workload


def split(work: Workload, replicas: int) -> list[tuple[np.ndarray, Workload]]:
    """(request indices, workload) per replica."""
    out = []
    for r in range(replicas):
        idx = np.arange(r, work.n, replicas)
        conc = None if work.concurrency is None else \
            work.concurrency // replicas + (r < work.concurrency % replicas)
        if len(idx) == 0 or conc == 0:
            continue
        hashes = getattr(work, "prefix_hashes", None)
        extra = {"prefix_hashes": [hashes[i] for i in idx]} if hashes is not None else {}
        out.append((idx, dataclasses.replace(
            work, arrival=work.arrival[idx], prompt=work.prompt[idx], output=work.output[idx],
            concurrency=conc, description=f"{work.description}; replica {r + 1} of "
                                          f"{replicas} (round-robin)", **extra)))
    return out


def merge(parts: list[tuple[np.ndarray, SimResult]], n: int) -> SimResult:
    """One result over all ``n`` requests from the replicas' (indices, result)."""
    def gather(field):
        out = np.full(n, np.nan)
        for idx, res in parts:
            out[idx] = getattr(res, field)
        return out
    output = np.zeros(n, dtype=parts[0][1].output.dtype)
    for idx, res in parts:
        output[idx] = res.output
    results = [res for _, res in parts]
    return SimResult(
        gather("arrival"), gather("first_token"), gather("finish"), output, gather("admitted"),
        ChunkLog.merged([res.chunks for res in results]),
        max(r.peak_hbm_bytes for r in results), max(r.peak_host_bytes for r in results),
        sum(r.in_system_area for r in results), min(r.max_batch_fit for r in results),
        sum(r.preemptions for r in results), replicas=len(results))
