"""The deployment search over a plan's configurations: for each, the smallest fleet that carries
the target rate within the SLO (:mod:`kvsim.plan.fleet`), searched where it could still be one of
the two cheapest.

Two passes, each split per configuration over the workers:

1. each configuration's own row: one replica fed the whole target rate (its figures in the table,
   flagged ``overloaded`` where it cannot keep up). What it completes per second bounds its fleet
   from below (work conservation: ``fleet_start`` replicas at least), and so its cost.
2. the fleet searches, cheapest lower bound first. A configuration whose lower bound costs
   more than the second-cheapest fleet found so far cannot be the answer or the runner-up: it
   is not searched, and its row says so (``usd_per_hour_at_least``); a search stops at the
   replicas that would cost more. Each search is handed the bound when a
   worker frees for it, so later searches stop sooner.

Results, each with its fleet's figures at the target (``fleet_*``), the router, why one replica
fewer fails, are in the table's rows; :mod:`kvsim.plan.decide` picks the answer from them.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from kvsim.errors import Infeasible, KvsimError
from kvsim.plan import fleet, slo
from kvsim.plan.executors import run_all
from kvsim.plan.sweep import SweepSpec, run_config
from kvsim.replay import Configuration, run_replay
from kvsim.replay.configuration import file_workload
from kvsim.sim.records import ROUTERS

FLEET = ("tpot_p50_ms", "tpot_p99_ms", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms",
         "itl_p99_ms", "e2e_p99_s", "served_frac_window", "requests_per_s", "requests",
         "gpu_util", "link_util", "mean_batch")  # a fleet's figures the table keeps


@dataclass(frozen=True)
class Target:
    """A deployment search's target: the rate, the routers to try, and the requests of each
    fleet replay (a long enough run: twice the SLO probe, or the workload file's, if fewer)."""
    qps: float
    routers: tuple[str, ...]
    requests: int


def target_of(spec: SweepSpec) -> Target | None:
    """The deployment search's target, where the plan has one."""
    if spec.target_qps is None:
        return None
    requests = 2 * spec.slo_requests
    if spec.workload is not None:
        requests = min(requests, file_workload(spec.workload).n)
    routers = spec.routers or [r for r in ROUTERS if r != "prefix-aware" or spec.caches()]
    return Target(spec.target_qps, tuple(routers), requests)


@dataclass
class FirstTask:
    """Pass 1: one configuration's row, of one replica at the target."""
    cfg: Configuration
    limits: list
    target: Target


def first_row(task: FirstTask) -> dict:
    cfg, target = task.cfg, task.target
    row = run_config(cfg, [], 0, run=cfg.at_rate(target.qps, target.requests))
    if row.get("status") == "ok":
        single = _Served(row)
        row["fleet_start"] = fleet.start_from(single, target.qps)
        ok, why = slo.check(single, task.limits)
        row["single_ok"], row["single_why"] = ok, why
    return row


class _Served:
    """What :func:`kvsim.plan.fleet.start_from` and :func:`kvsim.plan.slo.check` read of a
    replay, from its table row (a row crosses processes; a ReplayResult need not)."""

    def __init__(self, row: dict):
        from types import SimpleNamespace
        self.serving = SimpleNamespace(**{k: row.get(k) for k in (
            "requests_per_s", "served_frac_window", "queue_growth_window",
            "arrivals_window", "tpot_p50_ms", "tpot_p99_ms", "ttft_p50_ms", "ttft_p99_ms",
            "e2e_p50_s", "e2e_p99_s", "itl_p50_ms", "itl_p90_ms", "itl_p99_ms")})


@dataclass
class SearchTask:
    """Pass 2: one configuration's fleet search, up to ``cap`` replicas (None: no cap)."""
    cfg: Configuration
    limits: list
    target: Target
    start: int
    single: tuple  # (ok, why) of one replica at the target (pass 1's)
    cap: int | None = None
    bound: float | None = None  # the cost at which the search stops (for its words)


def search_row(task: SearchTask) -> dict:
    """The fleet columns of one configuration (its key with them, to merge into its row)."""
    try:
        return {"key": task.cfg.key(), **fleet_columns(task)}
    except Infeasible as e:
        return {"key": task.cfg.key(), "status": "infeasible", "error": str(e)}
    except KvsimError as e:
        return {"key": task.cfg.key(), "status": "failed", "error": str(e)}
    except Exception as e:  # a bug in one search must not end the plan; it is recorded
        return {"key": task.cfg.key(), "status": "failed", "error": f"{type(e).__name__}: {e}"}


def fleet_columns(task: SearchTask) -> dict:
    """The smallest fleet of ``task.cfg`` over each router (:mod:`kvsim.plan.fleet`), as table
    columns: ``replicas_needed``, ``router``, the fleet's figures at the target (``fleet_*``),
    why one replica fewer fails, and each router's count."""
    cfg, target = task.cfg, task.target
    runs: dict = {}

    def replay(n: int, router: str):
        key = (n, router if n > 1 else "")  # one replica: no router
        if key not in runs:
            runs[key] = run_replay(cfg.at_rate(target.qps, target.requests, replicas=n,
                                               router=router))
        return runs[key]

    known = {1: fleet.Check(1, *task.single, None)}  # pass 1 ran one replica
    cap = fleet.MAX_REPLICAS if task.cap is None else task.cap
    best, fleets = fleet.best(replay, task.limits, list(target.routers), task.start, cap,
                              known)
    out = {"fleet_runs": len(runs), "routers_tried": "; ".join(
        f"{f.router}: {f.replicas if f.replicas is not None else 'none'}" for f in fleets)}
    if best.replicas is None:
        why = best.why_fewer
        if task.cap is not None and max(best.checks) >= task.cap:
            why = (f"not searched beyond {task.cap} replica(s) (${task.bound:.2f}/h, the "
                   f"second-cheapest fleet found): {why}")
        return out | {"replicas_needed": math.nan, "router": None, "fewer_fails_because": why}
    r = best.check.result if best.check.result is not None else replay(best.replicas,
                                                                       best.router)
    return out | {
        "replicas_needed": best.replicas, "router": best.router,
        "fewer_fails_because": best.why_fewer,
        "capacity_per_replica": target.qps / best.replicas,
        **{f"fleet_{k}": getattr(r.serving, k) for k in FLEET},
        **{f"fleet_{k}_{end}": v for k, ends in r.bounds.items()
           if k in ("tpot_ms", "ttft_ms", "throughput_tok_s")
           for end, v in zip(("lo", "hi"), ends)},
        "engine_spread": r.interval.get("spread"), "engine_check": r.interval.get("engine_check"),
        **({"fleet_prefix_hit_frac": r.prefix_cache["prefix_hit_frac"],
            **{f"fleet_prefix_hit_frac_{t}": r.prefix_cache[f"prefix_hit_frac_{t}"]
               for t in ("gpu", "host", "pool", "disk")}} if r.prefix_cache else {})}


def search(spec: SweepSpec, todo: list[Configuration], executor, progress: bool, on_rows,
           status, prices: dict, memory=None) -> list[dict]:
    """Every configuration's row with its fleet (the module's two passes); ``on_rows`` gets
    each finished row (the plan's journal); ``prices``: GPU -> (USD per GPU-hour, source);
    ``memory``: the prices of the prefix cache's tiers (:class:`kvsim.plan.cost.MemoryPrices`)."""
    from kvsim.plan.cost import MemoryPrices
    memory = memory or MemoryPrices()
    target = target_of(spec)
    limits = list(spec.slo)
    firsts = run_all(executor, first_row, [FirstTask(c, limits, target) for c in todo],
                     progress, desc="plan (one replica each)", status=status)
    by_key = {c.key(): c for c in todo}
    rows = {r["key"]: r for r in firsts}
    costs: list[float] = []  # the fleets found so far, cheapest first (a heap)

    def per_replica(r):  # USD per hour of one replica: its GPUs and their cache tiers
        price = prices.get(r["gpu"], (None, ""))[0]
        return None if price is None else (price + memory.per_gpu(r)) * r.get("tp", 1)

    def lower(r):
        usd = per_replica(r)
        return math.inf if usd is None else usd * r["fleet_start"] + memory.fixed(r)

    for r in firsts:  # bounded before any fleet's engines are built
        if r.get("status") == "ok" and r["fleet_start"] > fleet.MAX_REPLICAS:
            r |= _beyond(r, target.qps)
    queue = sorted((r for r in firsts if r.get("status") == "ok"
                    and r.get("fleet_runs") != 0), key=lower)
    done = [r for r in firsts if r.get("status") != "ok" or r.get("fleet_runs") == 0]
    if done and on_rows is not None:
        on_rows(done)

    def tasks():
        for r in queue:
            bound = heapq.nsmallest(2, costs)[-1] if len(costs) >= 2 else None
            usd = per_replica(r)
            if usd is None or (bound is not None and lower(r) > bound):  # (a tie may win)
                r |= _not_searched(r, usd, bound, lower(r))
                if on_rows is not None:
                    on_rows([r])
                continue
            cap = None if bound is None else min(fleet.MAX_REPLICAS, max(
                r["fleet_start"], math.floor((bound - memory.fixed(r)) / usd)))
            yield SearchTask(by_key[r["key"]], limits, target, r["fleet_start"],
                             (r["single_ok"], r["single_why"]), cap, bound)

    def merged(found):
        r = rows[found["key"]]
        r.update(found)
        if math.isfinite(r.get("replicas_needed", math.nan)):
            heapq.heappush(costs, r["replicas_needed"] * per_replica(r) + memory.fixed(r))
        if on_rows is not None:
            on_rows([r])

    run_all(executor, search_row, tasks(), progress, desc="plan (fleets)", on_result=merged,
            status=status, total=len(queue))
    return [rows[c.key()] for c in todo]


def _beyond(r: dict, qps: float) -> dict:
    """A configuration whose fleet would exceed :data:`kvsim.plan.fleet.MAX_REPLICAS` by work
    conservation alone: not searched, and why."""
    why = (f"not searched: one replica completes {r['requests_per_s']:.3g} req/s at "
           f"{qps:g} req/s offered, so work conservation needs at least {r['fleet_start']:,} "
           f"replicas, beyond the {fleet.MAX_REPLICAS:,} a fleet search simulates")
    return {"replicas_needed": math.nan, "router": None, "fewer_fails_because": why,
            "usd_per_hour_at_least": None, "fleet_runs": 0}


def _not_searched(r: dict, usd: float | None, bound: float | None, least: float) -> dict:
    if usd is None:
        why = f"not searched: no price for {r['gpu']}"
    else:
        why = (f"not searched: work conservation needs at least {r['fleet_start']} replica(s), "
               f"${least:.2f}/h, more than the second-cheapest fleet found "
               f"(${bound:.2f}/h)")
    return {"replicas_needed": math.nan, "router": None, "fewer_fails_because": why,
            "usd_per_hour_at_least": None if usd is None else least, "fleet_runs": 0}
