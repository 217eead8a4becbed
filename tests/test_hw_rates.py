"""Compute rates by data type: the GEMMs of fp8 weights run at the fp8 rate (times the measured
fp8/bf16 efficiency ratio) only on a GPU that lists one, every rate carries its source, and a
compute-bound GEMM costs what a hand computation says."""

import dataclasses

import pytest

from kvsim.hw import catalog
from kvsim.hw.costs import (
    FLOP_EFFICIENCY,
    FP8_EFFICIENCY_RATIO,
    WEIGHT_ONLY_COMPUTE_SHARE,
    CostModel,
)
from kvsim.hw.engine import ROOFLINE


def _costs(gpu):
    return CostModel.from_spec(catalog.gpu(gpu)).apply(ROOFLINE)


def _fp8(m):
    return dataclasses.replace(m, weight_dtype_bytes=1)


def test_every_rate_has_a_source_and_bf16_is_always_listed():
    for g in catalog.GPUS.values():
        assert g.rates()["bf16"] == g.bf16_tflops
        assert g.rates_source, g.name
        if g.fp8_tflops:
            assert g.fp8_tflops >= g.bf16_tflops
    assert catalog.gpu("h100-sxm").fp8_tflops == 1979
    assert not catalog.gpu("a100-80gb").fp8_tflops  # Ampere has no fp8 tensor cores


@pytest.mark.parametrize("gpu", list(catalog.GPUS))
def test_the_fp8_rate_applies_only_on_gpus_that_have_it(gpu):
    m = catalog.model("qwen3-4b")
    c = _costs(gpu)
    g = catalog.gpu(gpu)
    assert c.gemm_flops(m) == c.flops  # bf16 weights: the bf16 rate
    assert "compute_gemm" not in c.provenance
    got = c.gemm_flops(_fp8(m))
    if g.fp8_tflops:
        assert got == pytest.approx(c.flops * g.fp8_tflops / g.bf16_tflops * 0.883)
        assert "W8A8" in c.provenance["compute_gemm"]
    else:
        assert got == c.flops
        assert "at the bf16 rate" in c.provenance["compute_gemm"]
    c4 = _costs(gpu)
    # 4-bit weights: a W4A16 kernel's compute-bound share of the bf16 rate
    assert c4.gemm_flops(dataclasses.replace(m, weight_dtype_bytes=0.5)) == \
        c4.flops * WEIGHT_ONLY_COMPUTE_SHARE
    assert "W4A16" in c4.provenance["compute_gemm"]


def test_a_compute_bound_gemm_at_fp8_and_bf16_by_hand():
    """4096 decode tokens through one Qwen3-4B layer on an H100 SXM: 2 FLOPs per parameter and
    token at 60% of the datasheet's dense rate (989 bf16, 1979 fp8 TFLOP/s; fp8 reaches 70.9% /
    80.3% as much of its peak as bf16: the MAMF table), far above the time to read the layer's
    weights once."""
    m = catalog.model("qwen3-4b")
    B = 4096
    flops = 2 * m.active_layer_params * B
    bf16 = flops / (989e12 * FLOP_EFFICIENCY)
    fp8 = flops / (1979e12 * FLOP_EFFICIENCY * 0.883)
    assert m.layer_params * 2 / (3350e9 * 0.85) < fp8 / 5  # compute-bound by a wide margin
    assert float(_costs("h100-sxm").gemm_time(B, m)) == pytest.approx(bf16, rel=1e-12)
    assert float(_costs("h100-sxm").gemm_time(B, _fp8(m))) == pytest.approx(fp8, rel=1e-12)
    # on an A100 fp8 weights only halve the bytes: the same compute-bound time as bf16
    a100 = _costs("a100-80gb")
    assert float(a100.gemm_time(B, _fp8(m))) == pytest.approx(float(a100.gemm_time(B, m)))
    # at batch 1 the GEMM reads the weights: fp8 halves that on either GPU
    one = _costs("h100-sxm")
    assert float(one.gemm_time(1, _fp8(m))) == pytest.approx(float(one.gemm_time(1, m)) / 2)


def test_an_engine_efficiency_scales_every_rate_alike():
    from kvsim.hw.engine import Engine, Value
    eng = Engine("e", {"flop_efficiency": Value(0.3, "override")})
    c = CostModel.from_spec(catalog.gpu("h100-sxm")).apply(eng)
    m = _fp8(catalog.model("qwen3-4b"))
    assert c.flops == pytest.approx(989e12 * 0.3)
    assert c.gemm_flops(m) == pytest.approx(1979e12 * 0.3 * FP8_EFFICIENCY_RATIO)


def test_kvsim_catalog_lists_each_gpus_rates_and_their_source():
    from conftest import run_cli
    code, out, err = run_cli("catalog")
    assert code == 0, err
    assert "fp8_tflops" in out and "int8_tops" in out
    assert "rates by type: NVIDIA H100 specification table" in out
    assert "mma_rows" in out and "tensor-core rows: Hopper" in out


def test_a_reader_that_leaves_early_gets_no_traceback():
    """kvsim catalog | head: the pipe closes under the printing; the command stops quietly."""
    import subprocess
    import sys
    proc = subprocess.Popen([sys.executable, "-m", "kvsim.cli", "catalog"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # before the command has printed (it imports for a second first)
    err = proc.stderr.read().decode()
    assert proc.wait() == 141 and "Traceback" not in err, err


def test_a_decode_step_below_the_tensor_core_tile_computes_the_tile_by_hand():
    """Hopper's tensor-core GEMM instruction multiplies 64 rows (wgmma m64nNk16): one decode
    token through a Qwen3-8B layer costs 64 tokens' compute. On an H20 (148 bf16 TFLOP/s for
    4.0 TB/s) that compute is longer than the weight reads; on an H100 the reads hide it, and
    from 64 tokens on the tile adds nothing."""
    from kvsim.hw.costs import Matmuls
    m = catalog.model("qwen3-8b")
    tile = 2 * m.active_layer_params * 64 / (148e12 * FLOP_EFFICIENCY)
    h20 = _costs("h20")
    assert h20.mma_rows == 64 and "wgmma" in h20.provenance["gemm_tile"]
    reads = m.layer_weight_bytes() / h20.hbm_bw
    assert reads < tile / 2
    for B in (1, 8, 63):
        assert float(h20.gemm_time(B, m)) == pytest.approx(tile, rel=1e-12)
        assert h20.matmuls(m).at(B) == pytest.approx(tile, rel=1e-12)
    assert float(h20.gemm_time(128, m)) == pytest.approx(2 * tile, rel=1e-12)
    # the fp8 checkpoint: the tile at the fp8 rate (296 TFLOP/s, the H20's INT8 rate, x 0.883)
    assert float(h20.gemm_time(1, _fp8(m))) == pytest.approx(tile / 2 / 0.883, rel=1e-12)
    # an H100 SXM: the weight reads hide the tile, as without it
    h100 = _costs("h100-sxm")
    bare = Matmuls(m, h100.gemm_flops(m), h100.hbm_bw, 1.0, 0.0)
    for B in (1, 16, 64, 512):
        assert float(h100.gemm_time(B, m)) == float(bare.time(B))
    # the LM head of one sequence: 64 rows of compute where that exceeds its weight reads
    p = m.vocab * m.hidden
    assert float(h20.head_time(1, m)) == pytest.approx(
        max(2 * p * 64 / h20.flops, p * 2 / h20.hbm_bw), rel=1e-12)


def test_every_catalog_gpu_names_its_tensor_core_tile():
    for g in catalog.GPUS.values():
        assert g.mma_rows in (16, 64) and g.mma_source, g.name
