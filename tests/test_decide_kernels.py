"""Decide kernels keyed by policy: a second fetching policy (a fake one, registered for the test)
is discovered from the registry, gets its own profiled table, its own fitted decide model and
its own provenance; one without a table gets the estimate and says so; kvsim fit names its
parameters after it."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import replay_json

from kvsim import trace as tracefile
from kvsim.cli import main
from kvsim.contract import DecodeCost
from kvsim.hw.catalog import model
from kvsim.hw.costs import CostModel, costs_for
from kvsim.hw.engine import DecideModel
from kvsim.policies import load_all, registry
from kvsim.policies.base import FetchPolicy
from kvsim.policies.registry import deciding
from kvsim.validate import decide_kernels, default_policies
from profiler import run as prun
from profiler.link import KiB, MiB
from profiler.run import Plan

FAKE = "fake-fetch"
TINY = Plan(link_sizes=[4 * KiB, 64 * KiB], bidir_sizes=[64 * KiB], gather_totals=[64 * KiB],
            gather_pool=1 * MiB, contexts=[128], batches=[1], max_tokens=128, gemm_batches=[1],
            head_batches=[1], mem_sizes=[1 * MiB], mm_sizes=[64], decide_contexts=[4096, 8192],
            decide_batches=[1, 2])


class FakeBench:
    """The decide-kernel protocol the profiler times: ``plan()`` (one decide call for the whole
    batch), ``fetched_frac`` (mean share of the context fetched per KV head) and, optionally,
    ``stack(batch)`` (the same step for ``batch`` requests decided in one call)."""

    def __init__(self, context: int, batch: int = 1):
        self.context, self.batch = context, batch
        self.fetched_frac = 0.125
        self.x = np.ones(context * batch)

    def plan(self):
        return float(self.x.sum())

    def stack(self, batch: int) -> FakeBench:
        return FakeBench(self.context, batch)


class FakeFetch(FetchPolicy):
    name = FAKE
    summary = "a test's fetching policy: an eighth of the cache fetched per step"

    def decode_cost(self, stats, model):
        return DecodeCost(resident_frac=0.1, hbm_read_frac=0.225, host_read_frac=0.125,
                          host_frac=1.0, overlap=False, copies_per_layer=1.0, path="gather",
                          staging_layers=1, decide_bytes_per_token=8.0, decide_kernel=self.name)

    def definition_stats(self):
        return {"kv_read_frac": 0.125, "output_rel_err_mean": 0.0}

    def compress(self, k, v, scores, obs_q, obs_pos, generator, layer, obs_k=None):
        raise AssertionError("needs no trace: never called")

    def attend(self, state, q, q_pos, k, v):
        raise AssertionError("needs no trace: never called")

    def decide_kernel(self, device, model, context, seed=0):
        return FakeBench(context)


@pytest.fixture
def fake(monkeypatch):
    load_all()
    monkeypatch.setitem(registry.REGISTRY, FAKE, FakeFetch)
    return FAKE


@pytest.fixture
def two_tables(fake, tmp_path, monkeypatch, capsys):
    """``kvsim profile --device cpu`` with no --policies: every fetching policy's table."""
    monkeypatch.setattr(prun, "plan_for", lambda kind, quick: TINY)
    out = tmp_path / "cpu.npz"
    assert main(["profile", "--device", "cpu", "--rounds", "1", "--no-progress", "--out",
                 str(out)]) == 0
    return out, capsys.readouterr().out


def test_fetching_policies_come_from_the_registry(fake):
    assert FAKE in deciding() and "verkv" in deciding()
    assert "dense-offload" not in deciding()
    assert default_policies() == ("dense-resident", "dense-offload", *deciding())
    assert set(decide_kernels(["dense-resident", FAKE])) == {FAKE}


def test_the_profiler_times_each_fetching_policy_into_its_own_table(two_tables):
    out, printed = two_tables
    hw = tracefile.load(out).hardware
    for kernel in deciding():
        t = hw.tables[f"kernel_decide_{kernel}"]
        assert list(zip(t["context"].tolist(), t["batch"].tolist())) == [
            (4096, 1), (4096, 2), (8192, 1), (8192, 2)]
        assert "whole batch" in hw.units[f"kernel_decide_{kernel}"]["seconds"]
        assert f"kernel_decide_{kernel}: {kernel}'s decide" in printed
    assert (hw.tables[f"kernel_decide_{FAKE}"]["fetched_frac"] == 0.125).all()
    assert "kernel_decide" not in hw.tables


def test_each_policy_gets_its_own_fit_and_says_where_it_came_from(two_tables):
    hw = tracefile.load(two_tables[0]).hardware
    cm = CostModel.from_hardware(hw)
    t = hw.tables[f"kernel_decide_{FAKE}"]
    own, _ = DecideModel.fit_table(t["context"], t["batch"], t["seconds"], t["fetched_frac"])
    assert cm.decide_models[FAKE] == own != cm.decide_models["verkv"]
    m = model("smollm2-135m")
    assert cm.decide_model(FAKE, m, 8.0) is cm.decide_models[FAKE]
    assert cm.provenance[f"decide.{FAKE}"].startswith(
        f"fit to measured table kernel_decide_{FAKE} (4 points")
    assert cm.provenance["decide"] == cm.provenance[f"decide.{FAKE}"]  # the policy asked
    assert cm.provenance["decide.verkv"].startswith("fit to measured table kernel_decide_verkv")
    cm.check_decide_range(65536)  # beyond what was measured: the asked kernel's table says so
    assert any(e.startswith(f"kernel_decide_{FAKE}: context 65536") for e in cm.extrapolations)
    assert not any(e.startswith("kernel_decide_verkv") for e in cm.extrapolations)


def test_a_policy_without_a_table_gets_the_estimate_and_says_so(two_tables):
    hw = tracefile.load(two_tables[0]).hardware
    del hw.tables[f"kernel_decide_{FAKE}"]
    cm = CostModel.from_hardware(hw)
    m = model("smollm2-135m")
    dm = cm.decide_model(FAKE, m, 8.0)
    assert dm == DecideModel(per_ktoken_us=4e9 * m.kv_heads * 8.0 / cm.hbm_bw)
    said = cm.provenance[f"decide.{FAKE}"]
    assert said.startswith("estimate: four passes") and f"kernel_decide_{FAKE} table" in said
    assert cm.provenance["decide.verkv"].startswith("fit to measured table kernel_decide_verkv")


def test_an_older_profiles_single_table_is_verkvs_and_says_so(two_tables):
    hw = tracefile.load(two_tables[0]).hardware
    hw.tables["kernel_decide"] = hw.tables.pop("kernel_decide_verkv")
    cm = CostModel.from_hardware(hw)
    assert set(cm.decide_models) == set(deciding()) >= {"verkv", FAKE}
    assert cm.provenance["decide.verkv"].startswith(
        "fit to measured table kernel_decide (the single decide table of an older profile, "
        "which timed verkv's decide)")


def test_replay_reports_the_planned_policys_decide_source(fake, two_tables):
    kw = dict(policy=FAKE, model="qwen3-4b", context=8192, batch=2, output_len=8)
    measured = replay_json(trace=two_tables[0], **kw)
    prov = measured["provenance"]
    assert prov["hw.decide"] == prov[f"hw.decide.{FAKE}"]
    assert f"kernel_decide_{FAKE}" in prov["hw.decide"]
    catalog = replay_json(gpu="h100-sxm", **kw)  # a published family: VerKV's only
    prov = catalog["provenance"]
    assert prov["hw.decide"].startswith("estimate: four passes")
    assert f"no profiled kernel_decide_{FAKE} table" in prov["hw.decide"]
    assert prov["hw.decide.verkv"].startswith("engine trtllm")
    assert "from engine vllm-paper" in prov["hw.decide.verkv"]
    # --decide-ms replaces the planned policy's decide, whichever it is
    d0, d10 = (replay_json(gpu="h100-sxm", engine="roofline", decide_ms=d,
                           **(kw | {"batch": 1})) for d in (0.0, 10.0))
    assert d10["tpot_ms"] - d0["tpot_ms"] == pytest.approx(10.0, rel=1e-6)
    assert "--decide-ms 10" in d10["provenance"][f"hw.decide.{FAKE}"]


def test_fit_names_decide_parameters_after_each_kernel_in_the_rows(fake):
    from kvsim.fit import Point, Predictor
    from kvsim.fit.solve import fit, identified, make_engine, parameters
    from kvsim.hw import engine as E
    from kvsim.policies.spec import parse
    truth = {"step_overhead_ms": 2.0, "link.gather.gbps": 15.0,
             f"decide.{FAKE}.per_ktoken_us": 30.0,
             f"decide.{FAKE}.serial_share": 0.25, f"decide.{FAKE}.per_layer_us": 5.0}
    known = make_engine(E.ROOFLINE, truth, "default", "", "h100-sxm", "qwen3-4b")
    assert known.decide(FAKE) is not None and known.decide("verkv") is None
    pred, pts = Predictor(None), []
    for i, (ctx, b) in enumerate(((8192, 1), (16384, 4), (32768, 2), (4096, 8), (8192, 2)),
                                 start=2):
        (spec,), _ = parse(FAKE)
        p = Point(i, "h100-sxm", "qwen3-4b", spec, ctx, b, {}, None, 32)
        got = pred.predict(p, known)
        p.measured = {k: got[k] for k in ("tpot_ms", "fetch_ms")}
        pts.append(p)
    assert set(identified(pts, pred)) == set(truth)
    assert f"decide.{FAKE}.per_kfetched_us" in parameters([FAKE])
    assert not any(k.startswith("decide.verkv") for k in parameters([FAKE]))
    res = fit(pts, pred, E.ROOFLINE)
    for k, v in truth.items():
        assert res.values[k] == pytest.approx(v, rel=1e-3), k
    assert set(res.engine.fields) >= {f"decide.{FAKE}", "step_overhead_ms"}
    assert "decide.verkv" not in res.engine.fields
    assert res.engine.decide(FAKE).per_ktoken_us == pytest.approx(30.0, rel=1e-3)
    costs, _ = costs_for("h100-sxm", None, res.engine)
    assert costs.provenance["decide"].startswith(f"models of their own for {FAKE}")
