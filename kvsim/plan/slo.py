"""The highest arrival rate a deployment sustains within its latency SLOs, by bracketing and
bisection on long runs.

A rate counts only if the simulated system keeps up with it and every SLO given holds:

* **sustainable**: over the measured window (from the arrival of the first fifth of the requests,
  the warm-up, to the last arrival), completions keep pace with arrivals (at least 95% of them)
  and the number of requests in the system grows by at most 5% of the window's arrivals (or 2);
  a queue that grows without end fails however good the latencies of the requests it served;
* **stationary**: a rate sustained on a probe of ``requests`` is run again twice as long (the
  same seed, so the first run is the second's beginning) and must be sustained there too: a
  queue that grows slowly enough to hide in the first run's window shows in the second, whose
  window is twice as long and whose later half the first run never reached;
* **within the SLOs**: on that longer run, each of TPOT, TTFT and end-to-end latency that has a
  limit, at the percentile chosen for it (p99 by default, or p50), is at or under its limit (a
  p99 of a few hundred requests rests on its few slowest, so it is judged on the most).

Arrival times for one seed scale exactly with 1/qps, so the tests get harder as the rate grows;
the search starts from an estimate (the closed loop's throughput), doubles or halves the rate
until it brackets the answer, then bisects geometrically until the last rate that passed and the
first that did not are within ``rel_tol`` (2%) of each other.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from kvsim.errors import KvsimError

METRICS = {"tpot_ms": ("TPOT", "ms"), "ttft_ms": ("TTFT", "ms"), "e2e_s": ("end-to-end", "s"),
           "itl_ms": ("ITL", "ms")}
# what each limit's percentile is over
OVER = {"tpot_ms": "over requests, each one's mean time per output token",
        "ttft_ms": "over requests", "e2e_s": "over requests",
        "itl_ms": "over tokens, each one's gap to the one before, prefill stalls included"}
PER_REQUEST = ("tpot_ms", "ttft_ms", "e2e_s")  # limits a request meets or misses (goodput)
PERCENTILES = ("p50", "p90", "p99")
SERVED_MIN, GROWTH_MAX = 0.95, 0.05


@dataclass(frozen=True)
class Limit:
    metric: str  # tpot_ms | ttft_ms | e2e_s
    value: float
    at: str = "p99"  # p50 | p90 | p99

    @property
    def key(self) -> str:  # the report key of the percentile the limit applies to
        base = self.metric.rsplit("_", 1)
        return f"{base[0]}_{self.at}_{base[1]}"

    def words(self) -> str:
        name, unit = METRICS[self.metric]
        return f"{self.at} {name} <= {self.value:g} {unit}"


def parse_limit(metric: str, text: str) -> Limit:
    """``"50"`` or ``"50@p50"`` for ``--slo-<metric>``; one-line error otherwise."""
    value, sep, at = str(text).partition("@")
    at = at if sep else "p99"  # (``60@`` names no percentile: refused)
    try:
        v = float(value)
    except ValueError:
        v = float("nan")
    allowed = PERCENTILES if metric == "itl_ms" else ("p50", "p99")
    if not (math.isfinite(v) and v > 0) or at not in allowed:
        raise KvsimError(f"--slo-{metric.replace('_', '-')} {text!r}: give a positive number, "
                         f"optionally {' or '.join('@' + a for a in allowed)} (default p99)")
    return Limit(metric, v, at)


@dataclass
class SLOResult:
    qps: float  # highest rate found that is sustained within the SLOs (0: not even the lowest)
    fails_at: float  # lowest rate found that is not (inf: none up to the cap)
    evaluations: int
    why_fails: str = ""  # what failed at ``fails_at``
    at_qps: dict = field(default_factory=dict)  # the probe report's figures at ``qps``


def sustained(result) -> tuple[bool, str]:
    """Whether an open-loop run (a :class:`~kvsim.replay.result.ReplayResult`) kept up with
    its arrivals; and why not, in words."""
    s = result.serving
    if s.served_frac_window is None:
        return True, ""
    if s.served_frac_window < SERVED_MIN:
        return False, (f"not sustained: {100 * s.served_frac_window:.0f}% of the arrivals "
                       f"served over the measured window")
    if s.queue_growth_window > max(GROWTH_MAX * s.arrivals_window, 2):
        return False, (f"not sustained: the queue grew by {s.queue_growth_window:.0f} "
                       f"requests over the measured window")
    return True, ""


def check(result, limits: list[Limit]) -> tuple[bool, str]:
    """Whether a run was :func:`sustained` and met every limit; and why not, in words."""
    ok, why = sustained(result)
    if not ok:
        return ok, why
    for lim in limits:
        got = getattr(result.serving, lim.key)
        if not got <= lim.value:  # NaN fails too
            return False, f"{lim.words()} missed: {got:.4g}"
    return True, ""


def describe(limits: list[Limit]) -> str:
    """The limits in words, each naming what its percentile is over."""
    if not limits:
        return "no latency bound given"
    return " and ".join(lim.words() for lim in limits) + " (" + "; ".join(
        f"{METRICS[m][0]} {OVER[m]}" for m in dict.fromkeys(lim.metric for lim in limits)) + ")"


def goodput_limits(limits: list[Limit]) -> dict:
    """The limits a request meets or misses, as a replay's goodput takes them (ITL's is over
    tokens: it has no per-request verdict)."""
    return {lim.metric: lim.value for lim in limits if lim.metric in PER_REQUEST}


def max_qps(run: Callable[[float, int], object], limits: list[Limit], requests: int = 1000,
            start: float | None = None, lo: float = 0.01, cap: float = 1e4,
            rel_tol: float = 0.02) -> SLOResult:
    """The highest rate within ``rel_tol`` that is :func:`sustained` on ``run(qps, requests)``
    and passes :func:`check` on ``run(qps, 2 * requests)``; ``start``: a first guess (default
    ``lo``), ``lo``: the lowest rate tried (below it the answer is 0), ``cap``: the highest."""
    n, reports, why = 0, {}, {}

    def ok(q: float) -> bool:
        nonlocal n
        n += 1
        good, why[q] = sustained(run(q, requests))  # a queue that grows here fails at once
        if not good:
            return False
        n += 1
        report = run(q, 2 * requests)
        good, why[q] = check(report, limits)
        if good:
            reports[q] = report
        return good

    def result(best: float, fails: float) -> SLOResult:
        at = {}
        if best > 0:
            s = reports[best].serving
            at = {k: getattr(s, k) for k in (
                "tpot_p50_ms", "tpot_p99_ms", "ttft_p50_ms", "ttft_p99_ms", "itl_p99_ms",
                "e2e_p99_s", "gpu_util", "link_util", "mean_batch", "served_frac_window")} | {
                "max_batch_fit": reports[best].memory.max_batch_fit}
        return SLOResult(best, fails, n, why.get(fails, ""), at)

    q = min(max(start or lo, lo), cap)
    if ok(q):
        good, bad = q, q * 2
        while ok(bad):
            good, bad = bad, bad * 2
            if bad > cap:
                return result(good, math.inf)
    else:
        good, bad = q / 2, q
        while good >= lo and not ok(good):
            good, bad = good / 2, good
        if good < lo:
            return result(0.0, bad)
    while bad / good > 1 + rel_tol:
        mid = math.sqrt(good * bad)
        if ok(mid):
            good = mid
        else:
            bad = mid
    return result(good, bad)


def capacity_interval(search: Callable[[list[Limit], float], SLOResult], limits: list[Limit],
                      qps: float, spread: float) -> tuple[float, float]:
    """The SLO capacity ``qps`` if the engine's times are off by ``e^-spread`` .. ``e^spread``
    (its prediction interval), by time rescaling: an engine ``f`` times slower at rate ``q`` is
    the predicted one at rate ``q f`` with every latency ``f`` times longer, so it meets a limit
    ``L`` where the prediction meets ``L / f``: its capacity is the predicted capacity under the
    limits ``L / f``, divided by ``f``. ``search(limits, start)``: :func:`max_qps` under other
    limits."""
    out = []
    for f in (math.exp(spread), math.exp(-spread)):
        scaled = [Limit(lim.metric, lim.value / f, lim.at) for lim in limits]
        out.append(search(scaled, qps * f).qps / f if qps > 0 else 0.0)
    return out[0], out[1]


def binding(at: dict) -> str:
    """What limits the deployment at the found rate, in words."""
    if not at:
        return "nothing sustained"
    parts = [f"GPU busy {100 * at['gpu_util']:.0f}%",
             f"host link busy {100 * at['link_util']:.0f}%",
             f"mean batch {at['mean_batch']:.1f} of {at['max_batch_fit']} that fit in memory"]
    return ", ".join(parts)
