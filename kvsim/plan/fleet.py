"""The smallest fleet that carries a target rate: for one configuration and one router, the
fewest replicas whose fleet replay at the target rate meets every SLO.

A fleet of N replicas behind a router is simulated as such (:func:`kvsim.replay.run_replay`
with ``replicas=N``: each replica its own engine, the router handing out the same arrivals), not
as N copies of one overloaded replica. Its verdict is :func:`kvsim.plan.slo.check`: the fleet
keeps up with its arrivals over the measured window and every latency limit holds at its
percentile.

The search: a start from work conservation (a replica fed the whole target rate completes what
it can: ``ceil(target / its completions per second)`` replicas at least), then up by half
at a time until a fleet passes, then bisection down to the fewest that pass; the fleet with one
replica fewer is always run too, so the answer says by what it fails. More replicas never serve
worse (``tests/test_fleet.py`` holds the verdict monotone in N on the cases it checks), so the
bisection's answer is the fewest.

An engine ``f`` times slower is, in time scaled by ``f``, the predicted engine at ``f`` times the
rate with every latency ``f`` times longer (arrivals scale with 1/rate, service with the engine):
a fleet meets limit ``L`` at rate ``q`` under it where the predicted fleet meets ``L / f`` at
``q f``. :func:`at_engine_end` searches so, for the ends of the engine's prediction interval.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvsim.plan import slo

MAX_REPLICAS = 4096  # a fleet search gives up beyond this many replicas
MAX_TARGET_QPS = 1e6  # --target-qps at most: 244 req/s per replica of the largest fleet
GROWTH = 1.5  # the search goes up by this factor (at least one replica) until a fleet passes


@dataclass
class Check:
    """One fleet replay's verdict."""
    replicas: int
    ok: bool
    why: str  # what failed ("" when it passed)
    result: object  # the ReplayResult


@dataclass
class Fleet:
    router: str
    replicas: int | None  # the fewest that pass (None: none up to the cap)
    check: Check | None  # the replay at ``replicas``
    fewer: Check | None  # the replay at ``replicas - 1`` (None where replicas is 1)
    start: int  # the search's start (work conservation)
    runs: int  # fleet replays it took
    checks: dict = field(default_factory=dict)  # replicas -> Check, every one run

    @property
    def why_fewer(self) -> str:
        """Why one replica fewer does not do (or why none up to the cap does)."""
        if self.replicas is None:
            last = self.checks[max(self.checks)]
            alone = " with at most one request per replica on average: more replicas would " \
                "not help" if unloaded(last) else ""
            return f"{last.replicas} replicas fail{alone}: {last.why}"
        return self.fewer.why if self.fewer is not None else "one replica suffices"


def start_from(single, target: float) -> int:
    """Replicas at least, from one replica's replay at the target rate (``single``, a
    ReplayResult): the requests it completed per second over its run, which an overloaded
    replica cannot exceed."""
    served = single.serving.requests_per_s
    if not (served is not None and served > 0):
        return 1
    return max(1, math.ceil(target / served * (1 - 1e-9)))


def smallest(replay, limits: list, router: str, start: int = 1,
             cap: int = MAX_REPLICAS, known: dict | None = None) -> Fleet:
    """The fewest replicas behind ``router`` that pass ``limits``, up to ``cap``;
    ``replay(replicas, router)``: the fleet's replay at the target rate (a ReplayResult);
    ``known``: verdicts already had, by replicas (one replica's, which has no router)."""
    checks: dict[int, Check] = dict(known or {})

    def run(n: int) -> Check:
        if n not in checks:
            r = replay(n, router)
            ok, why = slo.check(r, limits)
            checks[n] = Check(n, ok, why, r)
        return checks[n]

    n = max(1, min(start, cap))
    if run(n).ok:  # down: one fewer first (the start is usually tight), then by halves
        good, bad = n, 0
        if n > 1:
            if run(n - 1).ok:
                good = n - 1
            else:
                bad = n - 1
        while bad < good - 1:
            mid = (good + bad) // 2
            if run(mid).ok:
                good = mid
            else:
                bad = mid
    else:  # up, by half at a time, then back by halves
        bad = n
        good = None
        while good is None:
            nxt = min(cap, max(bad + 1, math.ceil(bad * GROWTH)))
            if nxt == bad or unloaded(checks[bad]):
                return Fleet(router, None, None, None, start, len(checks), checks)
            if run(nxt).ok:
                good = nxt
            else:
                bad = nxt
        while good - bad > 1:
            mid = (good + bad) // 2
            if run(mid).ok:
                good = mid
            else:
                bad = mid
    fewer = run(good - 1) if good > 1 else None
    return Fleet(router, good, checks[good], fewer, start, len(checks), checks)


def unloaded(check: Check) -> bool:
    """Whether a failing fleet failed a latency limit while its replicas held at most one
    request each on average: its requests were served about alone, so more replicas cannot
    bring them under the limit (the search stops there)."""
    if check.ok or check.result is None or check.why.startswith("not sustained"):
        return False
    return check.result.serving.mean_in_system <= check.replicas


def best(replay, limits: list, routers: list[str], start: int = 1,
         cap: int = MAX_REPLICAS, known: dict | None = None) -> tuple[Fleet, list[Fleet]]:
    """The fleet with the fewest replicas over ``routers`` (ties: the router named first),
    each router's search starting where the previous one ended; and every router's fleet.
    ``known``: verdicts that hold for every router (one replica's)."""
    fleets = []
    for router in routers:
        f = smallest(replay, limits, router, start, cap, known)
        fleets.append(f)
        if f.replicas is not None:
            start = f.replicas
    found = [f for f in fleets if f.replicas is not None]
    return (min(found, key=lambda f: f.replicas) if found else fleets[0]), fleets


def at_engine_end(replay_at, limits: list, router: str, target: float, factor: float,
                  start: int, cap: int = MAX_REPLICAS) -> Fleet:
    """The fewest replicas if the engine's times were ``factor`` times the predicted ones:
    the predicted fleet at ``factor`` times the rate under the limits divided by ``factor``.
    ``replay_at(rate, replicas, router)``: the fleet's replay at ``rate``."""
    scaled = [slo.Limit(lim.metric, lim.value / factor, lim.at) for lim in limits]
    return smallest(lambda n, r: replay_at(target * factor, n, r), scaled, router,
                    max(1, round(start * factor)), cap)
