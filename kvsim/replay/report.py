"""A replay's :class:`~kvsim.replay.result.ReplayResult` from a simulated run: the serving
figures, the memory, the policy's statistics, where every input came from, the warnings, and the
prediction intervals (the engine's checked error, the policy profile's).
"""

from __future__ import annotations

import math

import numpy as np

from kvsim.hw import catalog
from kvsim.hw.catalog import GiB
from kvsim.replay.result import HEADLINE, TABLE2, MemoryUse, ReplayResult, Serving, flatten
from kvsim.sim.records import DISK_GBPS, POOL_GBPS

__all__ = ["HEADLINE", "TABLE2", "add_intervals", "add_profile", "build", "flatten",
           "simulation"]


WARMUP = 0.2  # the first fifth of the arrivals warms the system up


def keeping_up(res, work) -> dict:
    """Of an open-loop run, over the measured window (the arrival of the first fifth of the
    requests to the last arrival, :func:`kvsim.sim.metrics.window_of`): the arrivals, the share
    of them the system served (its completions in the window over its arrivals) and how much
    the number in system grew."""
    req = res.requests
    if req.window is None:
        return {"arrivals_window": None, "served_frac_window": None, "queue_growth_window": None}
    t0, t1 = req.window
    a0, a1 = int((work.arrival <= t0).sum()), int((work.arrival <= t1).sum())
    arrived, served = a1 - a0, req.done_by_t1 - req.done_by_t0
    return {"arrivals_window": arrived,
            "served_frac_window": served / arrived if arrived else None,
            "queue_growth_window": (a1 - req.done_by_t1) - (a0 - req.done_by_t0)}


def simulation(res, work, scheduling) -> Serving:
    """Latency, throughput and utilisation of a simulated run (goodput if it had an SLO), and
    the scheduling it ran under."""
    req = res.requests
    makespan = req.last_finish - req.first_arrival if req.count else 0.0
    log = res.chunks  # sums over every chunk (kvsim.sim.records.ChunkLog)
    decode_time = log.decode_seconds  # a mixed step: its decodes' share
    reps = res.replicas  # busy time summed over replicas: utilisation per replica
    gpu_busy = log.gpu_busy / reps
    link_busy = log.link_busy / reps
    nan = float("nan")

    def ms(x):
        return x * 1e3

    def per_s(x):
        return x / makespan if makespan > 0 else nan
    out = {
        "tpot_ms": ms(req.tpot.mean()),
        "tpot_p50_ms": ms(req.tpot.percentile(50)), "tpot_p99_ms": ms(req.tpot.percentile(99)),
        "ttft_ms": ms(req.ttft.mean()), "ttft_p50_ms": ms(req.ttft.percentile(50)),
        "ttft_p99_ms": ms(req.ttft.percentile(99)),
        "e2e_s": req.e2e.mean(), "e2e_p50_s": req.e2e.percentile(50),
        "e2e_p99_s": req.e2e.percentile(99),
        "queue_wait_p99_ms": ms(req.wait.percentile(99)),
        "itl_ms": ms(req.itl.mean()),
        **{f"itl_p{q}_ms": ms(req.itl.percentile(q)) for q in (50, 90, 99)},
        "percentiles": req.method(),
        "pieces": res.pieces,  # simulated in pieces cut where the server was empty
        "throughput_tok_s": per_s(float(req.output_tokens)),
        "decode_tok_s": (reps * log.decode_tokens / decode_time if decode_time else nan),
        "requests_per_s": per_s(work.n),
        "requests": work.n,
        "makespan_s": makespan,
        "decode_steps": int(log.decode_steps),  # all replicas
        "mean_batch": log.batch_seconds / decode_time if decode_time else 0.0,
        "mean_in_system": res.in_system_area / makespan if makespan > 0 else 0.0,  # all
        "gpu_util": gpu_busy / makespan if makespan > 0 else 0.0,
        "link_util": link_busy / makespan if makespan > 0 else 0.0,
        "preemptions": res.preemptions,
        **keeping_up(res, work),
        "scheduler": scheduling.scheduler,
        "max_batched_tokens": scheduling.max_batched_tokens
        if scheduling.scheduler == "chunked" else None,
        "admission": scheduling.admission, "admission_order": scheduling.admission_order,
        "preemption": scheduling.preemption if scheduling.admission == "grow" else None,
    }
    if req.slo:  # DistServe's goodput: requests per second that meet every SLO, and their share
        out["goodput_rps"] = req.meet_slo / makespan if makespan > 0 else nan
        out["slo_attainment"] = req.meet_slo / req.count if req.count else nan
    return Serving(**out)


def memory(res, cost, model, mem, batch: int, tokens: float) -> MemoryUse:
    """Peak HBM and host use, with HBM split into weights, resident KV, transfer staging, policy
    metadata and workspace.

    The KV state a request reserves per token is ``resident_frac`` (of which ``meta_frac`` is
    metadata) plus its transfer staging; the peak KV state splits in those proportions. Where a
    term holds a fixed token count, in the proportions of a request of ``tokens`` tokens."""
    kv_state = res.peak_hbm_bytes - mem.weights_bytes - mem.workspace_bytes
    layers = cost.staging_layers / model.layers
    if cost.fixed:
        staging = layers * float(cost.tokens("host_read", tokens))
        per_token, meta_part = float(cost.tokens("resident", tokens)) + staging, \
            cost.meta_frac * tokens
    else:
        staging = layers * cost.host_read_frac
        per_token, meta_part = cost.resident_frac + staging, cost.meta_frac
    share = (lambda f: kv_state * f / per_token) if per_token > 0 else (lambda f: 0.0)
    meta, stage = share(meta_part), share(staging)
    return MemoryUse(
        hbm_gib=res.peak_hbm_bytes / GiB, host_gib=res.peak_host_bytes / GiB,
        hbm_weights_gib=mem.weights_bytes / GiB,
        hbm_kv_gib=(kv_state - meta - stage) / GiB, hbm_staging_gib=stage / GiB,
        hbm_meta_gib=meta / GiB, hbm_workspace_gib=mem.workspace_bytes / GiB,
        hbm_capacity_gib=mem.hbm_bytes / GiB, host_capacity_gib=mem.host_bytes / GiB,
        max_batch_fit=res.max_batch_fit, hbm_limited=res.max_batch_fit < batch)


def warnings(cfg, tr, model, costs, cost_source: str, res, prov: dict, cost,
             stats: dict, work) -> list[str]:
    out = []
    if res.max_batch_fit < cfg.batch:
        out.append(f"memory admits at most {res.max_batch_fit} requests at once, "
                   f"below --batch {cfg.batch}")
    lengths = work.prompt + work.output
    longest = int(lengths.max())
    if longest > model.max_context:
        over = int((lengths > model.max_context).sum())
        out.append(f"{longest} tokens exceed {model.name}'s trained context of "
                   f"{model.max_context}" + (f" ({over} of the workload's {work.n} requests "
                                            f"are longer than it)" if cfg.traffic.workload
                                            else ""))
    profiled = (tr.hardware.extra.get("model") or {}) if tr.hardware is not None else {}
    if cost_source.startswith("trace") and profiled.get("dtype_bytes", model.dtype_bytes) \
            != model.dtype_bytes:
        out.append(f"kernel tables were profiled with {profiled['dtype_bytes']}-byte values; "
                   f"{model.name} is planned with {model.dtype_bytes}-byte values")
    out += [f"extrapolated beyond measured table: {e}" for e in sorted(costs.extrapolations)]
    fitted = costs.engine.fitted_on
    where = [f"{k} {fitted[k]}" for k, now in (("gpu", costs.gpu_name), ("model", model.name))
             if fitted.get(k) and fitted[k] != now]
    span = costs.engine.fit.get("range", {}).get(cfg.policy.name)
    if span and cost.decide_kernel:  # the decide model is what depends on these
        now = {"context": token_lengths(cfg, work)["context"], "batch": cfg.batch,
               "kv_read_frac": cost.host_read_frac}
        off = [f"{k} {now[k]:g} (fitted {lo:g}..{hi:g})" for k, (lo, hi) in span.items()
               if not lo * (1 - 1e-9) <= now[k] <= hi * (1 + 1e-9)]
        if off:
            out.append(f"engine {costs.engine.name}'s decide model was fitted on "
                       f"{cfg.policy.name} points that do not span this plan: "
                       f"{'; '.join(off)}: extrapolated")
    if where:
        out.append(f"engine {costs.engine.name} was fitted on {', '.join(where)}; its overhead, "
                   f"efficiencies and decide costs are applied here unscaled (links scale with "
                   f"the catalog's link figures)")
    if "policy_transfer" in prov:
        out.append(prov["policy_transfer"])
    out += stats.get("notes", [])
    return out


def dtype_note(m) -> str:
    parts = [f"KV {m.kv_elem:g} B per element (--kv-dtype)" if m.kv_dtype_bytes else "",
             f"weights {m.weight_elem:g} B per parameter (--weight-dtype)"
             if m.weight_dtype_bytes else ""]
    parts = [p for p in parts if p]
    return f"; {', '.join(parts)}" if parts else ""


def provenance(cfg, trace_path, tr, analysis, model, costs, cost_source, mem,
               work, scheduling, work_at_prefill) -> dict:
    meta = tr.meta
    p = {
        "trace": f"{trace_path} ({tr.describe()}; recorded by {meta.get('recorded_by')}, "
                 f"{meta.get('created')})",
        "costs": cost_source,
        **{f"hw.{k}": v for k, v in costs.provenance.items()},
        "model": (f"catalog {model.name} ({model.source})" if model.name in catalog.MODELS
                  else f"{model.name}: {model.source}" if model.hf_id
                  else f"user-supplied shape {model.name}") + dtype_note(model),
        "policy": f"{analysis.name}: {analysis.provenance}",
        "host_memory": f"{mem.host_bytes / GiB:g} GiB " + (
            "(override --host-gib)" if cfg.deployment.host_gib is not None
            else "(default: 2 TiB host / 8 GPUs)"),
        "workspace": f"{mem.workspace_bytes / GiB:g} GiB " + (
            "(override --workspace-gib)" if cfg.deployment.workspace_gib is not None
            else "(default: CUDA context, activations, slack)"),
        "workload": work.description,
        "scheduler": scheduler_words(cfg, scheduling),
        "prefill": "FLOPs of the model's GEMMs and causal attention counted by hand "
                   "(kvsim.hw.catalog.ModelSpec.prefill_flops), at achievable compute; policy "
                   f"work: {work_at_prefill.source}",
    }
    if cfg.policy.needs_attention:
        src_model, src_ctx = meta.get("model"), tr.attention.context_len
        context = token_lengths(cfg, work)["context"]
        if src_model != model.name or src_ctx != context:
            p["policy_transfer"] = (
                f"policy statistics measured on {src_model} at {src_ctx} context tokens are "
                f"applied to {model.name} at {context} tokens")
    return p


def scheduler_words(cfg, s) -> str:
    if s.scheduler == "chunked":
        budget = (f"{s.max_batched_tokens} tokens per step "
                  + ("(override --max-batched-tokens)"
                     if cfg.scheduling.max_batched_tokens is not None else
                     "(default: vLLM's for this GPU, EngineArgs' OpenAI-server default)"))
        text = f"chunked prefill, decodes first, {budget}"
    else:
        text = "prefill-first: admitted prompts prefill whole while decodes wait"
    if s.admission_order != "arrival":
        text += f"; waiting requests admitted {s.admission_order}"
    if s.admission == "reserve":
        return text + "; admission reserves each request's whole length (never preempted)"
    return text + f"; admission grows per token, preemption by {s.preemption}"


TRACE_SHARES = ("resident_frac", "meta_frac", "kv_read_frac")


def build(cfg, trace_path, tr, analysis, model, costs, cost_source, mem, work,
          res, scheduling, work_at_prefill) -> ReplayResult:
    """The result of run ``res`` of configuration ``cfg``, its policy's ``analysis`` (its cost
    the one charged), before the policy profile's and the engine's intervals."""
    serving = simulation(res, work, scheduling)
    mem_use = memory(res, analysis.cost, model, mem, cfg.batch,
                     float((work.prompt + work.output).mean()))
    prov = provenance(cfg, trace_path, tr, analysis, model, costs, cost_source, mem, work,
                      scheduling, work_at_prefill)
    stats, cost = analysis.stats, analysis.cost
    # the trace's shares where they are not what is charged: of its own context (a cost with
    # fixed token counts) or of its own head size (metadata restated for the planned model)
    charged = {"resident_frac": cost.resident_frac, "meta_frac": cost.meta_frac,
               "kv_read_frac": cost.host_read_frac}
    stats = {(f"trace_{k}" if k in TRACE_SHARES and (cost.fixed or v != charged[k]) else k): v
             for k, v in stats.items()}
    lengths = token_lengths(cfg, work)
    context = lengths["context"]
    read = float(cost.tokens("host_read", context)) / context  # as charged here
    out = ReplayResult(cfg, costs.gpu_name, model.name, costs.engine.name, serving, mem_use,
                       analysis, stats, read, provenance=prov,
                       warnings=warnings(cfg, tr, model, costs, cost_source, res, prov, cost,
                                         stats, work), lengths=lengths)
    add_prefix_cache(out, cfg, res, work, model, costs)
    return out


def add_prefix_cache(out: ReplayResult, cfg, res, work, model, costs) -> None:
    """What prefix caching did (:func:`prefix_cache`), and where its tiers' figures came from;
    a warning where the workload names prefix blocks but the run could not cache them."""
    c = cfg.caching
    if res.cache is None:
        if work.prefix_hashes is not None and c.prefix_caching == "auto":
            why = "not modelled for this policy" if cfg.policy.name != "dense-resident" else \
                "off"
            out.warnings.append(
                f"the workload names prefix blocks but prefix caching is {why}: every prompt "
                f"token is prefilled (dense-resident caches them)")
        out.provenance["prefix_cache"] = "off" if work.prefix_hashes is not None else \
            "off (the workload names no prefix blocks)"
        return
    out.prefix_cache = prefix_cache(res.cache, work.prefix_block, model)
    link = costs.links["h2d"]
    tiers = ["GPU: the HBM its running requests leave free, least recently used evicted"]
    if c.cache_host_gib:
        tiers.append(f"host {c.cache_host_gib:g} GiB per GPU over the host link "
                     f"({link.beta / 1e9:.1f} GB/s, {link.source})")
    for name, gib, gbps, default, what in (
            ("pool", c.cache_pool_gib, c.cache_pool_gbps, POOL_GBPS, "a 200 Gb/s RDMA NIC"),
            ("disk", c.cache_disk_gib, c.cache_disk_gbps, DISK_GBPS, "a PCIe 4.0 x4 NVMe")):
        if gib:
            where = "in all, shared by the replicas" if name == "pool" else "per GPU"
            said = "override" if gbps != default else f"default: {what}"
            tiers.append(f"{name} {gib:g} GiB {where}, {gbps:g} GB/s per replica ({said})")
    out.provenance["prefix_cache"] = (
        f"{work.prefix_block}-token blocks named by the workload's prefix hashes; "
        + "; ".join(tiers))


def prefix_cache(counts, block: int, model) -> dict:
    """The prefix cache's figures: the share of admitted prompt tokens each tier served, the
    tokens prefilled, and the bytes each tier's link moved (GiB, per GPU, all replicas)."""
    prompt = counts.prompt_tokens or float("nan")
    hits = counts.hit_tokens
    return {
        "prefix_hit_frac": sum(hits.values()) / prompt,
        **{f"prefix_hit_frac_{t}": v / prompt for t, v in hits.items()},
        "prefix_block_tokens": block, "prefix_prompt_tokens": counts.prompt_tokens,
        "prefix_tokens_prefilled": counts.prefilled_tokens,
        "prefix_tokens_recomputed": counts.recomputed_tokens,
        **{f"prefix_loaded_gib_{t}": v / GiB for t, v in counts.loaded_bytes.items()},
        **{f"prefix_written_gib_{t}": v / GiB for t, v in counts.written_bytes.items()},
        "prefix_load_s": counts.load_seconds, "prefix_write_s": counts.write_seconds,
    }


def token_lengths(cfg, work) -> dict:
    """The prompt and output lengths a replay served: the configuration's, or a workload
    file's, then with their distribution (mean, p50, p99, max) and its mean prompt and output
    standing for ``context`` and ``output_len``."""
    if not cfg.traffic.workload and not cfg.traffic.reuse:
        return {"context": cfg.context, "output_len": cfg.traffic.output_len}

    def spread(x):
        return {"mean": float(x.mean()), "p50": float(np.percentile(x, 50)),
                "p99": float(np.percentile(x, 99)), "max": int(x.max())}
    return {"context": int(round(float(work.prompt.mean()))),
            "output_len": int(round(float(work.output.mean()))),
            "prompt_tokens": spread(work.prompt), "output_tokens": spread(work.output)}


QUALITY = ("output_rel_err_mean", "violation_rate")  # headline figures given 90% ends


def add_profile(result: ReplayResult, applied, bands: dict) -> None:
    """A policy profile's estimate in the result: the KV read (per decode step, per question
    pass, overall) and the quality figures (:data:`QUALITY`) with 90% intervals, TPOT and
    throughput at the ends of the KV read's interval (``bands``: "lo"/"hi" -> Serving), the
    per-layer KV read measured at each length, and where it came from; the trace's
    "policy_transfer" note gives way to the profile's."""
    iv, b = applied.intervals, result.bounds
    kv = "decode.kv_read_frac" if "decode.kv_read_frac" in iv else "question.kv_read_frac"
    lo, hi = iv.get(kv, (result.kv_read_frac, result.kv_read_frac))
    if result.policy.cost.host_read_tokens:  # a fixed count: the read is its budget, exactly
        lo = hi = result.kv_read_frac
    b["kv_read_frac"] = (lo, hi)
    for ps in ("question", "overall"):
        if f"{ps}.kv_read_frac" in iv:
            b[f"{ps}_kv_read_frac"] = tuple(iv[f"{ps}.kv_read_frac"])
    for stat in QUALITY:  # the headline's quality figures are the overall pass's
        if f"overall.{stat}" in iv and stat in result.stats:
            b[stat] = tuple(iv[f"overall.{stat}"])
    for key in ("tpot_ms", "ttft_ms", "throughput_tok_s", "decode_tok_s"):
        ends = sorted([result.figure(key)] + [getattr(s, key) for s in bands.values()])
        b[key] = (ends[0], ends[-1])
    result.profile = {
        "measured_tokens": list(applied.measured), "at_tokens": applied.at,
        "extrapolated": applied.extrapolated, "provenance": applied.provenance,
        "intervals": {k: list(v) for k, v in iv.items()},
        "forms": {k: {"form": f, "backtest_error": e} for k, (f, e) in applied.forms.items()},
        "per_layer_kv_read_frac": applied.per_layer,
        "interval_note": "90%: hierarchical bootstrap over tasks and questions (resampled "
                         "predictions stretched by sqrt(T/(T-1)) for T tasks), widened to the "
                         "forms whose back-test error is within 2x of the chosen one; TPOT and "
                         "throughput are simulated at the ends of the KV read's interval",
    }
    prov = result.provenance
    prov["policy"] = f"{result.configuration.policy.name}: {applied.provenance}"
    transfer = prov.pop("policy_transfer", None)
    if transfer:
        result.warnings = [w for w in result.warnings if w != transfer]
    prov["policy_transfer"] = (
        f"policy statistics measured on the profile's captures at {applied.measured[0]}.."
        f"{applied.measured[1]} tokens are applied to {result.model} at {applied.at} tokens")
    result.warnings.append(prov["policy_transfer"])


INTERVAL_KEYS = ("tpot_ms", "ttft_ms", "throughput_tok_s")
UNCHECKED_SPREAD = math.log(2)  # an engine never checked on measured points: x2 either way
INTERVAL_RULE = (
    "each figure's ends (the policy profile's where it gives one, else the figure) widened by "
    "the engine's spread s for its regime: lo x e^-s, hi x e^s. An engine fitted on published "
    "points: s = the 90% quantile of the regime's leave-one-source-out |ln(predicted / "
    "measured)| (TPOT: decode, TTFT: prefill, throughput: throughput); an engine fitted on one "
    "setup: the largest of its out-of-sample TPOT errors, TTFT counting one more uncovered "
    "dimension. Times 1 + k for k dimensions of this configuration its points did not cover "
    "(GPU, weight or KV type, TP size, MoE); an engine with no check: s = ln 2. An engine "
    "standing in for one without published points of its own (a name or version not fitted): "
    "s plus the spread between families, the 90% quantile over the published points of "
    "|ln(a family's prediction / the shared fit's)|")


def unchecked(costs, model, tp: int) -> list[str]:
    """What of this configuration the engine's measured points do not cover: the GPUs, types,
    TP sizes and model kinds of its rows (``fit["checked"]``), or for an engine fitted on one
    setup (``kvsim fit`` without families), TP 1 in bf16 on the GPU and model it names."""
    eng = costs.engine
    got = eng.fit.get("checked")
    if got is None:
        return _unchecked_one_setup(costs, model, tp)
    out = []
    if costs.gpu_name not in got["gpu"]:
        out.append(f"GPU {costs.gpu_name} (checked on {', '.join(got['gpu'])})")
    for what, elem, have in (("weights", model.weight_elem, got["weight_dtype"]),
                             ("KV", model.kv_elem, got["kv_dtype"])):
        if not any(ELEM[t] == elem for t in have if t in ELEM):
            out.append(f"{what} at {elem:g} B per element (checked: {', '.join(have)})")
    if tp not in got["tp"]:
        out.append(f"TP {tp} (checked at TP {', '.join(map(str, got['tp']))})")
    if model.experts and not got["moe"]:
        out.append(f"MoE model {model.name} (checked on dense models only)")
    return out


ELEM = {"bf16": 2, "fp16": 2, "fp8": 1, "int8": 1, "int4": 0.5}


def _unchecked_one_setup(costs, model, tp: int) -> list[str]:
    fitted = costs.engine.fitted_on
    out = []
    if fitted.get("gpu") and fitted["gpu"] != costs.gpu_name:
        out.append(f"GPU {costs.gpu_name} (checked on {fitted['gpu']})")
    types = [f"{what} {elem:g} B" for what, elem in (("weights", model.weight_elem),
                                                      ("KV", model.kv_elem)) if elem != 2]
    if types:
        out.append(f"{', '.join(types)} per element (checked in bf16)")
    if tp > 1:
        out.append(f"TP {tp} (checked at TP 1)")
    if model.experts:
        out.append(f"MoE model {model.name} (checked on dense {fitted.get('model', 'models')})")
    return out


def add_intervals(result: ReplayResult, costs, model, tp: int) -> None:
    """``<key>_lo``/``<key>_hi`` for TPOT, TTFT and throughput (and the decode rate where a
    policy profile gave it an interval) by :data:`INTERVAL_RULE`, what went into them under
    ``interval``, and a warning naming what the engine's points do not cover."""
    eng = costs.engine
    missing = unchecked(costs, model, tp)
    k = 1 + len(missing)
    spreads, why = {}, ""
    # an engine standing in for one without points: the spread between families on top
    between = eng.fit.get("between_families", {}) if eng.fit.get("stand_in") else {}
    for regime in ("decode", "prefill", "throughput"):
        s0, w = eng.spread(regime)
        why = why or w
        spreads[regime] = s0 + between.get(regime, 0.0) if s0 is not None else None
    if between:
        result.warnings.append(
            f"{eng.fit['stand_in']}: intervals widened by the spread between engine families "
            f"({', '.join(f'{r} x{math.exp(s):.3g}' for r, s in between.items())})")
    s0 = spreads["decode"]
    if s0 is None:
        result.warnings.append(f"{why}: every interval is a factor of 2 either way")
        widths = dict.fromkeys(("tpot_ms", "throughput_tok_s", "decode_tok_s", "ttft_ms"),
                               UNCHECKED_SPREAD)
    else:
        if missing:
            result.warnings.append(
                f"outside what engine {eng.name} was checked on: {'; '.join(missing)}: "
                f"intervals widened x{k} (s {s0:.3g} -> {k * s0:.3g})")
        published = "cv" in eng.fit  # else TTFT was never measured: one more dimension
        ttft = k * spreads["prefill"] if published and spreads["prefill"] else (k + 1) * s0
        thr = spreads["throughput"] if published and spreads["throughput"] else s0
        widths = {"tpot_ms": k * s0, "throughput_tok_s": k * thr, "decode_tok_s": k * s0,
                  "ttft_ms": ttft}
    before = {}
    for key, w in widths.items():
        if key not in INTERVAL_KEYS and key not in result.bounds:
            continue
        here = result.figure(key)
        lo, hi = result.bounds.get(key, (here, here))
        before[key] = [lo, hi]
        result.bounds[key] = (lo * math.exp(-w), hi * math.exp(w))
    result.interval = {"engine_spread": s0, "spread": widths["tpot_ms"],
                       "ttft_spread": widths["ttft_ms"], "unchecked": missing,
                       "engine_check": why, "before_engine": before, "rule": INTERVAL_RULE}
