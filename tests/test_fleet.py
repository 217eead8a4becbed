"""The deployment search sizes a fleet by replaying it: the fewest replicas behind a router whose
fleet meets every SLO at the target rate, checked against every replica count one by one."""

import json
import math

import numpy as np
import pandas as pd
import pytest
from conftest import run_cli

from kvsim.plan import fleet, slo
from kvsim.replay import configure, run_replay

TARGET = 12.0
LIMITS = [slo.Limit("tpot_ms", 25.0), slo.Limit("ttft_ms", 1500.0)]


@pytest.fixture(scope="module")
def verdicts():
    """Each replica count's verdict for both routers, replayed one by one (brute force)."""
    cfg = configure(policy="dense-resident", gpu="l40s", model="qwen3-4b", context=4096,
                    output_len=32, batch=8, slo={"tpot_ms": 25.0, "ttft_ms": 1500.0})
    runs = {}

    def replay(n, router):
        key = (n, router)
        if key not in runs:
            runs[key] = run_replay(cfg.at_rate(TARGET, 300, replicas=n, router=router))
        return runs[key]

    table = {router: [slo.check(replay(n, router), LIMITS)[0] for n in range(1, 13)]
             for router in ("round-robin", "least-loaded")}
    return replay, table


def test_the_verdict_is_monotone_in_the_replicas(verdicts):
    """More replicas behind the same router never fail where fewer passed (what lets the search
    bisect), and the case has both verdicts to tell apart."""
    _, table = verdicts
    for router, ok in table.items():
        assert not ok[0] and ok[-1], router
        first = ok.index(True)
        assert all(ok[first:]), (router, ok)


@pytest.mark.parametrize("start", [1, 2, 5, 11])
def test_the_search_finds_the_fewest_replicas_brute_force_does(verdicts, start):
    replay, table = verdicts
    for router, ok in table.items():
        f = fleet.smallest(replay, LIMITS, router, start=start)
        assert f.replicas == ok.index(True) + 1, (router, start)
        assert f.check.ok and (f.fewer is None or not f.fewer.ok)
        assert f.why_fewer == f.fewer.why and f.why_fewer  # one fewer fails, and says by what
        answer = ok.index(True) + 1  # a search: runs grow with log(answer), not with it
        assert f.runs <= 2 * math.ceil(math.log2(answer + 1)) + 2, (router, start, f.runs)


def test_the_best_router_is_the_one_with_fewest_replicas(verdicts):
    replay, table = verdicts
    best, fleets = fleet.best(replay, LIMITS, ["round-robin", "least-loaded"], start=2)
    fewest = min(ok.index(True) + 1 for ok in table.values())
    assert best.replicas == fewest and [f.router for f in fleets] == ["round-robin",
                                                                       "least-loaded"]
    assert best.router == min(table, key=lambda r: (table[r].index(True),
                                                    r != "round-robin"))


def test_work_conservation_starts_the_search_at_or_below_the_answer(verdicts):
    replay, table = verdicts
    start = fleet.start_from(replay(1, "round-robin"), TARGET)
    assert 1 <= start <= min(ok.index(True) + 1 for ok in table.values())


def test_a_search_that_cannot_pass_says_so():
    f = fleet.smallest(lambda n, r: _Fake(n < 0), [], "round-robin", start=1, cap=6)
    assert f.replicas is None and f.check is None and "6 replicas fail" in f.why_fewer


class _Fake:
    def __init__(self, ok):
        from types import SimpleNamespace
        self.serving = SimpleNamespace(served_frac_window=1.0 if ok else 0.5,
                                       queue_growth_window=0, arrivals_window=100)


def _workload(path, n=500, seed=3):
    rng = np.random.default_rng(seed)
    rows = zip(np.cumsum(rng.exponential(0.25, n)), rng.integers(2048, 8192, n),
               rng.integers(200, 300, n))
    path.write_text("arrival,prompt,output\n" + "".join(f"{a:.4f},{p},{o}\n" for a, p, o in rows))
    return path


@pytest.mark.slow  # two plans, each a fleet search per configuration (~1 min)
def test_a_workload_plan_answers_a_fleet_that_a_replay_confirms(tmp_path):
    """The plan's answer, replayed with kvsim replay --replicas N --workload at the target rate,
    meets the SLO, and with one replica fewer does not; the answer on the edge of a restricted
    TP list names the next size; the table's output length is the workload's."""
    wl = _workload(tmp_path / "wl.csv")
    out = tmp_path / "plan"
    code, stdout, err = run_cli(
        "plan", "--gpu", "l40s", "--model", "qwen3-4b", "--workload", wl, "--policy",
        "dense-resident", "--batch", "8", "--tp", "1", "--slo-tpot-ms", "40", "--slo-ttft-ms",
        "3000", "--slo-requests", "200", "--target-qps", "8", "--out", out, "--jobs", "1")
    assert code == 0, err
    a = json.loads((out / "answer.json").read_text())
    assert {"gpu", "tp", "replicas", "policy", "options", "batch", "kv_dtype", "usd_per_hour",
            "router"} <= set(a)
    df = pd.read_csv(out / "results.csv")
    assert df.output_len.iloc[0] == pytest.approx(np.mean(
        pd.read_csv(wl).output), abs=0.5)  # the workload's outputs, not --output-len
    assert any("--tp 2" in w for w in a["grid_edges"])  # TP 1 is the edge of a restricted list
    assert "Grid edge" in stdout

    def replay(replicas):
        code, out_, err_ = run_cli(
            "replay", "--policy", "dense-resident", "--gpu", "l40s", "--model", "qwen3-4b",
            "--batch", "8", "--workload", wl, "--limit", "400", "--time-scale",
            str(_scale(wl, 400, 8.0)), "--replicas", str(replicas), "--router", a["router"],
            "--slo-tpot-ms", "40", "--slo-ttft-ms", "3000", "--json")
        assert code == 0, err_
        return json.loads(out_)["sim"]

    def meets(s):
        return (s["served_frac_window"] >= 0.95 and s["tpot_p99_ms"] <= 40
                and s["ttft_p99_ms"] <= 3000)
    assert meets(replay(a["replicas"]))
    if a["replicas"] > 1:
        assert not meets(replay(a["replicas"] - 1))


def _scale(path, n, rate):
    t = pd.read_csv(path).arrival.to_numpy()[:n]
    return (n - 1) / (t[-1] - t[0]) / rate


def test_a_target_for_several_contexts_or_models_asks_which(tmp_path):
    for extra in (["--context", "8192,32768", "--model", "qwen3-4b"],
                  ["--context", "8192", "--model", "qwen3-4b,llama-3.1-8b"]):
        code, _, err = run_cli("plan", "--gpu", "h100-sxm", "--policy", "dense-resident",
                               "--slo-tpot-ms", "50", "--target-qps", "2", "--out",
                               tmp_path / "p", *extra)
        assert code == 2 and len(err.strip().splitlines()) == 1
        assert "one plan per (model, context)" in err


def test_an_itl_limit_binds_the_fleet_and_the_slo_line_says_what_each_limit_is_over(tmp_path):
    """ITL's p99 is over tokens (a prefill chunk stalls the decodes beside it), TPOT's over
    requests; a fleet that meets TPOT can miss ITL, and the answer says which statistic each
    limit is on."""
    out = tmp_path / "plan"
    code, stdout, err = run_cli(
        "plan", "--gpu", "h100-sxm", "--model", "qwen3-4b", "--context", "32768", "--output-len",
        "64", "--policy", "dense-resident", "--batch", "8", "--tp", "1", "--slo-tpot-ms",
        "150", "--slo-itl-ms", "300", "--slo-requests", "100", "--target-qps", "1",
        "--out", out, "--jobs", "1")
    assert code == 0, err
    a = json.loads((out / "answer.json").read_text())
    assert "p99 ITL <= 300 ms" in a["slo"] and "ITL over tokens" in a["slo"]
    assert "TPOT over requests" in a["slo"]
    got = a["latency_at_target"]
    assert got["itl_p99_ms"] <= 300 and got["tpot_p99_ms"] <= 150
    if a["one_fewer"]:  # one replica fewer: the 32K-token prompts' prefill chunks stall ITL
        assert "ITL" in a["one_fewer"]["why"]


def test_an_answer_on_the_edge_of_a_restricted_grid_names_the_neighbour():
    from kvsim.plan.decide import grid_edges
    from kvsim.plan.sweep import SweepSpec
    spec = SweepSpec(gpus=["h100-sxm"], models=["qwen3-4b"], contexts=[4096],
                     policies=["dense-resident"], batches=[4, 16], deployment={"tp": [1, 2]})
    edges = grid_edges({"tp": 2, "batch": 16}, spec)
    assert any("--tp 4 may be cheaper" in e and "(--tp 1,2,4)" in e for e in edges)
    assert any("--batch 32 may be cheaper" in e for e in edges)
    assert grid_edges({"tp": 1, "batch": 4}, spec) == [  # (no TP below 1)
        "the answer's batch 4 is the smallest --batch swept; --batch 2 may be cheaper: add it "
        "(--batch 2,4,16)"]
    inside = SweepSpec(gpus=["h100-sxm"], models=["qwen3-4b"], contexts=[4096],
                       policies=["dense-resident"], batches=[4, 16, 64],
                       deployment={"tp": [1, 2, 4]})
    assert grid_edges({"tp": 2, "batch": 16}, inside) == []  # inside the grid: nothing to say
    filled = SweepSpec(gpus=["h100-sxm"], models=["qwen3-4b"], contexts=[4096],
                       policies=["dense-resident"], batches=[4], deployment={"tp": [1, 2]},
                       defaulted=frozenset({"tp", "batch"}))
    assert grid_edges({"tp": 2, "batch": 4}, filled) == []  # the command chose those lists
