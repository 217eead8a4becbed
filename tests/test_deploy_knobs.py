"""The scheduling and memory settings a deployment varies are swept by ``kvsim plan`` like its
other axes (--max-batched-tokens, --host-gib take comma lists), and the answer says when one of
them decides it."""

import json

import pandas as pd
from conftest import run_cli

from kvsim.plan.decide import decided_by
from kvsim.plan.sweep import SweepSpec, expand


def _spec(**kw):
    return SweepSpec(gpus=["h100-sxm"], models=["qwen3-4b"], contexts=[4096],
                     policies=["dense-offload"], batches=[4], **kw)


def test_lists_of_tokens_per_step_and_host_memory_are_swept_and_single_values_keep_their_keys():
    spec = _spec(scheduling={"scheduler": "chunked", "max_batched_tokens": [256, 8192]},
                 deployment={"host_gib": [8.0, 64.0]})
    configs = expand(spec)
    assert sorted((c.scheduling.max_batched_tokens, c.deployment.host_gib)
                  for c in configs) == [(256, 8.0), (256, 64.0), (8192, 8.0), (8192, 64.0)]
    single = expand(_spec(scheduling={"scheduler": "chunked", "max_batched_tokens": [256]},
                          deployment={"host_gib": [8.0]}))
    scalar = expand(_spec(scheduling={"scheduler": "chunked", "max_batched_tokens": 256},
                          deployment={"host_gib": 8.0}))
    assert [c.key() for c in single] == [c.key() for c in scalar]
    # the swept values are axes, not settings: a plan with more of them extends the same DIR
    assert spec.settings() == _spec(scheduling={"scheduler": "chunked"}).settings()


def _row(mbt, host, usd, why):
    key = {"gpu": "g", "scheduling": {"max_batched_tokens": mbt},
           "deployment": {"host_gib": host}}
    return {"key": json.dumps(key), "status": "ok", "usd_per_hour": usd, "why_lost": why}


def test_a_knob_decides_the_answer_only_where_another_value_costs_more_or_fails():
    rows = [_row(8192, 64.0, 1.0, "the answer"), _row(256, 64.0, 2.0, "runner-up: dearer"),
            _row(8192, 8.0, 1.0, "as cheap"), _row(256, 8.0, float("nan"), "no rate meets")]
    (d,) = decided_by(rows, 0)  # host memory changes nothing at 8192 tokens per step
    assert d["knob"] == "max_batched_tokens" and d["value"] == 8192
    assert d["otherwise"] == [{"value": 256, "usd_per_hour": 2.0, "why": "runner-up: dearer"}]
    rows[2]["usd_per_hour"] = float("nan")  # no fleet of it carries the target
    rows[2]["why_lost"] = "no fleet carries the target within the SLO: TPOT"
    assert [d["knob"] for d in decided_by(rows, 0)] == ["max_batched_tokens", "host_gib"]


def test_plan_names_the_tokens_per_step_that_decide_the_answer(tmp_path):
    out = tmp_path / "plan"
    code, stdout, err = run_cli(
        "plan", "--gpu", "l40s", "--model", "qwen3-4b", "--context", "4096", "--output-len",
        "32", "--policy", "dense-resident", "--batch", "8", "--tp", "1",
        "--max-batched-tokens", "256,8192",
        "--host-gib", "64", "--slo-tpot-ms", "60", "--slo-ttft-ms", "1000", "--target-qps", "3",
        "--slo-requests", "100", "--out", out, "--jobs", "1", "--engine", "vllm-paper")
    assert code == 0, err
    answer = json.loads((out / "answer.json").read_text())
    assert len(pd.read_csv(out / "results.csv")) == 2
    assert answer["max_batched_tokens"] == 8192 and answer["runner_up"]["max_batched_tokens"] == 256
    (d,) = answer["decided_by"]
    assert d["knob"] == "max_batched_tokens" and d["value"] == 8192
    assert "Decided by --max-batched-tokens 8192: with 256: $" in stdout
    assert "--max-batched-tokens" in stdout.split("\n\n")[1]  # the table names each value
    assert "Decided by --max-batched-tokens 8192" in (out / "report.md").read_text()
