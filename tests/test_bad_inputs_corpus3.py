"""The third corpus of bad inputs and faults (issue #46): what an outside round found silent,
a traceback, a hang, misleading or left behind in the deployment search and the files it reads.
Each case: exit status 2 and one line naming the problem, or the right result; no file that was
there before is changed. The processes a plan starts die with it (``kill -9`` included)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from test_bad_inputs_corpus2 import (
    ENGINE,
    FAST,
    GOOD_CONFIG,
    MOE,
    PLAN,
    _check,
    _engine,
    _write,
    replay_profile,
)

from kvsim.errors import KvsimError
from kvsim.policy_profile import DEFAULT as SHIPPED_PROFILE

PROFILE = json.loads(SHIPPED_PROFILE.read_text())
SLO = ["--slo-tpot-ms", "200", "--slo-requests", "20"]


# ------------------------------------------------------------------ lists are sets
DUPLICATES = [
    ("--gpu", "h100-sxm,h100-sxm"), ("--gpu", "h100-sxm,H100-SXM"),
    ("--model", "qwen3-4b,qwen3-4b"), ("--context", "1024,1024"),
    ("--policy", "dense-resident,dense-resident"), ("--policy", "dense-resident,dense"),
    ("--batch", "4,4"), ("--qps", "1,1.0"), ("--tp", "1,1"), ("--replicas", "2,2"),
    ("--kv-dtype", "bf16,bf16"), ("--host-gib", "64,64.0"), ("--max-batched-tokens", "512,512"),
    ("--cache-host-gib", "8,8"), ("--compression", "16,16"), ("--sink", "4,4"),
    ("--router", "least-loaded,least-loaded"),
]


@pytest.mark.parametrize("flag, value", DUPLICATES, ids=lambda x: str(x))
def test_a_list_that_names_an_item_twice_is_refused_naming_it(flag, value, tmp_path, capsys):
    # (before: the same configuration ran and was written twice, or one was silently dropped)
    argv = [a for a in PLAN if a not in ("--requests", "4")] + ["--requests", "4"]
    if flag in ("--gpu", "--model", "--context", "--policy"):
        i = argv.index(flag)
        argv = argv[:i] + argv[i + 2:]
    err = _check([*argv, flag, value, "--out", tmp_path / "p"], capsys, tmp_path, flag)
    assert "twice" in err[-1] or "the same" in err[-1], err


def test_other_commands_lists_are_sets_too(tmp_path, capsys):
    from pathlib import Path

    from kvsim.model.capture import parse_layers
    trace = Path(__file__).parents[1] / "data/mooncake/synthetic_trace.jsonl"
    _check(["cache-curve", trace, "--capacity-tokens", "3e6,1e7,3e6"], capsys, tmp_path,
           "--capacity-tokens: 3e+06 is listed twice")
    with pytest.raises(KvsimError, match="--layers: 2 is listed twice"):
        parse_layers("0,2,2", 30)


def test_an_empty_list_names_its_own_flag(tmp_path, capsys):
    # (before: --host-gib '' was blamed on --tp, --replicas and --kv-dtype)
    err = _check([*PLAN, "--host-gib", "", "--out", tmp_path / "p"], capsys, tmp_path,
                 "--host-gib")
    assert "--tp" not in err[-1]


@pytest.mark.parametrize("flag, values", [("--context", "1024,4096"),
                                          ("--model", "qwen3-4b,qwen3-8b")])
def test_a_deployment_for_two_workloads_is_refused(flag, values, tmp_path, capsys):
    argv = [*PLAN]
    i = argv.index(flag)
    argv[i + 1] = values
    _check([*argv, *SLO, "--target-qps", "1", "--out", tmp_path / "p"], capsys, tmp_path,
           "one model and one prompt length")


# ------------------------------------------------------------------ numbers and their bounds
@pytest.mark.parametrize("argv, word", [
    (["--host-gib", "1e300"], "--host-gib must be a size in"),
    (["--cache-host-gib", "1e300"], "--cache-host-gib must be a size in"),
    (["--workspace-gib", "1e300"], "--workspace-gib must be a size in"),
    (["--cache-pool-gbps", "1e300"], "--cache-pool-gbps"),
    (["--price", "h100-sxm=1.7e308"], "at most 10,000"),
    (["--memory-price", "1e308"], "--memory-price"), (["--disk-price", "1e308"], "--disk-price"),
    (["--target-qps", "1e300", *SLO], "at most 1,000,000"),
    (["--slo-requests", "1000000000", "--slo-tpot-ms", "100"], "--slo-requests must be"),
    (["--slo-tpot-ms", "60@"], "--slo-tpot-ms"),
    (["--step-overhead-ms", "1e300"], "step_overhead_ms"),
    (["--link-gbps", "1e-300"], "--link-gbps must be"), (["--decide-ms", "1e300"], "--decide-ms"),
    (["--cache-disk-gbps", "1e-300"], "--cache-disk-gbps"),
    (["--qps", "1e-300"], "--qps must be a rate"), (["--qps", "1,1e300"], "--qps must be a rate"),
])
def test_numbers_beyond_what_can_be_simulated_are_refused_before_work(argv, word, tmp_path,
                                                                      capsys):
    # (before: an OverflowError from every configuration, $inf in answer.json, a run of 1e9
    # requests blamed on --requests, a hang building 1e299 replicas)
    start = time.monotonic()
    _check([*PLAN, *argv, "--out", tmp_path / "p"], capsys, tmp_path, word)
    assert time.monotonic() - start < 30


def test_a_prices_file_that_gives_a_gpu_twice_is_refused(tmp_path, capsys):
    path = _write(tmp_path / "prices.json", '{"h100-sxm": 2.0, "h100-sxm": 3.0}')
    _check([*PLAN, "--prices", path, "--out", tmp_path / "p"], capsys, tmp_path,
           "'h100-sxm' twice")


def test_a_rate_no_fleet_can_carry_says_why(tmp_path, capsys):
    # (before: "no configuration ... at a known price" after a check run of 235,968 replicas)
    out = tmp_path / "p"
    argv = [*PLAN, *SLO, "--target-qps", "1e6", "--tp", "1", "--batch", "4", "--out", out]
    _check(argv, capsys, tmp_path, None, out)
    answer = json.loads((out / "answer.json").read_text())
    assert answer["gpu"] is None
    assert "work conservation needs at least" in answer["why"] and "4,096" in answer["why"]


def test_outputs_hold_no_infinity():
    from kvsim.io import finite_json
    assert finite_json({"a": [1.0, float("nan")]}) == {"a": [1.0, None]}
    with pytest.raises(KvsimError, match="usd_per_hour is inf"):
        finite_json({"answer": {"usd_per_hour": float("inf")}})


# ------------------------------------------------------------------ engine files
ENGINES = {
    "moe_efficiency 1e-300": (_engine(fields={"moe_efficiency": {"value": 1e-300,
                                                                 "source": "fit"}}),
                              "moe_efficiency"),
    "step overhead 1e300": (_engine(fields={"step_overhead_ms": {"value": 1e300,
                                                                 "source": "fit"}}),
                            "step_overhead_ms"),
    "fit a string": (_engine(fit="x"), "fit"),
    "fit.cv a string": (_engine(fit={"cv": "x"}), "fit.cv"),
    "fit.cv log_err text": (_engine(fit={"cv": [{"regime": "decode", "log_err": "x"}]}),
                            "log_err"),
    "fit.cv log_err huge": (_engine(fit={"cv": [{"regime": "decode", "log_err": 1e300}]}),
                            "log_err"),
    "fit.cv no regime": (_engine(fit={"cv": [{"log_err": 0.1}]}), "regime"),
    "fit.points an object": (_engine(fit={"points": {"a": 1}}), "fit.points"),
    "fit.points error text": (_engine(fit={"points": [{"use": "fit", "loo_tpot_pct": "x"}]}),
                              "loo_tpot_pct"),
    "fit.points error -100%": (_engine(fit={"points": [{"use": "check",
                                                        "err_tpot_ms_pct": -100}]}),
                               "err_tpot_ms_pct"),
    "fit.checked a list": (_engine(fit={"checked": ["h100-sxm"]}), "checked"),
    "fit.checked tp text": (_engine(fit={"checked": {"gpu": [], "weight_dtype": [],
                                                     "kv_dtype": [], "tp": ["1"],
                                                     "moe": False}}), "checked"),
    "fit.range reversed": (_engine(fit={"range": {"verkv": {"batch": [8, 1]}}}), "range"),
    "a huge number in fit": (_engine(fit={"cv_summary": [{"values": 1e200}]}), "1e+200"),
    "a note that is a number": (_engine(fields={"step_overhead_ms": {
        "value": 1, "source": "fit", "note": 5}}), "note"),
    "a description that is a list": (_engine(description=[1]), "description"),
    "fitted_on a string": (_engine(fitted_on="h100"), "fitted_on"),
    "a key twice": (json.dumps(ENGINE)[:-1] + ', "name": "a", "name": "b"}', "twice"),
}


@pytest.mark.parametrize("name", ENGINES)
def test_engine_files(name, tmp_path, capsys):
    content, word = ENGINES[name]
    path = _write(tmp_path / "engine.json", content)
    _check(["replay", "--engine", path, "--policy", "dense-resident", "--model", "mixtral-8x7b",
            "--tp", "2", "--gpu", "h100-sxm", *FAST], capsys, tmp_path, word)


def test_an_engine_file_with_a_bad_fit_record_fails_a_plan_in_one_line(tmp_path, capsys):
    # (before: "every configuration failed (OverflowError)")
    path = _write(tmp_path / "engine.json", ENGINES["fit.cv log_err huge"][0])
    _check([*PLAN, "--engine", path, "--out", tmp_path / "p"], capsys, tmp_path, "log_err")


def test_the_shipped_engines_pass_their_own_checks():
    from kvsim.hw.engine import BUILTIN, load
    for name in BUILTIN:
        assert load(name).fit


# ------------------------------------------------------------------ policy-profile files
def _profile(change) -> dict:
    out = json.loads(json.dumps(PROFILE))
    change(out)
    return out


def _stat(col: int, value):
    def change(p):
        for r in p["rows"]:
            r[col] = value
    return change


PROFILES = {
    "a negative share": (_profile(_stat(8, -0.5)), "kv_read_frac must be a share"),
    "a share above one": (_profile(_stat(8, 3.0)), "kv_read_frac must be a share"),
    "a null statistic": (_profile(_stat(8, None)), "kv_read_frac must be a share"),
    "a negative error": (_profile(_stat(15, -1.0)), "output_rel_err_max must be a number"),
    "a setting with no rows": (_profile(lambda p: p.update(rows=[r for r in p["rows"]
                                                                if r[0] == 0])), "no rows"),
    "settings twice": (_profile(lambda p: p.update(settings=p["settings"] * 2)), "distinct"),
    "captures a string": (_profile(lambda p: p.update(captures="x")), "captures"),
    "a zero layer weight": (_profile(_stat(6, 0)), "layer weight"),
}


@pytest.mark.parametrize("name", PROFILES)
def test_policy_profile_files(name, tmp_path, capsys):
    # (before: a negative share was replayed, an interval's low end above its high end, TPOT 20x
    # off; one setting gave KeyError: 11, a null statistic KeyError: 'kv_read_frac')
    replay_profile(*PROFILES[name], tmp_path, capsys)


def test_an_interval_that_does_not_hold_its_value_is_no_answer():
    from types import SimpleNamespace

    from kvsim.replay.result import ReplayResult
    r = object.__new__(ReplayResult)
    r.serving = SimpleNamespace(requests=4)
    r.bounds = {"tpot_ms": (12.0, 9.0)}
    with pytest.raises(KvsimError, match="interval"):
        r._check_edges({"tpot_ms": 10.0, "ttft_ms": 1.0, "e2e_s": 1.0,
                        "throughput_tok_s": 5.0, "output_len": 8})
    r.bounds = {}
    with pytest.raises(KvsimError, match="tpot_ms came out"):
        r._check_edges({"tpot_ms": float("nan"), "ttft_ms": 1.0, "e2e_s": 1.0,
                        "throughput_tok_s": 5.0, "output_len": 8})


# ------------------------------------------------------------------ kvsim fit
FIT_HEAD = "gpu,model,policy,context,batch,tpot_ms,use,source,engine\n"


@pytest.mark.parametrize("rows, argv, word", [
    (["h100-sxm,qwen3-4b,dense-resident,32768,1,5.8,check,a,vllm"], [], "no rows to fit"),
    (["h100-sxm,qwen3-4b,dense-resident,32768,1,1e-300,fit,a,vllm"], [], "tpot_ms must be"),
    (["h100-sxm,qwen3-4b,dense-resident,32768,1,5.8,fit,a,vllm",
      "h100-sxm,qwen3-4b,dense-resident,8192,4,6.1,fit,a,vllm"], ["--cv", "source"],
     "leaves nothing to fit"),
])
def test_fit_data_that_cannot_be_fitted_or_held_out(rows, argv, word, tmp_path, capsys):
    # (before: max() arg is an empty sequence; array must not contain infs; a
    # "leave-one-source-out" table in which nothing was held out)
    path = _write(tmp_path / "points.csv", FIT_HEAD + "\n".join(rows) + "\n")
    _check(["fit", path, "--out", tmp_path / "e.json", *argv], capsys, tmp_path, word)
    assert not (tmp_path / "e.json").exists()


# ------------------------------------------------------------------ config.json
def test_a_moe_config_with_a_zero_expert_size_is_refused(tmp_path, capsys):
    # (before: read as the dense size, and reported as weights that exceed HBM)
    path = _write(tmp_path / "config.json", GOOD_CONFIG | MOE | {"moe_intermediate_size": 0})
    _check(["replay", "--model", path, "--gpu", "h100-sxm", "--policy", "dense-resident",
            *FAST], capsys, tmp_path, "moe_intermediate_size")


# ------------------------------------------------------------------ a folder kvsim wrote
def test_a_plan_stopped_by_a_full_disk_resumes_once_there_is_room(tmp_path, capsys,
                                                                  monkeypatch):
    # (before: the rerun refused its own folder: "holds results.csv, answer.json that kvsim
    # plan did not write")
    import errno

    import kvsim.plan.report as report
    out = tmp_path / "p"
    argv = [*PLAN, *SLO, "--target-qps", "0.5", "--tp", "1", "--batch", "4", "--out", out]

    def full(*a, **k):
        raise KvsimError(f"{out}/report.md: {os.strerror(errno.ENOSPC)}")
    with monkeypatch.context() as m:
        m.setattr(report, "write_report", full)
        m.setattr("kvsim.plan.planner.write_report", full)
        _check(argv, capsys, tmp_path, "no space left")
    assert (out / "results.csv").exists() and (out / "answer.json").exists()
    _check(argv, capsys, tmp_path, None, out)


# ------------------------------------------------------------------ Ray
def test_a_ray_address_where_nothing_listens_is_one_line_at_once(monkeypatch):
    pytest.importorskip("ray")
    import socket

    from kvsim.plan.executors import make_executor
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    start = time.monotonic()
    with pytest.raises(KvsimError, match="no Ray cluster answers there"):
        make_executor("ray", 1)
    assert time.monotonic() - start < 30
    monkeypatch.setenv("RAY_ADDRESS", "nonsense")
    with pytest.raises(KvsimError, match="give HOST:PORT"):
        make_executor("ray", 1)


def test_ray_failing_to_start_is_one_line(monkeypatch):
    ray = pytest.importorskip("ray")
    from kvsim.plan.executors import make_executor

    def refuse(**kw):
        raise RuntimeError("Failed to start the GCS server.\nmore lines of Ray's own")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", refuse)
    with pytest.raises(KvsimError, match=r"^Ray did not start \(RuntimeError: Failed to start "
                                         r"the GCS server\.\)$"):
        make_executor("ray", 1)


# ------------------------------------------------------------------ no orphans
def test_the_reaper_kills_what_its_parent_started_when_the_parent_dies(tmp_path):
    """A parent starts a watcher, then a child, which starts a grandchild; the parent is killed
    with -9: both go. A child the parent had before the watcher is not the watcher's."""
    script, middle = tmp_path / "parent.py", tmp_path / "child.py"
    sleeper = "[sys.executable, '-c', 'import time; time.sleep(600)']"
    middle.write_text("import subprocess, sys, time\n"
                      f"print(subprocess.Popen({sleeper}).pid, flush=True)\n"
                      "time.sleep(600)\n")
    script.write_text(
        "import subprocess, sys, time\n"
        "from kvsim.plan.reaper import POLL_S, Reaper\n"
        f"old = subprocess.Popen({sleeper})\n"
        "r = Reaper()\n"
        f"child = subprocess.Popen([sys.executable, {str(middle)!r}], stdout=subprocess.PIPE)\n"
        "grandchild = int(child.stdout.readline())\n"
        "time.sleep(3 * POLL_S)\n"
        "print(old.pid, child.pid, grandchild, flush=True)\n"
        "time.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, script], stdout=subprocess.PIPE,
                              env=os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)})
    old, child, grandchild = map(int, parent.stdout.readline().split())
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    try:
        assert _gone([child, grandchild], 10), "a process outlived its parent by 10 s"
        assert _alive(old)
    finally:
        os.kill(old, signal.SIGKILL)


def _gone(pids: list[int], within: float) -> bool:
    end = time.monotonic() + within
    while time.monotonic() < end:
        if not [p for p in pids if _alive(p)]:
            return True
        time.sleep(0.1)
    return False


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.parametrize("executor", ["local", "ray"])
def test_kill_9_of_a_plan_leaves_no_process_behind(executor, tmp_path):
    """A plan killed with -9 while its workers run: within 10 s none of its processes (the
    local pool's workers, or the Ray cluster kvsim started) is left."""
    if executor == "ray":
        pytest.importorskip("ray")
    from kvsim.plan.reaper import descendants
    env = os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop("RAY_ADDRESS", None)
    plan = subprocess.Popen(
        [sys.executable, "-m", "kvsim.cli", "plan", "--gpu", "h100-sxm,l40s", "--model",
         "qwen3-4b", "--context", "4096,16384", "--policy", "dense-resident,dense-offload",
         "--batch", "1,4,16", "--output-len", "256", "--requests", "400", "--jobs", "2",
         "--executor", executor, "--out", tmp_path / "p"], env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        kids: dict = {}
        end = time.monotonic() + 120
        want = 3 if executor == "local" else 5  # two workers (and a resource tracker)
        while time.monotonic() < end and plan.poll() is None:
            kids = descendants(plan.pid)
            if len(kids) >= want:
                break
            time.sleep(0.5)
        assert len(kids) >= want, f"the plan started {len(kids)} processes in 120 s"
        time.sleep(2)
        kids = descendants(plan.pid)
    finally:
        plan.kill()
        plan.wait()
    assert _gone(list(kids), 10), [p for p in kids if _alive(p)]
    if executor == "ray":  # nor any started after the look (Ray names its session by its driver)
        from pathlib import Path

        from kvsim.plan.reaper import _in_sessions
        sessions = {str(s).encode() for s in Path("/tmp/ray").glob(f"session_*_{plan.pid}")}
        assert sessions and not _in_sessions(sessions)


@pytest.mark.slow
def test_a_ray_plan_that_ends_well_exits_0_and_leaves_no_process(tmp_path):
    """At a normal exit the watcher never signals the plan itself (a Ray driver holds files in
    its session), and what Ray's shutdown leaves is gone."""
    pytest.importorskip("ray")
    from pathlib import Path

    from kvsim.plan.reaper import _in_sessions
    env = os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop("RAY_ADDRESS", None)
    plan = subprocess.Popen(
        [sys.executable, "-m", "kvsim.cli", "plan", "--gpu", "h100-sxm", "--model", "qwen3-4b",
         "--context", "4096", "--policy", "dense-resident", "--batch", "1,4", "--output-len",
         "16", "--requests", "20", "--jobs", "2", "--executor", "ray", "--out", tmp_path / "p"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, err = plan.communicate(timeout=300)
    assert plan.returncode == 0, err[-500:]
    sessions = {str(s).encode() for s in Path("/tmp/ray").glob(f"session_*_{plan.pid}")}
    time.sleep(2)
    assert sessions and not _in_sessions(sessions)
