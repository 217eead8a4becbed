"""Engine profiles and kvsim fit: files that round-trip, overrides said in provenance, a fit
that recovers known parameters and refuses what it cannot fit, and a profile's numbers left as
measured by the default engine."""

import dataclasses
import json

import numpy as np
import pytest
from conftest import replay_json, run_cli

from kvsim.errors import KvsimError
from kvsim.fit import Point, Predictor, read_points
from kvsim.fit.solve import fit, make_engine
from kvsim.hw import engine as E
from kvsim.hw.engine import DecideModel, Engine, Value
from kvsim.policies.spec import parse

HEADER = "gpu,model,policy,context,batch,tpot_ms"


def _replay(trace, **kw):
    return replay_json(trace=trace, **kw)


def test_decide_model_batches_and_fits_a_table_exactly():
    dm = DecideModel(per_layer_us=3.0, per_ktoken_us=20.0, per_kfetched_us=400.0,
                     serial_share=0.4)
    one = float(dm.seconds(1, 32768, 0.05))
    assert one == pytest.approx((3.0 + 20.0 * 32.768 + 400.0 * 0.05 * 32.768) * 1e-6)
    # 8 equal requests: (s * 8 + 1 - s) times one request
    assert float(dm.seconds(8, 8 * 32768, 0.05)) == pytest.approx(one * (0.4 * 8 + 0.6))
    serial = dataclasses.replace(dm, serial_share=1.0)
    assert float(serial.seconds(8, 8 * 32768, 0.05)) == pytest.approx(8 * one)
    ctx = np.array([4096, 8192, 16384, 32768] * 3, float)
    batch = np.repeat([1, 2, 8], 4).astype(float)
    frac = np.tile([0.02, 0.05, 0.03, 0.08], 3)
    secs = np.array([float(dm.seconds(b, b * n, f)) for n, b, f in zip(ctx, batch, frac)])
    got, worst = DecideModel.fit_table(ctx, batch, secs, frac)
    assert worst < 1e-6
    for f in dataclasses.fields(dm):
        assert getattr(got, f.name) == pytest.approx(getattr(dm, f.name), rel=1e-4, abs=1e-6)


def test_engine_files_are_checked_on_load(tmp_path):
    good = Engine("x", {"step_overhead_ms": Value(1.0, "fit")})
    path = tmp_path / "e.json"
    good.save(path)
    assert E.load(path).get("step_overhead_ms") == 1.0
    for change, msg in (({"version": 9}, "version"), ({"format": "nope"}, "not a kvsim engine"),
                        ({"fields": {"warp_factor": {"value": 9, "source": "fit"}}},
                         "unknown engine field"),
                        ({"fields": {"hbm_efficiency": {"value": 1.5, "source": "fit"}}},
                         "share in"),
                        ({"fields": {"step_overhead_ms": {"value": 1, "source": "guess"}}},
                         "source")):
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps({**good.to_json(), **change}))
        with pytest.raises(KvsimError, match=msg):
            E.load(bad)
        code, out, err = run_cli("replay", "--policy", "dense", "--engine", bad)
        assert code == 2 and len(err.strip().splitlines()) == 1 and msg in err


def test_an_engine_file_is_parsed_once_per_content_and_each_load_is_its_own(tmp_path):
    path = tmp_path / "e.json"
    Engine("x", {"step_overhead_ms": Value(1.0, "fit")}).save(path)
    a, b = E.load(path), E.load(path)
    assert a == b and a.fields is not b.fields and a.fit is not b.fit
    a.fit["points"] = [1]  # what kvsim fit does to the engine it made
    assert "points" not in E.load(path).fit
    # the same size, rewritten at once: the content decides, not the file's time stamp
    Engine("x", {"step_overhead_ms": Value(2.0, "fit")}).save(path, force=True)
    assert E.load(path).get("step_overhead_ms") == 2.0
    assert E.load("trtllm") == E.load("trtllm")


def test_the_default_engine_leaves_a_profile_as_measured(hw_trace):
    """With a profiled trace the default engine is the bare hardware: the same numbers as
    --engine roofline; with a catalog GPU it is the best-checked published family, and says so."""
    kw = dict(policy="dense-offload", model="qwen3-4b", context=32768, batch=2)
    a, b = _replay(hw_trace, **kw), _replay(hw_trace, engine="roofline", **kw)
    assert a["tpot_ms"] == b["tpot_ms"] and a["sim"] == b["sim"] and a["engine"] == "roofline"
    assert "default for measured hardware" in a["provenance"]["hw.engine"]
    c = _replay(hw_trace, gpu="h100-sxm", **kw)
    assert c["engine"] == E.CATALOG_DEFAULT and "default for a catalog GPU" in c["provenance"][
        "hw.engine"]


def test_overrides_change_what_they_name_and_say_so(attn_trace):
    base = dict(policy="dense-resident", gpu="h100-sxm", model="qwen3-4b", context=8192,
                output_len=16, engine="roofline")
    r0 = _replay(attn_trace, **base)
    r1 = _replay(attn_trace, step_overhead_ms=2.0, **base)
    assert r1["tpot_ms"] == pytest.approx(r0["tpot_ms"] + 2.0, rel=1e-9)
    assert "override" in r1["provenance"]["hw.engine.step_overhead_ms"]
    off = dict(base, policy="dense-offload")
    slow = _replay(attn_trace, link_gbps=10.0, **off)
    assert "override" in slow["provenance"]["hw.engine.link_gbps"]
    assert "override" in slow["provenance"]["hw.link_h2d"] and "beta 10.00 GB/s" in slow[
        "provenance"]["hw.link_h2d"]
    assert "beta 7.20 GB/s" in slow["provenance"]["hw.link_gather"]  # the catalog's 72% kept
    assert slow["tpot_ms"] > 3 * _replay(attn_trace, **off)["tpot_ms"]  # 52 -> 10 GB/s
    vk = dict(base, policy="verkv", policy_options={"sink": 4, "local": 4, "compression": 4})
    d0, d10 = (_replay(attn_trace, decide_ms=d, kv_read_frac=0.05, **vk) for d in (0.0, 10.0))
    assert d10["tpot_ms"] - d0["tpot_ms"] == pytest.approx(10.0, rel=1e-6)
    assert d0["kv_read_frac"] == 0.05 and "--kv-read-frac" in d0["provenance"]["policy"]
    with pytest.raises(KvsimError, match="does not apply to dense-resident"):
        _replay(attn_trace, kv_read_frac=0.1, **base)
    code, _, err = run_cli("replay", attn_trace, "--policy", "dense", "--kv-read-frac", "2")
    assert code == 2 and "share in [0, 1]" in err


def _points(rows):
    out = []
    for i, (pol, ctx, b, frac) in enumerate(rows, start=2):
        (spec,), _ = parse(pol)
        out.append(Point(i, "h100-sxm", "qwen3-4b", spec, ctx, b, {}, frac, 32))
    return out


def test_fit_recovers_known_parameters_and_round_trips(attn_trace, tmp_path):
    """Points made by a known engine are fitted back to it; the file drives replay --engine,
    every field's provenance in the report."""
    truth = {"step_overhead_ms": 2.0, "link.h2d.gbps": 40.0, "link.gather.gbps": 15.0,
             "decide.verkv.per_ktoken_us": 10.0, "decide.verkv.per_kfetched_us": 500.0,
             "decide.verkv.serial_share": 0.5, "decide.verkv.per_layer_us": 4.0}
    vk = "verkv:sink=4:local=4:compression=4"
    pts = _points([("dense-resident", 8192, 1, None), ("dense-offload", 8192, 1, None),
                   (vk, 8192, 1, 0.02), (vk, 8192, 1, 0.2), (vk, 16384, 4, 0.05),
                   (vk, 4096, 2, 0.1), ("dense-offload", 16384, 2, None)])
    pred = Predictor(attn_trace)
    base = dataclasses.replace(E.ROOFLINE, fields={"link_launches": Value("per-layer", "default"),
                                                   "fetch": Value("serial", "default")})
    known = make_engine(base, truth, "default", "", "h100-sxm", "qwen3-4b")
    for p in pts:
        got = pred.predict(p, known)
        p.measured = {k: got[k] for k in ("tpot_ms", "fetch_ms")[:2 if p.row in (4, 5) else 1]}
    res = fit(pts, pred, base)
    assert set(res.free) == set(truth)
    for k, v in truth.items():
        assert res.values[k] == pytest.approx(v, rel=1e-3), k
    loo = [r["loo_tpot_pct"] for r in res.rows]
    assert sum(x is not None for x in loo) >= 1 and all(abs(x) < 0.5 for x in loo if x is not None)
    path = tmp_path / "eng.json"
    res.engine.save(path)
    r = _replay(attn_trace, policy=vk.split(":")[0], policy_options={"sink": 4, "local": 4,
                "compression": 4}, gpu="h100-sxm", model="qwen3-4b", context=8192, batch=1,
                output_len=32, engine=str(path), kv_read_frac=0.02)
    for key, val in res.engine.fields.items():  # every field, with where it came from
        assert f"({val.source}" in r["provenance"][f"hw.engine.{key}"]
    assert {k.split(".")[0] for k in res.free} <= {k.split(".")[0] for k in res.engine.fields}
    assert "(fit" in r["provenance"]["hw.engine.step_overhead_ms"]
    assert r["tpot_ms"] == pytest.approx(pts[2].measured["tpot_ms"], rel=0.01)


def test_fit_refuses_what_it_cannot_fit(tmp_path):
    def cli(text, *extra):
        f = tmp_path / "m.csv"
        f.write_text(text)
        return run_cli("fit", f, "--out", tmp_path / "e.json", *extra)
    cases = [
        (f"{HEADER}\nh100-sxm,qwen3-4b,dense-offload,32768,1,100\n",
         "cannot fit 2 free parameters"),
        (f"{HEADER}\nh1000,qwen3-4b,dense,32768,1,5\n", "row 2: unknown GPU"),
        (f"{HEADER}\nh100-sxm,qwen9,dense,32768,1,5\n", "row 2: unknown model"),
        (f"{HEADER}\nh100-sxm,qwen3-4b,warpdrive,32768,1,5\n", "row 2: unknown policy"),
        (f"{HEADER}\nh100-sxm,qwen3-4b,dense,32768,1,-5\n",
         "row 2: tpot_ms must be a number in [0.001"),
        (f"{HEADER}\nh100-sxm,qwen3-4b,dense,32768,1.5,5\n", "batch must be a whole number"),
        (f"{HEADER},colour\nh100-sxm,qwen3-4b,dense,32768,1,5,red\n", "unknown column"),
        ("gpu,model,policy,batch,tpot_ms\nh100-sxm,qwen3-4b,dense,1,5\n", "missing column"),
        (f"{HEADER},use\nh100-sxm,qwen3-4b,dense,32768,1,5,maybe\n", "use 'maybe'"),
    ]
    for text, msg in cases:
        code, out, err = cli(text)
        assert code == 2 and msg in err and len(err.strip().splitlines()) == 1, (msg, err)
        assert not (tmp_path / "e.json").exists()
    (tmp_path / "e.json").write_text("keep")
    code, _, err = cli(f"{HEADER}\nh100-sxm,qwen3-4b,dense,32768,1,5\n"
                       f"h100-sxm,qwen3-4b,dense,8192,4,4\n")
    assert code == 2 and "exists" in err and (tmp_path / "e.json").read_text() == "keep"


def test_shipped_paper_points_read_and_the_shipped_engine_is_their_fit():
    pts = read_points("data/verkv-paper-h100.csv")
    assert {p.meta["certainty"] for p in pts} >= {"stated", "plot-kernel"}
    assert all(p.meta.get("source") for p in pts)
    eng = E.load("vllm-paper")
    rows = {r["row"]: r for r in eng.fit["points"]}
    assert {p.row for p in pts} == set(rows)
    fit_rows = [p for p in pts if p.use == "fit"]
    assert all(rows[p.row]["use"] == "fit" for p in fit_rows)
    assert all(rows[p.row]["certainty"] == "stated" or rows[p.row]["certainty"] ==
               "stated-approx" for p in fit_rows)  # fitted on the text's numbers only


def test_kvsim_fit_cli_fits_prints_leave_one_out_and_plans_with_it(tmp_path):
    """The command end to end on points a known engine made: resident rows at two KV sizes
    identify overhead and HBM efficiency, offload rows the H2D rate; the file then drives a plan
    whose rows record the engine."""
    from kvsim.fit import Predictor
    truth = {"step_overhead_ms": 1.5, "hbm_efficiency": 0.7, "link.h2d.gbps": 40.0}
    known = make_engine(E.ROOFLINE, truth, "default", "", "h100-sxm", "qwen3-4b")
    pred, rows = Predictor(None), []
    for pol, ctx, b in (("dense-resident", 8192, 1), ("dense-resident", 32768, 4),
                        ("dense-resident", 16384, 2), ("dense-offload", 8192, 1),
                        ("dense-offload", 32768, 2)):
        (spec,), _ = parse(pol)
        t = pred.predict(Point(0, "h100-sxm", "qwen3-4b", spec, ctx, b, {}, None, 128),
                         known)["tpot_ms"]
        rows.append(f"h100-sxm,qwen3-4b,{pol},{ctx},{b},{t:.6f}")
    csv = tmp_path / "m.csv"
    csv.write_text("\n".join([HEADER, *rows]) + "\n")
    out = tmp_path / "eng.json"
    code, text, err = run_cli("fit", csv, "--out", out)
    assert code == 0, err
    assert "leave-one-out" in text or "loo_err%" in text
    eng = E.load(out)
    for k, v in truth.items():
        assert eng.get(k) == pytest.approx(v, rel=1e-4), k
    assert all(r["loo_tpot_pct"] is None or abs(r["loo_tpot_pct"]) < 0.5
               for r in eng.fit["points"])
    code, _, err = run_cli("plan", "--gpu", "h100-sxm", "--model", "qwen3-4b", "--context",
                           "8192", "--policy", "dense", "--engine", out, "--step-overhead-ms",
                           "3", "--out", tmp_path / "plan", "--jobs", "1")
    assert code == 0, err
    import pandas as pd
    row = pd.read_csv(tmp_path / "plan" / "results.csv").iloc[0]
    assert json.loads(row["engine"]) == {"engine": str(out), "step_overhead_ms": 3.0}
    prov = json.loads(row["provenance"])
    assert "override" in prov["hw.engine.step_overhead_ms"]
    assert "(fit" in prov["hw.engine.hbm_efficiency"]


@pytest.mark.slow  # kvsim fit over the shipped points: a minute or more of CPU
def test_the_shipped_engine_is_what_kvsim_fit_makes_of_the_shipped_points(tmp_path):
    shipped = E.load("vllm-paper")
    out = tmp_path / "again.json"
    code, _, err = run_cli("fit", "data/verkv-paper-h100.csv", "--launches", "per-layer",
                           "--fetch", "serial", "--name", "vllm-paper", "--out", out)
    assert code == 0, err
    again = E.load(out)
    assert set(again.fields) == set(shipped.fields)
    for key, val in shipped.fields.items():
        a, b = again.fields[key].value, val.value
        if isinstance(b, dict):
            for k in b:
                assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-9), (key, k)
        elif isinstance(b, float):
            assert a == pytest.approx(b, rel=1e-4), key
        else:
            assert a == b, key


def test_kvsim_fit_cv_source_leaves_each_source_out(tmp_path):
    """Points a known engine made, in three sources: where the other sources identify every
    parameter, a source's rows are predicted exactly; the only source with offload rows, left
    out, leaves the link rate at the catalog's and says so."""
    from kvsim.fit import Predictor
    truth = {"step_overhead_ms": 1.5, "hbm_efficiency": 0.7, "link.h2d.gbps": 40.0}
    known = make_engine(E.ROOFLINE, truth, "default", "", "h100-sxm", "qwen3-4b")
    pred, rows = Predictor(None), []
    for src, pol, ctx, b in (("A", "dense-resident", 8192, 1), ("A", "dense-resident", 32768, 4),
                             ("B", "dense-resident", 16384, 2), ("B", "dense-resident", 65536, 1),
                             ("C", "dense-offload", 8192, 1), ("C", "dense-offload", 32768, 2)):
        (spec,), _ = parse(pol)
        t = pred.predict(Point(0, "h100-sxm", "qwen3-4b", spec, ctx, b, {}, None, 128),
                         known)["tpot_ms"]
        rows.append(f"h100-sxm,qwen3-4b,{pol},{ctx},{b},{t:.6f},{src}")
    csv = tmp_path / "m.csv"
    csv.write_text("\n".join([HEADER + ",source", *rows]) + "\n")
    code, text, err = run_cli("fit", csv, "--out", tmp_path / "e.json", "--cv", "source",
                              "--json")
    assert code == 0, err
    cv = json.loads(text)["cv"]
    by = {g["source"]: g for g in cv["groups"]}
    assert set(by) == {"A", "B", "C"} and by["A"]["rows"] == [2, 3]
    for s in ("A", "B"):
        assert all(abs(e) < 0.5 for e in by[s]["errors_pct"]) and by[s]["held"] == [], s
    assert by["C"]["held"] == ["link.h2d.gbps"]
    assert all(e < -5 for e in by["C"]["errors_pct"])  # the catalog's 52 GB/s, not 40
    assert cv["summary"]["predicted"] == 6 and cv["summary"]["within"] >= 4
    code, text, err = run_cli("fit", csv, "--out", tmp_path / "f.json", "--cv", "source")
    assert code == 0, err
    assert "leave-one-source-out" in text and "held-out predictions" in text
