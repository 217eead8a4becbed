"""Weight-only quantised matmuls (W4A16, W8A16) and the W8A8 fp8 rate, checked against the
published kernel figures they come from (kvsim/hw/costs.py lists each with its source) and
against hand computations from the datasheet numbers."""

import dataclasses
import json

import numpy as np
import pytest

from kvsim.hw import catalog
from kvsim.hw.costs import CostModel, costs_for
from kvsim.hw.engine import ROOFLINE

# Marlin over torch fp16 on an H100, one 8192x8192 channelwise matrix, TFLOP/s by tokens m
# (https://github.com/inclusionAI/humming/pull/2: the description's table, then jinzhen-lin's
# 2026-03-30 table): (m, torch-w16a16, marlin-w4a16, marlin-w8a16)
HUMMING_H100 = [(1, 2.30, 4.98, 3.46), (2, 4.63, 10.02, 6.87), (4, 9.26, 19.85, 13.75),
                (1, 2.68, 5.81, 4.29), (2, 5.32, 11.63, 8.55), (4, 10.63, 23.14, 17.22),
                (8, 21.23, 46.36, 34.1), (16, 42.09, 90.52, 67.18)]
# Marlin bench.py, speedup over fp16 at 1024, 2048, 4000 tokens (Ampere; comment on
# https://github.com/vllm-project/vllm/pull/2497)
MARLIN_LARGE_BATCH = [(1024, 0.66), (2048, 0.60), (4000, 0.61)]


def _costs(gpu="h100-sxm", engine=ROOFLINE):
    return CostModel.from_spec(catalog.gpu(gpu)).apply(engine)


def _w(m, elem, weight_only=False):
    return dataclasses.replace(m, weight_dtype_bytes=elem, weight_only=weight_only)


def test_w4a16_at_batch_one_reads_a_quarter_of_the_bytes_at_the_measured_share():
    """One token through a Llama-3.1-8B layer on an H100 SXM: memory-bound, the 4-bit weights
    (a quarter of bf16's bytes) read at 54.2% of the rate bf16's reach (3.35 TB/s x 0.85)."""
    m = catalog.model("llama-3.1-8b")
    c = _costs()
    reads = m.layer_params * 0.5 / (3350e9 * 0.85 * 0.542)
    bf16_reads = m.layer_params * 2 / (3350e9 * 0.85)
    assert reads == pytest.approx(bf16_reads / 4 / 0.542)
    w4 = c.matmuls(_w(m, 0.5))
    assert w4.at(1) == pytest.approx(reads, rel=1e-12)
    assert float(c.gemm_time(1, _w(m, 0.5))) == pytest.approx(reads, rel=1e-12)
    # its compute, 16 tokens at 62.3% of the bf16 rate, hides under the reads
    assert 2 * m.active_layer_params * 16 / (989e12 * 0.6 * 0.623) < reads / 2
    # fp8 weights cast for bf16 GEMMs: half of bf16's bytes at its full rate
    w8 = _w(catalog.model("llama-3.1-8b"), 1, weight_only=True)
    assert c.matmuls(w8).at(1) == pytest.approx(m.layer_params / (3350e9 * 0.85))


@pytest.mark.parametrize("m_tokens,torch_tf,w4_tf,w8_tf", HUMMING_H100)
def test_the_speedup_over_bf16_reproduces_the_published_h100_points(m_tokens, torch_tf, w4_tf,
                                                                    w8_tf):
    """The published speedups are ratios of TFLOP/s on the same matmul; kvsim's are ratios of
    its layer times on an H100 SXM (Llama-3.1-70B layers, hidden 8192 as published). int4
    within 2% of every point; int8 within 6% (the two published runs differ by 7% there)."""
    m = catalog.model("llama-3.1-70b")
    c = _costs()
    bf16 = c.matmuls(m).at(m_tokens)
    assert bf16 / c.matmuls(_w(m, 0.5)).at(m_tokens) == pytest.approx(w4_tf / torch_tf, rel=0.02)
    # (int8 weight-only, w8_tf, has no dtype in kvsim: 1-byte weights are fp8, cast not unpacked)


@pytest.mark.parametrize("gpu", ["h100-sxm", "a100-80gb", "h200"])
@pytest.mark.parametrize("tokens,published", MARLIN_LARGE_BATCH)
def test_at_large_batch_w4a16_is_slower_than_bf16_by_the_published_factor(gpu, tokens,
                                                                          published):
    """Compute-bound, the weight-only kernel runs at 0.623 of the bf16 GEMM's speed: within 7%
    of each published point under the roofline; within 10% under the default engine, whose
    partial overlap adds part of the weight reads to both."""
    m = catalog.model("llama-3.1-8b")
    for c, tol in ((_costs(gpu), 0.07), (costs_for(gpu, None)[0], 0.10)):
        bf16, w4 = c.matmuls(m).at(tokens), c.matmuls(_w(m, 0.5)).at(tokens)
        assert bf16 / w4 == pytest.approx(published, rel=tol)
        assert bf16 / w4 < 1.0  # slower than bf16 once compute-bound
    assert _costs(gpu).matmuls(m).at(16384) / _costs(gpu).matmuls(_w(m, 0.5)).at(16384) == \
        pytest.approx(0.623, rel=1e-12)


def test_a_weight_only_kernel_computes_at_least_16_tokens_not_the_wgmma_tile():
    """Marlin multiplies 16-row blocks (mma.sync m16n8k16) on every GPU: on an H20 (148 bf16
    TFLOP/s for 4 TB/s) one token's W4A16 matmuls cost 16 tokens' compute at the kernel's
    rate, not Hopper's 64-row wgmma tile, which bf16 pays."""
    m = catalog.model("qwen3-8b")
    h20 = _costs("h20")
    rate = 148e12 * 0.6 * 0.623
    sixteen = 2 * m.active_layer_params * 16 / rate
    assert m.layer_params * 0.5 / (4000e9 * 0.85 * 0.542) < sixteen  # compute-bound
    w4 = h20.matmuls(_w(m, 0.5))
    for n in (1, 8, 16):
        assert w4.at(n) == pytest.approx(sixteen, rel=1e-12)
    assert w4.at(32) == pytest.approx(2 * sixteen, rel=1e-12)
    assert h20.matmuls(m).at(1) == pytest.approx(2 * m.active_layer_params * 64 / (148e12 * 0.6),
                                                 rel=1e-12)


def test_fp8_at_large_batch_is_the_measured_fraction_of_twice_bf16_on_an_h100_sxm():
    """W8A8 at 1979 TFLOP/s dense fp8 (2.001x bf16's 989) x 0.883, the ratio of the achievable
    shares (fp8 70.9%, bf16 80.3%): the measured MAMF ratio 1402.6 / 794.5 within 0.5%."""
    m = catalog.model("llama-3.1-8b")
    c = _costs()
    fp8 = _w(m, 1)
    assert c.gemm_flops(fp8) / c.gemm_flops(m) == pytest.approx(1979 / 989 * 0.883, rel=1e-12)
    assert c.gemm_flops(fp8) / c.gemm_flops(m) == pytest.approx(1402.6 / 794.5, rel=0.005)
    big = 16384
    assert c.matmuls(m).at(big) / c.matmuls(fp8).at(big) == pytest.approx(2.001 * 0.883,
                                                                           rel=1e-3)
    assert c.matmuls(m).at(1) / c.matmuls(fp8).at(1) == pytest.approx(2.0)  # half the bytes
    assert "ml-engineering" in c.provenance["compute_gemm"]


def test_bf16_matmuls_are_unchanged():
    m = catalog.model("llama-3.1-8b")
    for gpu in ("h100-sxm", "a100-80gb", "h20"):
        c = _costs(gpu)
        mm = c.matmuls(m)
        assert (mm.rate, mm.hbm_bw) == (c.flops, c.hbm_bw) and c.gemm_flops(m) == c.flops
        tile = catalog.gpu(gpu).mma_rows
        for B in (1, 8, 256, 4096):
            want = max(2 * m.active_layer_params * max(B, tile) / c.flops,
                       m.layer_params * 2 / c.hbm_bw)
            assert mm.at(B) == pytest.approx(want, rel=1e-12)
        assert "compute_gemm" not in c.provenance


@pytest.mark.parametrize("model", ["llama-3.1-8b", "mixtral-8x7b"])
@pytest.mark.parametrize("elem,weight_only", [(0.5, False), (1, True), (1, False)])
def test_time_and_at_agree_for_quantised_weights(model, elem, weight_only):
    """``at`` is ``time`` in floats, for dense and mixture-of-experts layers, under the default
    engine (partial overlap, shape efficiency)."""
    m = _w(catalog.model(model), elem, weight_only)
    mm = costs_for("h100-sxm", None)[0].matmuls(m)
    n = np.array([0, 1, 3, 16, 17, 64, 65, 500, 4096], float)
    assert np.allclose(mm.time(n), [mm.at(float(x)) for x in n], rtol=1e-12, atol=0)


def test_the_provenance_names_the_weight_only_kernel_and_its_sources():
    m = catalog.model("llama-3.1-8b")
    for elem, wo, kind, share in ((0.5, False, "W4A16", "0.542"),):
        c = _costs()
        c.gemm_flops(_w(m, elem, wo))
        note = c.provenance["compute_gemm"]
        assert kind in note and f"weight reads at {share}" in note and "0.623" in note
        for src in ("inclusionAI/humming/pull/2", "vllm/pull/2497", "IST-DASLab/marlin"):
            assert src in note


def test_the_cli_prices_int4_between_its_bytes_and_bf16():
    """kvsim replay on an H100 SXM, Llama-3.1-8B, 8 requests at once with 2K prompts: int4
    weights stay faster than bf16 (its memory-bound decode), slower than fp8 (W8A8)."""
    from conftest import run_cli
    got = {}
    for w in ("bf16", "fp8", "int4"):
        code, out, err = run_cli(
            "replay", "--policy", "dense-resident", "--gpu", "h100-sxm", "--model", "llama-3.1-8b",
            "--tp", "1", "--context", "2048", "--output-len", "256", "--batch", "8",
            "--concurrency", "8", "--requests", "8", "--scheduler", "chunked", "--weight-dtype",
            w, "--kv-dtype", "bf16", "--json")
        assert code == 0, err
        got[w] = json.loads(out)
    assert got["fp8"]["tpot_ms"] < got["int4"]["tpot_ms"] < got["bf16"]["tpot_ms"]
    assert "W4A16" in got["int4"]["provenance"]["hw.compute_gemm"]
