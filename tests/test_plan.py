"""kvsim plan: one row per configuration, resumable, plots with the expected series, SLO search,
and the same results on the local pool and on Ray."""

import json

import pandas as pd
import pytest
from conftest import run_cli

from kvsim.plan import axes, plots, slo
from kvsim.plan.executors import LocalExecutor
from kvsim.plan.planner import plan
from kvsim.plan.sweep import SweepSpec, sweep
from kvsim.replay import configure, run_replay


def spec(trace, **kw):
    base = dict(gpus=["h100-sxm", "a100-40gb"], models=["qwen3-4b"], contexts=[8192, 250000],
                policies=["dense-resident", "dense-offload"], batches=[1, 4], output_len=16,
                trace=str(trace))
    base.update(kw)
    return SweepSpec(**base)


def test_plan_writes_one_row_per_configuration_and_resumes(attn_trace, tmp_path):
    out = tmp_path / "plan"
    s = plan(spec(attn_trace), out, LocalExecutor(1), progress=False).summary
    df = pd.read_csv(out / "results.csv")
    assert len(df) == 2 * 2 * 2 * 2 == s["rows"] and df.key.is_unique
    assert pd.read_parquet(out / "results.parquet").shape[0] == len(df)
    # 250K tokens of Qwen3-4B do not fit an A100-40GB without offloading: recorded, not fatal
    bad = df[(df.gpu == "a100-40gb") & (df.context == 250000) & (df.policy == "dense-resident")]
    assert (bad.status == "infeasible").all() and bad.error.str.contains("HBM").all()
    assert (df[df.policy == "dense-offload"].status == "ok").all()
    assert json.loads(df.provenance.dropna().iloc[0])["hw.gpu"].startswith("catalog")
    for name in ("throughput_vs_batch", "tpot_vs_context", "max_batch_fit", "hbm_breakdown",
                 "link_utilisation"):
        assert (out / f"{name}.png").stat().st_size > 1000 and (out / f"{name}.svg").exists()
    report = (out / "report.md").read_text()
    assert "![tpot_vs_context](tpot_vs_context.png)" in report and "infeasible" in report
    again = plan(spec(attn_trace), out, LocalExecutor(1), progress=False).summary
    assert again["new_runs"] == 0 and again["rows"] == len(df)
    more = plan(spec(attn_trace, batches=[1, 4, 8]), out, LocalExecutor(1),
                progress=False).summary
    assert more["new_runs"] == 8 and more["rows"] == 24


def test_plots_draw_the_expected_series(attn_trace, tmp_path):
    df = sweep(spec(attn_trace, gpus=["h100-sxm"], contexts=[4096, 16384, 65536]),
               LocalExecutor(1), progress=False)
    tput = plots.throughput_vs_batch(df, tmp_path)
    assert set(tput) == {f"h100-sxm|qwen3-4b|{c}|{p}" for c in (4096, 16384, 65536)
                         for p in ("dense-resident", "dense-offload")}
    xs, ys = tput["h100-sxm|qwen3-4b|4096|dense-resident"]
    assert xs == [1, 4] and ys[1] > ys[0]
    tpot = plots.tpot_vs_context(df, tmp_path)
    ctx, ms = tpot["h100-sxm|qwen3-4b|dense-offload"]
    assert ctx == [4096, 16384, 65536] and ms[0] < ms[1] < ms[2]
    hbm = plots.hbm_breakdown(df, tmp_path)
    assert set(hbm) == {"weights", "resident KV", "transfer staging", "sketch / metadata",
                        "workspace"}
    quality = pd.DataFrame({"label": ["dense-resident", "dense-offload"], "policy": ["a", "b"],
                            "relative_accuracy": [1.0, 1.0]})
    par = plots.pareto(df, quality, tmp_path)
    assert len(par["points"][0]) == 2 and (tmp_path / "pareto.png").exists()


def test_crossover_is_found_where_the_ratio_crosses_one(tmp_path):
    rows = []
    for ctx, fast, base in ((1024, 2.0, 1.0), (8192, 1.5, 3.0), (65536, 4.0, 20.0)):
        for pol, t in (("verkv", fast), ("dense-offload", base)):
            rows.append(dict(status="ok", qps=None, gpu="g", model="m", batch=1, context=ctx,
                             policy=pol, label=pol, tpot_ms=t, host_frac=1.0))
    s = plots.crossover(pd.DataFrame(rows), tmp_path)
    (name, x), = s["_crossings"].items()
    assert 1024 < x < 8192 and "verkv" in name


def test_identical_crossover_lines_are_drawn_once_under_both_names(tmp_path):
    rows = [dict(status="ok", qps=None, gpu="g", model="m", batch=1, context=ctx, policy=pol,
                 label=pol, tpot_ms=t, host_frac=1.0)
            for ctx in (1024, 8192) for pol, t in (("verkv", 2.0), ("quest", 2.0),
                                                  ("dense-offload", 1.0 + ctx / 1024))]
    s = plots.crossover(pd.DataFrame(rows), tmp_path)
    assert set(s) - {"_crossings"} == {"quest = verkv / dense-offload, g, m, batch 1"}
    tpot = plots.tpot_vs_context(pd.DataFrame(rows), tmp_path)
    assert set(tpot) == {"g|m|dense-offload", "g|m|quest = verkv"}


def test_merge_identical_joins_only_series_equal_at_every_point():
    merged = axes.merge_identical({"a": ([1, 2], [3.0, 4.0]), "b": ([1, 2], [3.0, 4.5]),
                                   "c": ([1, 2], [3.0, 4.0]), "d": ([1], [3.0])})
    assert merged == {"b": ([1, 2], [3.0, 4.5]), "a = c": ([1, 2], [3.0, 4.0]),
                      "d": ([1], [3.0])}


def test_the_cost_frontier_is_exactly_the_non_dominated_configurations(tmp_path):
    # (p99 TPOT ms, $ per M tokens): by hand, A (fastest), C and E (cheapest) are not beaten;
    # B is beaten by A (slower, dearer), D by C, F ties A's latency at a higher cost
    pts = {"A": (10, 5.0), "B": (20, 6.0), "C": (30, 2.0), "D": (40, 2.5), "E": (50, 1.0),
           "F": (10, 7.0)}
    d = pd.DataFrame([dict(status="ok", gpu="h100-sxm", model="m", context=4096, label=k,
                           policy=k, batch=4, tp=1, slo_max_qps=1.0,
                           usd_per_hour=1.0, usd_per_m_tokens=c, slo_at_tpot_p99_ms=t,
                           why_lost="the answer" if k == "E" else "dearer")
                      for k, (t, c) in pts.items()], index=list(pts))
    assert sorted(plots.frontier(d, "slo_at_tpot_p99_ms", "usd_per_m_tokens")) == ["A", "C", "E"]
    s = plots.cost_vs_latency(d, tmp_path)["slo_at_tpot_p99_ms"]
    assert s["frontier"] == ([10, 30, 50], [5.0, 2.0, 1.0]) and s["answer"] == ([50], [1.0])
    cap = plots.capacity_per_gpu(d, tmp_path)
    assert len(cap["capacity"][0]) == 6 and (tmp_path / "capacity_per_gpu.png").exists()


def _probe(q, requests=80):
    return run_replay(configure(trace=None, policy="dense-resident", gpu="h100-sxm",
                                model="qwen3-4b", context=4096, output_len=32, batch=16,
                                qps=q, requests=requests, seed=3))


@pytest.fixture
def default_trace_ok(attn_trace, monkeypatch):
    import kvsim.replay as r
    monkeypatch.setattr(r, "DEFAULT_TRACE", attn_trace)


def test_slo_search_brackets_the_answer_and_is_monotone(default_trace_ok):
    limits = lambda tpot: [slo.Limit("tpot_ms", tpot), slo.Limit("ttft_ms", 2000)]  # noqa: E731
    loose = slo.max_qps(_probe, limits(20), requests=80)
    tight = slo.max_qps(_probe, limits(9), requests=80, start=50)
    assert 0 < tight.qps <= loose.qps
    for res, tpot in ((loose, 20), (tight, 9)):
        # the answer is sustained on the probe and within the SLO on the run twice as long
        assert slo.sustained(_probe(res.qps, 80))[0]
        assert slo.check(_probe(res.qps, 160), limits(tpot))[0]
        assert not all(slo.check(_probe(res.fails_at, n), limits(tpot))[0] for n in (80, 160))
        assert res.fails_at / res.qps <= 1.02 + 1e-9
        assert res.at_qps["tpot_p99_ms"] <= tpot and res.why_fails
    assert slo.max_qps(_probe, [slo.Limit("tpot_ms", 0.001)], requests=80).qps == 0.0


@pytest.mark.slow  # starts a local Ray cluster
def test_ray_and_local_give_identical_results(attn_trace):
    pytest.importorskip("ray")
    import ray

    from kvsim.plan.executors import RayExecutor
    s = spec(attn_trace, gpus=["h200"], contexts=[8192])
    local = sweep(s, LocalExecutor(2), progress=False).sort_values("key").reset_index(drop=True)
    try:
        remote = sweep(s, RayExecutor(jobs=2), progress=False)
    finally:
        ray.shutdown()
    remote = remote.sort_values("key").reset_index(drop=True)
    pd.testing.assert_frame_equal(local, remote[local.columns])


@pytest.mark.slow  # starts a local Ray cluster
def test_ray_and_local_give_the_same_answer(tmp_path):
    pytest.importorskip("ray")
    import ray

    from kvsim.plan.executors import RayExecutor
    s = SweepSpec(gpus=["l40s"], models=["qwen3-4b"], contexts=[4096],
                  policies=["dense-resident"], batches=[4, 8], output_len=16,
                  slo=[slo.Limit("tpot_ms", 60)], slo_requests=50, target_qps=2)
    local = plan(s, tmp_path / "local", LocalExecutor(1), progress=False).summary
    try:
        remote = plan(s, tmp_path / "ray", RayExecutor(jobs=2), progress=False).summary
    finally:
        ray.shutdown()
    assert local["answer"]["gpu"] == "l40s" and remote["rows"] == local["rows"] == 2
    assert (tmp_path / "local" / "answer.json").read_text() == \
        (tmp_path / "ray" / "answer.json").read_text()


def test_plan_cli_errors(attn_trace, tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    for args, msg in ((["--out", f], "not a directory"),
                      (["--out", tmp_path / "o", "--batch", "0"], "positive"),
                      (["--out", tmp_path / "o", "--eps", "0.1"], "apply to none"),
                      (["--out", tmp_path / "o", "--executor", "spark"], "invalid choice")):
        code, _, err = run_cli("plan", "--gpu", "h100-sxm", "--model", "qwen3-4b", "--context",
                               "8192", "--policy", "dense-offload", "--trace", attn_trace, *args)
        assert code == 2 and msg in err and len(err.strip().splitlines()) == 1, err


def test_the_hbm_plot_shows_verkv_metadata(tmp_path):
    """VerKV's sketch and inclusion probabilities are metadata in HBM, not resident KV."""
    df = sweep(SweepSpec(gpus=["h100-sxm"], models=["qwen3-4b"], contexts=[32768],
                         policies=["verkv", "dense-offload"],
                         option_grid={"sink": [4], "local": [4]}), LocalExecutor(1),
               progress=False)
    labels, meta = plots.hbm_breakdown(df, tmp_path)["sketch / metadata"]
    _, staging = plots.hbm_breakdown(df, tmp_path)["transfer staging"]
    by = dict(zip(labels, meta))
    assert by["verkv local4 sink4"] > 0 and by["dense-offload"] == 0
    assert all(s > 0 for s in staging)  # both stream KV through HBM buffers
    row = df[df.policy == "verkv"].iloc[0]
    assert row.hbm_meta_gib == pytest.approx(
        row.hbm_gib - row.hbm_weights_gib - row.hbm_workspace_gib - row.hbm_kv_gib
        - row.hbm_staging_gib)


def test_a_sweep_whose_every_run_fails_still_writes_its_table_and_report(tmp_path):
    out = tmp_path / "p"
    from kvsim.errors import KvsimError
    with pytest.raises(KvsimError, match="every configuration failed"):
        plan(SweepSpec(gpus=["h100-sxm"], models=["qwen3-4b"], contexts=[4096],
                       policies=["dense-resident"], trace=str(tmp_path / "missing.npz")), out,
             LocalExecutor(1), progress=False)
    assert "no such trace" in (out / "report.md").read_text()
    assert pd.read_csv(out / "results.csv").status.eq("failed").all()


def test_plan_names_each_failure_and_exits_non_zero_after_writing_the_rest(attn_trace, tmp_path):
    out = tmp_path / "p"
    code, text, err = run_cli("plan", "--gpu", "h100-sxm", "--model", "qwen3-4b", "--context",
                              "4096", "--policy", "dense,verkv:sink=500:local=500",
                              "--trace", attn_trace, "--out", out, "--jobs", "1")
    assert code == 1
    assert "failed: h100-sxm qwen3-4b 4096 verkv" in err and "not enough for sink" in err
    import pandas as pd
    df = pd.read_csv(out / "results.csv")
    assert set(df.status) == {"ok", "failed"}  # the run that worked is kept


def _plan_cmd(out, trace):
    import sys
    return [sys.executable, "-m", "kvsim.cli", "plan", "--gpu", "h100-sxm,a100-80gb",
            "--model", "qwen3-4b", "--context", "4096,8192,16384", "--policy",
            "dense-resident,dense-offload", "--batch", "1,2,4", "--output-len", "8",
            "--trace", str(trace), "--out", str(out), "--jobs", "1", "--json"]


@pytest.mark.slow  # three plans in fresh processes, one killed
def test_a_plan_killed_mid_sweep_resumes_to_the_same_table(attn_trace, tmp_path):
    """kill -9 by PID after the first journaled group, rerun: results.csv is byte-identical to
    an uninterrupted plan's."""
    import os
    import signal
    import subprocess
    import time
    clean, killed = tmp_path / "clean", tmp_path / "killed"
    subprocess.run(_plan_cmd(clean, attn_trace), check=True, capture_output=True)
    p = subprocess.Popen(_plan_cmd(killed, attn_trace), stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    journal = killed / ".kvsim-plan-journal.jsonl"
    while p.poll() is None:  # (no time limit: a slow machine only waits longer)
        if journal.exists() and journal.read_text().count("\n") >= 1:
            break
        time.sleep(0.05)
    assert p.poll() is None, "the plan ended before it could be killed"
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    assert not (killed / "results.csv").exists()
    with open(journal, "a") as f:
        f.write('[{"key": "torn')  # a line cut by the kill
    subprocess.run(_plan_cmd(killed, attn_trace), check=True, capture_output=True)
    a = pd.read_csv(clean / "results.csv").drop(columns=["wall_s"], errors="ignore")
    b = pd.read_csv(killed / "results.csv").drop(columns=["wall_s"], errors="ignore")
    pd.testing.assert_frame_equal(a, b)
    assert not journal.exists()


def test_plan_never_overwrites_what_it_did_not_write(attn_trace, tmp_path):
    out = tmp_path / "p"
    out.mkdir()
    (out / "report.md").write_text("my notes")
    rc, _, err = run_cli(*["plan", "--gpu", "h100-sxm", "--model", "qwen3-4b", "--context", "4096",
                 "--policy", "dense-offload", "--trace", str(attn_trace), "--out", str(out)])
    assert rc == 2 and "did not write" in err
    assert (out / "report.md").read_text() == "my notes"
    (out / "report.md").unlink()
    (out / "tpot_vs_context.png").symlink_to(tmp_path / "nowhere")  # dangling: still foreign
    rc, _, err = run_cli(*["plan", "--gpu", "h100-sxm", "--model", "qwen3-4b", "--context", "4096",
                 "--policy", "dense-offload", "--trace", str(attn_trace), "--out", str(out)])
    assert rc == 2 and "tpot_vs_context.png" in err
    (out / "tpot_vs_context.png").unlink()
    rc, _, err = run_cli(*["plan", "--gpu", "h100-sxm", "--model", "qwen3-4b", "--context", "4096",
                 "--policy", "dense-offload", "--trace", str(attn_trace), "--out", str(out)])
    assert rc == 0, err
    rc2, _, _ = run_cli(*["plan", "--gpu", "h100-sxm", "--model", "qwen3-4b", "--context", "4096",
                     "--policy", "dense-offload", "--trace", str(attn_trace), "--out", str(out)])
    assert rc2 == 0  # its own files: the manifest lists them


def test_a_plan_where_everything_fails_exits_2_after_writing_why(attn_trace, tmp_path):
    out = tmp_path / "p"
    rc, _, err = run_cli(*["plan", "--gpu", "h100-sxm", "--model", "qwen3-4b", "--context", "4096",
                 "--policy", "verkv", "--compression", "4096", "--sink", "4", "--local", "4",
                 "--trace", str(attn_trace), "--out", str(out), "--json"])
    assert rc == 2 and "every configuration failed" in err, err
    assert len(err.strip().splitlines()) == 1
    assert pd.read_csv(out / "results.csv").status.eq("failed").all()


def test_a_plan_on_a_refitted_built_in_engine_is_not_resumed(attn_trace, tmp_path, monkeypatch):
    """A plan's rows name the built-in engine they ran on (the GPU's default here, trtllm) by
    its file's hash: after a refit of that file the plan is refused, and --force runs it
    again, rather than mixing rows of two engines."""
    from kvsim.errors import KvsimError
    from kvsim.hw import engine as E
    out, small = tmp_path / "plan", dict(gpus=["h100-sxm"], contexts=[8192],
                                         policies=["dense-resident"], batches=[1])
    plan(spec(attn_trace, **small), out, LocalExecutor(1), progress=False)
    refit = tmp_path / "trtllm.json"
    doc = json.loads(E.BUILTIN["trtllm"].read_text())
    doc["fields"]["step_overhead_ms"]["value"] += 0.5
    refit.write_text(json.dumps(doc))
    monkeypatch.setitem(E.BUILTIN, "trtllm", refit)
    with pytest.raises(KvsimError, match="engine trtllm changed since"):
        plan(spec(attn_trace, **small), out, LocalExecutor(1), progress=False)
    again = plan(spec(attn_trace, **small), out, LocalExecutor(1), progress=False, force=True)
    assert again.summary["new_runs"] == 1
