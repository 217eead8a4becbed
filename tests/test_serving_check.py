"""The published serving runs: every row of data/published/serving.csv is a setup kvsim replay
can take, the benchmark's length draws are what its options say, and the stored comparison
is what the rows measured."""

from __future__ import annotations

import csv
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from kvsim.hw import catalog

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("serving_check", ROOT / "scripts" /
                                              "serving_check.py")
S = importlib.util.module_from_spec(spec)
spec.loader.exec_module(S)
ROWS = list(csv.DictReader(open(ROOT / "data" / "published" / "serving.csv")))


def test_every_row_names_a_catalog_setup_and_a_measured_metric():
    assert len(ROWS) >= 100 and len({r["source"] for r in ROWS}) >= 3
    for r in ROWS:
        catalog.gpu(r["gpu"])
        catalog.model(r["model"])  # a Hugging Face id of a catalog shape
        assert r["metric"] in S.METRICS and float(r["measured"]) > 0
        assert r["arrivals"] in ("poisson", "all-at-once", "closed")
        assert bool(r["rate_qps"]) == (r["arrivals"] == "poisson")
        assert bool(r["concurrency"]) == (r["arrivals"] == "closed")
        assert int(r["requests"]) > 0 and r["url"].startswith("https://")


def test_length_draws_are_the_benchmarks():
    rng = np.random.default_rng(1)
    assert (S.lengths("fixed", 5, 1000, rng) == 1000).all()
    u = S.lengths("uniform", 200_000, 1024, rng)  # SGLang random, range ratio 0: [1, max]
    assert u.min() == 1 and u.max() == 1024 and u.mean() == pytest.approx(512.5, rel=0.01)
    p = S.lengths("pm15", 200_000, 20000, rng)  # vLLM --random-range-ratio 0.15
    assert p.min() == 17000 and p.max() == 23000 and p.mean() == pytest.approx(20000, rel=0.01)
    with pytest.raises(SystemExit):
        S.lengths("sharegpt", 1, 1, rng)


def test_a_poisson_workload_has_the_rate_and_count(tmp_path):
    run = {"requests": "4000", "lengths": "fixed", "input_len": "100", "output_len": "7",
           "arrivals": "poisson", "rate_qps": "8"}
    S.workload(run, tmp_path / "w.csv")
    lines = (tmp_path / "w.csv").read_text().splitlines()
    assert lines[0] == "arrival,prompt,output" and len(lines) == 4001
    t = np.array([float(x.split(",")[0]) for x in lines[1:]])
    assert (np.diff(t) >= 0).all() and 4000 / t[-1] == pytest.approx(8, rel=0.05)
    run.update(arrivals="all-at-once", rate_qps="")
    S.workload(run, tmp_path / "w.csv")
    assert all(x.startswith("0.000000,100,7") for x in
               (tmp_path / "w.csv").read_text().splitlines()[1:])


def test_the_stored_comparison_matches_the_rows():
    values = json.loads((ROOT / "data" / "published-serving.json").read_text())["values"]
    assert len(values) == len(ROWS)
    for v in values:
        r = ROWS[v["row"] - 2]
        assert v["measured"] == float(r["measured"]) and v["metric"] == r["metric"]
        assert v["err_pct"] == pytest.approx(100 * (v["predicted"] / v["measured"] - 1))
        assert "serving" in v["categories"]


def test_the_stored_predictions_are_what_the_shipped_engines_replay(tmp_path):
    """Two TensorRT-LLM runs replayed again with the shipped `trtllm` engine give the stored
    predictions: the comparison was made with the engines that ship (a refit reruns it)."""
    values = json.loads((ROOT / "data" / "published-serving.json").read_text())["values"]
    runs = {}
    for v in values:
        r = ROWS[v["row"] - 2]
        if r["source"] == "trtllm-perf-overview-v0.19plus" and int(r["requests"]) <= 1500 \
                and r["model"].endswith("8B-Instruct"):
            runs.setdefault(r["where"] + r["gpu"] + r["input_len"] + r["output_len"], (r, v))
    assert len(runs) >= 2
    for i, (r, v) in enumerate(list(runs.values())[:2]):
        got = S.run_one(S.replay_args(r, "trtllm", tmp_path, i))
        assert got["sim"][S.METRICS[r["metric"]]] == pytest.approx(v["predicted"], rel=1e-9)
