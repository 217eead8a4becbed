"""A plan's DIR holds one plan: the same plan resumes or extends its axes there, a plan with
other settings is refused in one line (exit 2) unless --force replaces it; long work off a
terminal says how far it got."""

import pandas as pd
from conftest import run_cli

from kvsim.plan import executors
from kvsim.plan.executors import LocalExecutor, run_all


def _plan(out, *extra):
    return run_cli("plan", "--gpu", "h100-sxm", "--model", "qwen3-4b", "--context", "4096",
                   "--policy", "dense-resident", "--output-len", "16", "--requests", "16",
                   "--slo-requests", "50", "--out", out, "--json", *extra)


def test_a_different_plan_is_refused_unless_forced_and_the_same_plan_extends(tmp_path):
    out = tmp_path / "plan"
    code, _, err = _plan(out, "--batch", "4", "--slo-tpot-ms", "50")
    assert code == 0, err
    before = (out / "results.csv").read_bytes()
    code, _, err = _plan(out, "--batch", "8", "--slo-tpot-ms", "30")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "holds a different plan" in err and "p99 TPOT <= 50 ms" in err and "--force" in err
    assert (out / "results.csv").read_bytes() == before
    code, _, err = _plan(out, "--batch", "4,8", "--slo-tpot-ms", "50")  # the same plan, extended
    assert code == 0, err
    assert sorted(pd.read_csv(out / "results.csv").batch) == [4, 8]
    code, _, err = _plan(out, "--batch", "8", "--slo-tpot-ms", "30", "--force")
    assert code == 0, err
    df = pd.read_csv(out / "results.csv")
    assert list(df.batch) == [8]  # replaced, not merged


def test_progress_off_a_terminal_is_a_plain_line_now_and_then(monkeypatch, capsys):
    monkeypatch.setattr(executors, "PROGRESS_EVERY_S", 0.0)
    assert run_all(LocalExecutor(1), abs, [-1, -2, -3], progress=True, desc="plan") == [1, 2, 3]
    lines = capsys.readouterr().err.splitlines()
    assert "kvsim plan: 3/3 tasks done, 0 s, about 0 s left" in lines
    assert run_all(LocalExecutor(1), abs, [-1], progress=False) == [1]
    assert capsys.readouterr().err == ""
