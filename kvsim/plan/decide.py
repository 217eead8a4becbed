"""Deciding a deployment for a target rate: the cheapest configuration that carries it within
the SLO, the runner-up, and what rules out each of the rest.

Each configuration was simulated as one replica and its sustained rate found by the SLO search
(:mod:`kvsim.plan.slo`); it needs ceil(target / that rate) replicas, priced by
:mod:`kvsim.plan.cost`. The cheapest is then checked: a replay of that many replicas at the
target rate (twice the SLO probe's requests) must pass the same test as the search; if it does
not, the configuration gets one more replica and the ranking is redone.
"""

from __future__ import annotations

import json
import math

import pandas as pd

from kvsim.plan import slo
from kvsim.plan.sweep import KNOBS, knobs

CHECK_TRIES = 3  # replicas added to a configuration whose check fails, at most
LATENCY = ("tpot_p50_ms", "tpot_p99_ms", "ttft_p50_ms", "ttft_p99_ms", "e2e_p99_s")


def binding(r) -> str:
    """What limits a configuration (one row): its memory (HBM, host memory), a latency limit
    (TPOT, TTFT, e2e latency), its max batch running full, the host link or the GPU; "failed"
    where the run failed."""
    if r.get("status") == "failed":
        return "failed"
    if r.get("status") == "infeasible":
        return "host memory" if "host" in str(r.get("error", "")).lower() else "HBM"
    why = str(r.get("slo_fails_because", ""))
    for words, name in (("TPOT", "TPOT"), ("TTFT", "TTFT"), ("end-to-end", "e2e latency")):
        if words in why:
            return name
    batch, fit = float(r.get("batch", 0)), float(r.get("max_batch_fit", math.inf))
    if fit < batch:
        return "HBM"  # the batch that fits in HBM caps the rate
    if float(r.get("slo_at_mean_batch", 0) or 0) >= 0.9 * batch:
        return "max batch"  # the batch it is allowed runs full
    link, gpu = float(r.get("slo_at_link_util", 0) or 0), float(r.get("slo_at_gpu_util", 0) or 0)
    return "the link" if link >= gpu and link > 0 else "GPU"


def describe(r) -> str:
    """A configuration (its table row) in a few words: ``h100-sxm TP1 dense-resident batch 16
    KV bf16`` (and ``max_batched_tokens 2048``, ``host_gib 64`` where set)."""
    knobs = r.get("knobs")
    return (f"{r['gpu']} TP{int(r.get('tp', 1))} {r['label']} batch {int(r['batch'])} KV "
            f"{r.get('kv_dtype') or 'bf16'}" + (f" {knobs}" if isinstance(knobs, str) and knobs
                                              else ""))


def decide(df: pd.DataFrame, target_qps: float, limits: list, check_run,
           configs: dict) -> tuple[pd.DataFrame, dict]:
    """``df`` with ``binding``, ``rank`` and ``why_lost`` columns, and the answer (the contents
    of answer.json). ``check_run(row, replicas)``: a replay of that configuration and count of
    replicas at the target rate (a ReplayResult); ``configs``: each row's configuration by its
    key."""
    df = df.copy()
    df["binding"] = [binding(r) for r in df.to_dict("records")]
    checks: dict[int, list] = {}
    rows = df.to_dict("records")
    candidates = [i for i, r in enumerate(rows) if r.get("status") == "ok"
                  and (r.get("slo_max_qps") or 0) > 0 and _finite(r.get("usd_per_hour"))]

    def cost(i):
        r = rows[i]
        return (r["usd_per_hour"], -r["slo_max_qps"] * r["replicas_needed"], i)

    order: list[int] = []
    while candidates:
        i = min(candidates, key=cost)
        r = rows[i]
        report = check_run(r, int(r["replicas_needed"]))
        good, why = slo.check(report, limits)
        checks.setdefault(i, []).append((int(r["replicas_needed"]), good, why, report))
        if good:
            order.append(i)
            candidates.remove(i)
            if len(order) == 2:
                break
        elif len(checks[i]) > CHECK_TRIES:
            candidates.remove(i)
        else:  # one replica more, priced again, and the ranking redone
            scale = (r["replicas_needed"] + 1) / r["replicas_needed"]
            for k in ("usd_per_hour", "usd_per_m_tokens", "usd_per_request", "gpus"):
                r[k] = r[k] * scale
            r["replicas_needed"] += 1
    rest = sorted((i for i, r in enumerate(rows) if i not in order),
                  key=lambda i: (not _finite(rows[i].get("usd_per_hour")),
                                 rows[i].get("usd_per_hour") or 0))
    ranked = order + rest
    answer_cost = rows[order[0]]["usd_per_hour"] if order else None
    for rank, i in enumerate(ranked):
        rows[i]["rank"] = rank + 1
        role = ("the answer", "runner-up")[order.index(i)] if i in order else ""
        rows[i]["why_lost"] = role if role == "the answer" else \
            _why_lost(rows[i], configs[rows[i]["key"]], role, answer_cost, checks.get(i, []))
    out = pd.DataFrame(rows, index=df.index)
    answer = {"target_qps": target_qps, "slo": slo.describe(limits)}
    def entry(i):
        return _entry(rows[i], configs[rows[i]["key"]], checks[i][-1])

    if order:
        answer |= entry(order[0])
        answer["runner_up"] = entry(order[1]) if len(order) > 1 else None
    else:
        answer |= {"gpu": None, "why": "no configuration carries the target rate within the SLO "
                                       "at a known price"}
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
        value = key[group].pop(knob, None)
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
            carries = r.get("status") == "ok" and _finite(r.get("usd_per_hour")) and \
                not str(r.get("why_lost", "")).startswith(("fails at", "no rate"))
            others.append({"value": value, "usd_per_hour": r["usd_per_hour"] if carries else None,
                           "why": r.get("why_lost")})
        if any(o["usd_per_hour"] is None or o["usd_per_hour"] > a["usd_per_hour"] + 1e-9
               for o in others):
            out.append({"knob": knob, "value": mine, "otherwise": others})
    return out


def _finite(v) -> bool:
    try:
        return math.isfinite(float(v))
    except (TypeError, ValueError):
        return False


def _why_lost(r, cfg, role: str, answer_cost, checks: list) -> str:
    """Why a configuration is not the answer, in words (``role``: "runner-up" or "")."""
    if r.get("status") != "ok":
        return f"does not run: {r.get('error')}"
    if not (r.get("slo_max_qps") or 0) > 0:
        return f"no rate meets the SLO: {r.get('slo_fails_because')}"
    if not _finite(r.get("usd_per_hour")):
        return f"no price for {r['gpu']}: {r.get('price_source')}"
    failed = [c for c in checks if not c[1]]
    if checks and not checks[-1][1]:
        return (f"fails at the target rate with up to {checks[-1][0]} replicas: "
                f"{checks[-1][2]}")
    more = r["usd_per_hour"] - answer_cost if answer_cost is not None else math.nan
    words = (f"${r['usd_per_hour']:.2f}/h, ${more:.2f}/h more than the answer: "
             f"{r['binding']} limits it to {r['slo_max_qps']:.3g} req/s per replica, so it "
             f"needs {int(r['replicas_needed'])} replica(s) of {cfg.deployment.tp} GPU(s)")
    if failed:
        words += f" ({failed[0][0]} replica(s) failed the check at the target rate)"
    return (f"{role}: " if role else "") + words


def _entry(r, cfg, check) -> dict:
    replicas, good, why, report = check
    s, d = report.serving, cfg.deployment
    return {"gpu": r["gpu"], "tp": d.tp, "replicas": replicas, "gpus": replicas * d.tp,
            "policy": cfg.policy.name, "options": dict(cfg.options), "label": r["label"],
            "batch": cfg.batch, "kv_dtype": d.kv_dtype or "bf16", **knobs(cfg),
            "weight_dtype": d.weight_dtype or "bf16",
            "usd_per_hour": r["usd_per_hour"], "usd_per_m_tokens": r["usd_per_m_tokens"],
            "usd_per_request": r["usd_per_request"],
            "price_usd_per_gpu_hour": r["price_usd_per_gpu_hour"],
            "price_source": r["price_source"],
            "qps_capacity_per_replica": r["slo_max_qps"],
            "qps_capacity_per_replica_interval": [r.get("slo_max_qps_lo"),
                                                  r.get("slo_max_qps_hi")],
            "binding": r["binding"],
            "latency_at_target": {k: getattr(s, k) for k in LATENCY},
            "uncertainty": _uncertainty(report),
            "check": {"requests": s.requests, "replicas": replicas,
                      "served_frac_window": s.served_frac_window,
                      "requests_per_s": s.requests_per_s, "meets_slo": good, "why": why}}


def _uncertainty(result) -> dict:
    """How sure the check's figures are: the prediction interval every result carries (the
    engine's checked error, around the policy profile's 90% interval on the KV read where one
    applies) on TPOT, TTFT and throughput, and the profile's KV-read interval."""
    b = result.bounds
    out = {f"{k}_interval": list(b[k]) for k in ("tpot_ms", "ttft_ms", "throughput_tok_s")
           if k in b}
    if "kv_read_frac" in b:
        out["kv_read_frac_interval"] = list(b["kv_read_frac"])
    out["engine_check"] = result.interval.get("engine_check")
    out["rule"] = result.interval.get("rule")
    return out
