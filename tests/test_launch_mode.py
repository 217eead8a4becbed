"""How an engine launches a step's kernels: a CUDA graph per step, or kernel by kernel from
the host while the GPU runs the ones before (``launch``, ``launch_overhead_us``), each against
a hand computation; the families' documented modes and what their code fixes; and the stated
physical limits of the fitted overheads (the per-layer ceiling, the host's share of a step)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvsim.contract import DecodeCost
from kvsim.errors import KvsimError
from kvsim.fit import families as F
from kvsim.fit.solve import bounds
from kvsim.hw import catalog
from kvsim.hw import engine as E
from kvsim.hw.costs import costs_for
from kvsim.sim.steps import StepCosts

ROOT = Path(__file__).resolve().parents[1]


def _steps(model: str, **fields):
    m = catalog.model(model)
    costs, _ = costs_for("h100-sxm", None, E.ROOFLINE.with_fields(**fields))
    return StepCosts(m, costs, DecodeCost(1.0, 1.0, 0.0, 0.0, False))  # KV resident


def _tpot(model, B, ctx, **fields) -> float:
    steps = _steps(model, **fields)
    return float(steps.decode(np.full(B, float(ctx)), 1)[0][0])


def test_an_eager_step_takes_at_least_its_host_launches_by_hand():
    """Llama-3.1-8B on an H100: at batch 1 the GPU's work of a layer (about 140 us) is less
    than 300 us of host launches, so the step is the launches plus the per-step overhead; at
    batch 64 with 8K contexts the GPU's work is longer and hides them (the CUDA-graph step)."""
    L = catalog.model("llama-3.1-8b").layers
    base = {"step_overhead_ms": 0.5, "layer_overhead_us": 10.0}
    graph = _tpot("llama-3.1-8b", 1, 512, **base)
    assert graph < L * 300e-6  # (the premise: launches bind at batch 1)
    eager = _tpot("llama-3.1-8b", 1, 512, launch="eager", launch_overhead_us=300.0, **base)
    assert eager == pytest.approx(L * 300e-6 + 0.5e-3, rel=1e-12)
    big = {"launch_overhead_us": 300.0, **base}
    assert _tpot("llama-3.1-8b", 64, 8192, launch="eager", **big) == \
        _tpot("llama-3.1-8b", 64, 8192, **base)  # the GPU's work hides the launches
    # a CUDA-graph engine pays no host launches, whatever its launch_overhead_us says
    assert _tpot("llama-3.1-8b", 1, 512, launch="cuda-graph", **big) == graph


def test_the_gpu_side_layer_overhead_and_the_launches_overlap_not_add():
    """Where the launches bind, the per-layer GPU overhead runs under them: a step is
    max(GPU work + L x layer overhead, L x launches) + the per-step overhead."""
    L = catalog.model("qwen3-4b").layers
    bare = _tpot("qwen3-4b", 2, 1024)
    for layer, launch in ((10.0, 400.0), (40.0, 60.0), (0.0, 0.0)):
        got = _tpot("qwen3-4b", 2, 1024, launch="eager", launch_overhead_us=launch,
                    layer_overhead_us=layer, step_overhead_ms=1.0)
        want = max(bare + L * layer * 1e-6, L * launch * 1e-6) + 1e-3
        assert got == pytest.approx(want, rel=1e-12), (layer, launch)


@pytest.mark.parametrize("field, value", [("launch", "lazy"), ("launch", 1),
                                          ("launch_overhead_us", -1.0),
                                          ("launch_overhead_us", float("nan"))])
def test_bad_launch_fields_are_refused(field, value):
    with pytest.raises(KvsimError, match=field):
        E.ROOFLINE.with_fields(**{field: value})


def test_every_family_launches_as_documented():
    """The shipped families carry their documented launch mode, and the eager ones their host
    time per layer (the measured per-kernel launch cost times the layer's kernels), said as
    documented rather than fitted."""
    assert set(E.FAMILY_LAUNCH) == set(E.FAMILIES)
    for fam, (mode, host_us, _) in E.FAMILY_LAUNCH.items():
        eng = E.load(fam)
        assert eng.get("launch") == mode and eng.fields["launch"].source == "docs", fam
        if host_us:
            assert mode == "eager"
            assert eng.get("launch_overhead_us") == pytest.approx(host_us)
            assert eng.fields["launch_overhead_us"].source == "docs"
        else:
            assert eng.get("launch_overhead_us") is None
    assert E.FAMILY_LAUNCH["trtllm"][1] == pytest.approx(10 * 3.8)
    assert E.EAGER_PYTORCH_LAYER_US == pytest.approx(1e6 / 25.5 / 32)
    # a family held out of a fit is predicted by the shared fit launching as documented
    shared = E.load(E.SHARED)
    assert shared.get("launch") is None
    assert F.engine_for("lmdeploy", shared, {}).get("launch_overhead_us") == \
        pytest.approx(38.0)
    assert F.engine_for("lmdeploy", shared, {}).get("launch") == "eager"
    assert F.engine_for("unknown-engine", shared, {}) is shared


def test_what_a_familys_code_fixes_stands_in_where_it_has_no_fit():
    """gpt-fast decodes in a bare loop around one compiled step: no per-step host work where
    the shared fit stands in for it (a fold that holds it out); its own points agree (its fit
    is under a sixth of the shared fit's, the serving engines' typical step)."""
    assert E.FAMILY_FIELDS["gpt-fast"]["step_overhead_ms"][0] == 0.0
    eng = E.load("gpt-fast")
    assert eng.get("step_overhead_ms") < E.load(E.SHARED).get("step_overhead_ms") / 6
    assert eng.fields["step_overhead_ms"].source == "fit"
    stand_in = F.engine_for("gpt-fast", E.load(E.SHARED), {})
    assert stand_in.get("step_overhead_ms") == 0.0 and stand_in.get("launch") == "cuda-graph"
    assert E.load(E.SHARED).get("step_overhead_ms") > 0.5  # the serving engines' typical step


def test_no_fitted_per_layer_overhead_passes_its_physical_ceiling():
    """The per-layer overhead is GPU time around a layer's kernels: at most its kernels (14,
    the most any family launches) at the measured 3.8 us a small kernel takes from launch to
    launch (53.2 us). The fit's bound is that ceiling, a family's offset is clipped to it, and
    no shipped engine passes it."""
    ceiling = E.LAYER_OVERHEAD_CEILING_US
    assert ceiling == pytest.approx(14 * 3.8)
    assert bounds("layer_overhead_us") == (0.0, ceiling)
    assert F._offset("layer_overhead_us", 40.0, 30.0) == ceiling
    for name in (*E.FAMILIES, E.SHARED):
        eng = E.load(name)
        assert eng.get("layer_overhead_us", 0.0) <= ceiling + 1e-9, name


@pytest.mark.slow
def test_no_family_overheads_pass_their_stated_share_on_their_own_points():
    """On every point a shipped family was fitted on, its host overheads (per step, per token,
    launches) take at most the host's measured share of a vLLM 0.5.3 step (62%,
    :data:`F.OVERHEAD_SHARE_CEILING`). The shares are the check page's
    (docs/published_check.md)."""
    from kvsim.fit import Predictor, read_points
    rows = [p for p in read_points(ROOT / "data" / "published.csv") if p.use == "fit"]
    engines = {fam: E.load(fam) for fam in E.FAMILIES}
    shares = F.overhead_shares(rows, Predictor(None), engines)
    host = {s["family"]: s for s in shares if s["overhead"] == "host"}
    assert set(host) >= {"trtllm", "vllm-v0", "sglang", "lmdeploy", "gpt-fast", "hf"}
    for fam, s in host.items():
        assert s["max_share"] <= F.OVERHEAD_SHARE_CEILING, (fam, s)
    # one host overhead alone never takes more than all of them at once
    for s in shares:
        if s["overhead"] in F.HOST_OVERHEADS:
            assert s["max_share"] <= host[s["family"]]["max_share"] + 1e-9, s
