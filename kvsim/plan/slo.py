"""The highest arrival rate that meets a latency SLO, by bracketing and bisection.

A rate meets the SLO when the p99 TPOT and the p99 TTFT of a Poisson run at that rate stay within
their limits. Arrival times for one seed scale exactly with 1/qps, so latency grows with the
rate; the search doubles the rate until it fails, then bisects (geometrically) between the last
rate that met the SLO and the first that did not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable


@dataclass
class SLOResult:
    qps: float  # highest rate found that meets the SLO (0: not even the lowest)
    fails_at: float  # lowest rate found that does not (inf: none up to the cap)
    evaluations: int


def meets(report: dict, tpot_ms: float, ttft_ms: float) -> bool:
    sim = report["sim"]
    return sim["tpot_p99_ms"] <= tpot_ms and sim["ttft_p99_ms"] <= ttft_ms


def max_qps(run: Callable[[float], dict], tpot_ms: float, ttft_ms: float, lo: float = 0.01,
            cap: float = 1e4, rel_tol: float = 0.02) -> SLOResult:
    n = 0

    def ok(q: float) -> bool:
        nonlocal n
        n += 1
        r = run(q)
        return meets(r, tpot_ms, ttft_ms)

    if not ok(lo):
        return SLOResult(0.0, lo, n)
    hi = lo * 2
    while ok(hi):
        lo, hi = hi, hi * 2
        if hi > cap:
            return SLOResult(lo, math.inf, n)
    while hi / lo > 1 + rel_tol:
        mid = math.sqrt(lo * hi)
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return SLOResult(lo, hi, n)
