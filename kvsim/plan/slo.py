"""The highest arrival rate a deployment sustains within its latency SLOs, by bracketing and
bisection.

A rate counts only if the simulated system keeps up with it and every SLO given holds:

* **sustainable**: over the measured window (from the arrival of the first fifth of the requests,
  the warm-up, to the last arrival), completions keep pace with arrivals (at least 95% of them)
  and the number of requests in the system grows by at most 5% of the window's arrivals (or 2);
  a queue that grows without end fails however good the latencies of the requests it served;
* **within the SLOs**: each of TPOT, TTFT and end-to-end latency that has a limit, at the
  percentile chosen for it (p99 by default, or p50), is at or under its limit.

Arrival times for one seed scale exactly with 1/qps, so both tests get harder as the rate grows;
the search doubles the rate until one fails, then bisects (geometrically) between the last rate
that passed and the first that did not.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from kvsim.errors import KvsimError

METRICS = {"tpot_ms": ("TPOT", "ms"), "ttft_ms": ("TTFT", "ms"), "e2e_s": ("end-to-end", "s")}
SERVED_MIN, GROWTH_MAX = 0.95, 0.05


@dataclass(frozen=True)
class Limit:
    metric: str  # tpot_ms | ttft_ms | e2e_s
    value: float
    at: str = "p99"  # p50 | p99

    @property
    def key(self) -> str:  # the report key of the percentile the limit applies to
        base = self.metric.rsplit("_", 1)
        return f"{base[0]}_{self.at}_{base[1]}"

    def words(self) -> str:
        name, unit = METRICS[self.metric]
        return f"{self.at} {name} <= {self.value:g} {unit}"


def parse_limit(metric: str, text: str) -> Limit:
    """``"50"`` or ``"50@p50"`` for ``--slo-<metric>``; one-line error otherwise."""
    value, _, at = str(text).partition("@")
    at = at or "p99"
    try:
        v = float(value)
    except ValueError:
        v = float("nan")
    if not (math.isfinite(v) and v > 0) or at not in ("p50", "p99"):
        raise KvsimError(f"--slo-{metric.replace('_', '-')} {text!r}: give a positive number, "
                         f"optionally @p50 or @p99 (default p99)")
    return Limit(metric, v, at)


@dataclass
class SLOResult:
    qps: float  # highest rate found that is sustained within the SLOs (0: not even the lowest)
    fails_at: float  # lowest rate found that is not (inf: none up to the cap)
    evaluations: int
    why_fails: str = ""  # what failed at ``fails_at``
    at_qps: dict = field(default_factory=dict)  # the probe report's figures at ``qps``


def sustained(report: dict) -> tuple[bool, str]:
    """Whether an open-loop run kept up with its arrivals; and why not, in words."""
    s = report["sim"]
    if s.get("served_frac_window") is None:
        return True, ""
    if s["served_frac_window"] < SERVED_MIN:
        return False, (f"not sustained: {100 * s['served_frac_window']:.0f}% of the arrivals "
                       f"served over the measured window")
    if s["queue_growth_window"] > max(GROWTH_MAX * s["arrivals_window"], 2):
        return False, (f"not sustained: the queue grew by {s['queue_growth_window']:.0f} "
                       f"requests over the measured window")
    return True, ""


def check(report: dict, limits: list[Limit]) -> tuple[bool, str]:
    ok, why = sustained(report)
    if not ok:
        return ok, why
    s = report["sim"]
    for lim in limits:
        got = s[lim.key]
        if not got <= lim.value:  # NaN fails too
            return False, f"{lim.words()} missed: {got:.4g}"
    return True, ""


def describe(limits: list[Limit]) -> str:
    return " and ".join(lim.words() for lim in limits) if limits else "no latency bound given"


def max_qps(run: Callable[[float], dict], limits: list[Limit], lo: float = 0.01,
            cap: float = 1e4, rel_tol: float = 0.02) -> SLOResult:
    n, reports, why = 0, {}, {}

    def ok(q: float) -> bool:
        nonlocal n
        n += 1
        reports[q] = run(q)
        good, why[q] = check(reports[q], limits)
        return good

    def result(best: float, fails: float) -> SLOResult:
        at = {}
        if best > 0:
            s = reports[best]["sim"]
            at = {k: s[k] for k in ("tpot_p50_ms", "tpot_p99_ms", "ttft_p50_ms", "ttft_p99_ms",
                                    "e2e_p99_s", "gpu_util", "link_util", "mean_batch",
                                    "served_frac_window")} | {
                "max_batch_fit": reports[best]["memory"]["max_batch_fit"]}
        return SLOResult(best, fails, n, why.get(fails, ""), at)

    if not ok(lo):
        return result(0.0, lo)
    hi = lo * 2
    while ok(hi):
        lo, hi = hi, hi * 2
        if hi > cap:
            return result(lo, math.inf)
    while hi / lo > 1 + rel_tol:
        mid = math.sqrt(lo * hi)
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return result(lo, hi)


def binding(at: dict) -> str:
    """What limits the deployment at the found rate, in words."""
    if not at:
        return "nothing sustained"
    parts = [f"GPU busy {100 * at['gpu_util']:.0f}%",
             f"host link busy {100 * at['link_util']:.0f}%",
             f"mean batch {at['mean_batch']:.1f} of {at['max_batch_fit']} that fit in memory"]
    return ", ".join(parts)
