"""The base install (no torch, no model packages) plans: the catalog, replay on the shipped
policy profile; a command that needs torch says so in one line, with the install command, exit 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCK = """
import sys
class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('torch', 'transformers'):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, _NoTorch())
from kvsim.cli import main
rc = main(sys.argv[1:])
assert 'torch' not in sys.modules
sys.exit(rc)
"""


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK, *argv], capture_output=True, text=True,
                          cwd=ROOT, timeout=1800, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_catalog_and_profile_replay_without_torch():
    assert _run("catalog").returncode == 0
    r = _run("replay", "--policy", "verkv", "--sink", "4", "--local", "4", "--gpu", "h100-sxm",
             "--model", "qwen3-4b", "--context", "32768", "--json")
    assert r.returncode == 0, r.stderr
    assert '"tpot_ms"' in r.stdout
    for dense in ("dense-resident", "dense-offload"):  # exact by definition: no tensors
        r = _run("replay", "--policy", dense, "--gpu", "h100-sxm", "--model", "qwen3-4b",
                 "--context", "32768", "--json")
        assert r.returncode == 0, r.stderr


def test_a_command_that_needs_torch_says_so_in_one_line():
    r = _run("replay", "traces/smollm2-mk-2k.npz", "--policy", "verkv", "--sink", "4",
             "--local", "4")
    assert r.returncode == 2
    last = r.stderr.strip().splitlines()[-1]
    assert "needs torch" in last and 'pip install torch==2.13.0 -e ".[model]"' in last
    assert "Traceback" not in r.stderr


def test_eval_help_and_a_bad_eval_option_need_no_torch():
    """`kvsim eval --help` builds its parser without torch or transformers, and a bad policy
    option is refused (one line, exit 2) before either is needed."""
    r = _run("eval", "--help")
    assert r.returncode == 0 and "--policy" in r.stdout, r.stderr
    r = _run("eval", "--policy", "verkv:sketch=nope", "--sink", "4")
    assert r.returncode == 2 and "needs torch" not in r.stderr
    assert r.stderr.strip().splitlines() == ["kvsim eval: error: --sketch must be one of 2bit, "
                                             "bounded, perfect; got 'nope'"]


def test_policies_lists_every_policy_without_torch():
    r = _run("policies", "verkv")
    assert r.returncode == 0 and "sketch" in r.stdout, r.stderr
