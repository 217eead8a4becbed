"""Deciding a deployment for a target rate: the cheapest fleet that carries it within the SLO,
the runner-up, and what rules out each of the rest.

Each configuration's fleet was found by the deployment search (:mod:`kvsim.plan.fleet`, run per
configuration by :mod:`kvsim.plan.deployment`): the fewest replicas behind the best
router whose fleet replay at the target rate meets every SLO, and the fleet with one replica
fewer that does not. Priced by :mod:`kvsim.plan.cost`, the cheapest is the answer (ties: fewer
GPUs, then the lower p99 TPOT). For the answer and the runner-up the search is run again at the
two ends of the engine's prediction interval (:func:`kvsim.plan.fleet.at_engine_end`): the
fleet size and cost a buyer should be ready for.
"""

from __future__ import annotations

import json
import math

import pandas as pd

from kvsim.plan import slo
from kvsim.plan.sweep import KNOBS, knobs

LATENCY = ("tpot_p50_ms", "tpot_p99_ms", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms",
           "itl_p99_ms", "e2e_p99_s")


def decide_plan(df: pd.DataFrame, spec, configs: dict) -> tuple[pd.DataFrame, dict]:
    """The answer for ``spec.target_qps`` among this plan's configurations (``configs``, by
    key): the cheapest fleet the deployment search found (:func:`decide`), with the
    fleet at the engine interval's ends for the answer and the runner-up, and the grid's edges
    the answer sits on."""
    from kvsim.plan import fleet
    from kvsim.plan.deployment import target_of
    from kvsim.replay import run_replay
    target = target_of(spec)

    def ends(row: dict):
        spread = row.get("engine_spread")
        if not (isinstance(spread, float) and math.isfinite(spread) and spread > 0):
            return None
        cfg = configs[row["key"]]

        def replay_at(rate, n, router):
            return run_replay(cfg.at_rate(rate, target.requests, replicas=n, router=router))
        return {end: fleet.at_engine_end(replay_at, spec.slo, row["router"], target.qps,
                                         math.exp(s), int(row["replicas_needed"]))
                for end, s in (("lo", -spread), ("hi", spread))}

    mine = df["key"].isin(configs)
    decided, answer = decide(df[mine], spec.target_qps, spec.slo, configs, ends)
    if answer.get("gpu") is not None:
        answer["grid_edges"] = grid_edges(answer, spec)
    return pd.concat([decided, df[~mine]]), answer


NEIGHBOURS = {"tp": [1, 2, 4, 8], "batch": [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]}


def grid_edges(answer: dict, spec) -> list[str]:
    """Where the answer sits on the edge of a dimension the user restricted (``--tp``,
    ``--batch``), in words naming the neighbour to try."""
    swept = {"tp": spec.deployment.get("tp", [1]), "batch": spec.batches}
    out = []
    for axis, flag in (("tp", "--tp"), ("batch", "--batch")):
        values = swept[axis] if isinstance(swept[axis], list) else [swept[axis]]
        if axis in spec.defaulted or len(values) < 1:
            continue
        mine, ladder = answer[axis], NEIGHBOURS[axis]
        for edge, side in ((max(values), 1), (min(values), -1)):
            if mine != edge:
                continue
            nxt = [v for v in ladder if (v > edge if side > 0 else v < edge)]
            if nxt:
                near = nxt[0] if side > 0 else nxt[-1]
                words = "largest" if side > 0 else "smallest"
                out.append(f"the answer's {flag.lstrip('-')} {mine} is the {words} {flag} swept; "
                           f"{flag} {near} may be cheaper: add it "
                           f"({flag} {','.join(map(str, sorted({*values, near})))})")
    return out


def binding(r) -> str:
    """What limits a configuration (one row): its memory (HBM, host memory), a latency limit
    (TPOT, TTFT, ITL, e2e latency) or keeping up (the queue), its max batch running full, the
    host link or the GPU; "failed" where the run failed. Of a fleet: what fails with one
    replica fewer, and how busy the fleet runs at the target."""
    if r.get("status") == "failed":
        return "failed"
    if r.get("status") == "infeasible":
        return "host memory" if "host" in str(r.get("error", "")).lower() else "HBM"
    fleet = "fewer_fails_because" in r and isinstance(r.get("fewer_fails_because"), str)
    why = str(r.get("fewer_fails_because" if fleet else "slo_fails_because", ""))
    for words, name in (("TPOT", "TPOT"), ("TTFT", "TTFT"), ("ITL", "ITL"),
                        ("end-to-end", "e2e latency")):
        if words in why:
            return name
    at = "fleet_" if fleet else "slo_at_"
    batch, fit = float(r.get("batch", 0)), float(r.get("max_batch_fit", math.inf))
    if fit < batch:
        return "HBM"  # the batch that fits in HBM caps the rate
    if float(r.get(f"{at}mean_batch", 0) or 0) >= 0.9 * batch:
        return "max batch"  # the batch it is allowed runs full
    link, gpu = float(r.get(f"{at}link_util", 0) or 0), float(r.get(f"{at}gpu_util", 0) or 0)
    return "the link" if link >= gpu and link > 0 else "GPU"


def describe(r) -> str:
    """A configuration (its table row) in a few words: ``h100-sxm TP1 dense-resident batch 16
    KV bf16`` (and ``max_batched_tokens 2048``, ``host_gib 64`` where set)."""
    knobs, tp = r.get("knobs"), int(r.get("tp", 1))
    label = str(r["label"]).removesuffix(f" TP{tp}")  # (a figure's label may name it)
    return (f"{r['gpu']} TP{tp} {label} batch {int(r['batch'])} KV "
            f"{r.get('kv_dtype') or 'bf16'}" + (f" {knobs}" if isinstance(knobs, str) and knobs
                                              else ""))


def decide(df: pd.DataFrame, target_qps: float, limits: list, configs: dict,
           ends=None) -> tuple[pd.DataFrame, dict]:
    """``df`` with ``binding``, ``rank`` and ``why_lost`` columns, and the answer (the contents
    of answer.json). ``configs``: each row's configuration by its key; ``ends(row)``: the fleet
    at the two ends of the engine's interval (``{"lo": Fleet, "hi": Fleet}``, lo the faster
    engine), for the answer and the runner-up."""
    df = df.copy()
    df["binding"] = [binding(r) for r in df.to_dict("records")]
    rows = df.to_dict("records")
    carry = [i for i, r in enumerate(rows) if r.get("status") == "ok"
             and _finite(r.get("replicas_needed")) and _finite(r.get("usd_per_hour"))]
    order = sorted(carry, key=lambda i: (rows[i]["usd_per_hour"], rows[i]["gpus"],
                                         rows[i].get("fleet_tpot_p99_ms") or 0, i))[:2]
    rest = sorted((i for i in range(len(rows)) if i not in order),
                  key=lambda i: (not _finite(rows[i].get("usd_per_hour")),
                                 rows[i].get("usd_per_hour") or 0))
    ranked = order + rest
    answer_cost = rows[order[0]]["usd_per_hour"] if order else None
    for rank, i in enumerate(ranked):
        rows[i]["rank"] = rank + 1
        role = ("the answer", "runner-up")[order.index(i)] if i in order else ""
        rows[i]["why_lost"] = role if role == "the answer" else \
            _why_lost(rows[i], role, answer_cost)
    out = pd.DataFrame(rows, index=df.index)
    answer = {"target_qps": target_qps, "slo": slo.describe(limits)}

    def entry(i):
        return _entry(rows[i], configs[rows[i]["key"]],
                      ends(rows[i]) if ends is not None else None)

    if order:
        answer |= entry(order[0])
        answer["runner_up"] = entry(order[1]) if len(order) > 1 else None
    else:  # the nearest miss says why: the configuration that needs the fewest GPUs
        near = min(ranked, key=lambda i: (rows[i].get("status") != "ok",
                                          _gpus_at_least(rows[i]), i), default=None)
        answer |= {"gpu": None, "why": "no configuration carries the target rate within the SLO "
                                       "at a known price" + (
                                           f"; the nearest, {describe(rows[near])}: "
                                           f"{rows[near]['why_lost']}" if near is not None
                                           else "")}
    answer["decided_by"] = decided_by(rows, order[0]) if order else []
    answer["rejected"] = [{"configuration": describe(rows[i]), "binding": rows[i]["binding"],
                           "why": rows[i]["why_lost"]} for i in ranked if i not in order]
    answer["pruned"] = int(out["error"].astype(str).str.startswith("pruned before").sum()) \
        if "error" in out else 0
    answer["configurations"] = len(out)
    return out, answer


def decided_by(rows: list[dict], answer: int) -> list[dict]:
    """The swept scheduling and memory settings that decide the answer: those for which the
    answer's configuration with another value (all else the same) costs more or does not carry
    the target within the SLO. Each: the knob, the answer's value and what the other values
    give."""
    def without(r, group, knob):  # the configuration's key but for the knob, and its value
        key = json.loads(r["key"])  # (Configuration.key: JSON of its typed fields)
        value = key.get(group, {}).pop(knob, None)  # (caching: only where set)
        if not key.get(group, True):
            del key[group]
        if group == "caching" and value is None:
            value = 0.0
        return json.dumps(key, sort_keys=True), value

    a = rows[answer]
    out = []
    for group, knob in KNOBS:
        rest, mine = without(a, group, knob)
        others = []
        for r in rows:
            theirs, value = without(r, group, knob)
            if theirs != rest or value == mine:
                continue
            carries = r.get("status") == "ok" and _finite(r.get("usd_per_hour"))
            others.append({"value": value, "usd_per_hour": r["usd_per_hour"] if carries else None,
                           "why": r.get("why_lost")})
        if any(o["usd_per_hour"] is None or o["usd_per_hour"] > a["usd_per_hour"] + 1e-9
               for o in others):
            out.append({"knob": knob, "value": mine, "otherwise": others})
    return out


def _gpus_at_least(r: dict) -> float:
    """The GPUs a configuration's fleet needs at least (its search's start); inf if unknown."""
    start = r.get("fleet_start")
    return start * int(r.get("tp", 1)) if _finite(start) else math.inf


def _finite(v) -> bool:
    try:
        return math.isfinite(float(v))
    except (TypeError, ValueError):
        return False


def _why_lost(r, role: str, answer_cost) -> str:
    """Why a configuration is not the answer, in words (``role``: "runner-up" or "")."""
    if r.get("status") != "ok":
        return f"does not run: {r.get('error')}"
    if not _finite(r.get("replicas_needed")):
        why = str(r.get("fewer_fails_because"))
        return why if why.startswith("not searched") else \
            f"no fleet carries the target within the SLO: {why}"
    if not _finite(r.get("usd_per_hour")):
        return f"no price for {r['gpu']}: {r.get('price_source')}"
    more = r["usd_per_hour"] - answer_cost if answer_cost is not None else math.nan
    n = int(r["replicas_needed"])
    words = (f"${r['usd_per_hour']:.2f}/h, ${more:.2f}/h more than the answer: it needs "
             f"{n} replica(s) of {int(r.get('tp', 1))} GPU(s) behind {r.get('router')}"
             + (f"; {n - 1} fail ({r['binding']}: {r.get('fewer_fails_because')})" if n > 1
                else ""))
    return (f"{role}: " if role else "") + words


def _entry(r, cfg, ends) -> dict:
    d, n = cfg.deployment, int(r["replicas_needed"])
    out = {"gpu": r["gpu"], "tp": d.tp, "replicas": n, "gpus": n * d.tp,
           "router": r["router"], "policy": cfg.policy.name, "options": dict(cfg.options),
           "label": r["label"], "batch": cfg.batch, "kv_dtype": d.kv_dtype or "bf16",
           **knobs(cfg), "weight_dtype": d.weight_dtype or "bf16",
           "usd_per_hour": r["usd_per_hour"], "usd_per_m_tokens": r["usd_per_m_tokens"],
           "usd_per_request": r["usd_per_request"],
           "price_usd_per_gpu_hour": r["price_usd_per_gpu_hour"],
           "price_source": r["price_source"],
           "qps_capacity_per_replica": r["capacity_per_replica"],
           "binding": r["binding"],
           "latency_at_target": {k: r[f"fleet_{k}"] for k in LATENCY},
           "uncertainty": _uncertainty(r, ends),
           "check": {"requests": int(r["fleet_requests"]), "replicas": n,
                     "served_frac_window": r["fleet_served_frac_window"],
                     "requests_per_s": r["fleet_requests_per_s"], "meets_slo": True,
                     "why": ""},
           "one_fewer": ({"replicas": n - 1, "meets_slo": False,
                          "why": r["fewer_fails_because"]} if n > 1 else None),
           "routers": r.get("routers_tried")}
    if _finite(r.get("fleet_prefix_hit_frac")):
        out["prefix_cache"] = prefix_cache_answer(r, cfg, n)
    return out


def prefix_cache_answer(r, cfg, replicas: int) -> dict:
    """What the answer buys for its prefix cache: each tier's size per GPU, per replica and in
    all, its cost per hour, and the share of prompt tokens each tier served in its fleet
    replay at the target rate."""
    c, tp = cfg.caching, cfg.deployment.tp
    tiers = {}
    for name in ("host", "disk"):
        gib = getattr(c, f"cache_{name}_gib")
        tiers[name] = {"gib_per_gpu": gib, "gib_per_replica": gib * tp,
                       "gib_in_all": gib * tp * replicas}
    tiers["pool"] = {"gib_in_all": c.cache_pool_gib}
    return {"tiers": tiers, "usd_per_hour": r.get("cache_usd_per_hour"),
            "hit_frac": r["fleet_prefix_hit_frac"],
            "hit_frac_by_tier": {t: r.get(f"fleet_prefix_hit_frac_{t}")
                                 for t in ("gpu", "host", "pool", "disk")}}


def _uncertainty(r, ends) -> dict:
    """How sure the answer is: the fleet's latencies at the ends of the prediction interval
    (the engine's checked error, around the policy profile's where one applies), and the fleet
    the search finds at the engine interval's ends, in replicas, GPUs and dollars."""
    from kvsim.replay.report import INTERVAL_RULE
    out = {f"{k}_interval": [r.get(f"fleet_{k}_lo"), r.get(f"fleet_{k}_hi")]
           for k in ("tpot_ms", "ttft_ms", "throughput_tok_s")
           if _finite(r.get(f"fleet_{k}_lo"))}
    out |= {"engine_spread": r.get("engine_spread"), "engine_check": r.get("engine_check"),
            "rule": INTERVAL_RULE}
    if ends:
        tp, price = int(r.get("tp", 1)), r["price_usd_per_gpu_hour"]
        fleets = {end: f.replicas for end, f in ends.items()}
        out["fleet_at_engine_ends"] = {
            "replicas": [fleets.get("lo"), fleets.get("hi")],
            "gpus": [None if fleets.get(e) is None else fleets[e] * tp for e in ("lo", "hi")],
            "usd_per_hour": [None if fleets.get(e) is None else fleets[e] * tp * price
                             for e in ("lo", "hi")],
            "rule": "the deployment search with the engine's times at the ends of its "
                    "interval (lo: e^-s times the predicted, hi: e^s; s the engine's spread): "
                    "the predicted fleet at e^(+-s) times the rate under the limits divided "
                    "by e^(+-s)"}
    return out
