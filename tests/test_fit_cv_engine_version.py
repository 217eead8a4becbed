"""Leave-one-engine-version-out cross-validation (``kvsim fit --cv engine-version``): the version
key, the refusals, and a held-out version predicted by fits that never saw its rows."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from kvsim.errors import KvsimError
from kvsim.fit import Point, Predictor, read_points
from kvsim.fit import families as F
from kvsim.fit.solve import make_engine
from kvsim.hw import engine as E
from kvsim.policies.spec import parse

ROOT = Path(__file__).resolve().parents[1]

# the engine_version texts of data/published.csv and the version each is
SHIPPED = {
    ("trtllm", "0.9.0"): "trtllm 0.9",
    ("trtllm", "0.5.0"): "trtllm 0.5",
    ("trtllm", "~0.5 (Nov 2023, main)"): "trtllm 0.5",
    ("trtllm", "0.6.1"): "trtllm 0.6",
    ("trtllm", "0.7a"): "trtllm 0.7",
    ("trtllm", ""): "trtllm unstated",
    ("vllm-v0", "0.6.3"): "vllm-v0 0.6",
    ("vllm-v0", "0.6.4.dev22+g5b8a1fde"): "vllm-v0 0.6",
    ("vllm-v0", "0.5 (its script's API)"): "vllm-v0 0.5",
    ("vllm-v0", "~0.4.0 (PR #4002 branch, Apr 2024)"): "vllm-v0 0.4",
    ("vllm-0.3", "~0.2.7 (PR #2542 branch, Jan 2024)"): "vllm-0.3 0.2",
    ("vllm-0.3", "~0.3.3 (PR #3240 branch, Mar 2024)"): "vllm-0.3 0.3",
    ("sglang", "0.4.6.post1"): "sglang 0.4",
    ("sglang", "~0.3.5 (Nov 2024 main)"): "sglang 0.3",
    ("vllm", "0.19.1"): "vllm 0.19",
    ("lmdeploy", "0.1.0 (turbomind)"): "lmdeploy 0.1",
    ("hf", "repo@a21f5a9"): "hf repo@a21f5a9",
    ("hf", "minference harness@e3569ed"): "hf minference",
    ("gpt-fast", "gpt-fast main, PyTorch nightly (Dec 2023 numbers)"): "gpt-fast gpt-fast",
    ("vllm-paper", ""): "vllm-paper unstated",
}


def test_version_key_over_the_shipped_versions():
    for (engine, text), key in SHIPPED.items():
        assert F.version_key(engine, text) == key, text
    with open(ROOT / "data" / "published.csv", newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(r for r in f if not r.lstrip().startswith("#")))
    keys = set()
    for r in rows:  # every version in the file: its family, then a major.minor, word or unstated
        key = F.version_key(r["engine"], r["engine_version"])
        fam, _, version = key.partition(" ")
        assert fam == r["engine"] and version, r
        assert version in r["engine_version"] or version == "unstated", (key, r)
        keys.add(key)
    assert {"trtllm 0.9", "trtllm 0.5", "vllm-v0 0.6", "vllm-0.3 0.2"} <= keys
    assert sum(k.startswith("trtllm ") for k in keys) >= 2  # something to hold out of trtllm
    (spec,), _ = parse("dense-resident")
    p = Point(2, "h100-sxm", "qwen3-4b", spec, 1024, 1, {"tpot_ms": 5.0}, engine="sglang",
              meta={"source": "s", "engine_version": "0.4.6.post1"})
    assert F.group_of(p) == "s" and F.group_of(p, "engine-version") == "sglang 0.4"


HEAD = "gpu,model,policy,context,batch,tpot_ms,use,source,engine,engine_version\n"


@pytest.mark.parametrize("rows, word", [
    (["h100-sxm,qwen3-4b,dense-resident,1024,1,5.8,fit,a,,",
      "h100-sxm,qwen3-4b,dense-resident,8192,4,6.1,fit,b,,"], "no engine column"),
    (["h100-sxm,qwen3-4b,dense-resident,1024,1,5.8,fit,a,vllm,0.6.3",
      "h100-sxm,qwen3-4b,dense-resident,8192,4,6.1,fit,b,vllm,~0.6 (main)"],
     "holds one engine version (vllm 0.6)"),
])
def test_engine_version_cv_is_refused_where_nothing_can_be_held_out(rows, word, tmp_path):
    from conftest import run_cli
    path = tmp_path / "points.csv"
    path.write_text(HEAD + "\n".join(rows) + "\n")
    code, _, err = run_cli("fit", path, "--out", tmp_path / "e.json", "--cv", "engine-version")
    assert code == 2 and word in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "e.json").exists()
    with pytest.raises(KvsimError, match="one of source, engine-version"):
        F.cross_validate(read_points(path), Predictor(None), E.ROOFLINE, by="engine")


# family "a": two versions of one engine (2 ms more per step than the shared one); family "b":
# one version (the shared engine)
VERSIONS = (("a", "0.1.0", "s1"), ("a", "~0.2 (main)", "s2"), ("b", "repo@abc", "s3"))
CONFIGS = (("qwen3-4b", 1024, 1), ("llama-3.1-8b", 4096, 16), ("qwen3-8b", 2048, 64),
           ("qwen3-4b", 8192, 8))


def _write(path: Path, scale_held: float = 1.0) -> Path:
    """The synthetic points as a CSV; ``scale_held`` multiplies version a 0.1's measured values."""
    pred = Predictor(None)
    shared = make_engine(E.ROOFLINE, {"hbm_efficiency": 0.8}, "default", "", "h100-sxm",
                         "qwen3-4b")
    fam_a = make_engine(shared, {"step_overhead_ms": 2.0}, "default", "", "h100-sxm", "qwen3-4b")
    (spec,), _ = parse("dense-resident")
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["gpu", "model", "policy", "context", "batch", "output_len", "tpot_ms",
                    "ttft_ms", "engine", "engine_version", "source"])
        for fam, version, source in VERSIONS:
            for model, ctx, b in CONFIGS:
                p = Point(2, "h100-sxm", model, spec, ctx, b, {"tpot_ms": 1.0, "ttft_ms": 1.0})
                got = pred.predict(p, fam_a if fam == "a" else shared)
                s = scale_held if version == "0.1.0" else 1.0
                w.writerow(["h100-sxm", model, "dense-resident", ctx, b, 128,
                            f"{s * got['tpot_ms']:.6f}", f"{s * got['ttft_ms']:.6f}", fam,
                            version, source])
    return path


def test_a_held_out_version_is_predicted_by_fits_that_never_saw_it(tmp_path):
    """Corrupting version a 0.1's measured values leaves its held-out predictions exactly as
    they were (no fit that predicts them saw them), and moves the other versions' (whose fits
    did); a 0.1 is predicted with family a's offsets (taught by a 0.2), b's only version by the
    shared engine (two cross-validations of three fits, ~7 s)."""
    pred = Predictor(None)
    clean = F.cross_validate(read_points(_write(tmp_path / "clean.csv")), pred, E.ROOFLINE,
                             by="engine-version")
    bad = F.cross_validate(read_points(_write(tmp_path / "bad.csv", 3.0)), pred, E.ROOFLINE,
                           by="engine-version", jobs=2)
    assert [v["held_out"] for v in clean] == [v["held_out"] for v in bad]
    assert list(dict.fromkeys(v["held_out"] for v in clean)) == ["a 0.1", "a 0.2", "b repo@abc"]
    assert len(clean) == 2 * len(VERSIONS) * len(CONFIGS)
    held = [(c, b) for c, b in zip(clean, bad) if c["held_out"] == "a 0.1"]
    assert len(held) == 2 * len(CONFIGS)
    for c, b in held:
        assert b["predicted"] == c["predicted"]
        assert b["measured"] == pytest.approx(3 * c["measured"], rel=1e-5)
        assert c["fitted_as"] == "a"
    rest = [(c, b) for c, b in zip(clean, bad) if c["held_out"] != "a 0.1"]
    assert any(abs(b["predicted"] / c["predicted"] - 1) > 1e-3 for c, b in rest)
    assert {v["fitted_as"] for v in clean if v["held_out"] == "b repo@abc"} == {"shared"}
    # a's versions share an engine: the other version teaches it; b's only version is
    # predicted by a shared engine fitted on a's rows alone, with a's 2 ms more per step
    assert all(abs(v["err_pct"]) < 5 for v in clean if v["engine"] == "a")
    assert all(v["err_pct"] > 10 for v in clean if v["engine"] == "b" and v["metric"] == "tpot_ms")
    rows = {r["category"]: r for r in F.summary(clean, groups=lambda v: [v["held_out"]])}
    assert set(rows) == {"a 0.1", "a 0.2", "b repo@abc"}


def test_kvsim_fit_prints_the_engine_version_table(tmp_path):
    from conftest import run_cli  # a fit per held-out version and one of every row, ~6 s
    path = _write(tmp_path / "pub.csv")
    code, text, err = run_cli("fit", path, "--family", "a", "--out", tmp_path / "a.json",
                              "--cv", "engine-version", "--jobs", "2")
    assert code == 0, err
    assert "leave-one-engine-version-out" in text and "within 20%" in text
    assert "held out" in text and "a 0.2" in text and "b repo@abc" in text
    eng = E.load(tmp_path / "a.json")
    assert eng.fit["cv_by"] == "engine-version"
    assert len(eng.fit["cv"]) == 2 * len(VERSIONS) * len(CONFIGS)
