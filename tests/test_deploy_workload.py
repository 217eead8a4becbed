"""A plan over a workload file: every configuration replays the file, and the SLO search scales
the file's arrival times, so its answer is a rate at which the file's traffic is sustained."""

import json

import numpy as np
import pandas as pd
import pytest
from conftest import run_cli

from kvsim.plan import slo


def _workload(path, n=400):
    rng = np.random.default_rng(1)
    rows = zip(np.cumsum(rng.exponential(0.5, n)), rng.integers(2048, 6144, n),
               rng.integers(16, 48, n))
    path.write_text("arrival,prompt,output\n" + "".join(f"{a:.4f},{p},{o}\n" for a, p, o in rows))
    return path


def test_a_workload_plan_answers_a_fleet_the_scaled_file_confirms(tmp_path):
    """With a workload the deployment search replays the file's first requests, their times
    scaled to the target rate, on each fleet: the answer's fleet meets the SLO there and one
    replica fewer does not; the table says the file's prompt and output lengths."""
    from kvsim.replay import configure, run_replay
    wl = _workload(tmp_path / "wl.csv")
    out = tmp_path / "plan"
    code, _, err = run_cli("plan", "--gpu", "h100-sxm", "--model", "qwen3-4b", "--workload", wl,
                           "--policy", "dense-resident", "--batch", "8", "--tp", "1",
                           "--slo-tpot-ms", "20", "--slo-requests", "200", "--target-qps", "10",
                           "--out", out, "--json")
    assert code == 0, err
    df = pd.read_csv(out / "results.csv")
    row = df.iloc[0]
    assert row.context == 4089  # the file's mean prompt
    assert row.output_len == pytest.approx(pd.read_csv(wl).output.mean(), abs=0.5)
    answer = json.loads((out / "answer.json").read_text())
    limits = [slo.Limit("tpot_ms", 20)]
    cfg = configure(policy="dense-resident", gpu="h100-sxm", model="qwen3-4b", batch=8,
                    workload_csv=wl, slo={"tpot_ms": 20})

    def replay(replicas):  # the file's first 400 requests, their times scaled to 10 req/s
        return run_replay(cfg.at_rate(10.0, 400, replicas=replicas, router=answer["router"]))
    at = replay(answer["replicas"])
    assert at.serving.requests == 400 and slo.check(at, limits)[0]
    assert answer["check"]["meets_slo"] and answer["replicas"] > 1
    assert not slo.check(replay(answer["replicas"] - 1), limits)[0]


def test_workload_and_context_are_one_or_the_other(tmp_path):
    wl = _workload(tmp_path / "wl.csv", 50)
    for extra in (["--workload", wl, "--context", "4096"], []):
        code, _, err = run_cli("plan", "--gpu", "h100-sxm", "--model", "qwen3-4b", "--policy",
                               "dense-resident", "--out", tmp_path / "p", *extra)
        assert code == 2 and "--context" in err and len(err.strip().splitlines()) == 1
    code, _, err = run_cli("plan", "--gpu", "h100-sxm", "--model", "qwen3-4b", "--policy",
                           "dense-resident", "--workload", wl, "--slo-tpot-ms", "20",
                           "--out", tmp_path / "p")
    assert code == 2 and "lower --slo-requests" in err
