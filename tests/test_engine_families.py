"""The engine model's kernel-shape terms against hand computations, the published dataset, and
the two-level family fit with its leave-one-source-out check."""

from __future__ import annotations

import csv
import dataclasses
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvsim.errors import KvsimError
from kvsim.fit import Point, Predictor, read_points
from kvsim.fit import families as F
from kvsim.fit.solve import HBM_CEILING, make_engine
from kvsim.hw import catalog
from kvsim.hw import engine as E
from kvsim.hw.costs import FLOP_EFFICIENCY, HBM_EFFICIENCY, costs_for
from kvsim.policies.spec import parse
from kvsim.sim.steps import StepCosts

ROOT = Path(__file__).resolve().parents[1]
GB = 1e9


def _costs(gpu="h100-sxm", **fields):
    eng = E.ROOFLINE.with_fields(**fields) if fields else E.ROOFLINE
    return costs_for(gpu, None, eng)[0]


# ------------------------------------------------------------------- cost terms, by hand
def test_matmul_overlap_and_shape_efficiency_by_hand():
    m = catalog.model("llama-3.1-8b")
    rate = 989e12 * FLOP_EFFICIENCY
    bw = 3350 * GB * HBM_EFFICIENCY
    flops, weights = 2 * m.active_layer_params, m.layer_params * 2
    for n in (1.0, 64.0, 4096.0):
        c, w = flops * n / rate, weights / bw
        assert _costs().gemm_time(n, m) == pytest.approx(max(c, w), rel=1e-12)  # roofline
        got = _costs(gemm_overlap=0.25).gemm_time(n, m)
        assert got == pytest.approx(c + w - 0.25 * min(c, w), rel=1e-12)
        eff = n / (n + 100.0)
        got = _costs(gemm_overlap=0.0, gemm_half_tokens=100.0).gemm_time(n, m)
        assert got == pytest.approx(c / eff + w, rel=1e-12)
    mm = _costs(gemm_overlap=0.5, gemm_half_tokens=30.0).matmuls(m)
    assert mm.at(77.0) == pytest.approx(float(mm.time(77.0)), rel=1e-12)


def test_grouped_expert_matmuls_by_hand():
    """Mixtral: the routed experts' FLOPs at the tokens each expert gets (n k / E) and at the
    engine's MoE efficiency; the rest at n tokens."""
    m = catalog.model("mixtral-8x7b")
    routed = 3 * m.hidden * m.moe_intermediate * m.experts_per_token
    dense = m.active_layer_params - routed
    rate = 989e12 * FLOP_EFFICIENCY
    n, half, moe = 256.0, 64.0, 0.5
    per_expert = n * m.experts_per_token / m.experts
    c = 2 * dense * n / (rate * n / (n + half)) \
        + 2 * routed / moe * n / (rate * per_expert / (per_expert + half))
    w = float(m.layer_weight_bytes(n)) / (3350 * GB * HBM_EFFICIENCY)
    got = _costs(gemm_overlap=0.0, gemm_half_tokens=half, moe_efficiency=moe).gemm_time(n, m)
    assert got == pytest.approx(c + w, rel=1e-12)


def test_shared_routing_reads_one_tokens_experts_and_gives_each_every_token_by_hand(tmp_path):
    """A batch of copies of one greedy sequence (ModelSpec.routing "shared"): a step reads the
    attention weights and the k experts of one token, and each of those experts gets every
    token of the step; uniform routing reads what n independent tokens touch."""
    m = catalog.model("mixtral-8x7b")
    shared = dataclasses.replace(m, routing="shared")
    k, E_, d = m.experts_per_token, m.experts, m.hidden
    one = m.attn_params + 3 * d * k * m.moe_intermediate + d * E_  # + the router
    for n in (1.0, 16.0, 64.0):
        assert float(shared.layer_weight_bytes(n)) == pytest.approx(one * 2, rel=1e-12)
        hit = E_ * (1 - (1 - k / E_) ** n)
        assert float(m.layer_weight_bytes(n)) == pytest.approx(
            (m.attn_params + 3 * d * hit * m.moe_intermediate + d * E_) * 2, rel=1e-12)
    routed = 3 * d * m.moe_intermediate * k
    dense, rate, half, n = m.active_layer_params - routed, 989e12 * FLOP_EFFICIENCY, 64.0, 16.0
    c = 2 * dense * n / (rate * n / (n + half)) + 2 * routed * n / (rate * n / (n + half))
    w = one * 2 / (3350 * GB * HBM_EFFICIENCY)
    got = _costs(gemm_overlap=0.0, gemm_half_tokens=half, moe_efficiency=1.0).gemm_time(n, shared)
    assert got == pytest.approx(c + w, rel=1e-12)
    assert _costs().gemm_time(16.0, shared) < _costs().gemm_time(16.0, m)  # 2 experts, not ~8
    path = tmp_path / "p.csv"
    for value, want in (("shared", "shared"), ("", "uniform")):
        path.write_text(f"gpu,model,policy,context,batch,tpot_ms,routing\n"
                        f"h100-sxm,mixtral-8x7b,dense-resident,128,16,10,{value}\n")
        assert read_points(path)[0].routing == want
    path.write_text("gpu,model,policy,context,batch,tpot_ms,routing\n"
                    "h100-sxm,mixtral-8x7b,dense-resident,128,16,10,greedy\n")
    with pytest.raises(KvsimError, match="routing"):
        read_points(path)


def test_weight_only_fp8_reads_fp8_bytes_at_the_bf16_rate(tmp_path):
    """fp8 weights cast for bf16 GEMMs (an engine with no fp8 kernel for the model): the weight
    bytes of fp8 at the bf16 rate; W8A8 takes the fp8 rate on an H100 (times the measured
    fp8/bf16 efficiency ratio, 0.883)."""
    from kvsim.replay import with_dtypes
    m = with_dtypes(catalog.model("mixtral-8x7b"), None, "fp8")
    w8a16 = dataclasses.replace(m, weight_only=True)
    c = _costs()
    assert c.gemm_flops(w8a16) == c.flops
    assert c.gemm_flops(m) == pytest.approx(c.flops * 2.001 * 0.883, rel=1e-3)
    assert float(w8a16.layer_weight_bytes(64.0)) == float(m.layer_weight_bytes(64.0))
    assert c.gemm_time(4096.0, w8a16) > c.gemm_time(4096.0, m)  # compute-bound: 2x slower
    path = tmp_path / "p.csv"
    path.write_text("gpu,model,policy,context,batch,tpot_ms,weight_dtype,weight_only\n"
                    "h100-sxm,mixtral-8x7b,dense-resident,128,16,10,fp8,true\n")
    assert read_points(path)[0].weight_only is True
    path.write_text("gpu,model,policy,context,batch,tpot_ms,weight_dtype,weight_only\n"
                    "h100-sxm,mixtral-8x7b,dense-resident,128,16,10,fp8,yes\n")
    with pytest.raises(KvsimError, match="weight_only"):
        read_points(path)


def test_attention_per_query_head_rereads_kv_and_overheads_add_by_hand():
    m = catalog.model("llama-3.1-70b")  # 64 query heads over 8 KV heads
    (spec,), _ = parse("dense-resident")
    cost = Predictor(None).cost(Point(0, "h100-sxm", m.name, spec, 1, 1, {}))
    tokens = 8 * 32768.0
    base = StepCosts(m, _costs(), cost)
    slow = StepCosts(m, _costs(attention="per-query-head"), cost)
    kv_layer = m.kv_bytes_per_token / m.layers * tokens
    extra = 7 * kv_layer / (3350 * GB * HBM_EFFICIENCY)  # 8 reads instead of 1
    (c0,), _, _ = base.layer_costs(8, np.array([tokens]))
    (c1,), _, _ = slow.layer_costs(8, np.array([tokens]))
    assert c1 - c0 == pytest.approx(extra, rel=1e-9)
    # where a share of the 7 repeat reads hit the L2 cache, only the rest cost HBM time
    part = StepCosts(m, _costs(attention="per-query-head", head_reread_share=0.25), cost)
    (c2,), _, _ = part.layer_costs(8, np.array([tokens]))
    assert c2 - c0 == pytest.approx(0.25 * extra, rel=1e-9)
    over = StepCosts(m, _costs(layer_overhead_us=10.0, step_overhead_ms=1.0,
                               token_overhead_us=20.0), cost)
    s0 = base.decode(np.full(8, 32768.0), 1)[0][0]
    s1 = over.decode(np.full(8, 32768.0), 1)[0][0]
    assert s1 - s0 == pytest.approx(1e-3 + 80 * 10e-6 + 8 * 20e-6, rel=1e-9)


def test_attention_efficiency_slows_decode_attention_alone_by_hand():
    """The engine's ``attention_efficiency`` divides decode attention's HBM rate (the KV reads)
    and nothing else: a layer's cost grows by the KV bytes over the slower rate."""
    m = catalog.model("llama-3.1-8b")
    (spec,), _ = parse("dense-resident")
    cost = Predictor(None).cost(Point(0, "h100-sxm", m.name, spec, 1, 1, {}))
    tokens = 4 * 65536.0
    kv_layer = m.kv_bytes_per_token / m.layers * tokens
    bw = 3350 * GB * HBM_EFFICIENCY
    (c0,), _, _ = StepCosts(m, _costs(), cost).layer_costs(4, np.array([tokens]))
    (c1,), _, _ = StepCosts(m, _costs(attention_efficiency=0.6), cost).layer_costs(
        4, np.array([tokens]))
    assert c1 - c0 == pytest.approx(kv_layer / (0.6 * bw) - kv_layer / bw, rel=1e-9)
    slow = _costs(attention_efficiency=0.6)
    assert float(slow.gemm_time(4, m)) == float(_costs().gemm_time(4, m))
    assert "0.6" in slow.provenance["decode_attention"]


def test_attention_efficiency_is_identified_by_rows_of_several_kv_shares_and_fitted():
    """Resident decode rows of two models where the KV is a small and a large share of the
    bytes a step reads tell decode attention's rate from the weight reads'; the fit recovers
    it. With one model's rows the weight reads trade against the step overhead: not free."""
    from kvsim.fit.solve import fit, identified
    truth = {"step_overhead_ms": 1.0, "hbm_efficiency": 0.8, "attention_efficiency": 0.7}
    known = make_engine(E.ROOFLINE, truth, "default", "", "h100-sxm", "llama-3.1-8b")
    (spec,), _ = parse("dense-resident")
    pred, pts = Predictor(None), []
    for i, (model, ctx, b) in enumerate((("llama-3.1-8b", 512, 1), ("qwen3-4b", 4096, 4),
                                         ("llama-3.1-8b", 32768, 4),
                                         ("qwen3-4b", 65536, 8)), start=2):
        p = Point(i, "h100-sxm", model, spec, ctx, b, {}, None, 16)
        p.measured = {"tpot_ms": pred.predict(p, known)["tpot_ms"]}
        pts.append(p)
    assert "attention_efficiency" in identified(pts, pred)
    assert "attention_efficiency" not in identified(pts[:2], pred)  # the KV a small share only
    assert "attention_efficiency" not in identified(pts[::2], pred)  # one model
    res = fit(pts, pred, E.ROOFLINE, free=list(truth), loo=False)
    for k, v in truth.items():
        assert res.values[k] == pytest.approx(v, rel=1e-3), k


def test_prefill_attention_efficiency_slows_prefill_attention_alone_by_hand():
    """``prefill_attention_efficiency`` divides the compute rate of a prefill's causal attention
    FLOPs and nothing else: a 32K-token prefill's step grows by those FLOPs at the slower rate,
    a decode step not at all."""
    m = catalog.model("llama-3.1-8b")
    (spec,), _ = parse("dense-resident")
    cost = Predictor(None).cost(Point(0, "h100-sxm", m.name, spec, 1, 1, {}))
    n = 32768.0
    attn = float(m.attention_flops(n))
    rate = 989e12 * FLOP_EFFICIENCY
    fast, slow = (StepCosts(m, c, cost) for c in (_costs(),
                                                  _costs(prefill_attention_efficiency=0.5)))
    t0, t1 = (s.step(0, 0.0, n, attn, 1, [n])[0] for s in (fast, slow))
    assert t1 - t0 == pytest.approx(attn / (0.5 * rate) - attn / rate, rel=1e-9)
    d0, d1 = (s.decode(np.full(4, n), 1)[0][0] for s in (fast, slow))
    assert d0 == d1


def test_prefill_attention_efficiency_is_identified_by_prompts_of_several_lengths_and_fitted():
    """Time to first token at prompts where attention is a small and a large share of the
    prefill's FLOPs tells its rate from the matmuls'; the fit recovers it."""
    from kvsim.fit.solve import fit, identified
    truth = {"step_overhead_ms": 1.0, "flop_efficiency": 0.6, "prefill_attention_efficiency": 0.5}
    known = make_engine(E.ROOFLINE, truth, "default", "", "h100-sxm", "llama-3.1-8b")
    (spec,), _ = parse("dense-resident")
    pred, pts = Predictor(None), []
    for i, ctx in enumerate((2048, 8192, 65536, 131072), start=2):
        p = Point(i, "h100-sxm", "llama-3.1-8b", spec, ctx, 1, {"ttft_ms": 1.0}, None, 1)
        p.measured = {"ttft_ms": pred.predict(p, known)["ttft_ms"]}
        pts.append(p)
    assert "prefill_attention_efficiency" in identified(pts, pred)
    assert "prefill_attention_efficiency" not in identified(pts[:2], pred)  # short prompts
    res = fit(pts, pred, E.ROOFLINE, free=list(truth), loo=False)
    for k, v in truth.items():
        assert res.values[k] == pytest.approx(v, rel=1e-3), k


def test_the_share_of_per_query_head_rereads_is_identified_and_fitted():
    """Rows of a kernel that is not GQA-aware at several contexts (and GQA-aware ones beside
    them) identify how many of its repeat KV reads reach HBM; the fit recovers it."""
    from kvsim.fit.solve import fit, identified
    truth = {"step_overhead_ms": 1.5, "head_reread_share": 0.3}
    known = make_engine(E.ROOFLINE, truth, "default", "", "h100-sxm", "llama-3.1-70b")
    (spec,), _ = parse("dense-resident")
    pred, pts = Predictor(None), []
    for i, (ctx, b, attention) in enumerate(((2048, 8, "per-query-head"),
                                             (16384, 4, "per-query-head"),
                                             (4096, 16, None), (32768, 2, None)), start=2):
        p = Point(i, "h100-sxm", "llama-3.1-70b", spec, ctx, b, {}, None, 16, tp=4,
                  attention=attention)
        p.measured = {"tpot_ms": pred.predict(p, known)["tpot_ms"]}
        pts.append(p)
    assert "head_reread_share" in identified(pts, pred)
    assert "head_reread_share" not in identified(pts[2:], pred)  # GQA-aware rows only
    res = fit(pts, pred, E.ROOFLINE, free=list(truth), loo=False)
    for k, v in truth.items():
        assert res.values[k] == pytest.approx(v, rel=1e-3), k


def test_engine_allreduce_latency_adds_per_call():
    m = catalog.model("llama-3.1-70b").shard(4)
    a, b = _costs(), _costs(allreduce_us=15.0)
    a.set_tp(4), b.set_tp(4)
    assert float(b.allreduce_time(8, m) - a.allreduce_time(8, m)) == pytest.approx(30e-6)
    assert float(_costs(allreduce_us=15.0).allreduce_time(8, m)) == 0.0  # TP 1: none


def test_default_engine_fields_leave_the_roofline_unchanged():
    """An engine that sets none of the new fields prices exactly as before they existed."""
    m = catalog.model("qwen3-4b")
    c = _costs()
    for B in (1, 8, 256):
        rate, bw = c.gemm_flops(m), c.hbm_bw
        want = np.maximum(2.0 * m.active_layer_params * B / rate, m.layer_weight_bytes(B) / bw)
        assert float(c.gemm_time(B, m)) == float(want)


def test_engine_fields_are_checked():
    for key, bad in (("gemm_overlap", 1.5), ("attention", "per-head"), ("moe_efficiency", 0),
                     ("token_overhead_us", -1.0), ("allreduce_us", float("nan")),
                     ("head_reread_share", 1.5), ("attention_efficiency", 0.0),
                     ("prefill_attention_efficiency", 1.5)):
        with pytest.raises(E.KvsimError, match=key):
            E.ROOFLINE.with_fields(**{key: bad})


# ------------------------------------------------------------------------ the dataset
def test_published_dataset_is_what_the_build_script_makes_and_names_its_sources(tmp_path):
    text = (ROOT / "data" / "published.csv").read_text()
    subprocess.run([sys.executable, str(ROOT / "scripts" / "build_published_dataset.py")],
                   check=True, capture_output=True)
    assert (ROOT / "data" / "published.csv").read_text() == text  # fresh
    rows = list(csv.DictReader(line for line in text.splitlines() if not line.startswith("#")))
    assert len(rows) >= 60
    assert len({r["source"] for r in rows}) >= 8
    for r in rows:
        assert r["source"] and r["where"] and r["url"] and r["certainty"], r
    points = read_points(ROOT / "data" / "published.csv")
    cats = {c for p in points for c in p.categories()}
    assert {"decode", "prefill", "throughput", "tp", "fp8", "moe", "long-context",
            "offload"} <= cats
    assert {p.tp for p in points} >= {1, 2, 4, 8}


def test_the_build_keeps_one_reading_of_a_run_and_drops_a_decode_only_throughput():
    """Throughput and latency of the same run: the throughput stays. A throughput that is
    batch / TPOT beside a latency it does not match (sglang issue 2087's bench_latency prints
    its decode-only throughput): the latency stays, the throughput repeats the TPOT."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "build_published", ROOT / "scripts" / "build_published_dataset.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    raw = next(r for r in csv.DictReader(open(ROOT / "data" / "published" / "sglang.csv"))
               if r["source"] == "sglang-issue-2087")
    out, _ = build.convert(raw)
    assert (out["throughput_tok_s"], out["latency_s"], out["tpot_ms"]) == ("", "4.614", "13.64")
    same = dict(raw, throughput_tok_s=f"{32 * 256 / 4.614:.2f}")  # the whole run's
    out, _ = build.convert(same)
    assert out["throughput_tok_s"] == same["throughput_tok_s"] and out["latency_s"] == ""


# ------------------------------------------------------------------ the family fit
def _synthetic(pred, truth_shared, truth_family):
    """Points two engine families would measure: family "a" is the shared engine with its own
    overhead, family "b" the shared engine; two sources each."""
    shared = make_engine(E.ROOFLINE, truth_shared, "default", "", "h100-sxm", "qwen3-4b")
    fam_a = make_engine(shared, truth_family, "default", "", "h100-sxm", "qwen3-4b")
    (spec,), _ = parse("dense-resident")
    pts = []
    for i, (model, ctx, b, out) in enumerate((
            ("qwen3-4b", 1024, 1, 128), ("qwen3-4b", 8192, 8, 128), ("qwen3-4b", 2048, 64, 256),
            ("llama-3.1-8b", 1024, 1, 128), ("llama-3.1-8b", 4096, 16, 128),
            ("llama-3.1-8b", 2048, 128, 128), ("qwen3-8b", 512, 4, 1),
            ("qwen3-8b", 16384, 2, 64))):
        for fam, eng in (("a", fam_a), ("b", shared)):
            p = Point(len(pts) + 2, "h100-sxm", model, spec, ctx, b, {}, None, out,
                      meta={"source": f"{fam}{i % 2}"}, engine=fam)
            p.measured = {"ttft_ms": 1.0}
            got = pred.predict(p, eng)
            p.measured = {"tpot_ms": got["tpot_ms"], "ttft_ms": got["ttft_ms"]}
            pts.append(p)
    return pts


def test_joint_fit_reproduces_two_families_made_by_known_engines():
    """Family "a" has 2 ms more per-step overhead than family "b"; the joint fit reproduces
    every point with its family's engine, and family "a"'s engine is the slower one."""
    pred = Predictor(None)
    pts = _synthetic(pred, {"hbm_efficiency": 0.8, "layer_overhead_us": 20.0},
                     {"step_overhead_ms": 2.0})
    shared, fams, free = F.fit_joint(pts, pred, E.ROOFLINE)
    assert set(fams) == {"a", "b"} and "step_overhead_ms" in free["a"]
    for p in pts:  # within 6%: the prior shrinks each family's offsets towards the shared engine
        got = pred.predict(p, fams[p.engine])
        for k, v in p.measured.items():
            assert got[k] == pytest.approx(v, rel=6e-2), (p, k)
    p = pts[0]
    slow, fast = (pred.predict(p, fams[f])["tpot_ms"] for f in ("a", "b"))
    assert slow - fast == pytest.approx(2.0, rel=0.15)
    _, fam_a, levels, fams_again = F.fit_levels(pts, pred, E.ROOFLINE, "a")
    assert set(fams_again) == set(fams)
    vals = F.fitted_values(pts, pred, shared, fams)  # in-sample: each row by its own family
    assert len(vals) == 2 * len(pts) and {v["fitted_as"] for v in vals} == {"a", "b"}
    assert all(abs(v["err_pct"]) < 6 for v in vals)
    assert F.summary(vals)[0]["within_share"] == 1.0
    assert levels["family"] == free["a"]
    assert fam_a.get("step_overhead_ms") == fams["a"].get("step_overhead_ms")


def test_no_fitted_engine_reads_hbm_beyond_the_ceiling(monkeypatch):
    """Points of an engine streaming at 100% of spec: without the ceiling the fit goes past it,
    with it no engine does; the shipped families respect it too."""
    from kvsim.fit import solve

    pred = Predictor(None)
    pts = _synthetic(pred, {"hbm_efficiency": 1.0}, {"step_overhead_ms": 2.0})

    def fitted():
        shared, fams, _ = F.fit_joint(pts, pred, E.ROOFLINE)
        return [e.get("hbm_efficiency") for e in (shared, *fams.values())]

    assert all(h <= HBM_CEILING + 1e-12 for h in fitted())
    monkeypatch.setitem(solve.PARAMS, "hbm_efficiency", (0.05, 1.0))
    assert max(fitted()) > HBM_CEILING
    for name in ("trtllm", "vllm", "sglang"):
        assert E.load(name).get("hbm_efficiency") <= HBM_CEILING + 1e-12


@pytest.mark.slow  # a fit per held-out source, ~15 s
def test_cross_validation_never_fits_on_the_held_out_source(monkeypatch):
    pred = Predictor(None)
    pts = _synthetic(pred, {"hbm_efficiency": 0.8}, {"step_overhead_ms": 2.0})
    seen = []
    real = F.fit_joint

    def spy(rows, *a, **k):
        seen.append({p.meta["source"] for p in rows})
        return real(rows, *a, **k)

    monkeypatch.setattr(F, "fit_joint", spy)
    vals = F.cross_validate(pts, pred, E.ROOFLINE)
    sources = {p.meta["source"] for p in pts}
    assert {v["source"] for v in vals} == sources
    assert all(len(s) == len(sources) - 1 for s in seen)
    assert all(abs(v["err_pct"]) < 15 for v in vals)  # the truth is in the model family
    rows = {r["category"]: r for r in F.summary(vals)}
    assert rows["all"]["values"] == len(vals) == 2 * len(pts)
    assert 0 <= rows["all"]["covered_share"] <= 1


def test_interval_coverage_uses_only_other_sources():
    """A source whose errors are far larger than every other's is not covered: its own errors
    never widen its interval."""
    vals = [{"source": s, "regime": "decode", "categories": ["decode"], "err_pct": e,
             "log_err": math.log1p(e / 100)} for s, e in
            (("x", 5.0), ("x", -4.0), ("y", 3.0), ("y", -6.0), ("z", 80.0))]
    rows = {r["category"]: r for r in F.summary(vals)}
    assert rows["all"]["covered_share"] == pytest.approx(4 / 5)


# ------------------------------------------------------------------ the shipped engines
def test_builtin_families_load_and_the_best_checked_one_is_the_catalog_default():
    for name in ("vllm", "sglang", "trtllm", "vllm-paper"):
        eng = E.load(name)
        assert eng.name == name
    costs, _ = costs_for("h100-sxm", None)
    assert costs.engine.name == E.CATALOG_DEFAULT == "trtllm"
    cv = E.load("trtllm").fit["cv_summary"]  # the family with the most checked values
    assert cv[0]["category"] == "all" and cv[0]["values"] >= 300
    for name in ("vllm", "sglang", "trtllm"):
        eng = E.load(name)
        assert eng.fit["cv"] and eng.fit["checked"]["gpu"]
        s, why = eng.spread("decode")
        assert 0 < s < 1 and "held-out" in why


@pytest.mark.slow  # ~15 s
def test_kvsim_fit_of_families_prints_the_cross_validation_table(tmp_path):
    from conftest import run_cli
    pred = Predictor(None)
    pts = _synthetic(pred, {"hbm_efficiency": 0.8}, {"step_overhead_ms": 2.0})
    lines = ["gpu,model,policy,context,batch,output_len,tpot_ms,ttft_ms,engine,source"]
    lines += [f"{p.gpu},{p.model},dense-resident,{p.context},{p.batch},{p.output_len},"
              f"{p.measured['tpot_ms']:.6f},{p.measured['ttft_ms']:.6f},{p.engine},"
              f"{p.meta['source']}" for p in pts]
    csv_path = tmp_path / "pub.csv"
    csv_path.write_text("\n".join(lines) + "\n")
    out = tmp_path / "a.json"
    code, text, err = run_cli("fit", csv_path, "--family", "a", "--out", out, "--cv", "source")
    assert code == 0, err
    assert "leave-one-source-out" in text and "within 20%" in text and "in interval" in text
    assert "fitted: within 20%" in text  # the same values under the fit of every source
    eng = E.load(out)
    assert eng.fit["family"] == "a" and len(eng.fit["cv"]) == 2 * len(pts)
    assert eng.fit["checked"]["gpu"] == ["h100-sxm"]
    code, _, err = run_cli("fit", csv_path, "--family", "zz", "--out", tmp_path / "z.json")
    assert code == 2 and "no such engine" in err and len(err.strip().splitlines()) == 1


# ---------------------------------------------------------------- the fit's speed-ups
def test_predictions_do_not_depend_on_what_the_predictor_priced_before():
    """A predictor shares a GPU's costs between the points of one engine object and skips the
    fetch and decide terms of dense policies: every prediction of the shipped dataset's rows is
    the same, to the bit, whether a fresh predictor makes it or one that priced every row under
    another engine first (and the skipped terms are the zeros they were)."""
    pts = [p for p in read_points(ROOT / "data" / "published.csv") if p.use == "fit"][::4]
    a, b = E.load("trtllm"), E.load("vllm")
    warm = Predictor(None)
    for p in pts:
        warm.predict(p, b)
    for p in pts:
        fresh = Predictor(None).predict(p, a)
        assert warm.predict(p, a) == fresh
        assert fresh["fetch_ms"] == fresh["decide_ms"] == 0.0  # dense rows


def test_one_batch_size_at_a_time_prices_as_the_run_ahead():
    m = catalog.model("mixtral-8x7b").shard(2)
    (spec,), _ = parse("dense-resident")
    policy = Predictor(None).cost(Point(2, "a100-80gb", "mixtral-8x7b", spec, 1024, 1, {}))
    costs = _costs("a100-80gb", gemm_overlap=0.3, gemm_half_tokens=40.0).set_tp(2)
    ahead, one = StepCosts(m, costs, policy), StepCosts(m, costs, policy, ahead=False)
    for B in (1, 7, 64, 300):
        assert one.per_batch(B) == ahead.per_batch(B)
    assert len(one._per_batch) == 4 < len(ahead._per_batch)


@pytest.mark.slow  # two leave-one-source-out runs, ~30 s
def test_cross_validation_in_worker_processes_gives_the_same_records():
    pred = Predictor(None)
    pts = _synthetic(pred, {"hbm_efficiency": 0.8}, {"step_overhead_ms": 2.0})
    assert F.cross_validate(pts, pred, E.ROOFLINE, jobs=2) == \
        F.cross_validate(pts, pred, E.ROOFLINE)


def test_kvsim_fit_rejects_a_job_count_below_one(tmp_path):
    from conftest import run_cli
    out = tmp_path / "e.json"
    code, _, err = run_cli("fit", ROOT / "data" / "published.csv", "--out", out, "--cv",
                           "source", "--jobs", "0")
    assert code == 2 and "--jobs" in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_the_default_engine_runs_on_the_gpu_it_plans_for(capsys):
    """No NVIDIA-only engine on an AMD GPU: the default follows the GPU's vendor, and naming
    TensorRT-LLM for an MI300X is one line naming the default that runs there."""
    import json

    from conftest import run_cli

    from kvsim.hw.engine import RUNS_ON, default_for
    for g in catalog.GPUS.values():
        assert g.vendor in RUNS_ON.get(default_for(g.vendor), (g.vendor,)), g.name
    assert default_for("amd") == "vllm" and default_for("nvidia") == "trtllm"
    code, out, err = run_cli("replay", "--gpu", "mi300x", "--model", "qwen3-4b", "--context",
                             "4096", "--policy", "dense-resident", "--requests", "2",
                             "--output-len", "4", "--json")
    assert code == 0 and json.loads(out)["engine"] == "vllm"
    assert "GPU mi300x (checked on" in err  # the family's points do not cover it: said so
    code, _, err = run_cli("replay", "--gpu", "mi300x", "--model", "qwen3-4b", "--context",
                           "4096", "--policy", "dense-resident", "--engine", "trtllm")
    assert code == 2 and "runs on nvidia GPUs only" in err and "--engine vllm" in err
