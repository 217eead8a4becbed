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
               "usd_per_m_tokens", "qps_capacity_per_replica", "router", "options"}


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
    ends = answer["uncertainty"]["fleet_at_engine_ends"]
    assert ends["rule"] and answer["uncertainty"]["tpot_ms_interval"]
    lo, hi = ends["replicas"]
    assert lo <= answer["replicas"] <= hi  # a faster engine needs no more, a slower no fewer
    assert ends["usd_per_hour"] == [n * answer["tp"] * price for n in (lo, hi)]
    assert answer["one_fewer"] is None or (answer["one_fewer"]["replicas"] ==
                                           answer["replicas"] - 1
                                           and not answer["one_fewer"]["meets_slo"]
                                           and answer["one_fewer"]["why"])
    assert answer["runner_up"]["usd_per_hour"] >= answer["usd_per_hour"]
    df = pd.read_csv(out / "results.csv")
    assert {"usd_per_hour", "usd_per_m_tokens", "replicas_needed", "router", "binding"} <= \
        set(df.columns)
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


def test_the_answer_is_the_cheapest_fleet_ties_going_to_fewer_gpus_then_lower_latency():
    """decide ranks the fleets the search found by cost per hour, then GPUs, then p99 TPOT;
    a configuration the search left out says why (it cannot be among the first two)."""
    from kvsim.plan.decide import decide
    configs = {}

    def row(gpu, tp, replicas, price, tpot, searched=True):
        cfg = configure(policy="dense-resident", gpu=gpu, batch=8, tp=tp)
        configs[cfg.key()] = cfg
        usd = replicas * tp * price
        return {"gpu": gpu, "key": cfg.key(), "status": "ok", "tp": tp, "batch": 8,
                "label": "dense-resident", "kv_dtype": "bf16", "router": "round-robin",
                "replicas_needed": replicas if searched else float("nan"),
                "usd_per_hour": usd if searched else float("nan"), "usd_per_m_tokens": usd,
                "usd_per_request": usd, "gpus": replicas * tp, "price_usd_per_gpu_hour": price,
                "price_source": "test", "capacity_per_replica": 5.0 / replicas,
                "fewer_fails_because": "p99 TPOT <= 20 ms missed: 21" if searched else
                "not searched: work conservation needs at least 9 replica(s), $27.00/h",
                "max_batch_fit": 64, "error": "", "fleet_requests": 200,
                "fleet_served_frac_window": 1.0, "fleet_requests_per_s": 5.0,
                **{f"fleet_{k}": tpot for k in ("tpot_p50_ms", "tpot_p99_ms", "ttft_p50_ms",
                                                "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms",
                                                "e2e_p99_s")}}

    df = pd.DataFrame([row("l40s", 1, 4, 1.0, 12.0), row("h100-sxm", 2, 1, 2.0, 15.0),
                       row("h200", 1, 4, 1.0, 9.0), row("a100-80gb", 1, 9, 3.0, 5.0, False)])
    out, answer = decide(df, 5.0, [slo.Limit("tpot_ms", 20)], configs)
    # three at $4.00/h: 2 GPUs beat 4; of the two with 4 GPUs the lower p99 TPOT
    assert (answer["gpu"], answer["replicas"], answer["gpus"]) == ("h100-sxm", 1, 2)
    assert answer["runner_up"]["gpu"] == "h200"
    why = dict(zip(out.gpu, out.why_lost))
    assert why["h100-sxm"] == "the answer" and why["h200"].startswith("runner-up: $4.00/h")
    assert why["l40s"].startswith("$4.00/h, $0.00/h more than the answer: it needs 4 "
                                  "replica(s) of 1 GPU(s) behind round-robin; 3 fail")
    assert why["a100-80gb"].startswith("not searched: work conservation")
    assert list(out.sort_values("rank").gpu) == ["h100-sxm", "h200", "l40s", "a100-80gb"]
    assert answer["one_fewer"] is None and answer["runner_up"]["one_fewer"]["replicas"] == 3
