"""kvsim validate on the CPU at tiny sizes: real decode loops, the simulator's prediction from the
profile, and the report's structure. No timing targets are asserted (the cores are shared)."""

from __future__ import annotations

import json

import pytest
import torch

from kvsim import trace as tracefile
from kvsim import validate as V
from kvsim.cli import main
from kvsim.errors import KvsimError
from kvsim.hw.catalog import model
from kvsim.policies import PolicySpec, make
from kvsim.validate import loops
from profiler.backend import make_backend
from profiler.link import KiB, MiB
from profiler.run import Plan, profile

TINY = Plan(link_sizes=[4 * KiB, 64 * KiB, 1 * MiB], bidir_sizes=[64 * KiB],
            gather_totals=[64 * KiB], gather_pool=4 * MiB, contexts=[128, 256], batches=[1, 2],
            max_tokens=512, gemm_batches=[1, 2], head_batches=[1], mem_sizes=[4 * MiB],
            mm_sizes=[128], decide_contexts=[4096])

SMALL = dict(contexts=[256], batches=[1, 2], layers=2, steps=2, warmup=1, rounds=1,
             policies=("dense-resident", "dense-offload"))


@pytest.fixture(scope="module")
def cpu_profile(tmp_path_factory):
    out = tmp_path_factory.mktemp("val") / "cpu.npz"
    profile(out, device="cpu", plan=TINY, rounds=1, progress=False,
            decide=V.decide_kernels(["verkv"]))
    return out


def _check(res, n_configs):
    assert isinstance(res["mape"], float) and res["mape"] >= 0
    assert len(res["configs"]) == res["n_configs"] == n_configs
    for r in res["configs"]:
        assert r["measured_tpot_ms"] > 0 and r["predicted_tpot_ms"] > 0
        assert r["error_pct"] == pytest.approx(
            100 * (r["predicted_tpot_ms"] - r["measured_tpot_ms"]) / r["measured_tpot_ms"])
    assert res["mape"] == pytest.approx(
        sum(abs(r["error_pct"]) for r in res["configs"]) / n_configs)


def test_validate_cpu_tiny(cpu_profile):
    res = V.validate(cpu_profile, device="cpu", progress=False, **SMALL)
    _check(res, 4)
    assert {(r["policy"], r["context"], r["batch"]) for r in res["configs"]} == {
        (p, 256, b) for p in ("dense-resident", "dense-offload") for b in (1, 2)}
    assert res["kind"] == "cpu" and res["model_shape"]["layers"] == 2
    assert res["model_shape"]["dtype_bytes"] == 4
    assert set(res["mape_by_policy"]) == {"dense-resident", "dense-offload"}
    assert res["profile"] == str(cpu_profile)


def test_validate_any_registered_policy(cpu_profile):
    """Policies come from the registry: top-k eviction (no hand-written loop) runs the
    resident loop over the share of the cache it keeps, and is predicted from its own
    statistics on the same synthetic layer."""
    res = V.validate(cpu_profile, device="cpu", progress=False,
                     **{**SMALL, "policies": ("topk:compression=8:sink=4:local=4",),
                        "batches": [1]})
    _check(res, 1)
    assert res["configs"][0]["policy"] == "topk:compression=8:sink=4:local=4"


def test_validate_verkv_cpu_tiny(cpu_profile):
    """VerKV runs where its budget allows (4096 tokens here; 256 is too short for sink 64 +
    local 64 and is skipped with a note), fetching what the simulator's statistics on the same
    layer say."""
    res = V.validate(cpu_profile, device="cpu", progress=False, contexts=[256, 4096],
                     batches=[1], layers=1, steps=1, warmup=1, rounds=1,
                     policies=("verkv:sink=64:local=64",))
    _check(res, 1)
    r = res["configs"][0]
    assert (r["policy"], r["context"], r["batch"]) == ("verkv:sink=64:local=64", 4096, 1)
    assert 0 < r["loop_fetched_frac"] < 1
    # the simulator's VerKV statistics come from the same layer: same fetch share, within the
    # policy's accounting (shortlisted keys counted, the pass's other rows)
    assert abs(r["predicted_kv_read_frac"] - r["loop_fetched_frac"]) < 0.05
    assert any("skipped at context 256" in n for n in res["notes"])


def test_prediction_is_the_simulator_on_the_profile(cpu_profile):
    m = V.ModelSpec(**tracefile.load(cpu_profile).hardware.extra["model"])
    import dataclasses
    m2 = dataclasses.replace(m, layers=2)
    res, off = PolicySpec("dense-resident"), PolicySpec("dense-offload")
    one = V.predict(cpu_profile, res, m2, 256, 1, 0)["tpot_ms"]
    two = V.predict(cpu_profile, res, dataclasses.replace(m, layers=4), 256, 1, 0)["tpot_ms"]
    assert 0 < one < two  # more layers, longer steps: the replay uses the stack's shape
    off = V.predict(cpu_profile, off, m2, 256, 2, 0)["tpot_ms"]
    assert off > 0


def test_offload_step_moves_the_host_kv_into_staging(cpu_profile, monkeypatch):
    """The double-buffered loop really computes on what it copied from the host buffer."""
    monkeypatch.setattr(loops, "_head", lambda st, x: x)  # compare hidden states, not tokens
    be = make_backend(None, "cpu", 1)
    m = V.ModelSpec(**{**tracefile.load(cpu_profile).hardware.extra["model"], "layers": 3})
    st = loops.build_stack(be, m, 0)
    host = loops.KVStore(be, m, 2 * 64, "host")
    dev = loops.KVStore(be, m, 2 * 64, "device")
    for a, b in zip(host.k + host.v, dev.k + dev.v):
        b.copy_(a)
    with torch.inference_mode():
        torch.manual_seed(1)  # the same input token states for both loops
        s_off, close = loops.offload_step(be, st, host, 2, 64)
        torch.manual_seed(1)
        s_res, _ = loops.resident_step(be, st, dev, 2, 64)
        try:
            close_ = lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-6)  # noqa: E731
            assert close_(s_off(), s_res())
            assert close_(s_off(), s_res())  # again: the staging slots alternate
            for t in host.k:  # other KV in the host buffer: the offload loop must see it
                t.mul_(-3.0)
            assert not close_(s_off(), s_res())
        finally:
            close()


def test_cli_json(cpu_profile, capsys):
    rc = main(["validate", "--device", "cpu", "--profile", str(cpu_profile), "--json",
               "--contexts", "128,256", "--batches", "1", "--layers", "2", "--steps", "1",
               "--rounds", "1", "--policies", "dense-offload"])
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    _check(res, 2)
    assert all(r["policy"] == "dense-offload" for r in res["configs"])


def test_cli_profiles_first_when_no_profile_is_given(tmp_path, capsys):
    keep = tmp_path / "p.npz"
    rc = main(["validate", "--device", "cpu", "--json", "--save-profile", str(keep),
               "--contexts", "256", "--batches", "1", "--layers", "1", "--steps", "1",
               "--rounds", "1", "--policies", "dense-resident,dense-offload"])
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    _check(res, 2)
    assert tracefile.load(keep).hardware.extra["quick"] is True
    assert any("profiled first" in n for n in res["notes"])


def test_bad_inputs(cpu_profile, tmp_path, capsys):
    with pytest.raises(KvsimError, match="unknown policy 'verkv-nope'"):
        V.validate(cpu_profile, device="cpu", progress=False,
                   **{**SMALL, "policies": ("verkv-nope",)})
    att_only = tmp_path / "att.npz"
    with pytest.raises(KvsimError):
        V.validate(att_only, device="cpu", progress=False, **SMALL)  # no such file
    code = main(["validate", "--device", "cpu", "--profile", str(cpu_profile), "--contexts",
                 "0,5"])  # argparse: one line, status 2
    assert code == 2 and len(capsys.readouterr().err.strip().splitlines()) == 1
    tr = tracefile.load(cpu_profile)
    del tr.hardware.extra["model"]
    bad = tmp_path / "nomodel.npz"
    tracefile.save(tr, bad)
    with pytest.raises(KvsimError, match="model shape"):
        V.validate(bad, device="cpu", progress=False, **SMALL)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_validate_gpu_tiny(tmp_path):
    out = tmp_path / "gpu.npz"
    profile(out, gpu=0, quick=True, progress=False, model="smollm2-135m")
    res = V.validate(out, gpu=0, contexts=[1024], batches=[1, 4], layers=4, steps=3,
                     progress=False)
    _check(res, 4)
    assert model("smollm2-135m").kv_heads == res["model_shape"]["kv_heads"]


def test_prediction_is_the_batch_decoding_alone(cpu_profile):
    """The predicted TPOT is the simulator's decode step of the full batch (what the loop
    times), not decode steps mixed with the other requests' prefill chunks."""
    import dataclasses

    import numpy as np

    from kvsim.hw.catalog import ModelSpec
    from kvsim.hw.costs import costs_for
    from kvsim.sim.steps import StepCosts
    tr = tracefile.load(cpu_profile)
    m = dataclasses.replace(ModelSpec(**tr.hardware.extra["model"]), layers=2)
    spec = PolicySpec("dense-resident", {})
    for B in (1, 4):
        r = V.predict(cpu_profile, spec, m, 4096, B, 0)  # 4 x 4096 > one chunk budget
        costs, _ = costs_for(None, tr.hardware)
        steps = StepCosts(m, costs, make("dense-resident").decode_cost({}, m))
        ctx = np.full(B, float(4096 - V.SIM_OUTPUT_LEN // 2 + 1))
        step = steps.decode(ctx, V.SIM_OUTPUT_LEN - 1)[0].mean()
        assert r["tpot_ms"] == pytest.approx(1e3 * step, rel=1e-6)
