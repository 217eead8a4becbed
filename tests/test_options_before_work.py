"""Every command checks its options before it loads a model, torch or a trace: a bad option is
one line, exit 2, and the loader is never called (here it fails loudly if it is)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import run_cli

MEASURED = Path(__file__).resolve().parents[1] / "data" / "verkv-paper-h100.csv"


@pytest.fixture
def no_loading(monkeypatch):
    """Make loading SmolLM2 (or any model) an error that no command may reach."""
    import kvsim.model
    import kvsim.model.loading

    def loader(*a, **k):
        raise AssertionError("the model loader was called before the options were checked")
    monkeypatch.setattr(kvsim.model, "load_model", loader)
    monkeypatch.setattr(kvsim.model.loading, "load_model", loader)


def _one_line(code: int, out: str, err: str) -> str:
    assert code == 2, err
    assert out == "" and "Traceback" not in err and "AssertionError" not in err
    (line,) = err.strip().splitlines()
    return line


@pytest.mark.parametrize("argv,said", [
    (["--policy", "verkv:sketch=nope"], "--sketch must be one of 2bit, bounded, perfect"),
    (["--policy", "dense,verkv:no_such=1"], "policy verkv has no option 'no_such'"),
    (["--policy", "quest:token_budget=lots"], "quest:token_budget=lots: expected int"),
    (["--policy", "verkv", "--sketch", "perfect"], "write --policy verkv:sketch=perfect;"),
    (["--policy", "verkv", "--eps", "0"], "--eps must be > 0"),
    (["--policy", "streamingllm", "--delta", "0.1"], "--delta applies to none"),
    (["--policy", "no-such-policy"], "unknown policy 'no-such-policy'"),
    (["--policy", "dense", "--context", "0"], "--context must be positive"),
    (["--policy", "dense", "--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
    (["--policy", "dense", "--model", "/nowhere/model"], "nothing is downloaded"),
    (["--policy", "dense", "--prompts", "/nowhere/p.jsonl"], "no such prompts file"),
])
def test_eval_refuses_a_bad_option_without_loading_the_model(no_loading, argv, said):
    line = _one_line(*run_cli("eval", *argv))
    assert line.startswith("kvsim eval: error: ") and said in line


def test_capture_refuses_bad_options_without_loading_the_model(no_loading, tmp_path):
    out = tmp_path / "t.npz"
    for argv, said in ((["--layers", "0,x"], "--layers '0,x'"),
                       (["--model", "/nowhere/model"], "nothing is downloaded"),
                       (["--prompts", "/nowhere/p.jsonl"], "no such prompts file"),
                       (["--lengths", "1024,2048", "--layers", "0,1",
                         "--layer-weights", "1,2,3"], "3 weights for 2 layers"),
                       (["--lengths", "1024,2048", "--prompts", "p.jsonl"], "does not apply")):
        line = _one_line(*run_cli("capture", "--out", out, *argv))
        assert said in line, line


def test_other_commands_refuse_bad_files_before_their_work(tmp_path):
    line = _one_line(*run_cli("calibrate", "--traces", tmp_path / "none.npz", "--out",
                              tmp_path / "b.txt"))
    assert "a basis file must end in .npz" in line
    line = _one_line(*run_cli("calibrate", "--traces", tmp_path / "none.npz", "--out",
                              tmp_path / "b.npz"))
    assert "none.npz: no such trace file" in line
    line = _one_line(*run_cli("profile", "--device", "cpu", "--model", "no-such-model",
                              "--out", tmp_path / "p.npz"))
    assert "no-such-model" in line
    line = _one_line(*run_cli("validate", "--device", "cpu", "--profile", tmp_path / "none.npz"))
    assert "no such profile" in line
    line = _one_line(*run_cli("validate", "--device", "cpu", "--steps", "0"))
    assert "--steps must be positive" in line
    line = _one_line(*run_cli("fit", MEASURED, "--out", tmp_path / "e.json",
                              "--fix", "step_overhead_ms=abc"))
    assert "--fix step_overhead_ms" in line
    line = _one_line(*run_cli("fit", MEASURED, "--out", tmp_path / "e.json",
                              "--trace", tmp_path / "none.npz"))
    assert "none.npz: no such trace file" in line
    line = _one_line(*run_cli("policy-profile", tmp_path / "none.npz", "--policy", "verkv",
                              "--out", tmp_path / "p.json"))
    assert "no such capture set" in line


def test_eval_help_loads_no_torch_and_no_transformers():
    import subprocess
    import sys
    code = ("import sys; from kvsim.cli import main\n"
            "try:\n    main(['eval', '--help'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in ('torch', 'transformers', 'kvsim.policies.verkv') "
            "if m in sys.modules), file=sys.stderr)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       timeout=600)
    assert p.stderr.strip() == "[]" and "--policy" in p.stdout and "kvsim policies" in p.stdout
