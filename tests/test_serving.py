"""Serving dynamics: prefill counted right, chunked prefill, preemption, goodput and an SLO
search whose answer a replay sustains."""

import dataclasses
import math

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import replay_json, run_cli
from torch.utils.flop_counter import FlopCounterMode

from kvsim.hw import catalog
from kvsim.hw.catalog import ModelSpec
from kvsim.plan import slo
from kvsim.plan.executors import LocalExecutor
from kvsim.plan.sweep import SweepSpec, sweep
from kvsim.policies import make

TINY = ModelSpec("tiny", "none", layers=2, q_heads=4, kv_heads=2, head_dim=8, hidden=24,
                 intermediate=40, vocab=50, tied_embeddings=True, rope_theta=1e4,
                 max_context=4096)


def _torch_prefill(m: ModelSpec, size: int, prefix: int) -> None:
    """A real prefill of ``size`` tokens after ``prefix`` cached ones through a model-shaped
    stack: projections, causal attention written query by query over the keys each query may
    see, output projection, gated MLP. FlopCounterMode counts what the matmuls do."""
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    H, G, d, h, inter = m.q_heads, m.kv_heads, m.head_dim, m.hidden, m.intermediate
    x = r(size, h)
    for _ in range(m.layers):
        q, k, v = (x @ r(h, H * d)), (x @ r(h, G * d)), (x @ r(h, G * d))
        k_all = torch.cat([r(prefix, G * d), k]).view(-1, G, d).repeat_interleave(H // G, 1)
        v_all = torch.cat([r(prefix, G * d), v]).view(-1, G, d).repeat_interleave(H // G, 1)
        q = q.view(size, H, d)
        out = []
        for i in range(size):  # query i sees the prefix, the tokens before it and itself
            kk, vv = k_all[:prefix + i + 1].transpose(0, 1), v_all[:prefix + i + 1].transpose(0, 1)
            w = torch.softmax(torch.bmm(q[i][:, None, :], kk.transpose(1, 2)), -1)
            out.append(torch.bmm(w, vv)[:, 0])
        a = torch.stack(out).reshape(size, H * d)
        x = x + a @ r(H * d, h)
        gate, up = (x @ r(h, 2 * inter)).chunk(2, -1)
        x = x + (torch.nn.functional.silu(gate) * up) @ r(inter, h)


@pytest.mark.parametrize("size,prefix", [(1, 0), (7, 0), (5, 9), (16, 33)])
def test_prefill_flops_match_a_count_of_a_real_forward_pass(size, prefix):
    with FlopCounterMode(display=False) as counter:
        _torch_prefill(TINY, size, prefix)
    assert TINY.prefill_flops(size, prefix) == counter.get_total_flops()


def test_qwen3_4b_prefill_from_the_hand_count():
    m, g = catalog.model("qwen3-4b"), catalog.gpu("h100-sxm")
    flops = m.prefill_flops(32768)
    causal = 4 * m.layers * m.q_heads * m.head_dim * 32768 * 32769 / 2  # QK^T + PV, causal
    assert flops == pytest.approx(2 * m.layers * m.layer_params * 32768 + causal, rel=1e-12)
    r = replay_json(policy="dense-resident", gpu="h100-sxm", model="qwen3-4b",
                    context=32768, batch=1, output_len=2, engine="vllm-paper")
    seconds = flops / (g.bf16_tflops * 1e12 * 0.6)  # achievable compute, the catalog default
    assert r["ttft_ms"] / 1e3 == pytest.approx(seconds, rel=0.01)  # + the LM head of 1 token
    assert 0.9 < seconds < 1.0  # 935 ms, not the 711 ms that counted half the attention


def _poisson(**kw):
    return replay_json(policy="dense-resident", gpu="h100-sxm", model="qwen3-4b",
                       context=4096, output_len=256, batch=32, qps=6, requests=300,
                       seed=0, engine="vllm-paper", **kw)["sim"]


def test_chunked_prefill_trades_ttft_for_tpot_as_the_budget_shrinks():
    """Sarathi-Serve's trade-off: smaller chunks bound the stall a prefill puts on the decodes
    (TPOT p99 falls) and spread each prompt over more steps (TTFT rises)."""
    runs = [_poisson(scheduler="prefill-first"), _poisson(max_batched_tokens=8192),
            _poisson(max_batched_tokens=2048), _poisson(max_batched_tokens=512)]
    tpot99 = [s["tpot_p99_ms"] for s in runs]
    ttft50 = [s["ttft_p50_ms"] for s in runs]
    assert all(a > b for a, b in zip(tpot99, tpot99[1:])), tpot99
    assert all(a < b for a, b in zip(ttft50, ttft50[1:])), ttft50
    assert runs[-1]["ttft_p99_ms"] > runs[0]["ttft_p99_ms"]
    assert all(s["served_frac_window"] > 0.95 for s in runs)  # the same load, sustained


def test_policy_prefill_work_is_charged_to_ttft(attn_trace):
    kw = dict(trace=attn_trace, gpu="h100-sxm", model="qwen3-4b", context=32768, batch=1,
              output_len=2, engine="vllm-paper")  # the roofline's compute: 60% of peak
    base = replay_json(policy="dense-resident", **kw)
    opts = {"compression": 2.0, "r_min": 2, "window": 16, "obs_window": 16}
    vr = replay_json(policy="varrate", policy_options=opts, **kw)
    work = make("varrate", opts).prefill_work(catalog.model("qwen3-4b"))
    flops = 0.6 * catalog.gpu("h100-sxm").bf16_tflops * 1e12
    assert (vr["ttft_ms"] - base["ttft_ms"]) / 1e3 == pytest.approx(
        work.flops(32768) / flops, rel=1e-6)
    assert "anchor search" in vr["provenance"]["prefill"]
    assert "none" in base["provenance"]["prefill"]


def test_grow_admission_preempts_and_every_request_still_finishes():
    kw = dict(policy="dense-resident", gpu="h100-sxm", model="qwen3-4b", context=16384,
              output_len=8192, batch=64, concurrency=64, requests=64)
    reserve = replay_json(**kw)
    assert reserve["sim"]["preemptions"] == 0
    for mode in ("recompute", "swap"):
        r = replay_json(admission="grow", preemption=mode, **kw)
        s, m = r["sim"], r["memory"]
        assert s["preemptions"] > 0 and s["requests"] == 64 and math.isfinite(r["e2e_s"])
        assert r["hbm_gib"] <= m["hbm_capacity_gib"] + 1e-9
        assert (r["host_gib"] > 0) == (mode == "swap")  # swapped states wait in host memory
        assert (s["link_util"] > 0) == (mode == "swap")


def test_goodput_counts_the_requests_within_every_slo():
    loose = _poisson(slo={"tpot_ms": 1e6, "ttft_ms": 1e9})
    assert loose["slo_attainment"] == 1.0
    assert loose["goodput_rps"] == pytest.approx(loose["requests_per_s"])
    none = _poisson(slo={"ttft_ms": 1e-3})
    assert none["goodput_rps"] == 0.0 and none["slo_attainment"] == 0.0
    mid = _poisson(slo={"tpot_ms": 8.0})
    assert 0 < mid["slo_attainment"] < 1


def test_the_slo_answer_is_a_rate_a_replay_sustains(tmp_path):
    """The case of the issue: a TPOT bound alone used to pass at 5,243 req/s, a rate whose queue
    grows without end."""
    spec = SweepSpec(gpus=["h100-sxm"], models=["qwen3-4b"], contexts=[8192],
                     policies=["dense-resident"], batches=[16], slo=[slo.Limit("tpot_ms", 50)])
    row = sweep(spec, LocalExecutor(1), progress=False).iloc[0]
    q = row.slo_max_qps
    assert 1 < q < 20 and row.slo_qps_fails / q <= 1.03
    assert "not sustained" in row.slo_fails_because and "GPU busy" in row.slo_binding
    at = replay_json(policy="dense-resident", gpu="h100-sxm", model="qwen3-4b",
                     context=8192, batch=16, qps=q, requests=200)
    s = at["sim"]
    assert s["served_frac_window"] >= 0.95 and s["tpot_p99_ms"] <= 50
    assert s["queue_growth_window"] <= max(0.05 * s["arrivals_window"], 2)
    from kvsim.replay import configure, run_replay
    over = run_replay(configure(policy="dense-resident", gpu="h100-sxm", model="qwen3-4b",
                             context=8192, batch=16, qps=5243, requests=200))
    assert not slo.sustained(over)[0]  # the old answer: a tenth of its arrivals served


def test_limits_parse_with_their_percentile_and_refuse_nonsense():
    assert slo.parse_limit("ttft_ms", "2000@p50") == slo.Limit("ttft_ms", 2000.0, "p50")
    assert slo.parse_limit("e2e_s", "30").key == "e2e_p99_s"
    for bad in ("-1", "abc", "5@p90", "nan", "0"):
        with pytest.raises(Exception, match="positive number"):
            slo.parse_limit("tpot_ms", bad)
    assert slo.describe([]) == "no latency bound given"


@pytest.mark.parametrize("args, message", [
    (["replay", "--max-batched-tokens", "0"], "--max-batched-tokens must be a whole number"),
    (["replay", "--scheduler", "fifo"], "invalid choice"),
    (["replay", "--slo-ttft-ms", "-5"], "SLO ttft_ms"),
    (["plan", "--gpu", "h100-sxm", "--model", "qwen3-4b", "--context", "4096", "--policy",
      "dense", "--out", "OUT", "--slo-tpot-ms", "fast"], "positive number"),
])
def test_bad_scheduling_and_slo_input_is_one_line(args, message, tmp_path):
    args = [str(tmp_path / "o") if a == "OUT" else a for a in args]
    code, out, err = run_cli(*args)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_scheduling_travels_through_a_sweep():
    """Scheduling settings travel through a sweep's configuration and back."""
    spec = SweepSpec(gpus=["h100-sxm"], models=["qwen3-4b"], contexts=[4096],
                     policies=["dense-resident"], batches=[4],
                     scheduling={"scheduler": "prefill-first"})
    row = sweep(spec, LocalExecutor(1), progress=False).iloc[0]
    assert row.scheduler == "prefill-first" and pd.isna(row.max_batched_tokens)
    assert dataclasses.asdict(slo.Limit("tpot_ms", 1.0))["at"] == "p99"


def test_the_scalar_step_is_the_vectorised_step():
    """The engine's scalar hot path equals the vectorised steps it specialises, with and
    without decodes, for every kind of policy cost (resident, offloading with its KV write,
    deciding), on the bare hardware, under an engine profile (overhead, batched launches), in
    a tensor-parallel group (all-reduces) and under an eager engine whose host launches bind."""
    from kvsim.contract import DecodeCost, PrefillWork
    from kvsim.hw.costs import CostModel
    from kvsim.hw.engine import DecideModel, Engine, Value
    from kvsim.sim.records import Chunks
    from kvsim.sim.steps import StepCosts
    m = catalog.model("qwen3-4b")
    eng = Engine("t", {"step_overhead_ms": Value(1.5, "default"),
                       "link_launches": Value("per-layer", "default"),
                       "decide.verkv": Value(dataclasses.asdict(DecideModel(3, 40, 900, 0.6)),
                                             "default")})
    work = PrefillWork(3e6, 12.0, 5e4)
    for c in (CostModel.from_spec(catalog.gpu("h100-sxm")),
              CostModel.from_spec(catalog.gpu("h100-sxm")).apply(eng),
              CostModel.from_spec(catalog.gpu("h100-sxm")).apply(eng).set_tp(2),
              CostModel.from_spec(catalog.gpu("h100-sxm")).apply(eng.with_fields(
                  launch="eager", launch_overhead_us=2000.0, layer_overhead_us=5.0))):
        for cost in (DecodeCost(1, 1, 0, 0, False), DecodeCost(0, 1, 1, 1, True, 2.0, "h2d", 2),
                     DecodeCost(0.1, 0.4, 0.3, 1, False, 2.0, "gather", 1, 4.25, 0.03,
                                "verkv")):
            s = StepCosts(m, c, cost, work)
            sizes, prefixes = np.array([4096.0, 1000.0, 31.0]), np.zeros(3)
            flops = float(m.attention_flops(sizes, prefixes).sum())
            general = s.run(np.zeros(1), np.zeros(1), Chunks(
                np.array([sizes.sum()]), np.array([flops]), np.array([3.0]), np.array([3.0]),
                np.array([float(work.flops(sizes).sum())]),
                np.array([float(work.bytes(sizes).sum())])))
            fast = s.step(0, 0.0, float(sizes.sum()), flops, 3, sizes)
            np.testing.assert_allclose([g[0] for g in general], fast, rtol=1e-12)
            ctx = np.array([5000.0, 7000.0, 123.0])
            general = s.run(np.array([3.0]), np.array([ctx.sum()]), Chunks(
                np.array([2048.0]), np.array([flops]), np.array([1.0]), np.array([1.0]),
                np.array([float(work.flops(sizes[:1]).sum())]),
                np.array([float(work.bytes(sizes[:1]).sum())])))
            fast = s.step(3, float(ctx.sum()), 2048.0, flops, 1, sizes[:1])
            np.testing.assert_allclose([g[0] for g in general], fast, rtol=1e-12)
            dec = s.decode(ctx, 4)[0][0]  # a plain decode step: run without chunks
            np.testing.assert_allclose(dec, s.run(np.array([3.0]), np.array([ctx.sum()]))[0][0],
                                       rtol=1e-12)
