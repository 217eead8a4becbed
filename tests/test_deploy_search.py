"""Deciding a deployment: the search over GPU x TP x policy x batch names the cheapest
configuration that carries the target rate within the SLO, and no cheaper one does."""

import json
import math

import pandas as pd
import pytest
from conftest import run_cli

from kvsim.hw import catalog
from kvsim.plan import slo
from kvsim.plan.executors import LocalExecutor
from kvsim.plan.planner import plan
from kvsim.plan.sweep import SweepSpec, expand
from kvsim.replay import configure, run_replay

TARGET, TPOT = 20.0, 30.0
ANSWER_KEYS = {"gpu", "tp", "replicas", "policy", "batch", "kv_dtype", "usd_per_hour",
               "usd_per_m_tokens", "qps_capacity_per_replica"}


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    spec = SweepSpec(gpus=["h100-sxm", "l40s"], models=["qwen3-4b"], contexts=[4096],
                     policies=["dense-resident", "dense-offload", "streamingllm"],
                     batches=[4, 8, 16], output_len=32, slo=[slo.Limit("tpot_ms", TPOT)],
                     slo_requests=200, deployment={"tp": [1, 2]}, target_qps=TARGET)
    out = tmp_path_factory.mktemp("search")
    summary = plan(spec, out, LocalExecutor(1), progress=False).summary
    return spec, out, summary


@pytest.mark.slow  # the search behind it takes about a minute
def test_the_answer_is_written_with_its_contract_keys(searched):
    spec, out, summary = searched
    answer = json.loads((out / "answer.json").read_text())
    assert ANSWER_KEYS <= set(answer) and ANSWER_KEYS <= set(answer["runner_up"])
    assert answer == json.loads(json.dumps(summary["answer"]))
    price = catalog.gpu(answer["gpu"]).usd_per_hour
    assert answer["usd_per_hour"] == pytest.approx(answer["replicas"] * answer["tp"] * price)
    assert answer["replicas"] >= math.ceil(TARGET / answer["qps_capacity_per_replica"] - 1e-9)
    assert answer["check"]["meets_slo"] and answer["check"]["served_frac_window"] >= 0.95
    assert answer["uncertainty"]["rule"] and answer["uncertainty"]["tpot_ms_interval"]
    assert answer["runner_up"]["usd_per_hour"] >= answer["usd_per_hour"]
    df = pd.read_csv(out / "results.csv")
    assert {"usd_per_hour", "usd_per_m_tokens", "slo_max_qps", "binding"} <= set(df.columns)
    assert len(df) == 2 * 2 * 3 * 3 and df.binding.notna().all()
    assert len(answer["rejected"]) == len(df) - 2
    report = (out / "report.md").read_text().splitlines()
    assert report[2].startswith("Answer for 20 req/s") and report[4].startswith("Runner-up")
    for name in ("cost_vs_latency", "capacity_per_gpu"):  # the decision's plots
        assert (out / f"{name}.png").stat().st_size > 1000 and f"{name}.png" in summary["plots"]


@pytest.mark.slow
def test_no_cheaper_configuration_meets_the_slo_at_the_target_rate(searched):
    """Every configuration, with as many replicas as cost less than the answer, replayed at the
    target rate: none passes the SLO check."""
    spec, out, _ = searched
    answer = json.loads((out / "answer.json").read_text())
    cheaper = 0
    for c in expand(spec):
        tp = c.deployment.tp
        per_replica = tp * catalog.gpu(c.gpu).usd_per_hour
        replicas = math.ceil(answer["usd_per_hour"] / per_replica - 1e-9) - 1
        if replicas < 1:
            continue
        cheaper += 1
        r = run_replay(c.at_rate(TARGET, 2 * spec.slo_requests, replicas=replicas))
        assert not slo.check(r, spec.slo)[0], (c.gpu, tp, c.policy.name, c.batch, replicas)
    assert cheaper >= 6  # the test compares against something


def test_configurations_whose_weights_do_not_fit_are_pruned_before_simulation(tmp_path):
    out = tmp_path / "plan"
    code, stdout, err = run_cli(
        "plan", "--gpu", "l40s", "--model", "qwen3-4b", "--context", "4096", "--policy",
        "dense-resident", "--tp", "1,2", "--workspace-gib", "38", "--batch", "4",
        "--output-len", "16", "--slo-tpot-ms", "200", "--slo-requests", "50",
        "--target-qps", "0.5", "--out", out)
    assert code == 0, err
    df = pd.read_csv(out / "results.csv")
    tp1 = df[df.deployment == '{"workspace_gib": 38.0}'].iloc[0]
    assert tp1.status == "infeasible" and tp1.error.startswith("pruned before simulation: HBM")
    assert tp1.binding == "HBM"
    answer = json.loads((out / "answer.json").read_text())
    assert answer["pruned"] == 1 and "1 pruned before simulation" in stdout


def test_a_cheapest_candidate_that_fails_its_check_gets_a_replica_and_is_ranked_again():
    from types import SimpleNamespace

    from kvsim.plan.decide import decide
    configs = {}

    def row(gpu, usd, qps):
        cfg = configure(policy="dense-resident", gpu=gpu, batch=8)
        configs[cfg.key()] = cfg
        return {"gpu": gpu, "key": cfg.key(), "status": "ok", "slo_max_qps": qps,
                "replicas_needed": 1.0,
                "usd_per_hour": usd, "usd_per_m_tokens": usd, "usd_per_request": usd,
                "gpus": 1.0, "deployment": "{}", "label": "dense-resident", "batch": 8,
                "policy": "dense-resident", "options": "{}", "price_usd_per_gpu_hour": usd,
                "price_source": "test", "slo_fails_because": "p99 TPOT <= 20 ms missed: 21",
                "max_batch_fit": 64, "error": ""}

    def check_run(r, replicas):  # l40s needs two replicas, whatever its search said
        ok = r["gpu"] != "l40s" or replicas >= 2
        lat = dict.fromkeys(("tpot_p50_ms", "ttft_p50_ms", "ttft_p99_ms", "e2e_p99_s"), 1.0)
        serving = SimpleNamespace(served_frac_window=1.0, queue_growth_window=0,
                                  arrivals_window=100, tpot_p99_ms=10.0 if ok else 30.0, **lat,
                                  requests=200, requests_per_s=5.0)
        return SimpleNamespace(serving=serving, bounds={}, interval={})

    df = pd.DataFrame([row("l40s", 1.0, 6.0), row("h100-sxm", 1.5, 6.0),
                       row("h200", 3.0, 6.0)])
    out, answer = decide(df, 5.0, [slo.Limit("tpot_ms", 20)], check_run, configs)
    assert (answer["gpu"], answer["replicas"]) == ("h100-sxm", 1)  # 2 x l40s: $2.00/h
    assert answer["runner_up"]["gpu"] == "l40s" and answer["runner_up"]["replicas"] == 2
    assert answer["runner_up"]["usd_per_hour"] == pytest.approx(2.0)
    why = dict(zip(out.gpu, out.why_lost))
    assert why["h100-sxm"] == "the answer" and why["l40s"].startswith("runner-up: $2.00/h")
    assert "1 replica(s) failed the check" in why["l40s"]
    assert list(out.sort_values("rank").gpu) == ["h100-sxm", "l40s", "h200"]
    assert answer["rejected"][0]["configuration"].startswith("h200")
