"""The engine a user runs, by name and version: every fitted family loads by its name and
aliases, vLLM's version picks its generation, and an engine or version without published
points of its own is one warning and a wider interval."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from kvsim.errors import KvsimError
from kvsim.hw import engine as E


@pytest.mark.parametrize("name, family, version", [
    ("trtllm", "trtllm", None), ("TensorRT-LLM", "trtllm", None), ("trt-llm", "trtllm", None),
    ("vllm", "vllm", None), ("vllm-v1", "vllm", None), ("vllm==0.19.1", "vllm", "0.19.1"),
    ("vllm==0.6.3", "vllm-v0", "0.6.3"), ("vllm-0.5", "vllm-v0", "0.5"),
    ("vllm@0.3.3", "vllm-0.3", "0.3.3"), ("vllm-0.3", "vllm-0.3", None),
    ("vllm-v0", "vllm-v0", None), ("turbomind", "lmdeploy", None),
    ("transformers", "hf", None), ("gpt-fast", "gpt-fast", None),
    ("sglang@0.4.6", "sglang", "0.4.6"), ("tgi", "shared", None),
    ("llama.cpp", "shared", None), ("tgi==2.4", "shared", "2.4"),
])
def test_names_and_versions_resolve_to_families(name, family, version):
    assert E.resolve(name) == (family, version)


def test_every_family_ships_with_its_versions_and_the_spread_between_families():
    for fam in (*E.FAMILIES, E.SHARED):
        eng = E.load(fam)
        assert eng.name == fam and "stand_in" not in eng.fit
        between = eng.fit["between_families"]
        assert set(between) == {"decode", "prefill", "throughput"}
        assert all(0 < s < 2 for s in between.values())
        assert (eng.fit["versions"] != []) == (fam != E.SHARED)


def test_a_fitted_version_stands_as_itself_and_another_is_said():
    assert "stand_in" not in E.load("trtllm==0.9.0").fit  # 0.9 has points
    eng = E.load("trtllm==0.19")
    assert eng.name == "trtllm==0.19"
    assert "trtllm 0.19 has no published points of its own" in eng.fit["stand_in"]
    assert "0.9" in eng.fit["stand_in"]  # names the versions that have points


def test_an_unknown_engine_is_the_shared_fit_said_once_with_a_wider_interval():
    def run(engine):
        out = subprocess.run(
            [sys.executable, "-m", "kvsim.cli", "replay", "--policy", "dense-resident",
             "--gpu", "h200", "--model", "llama-3.1-8b", "--context", "2048", "--batch", "4",
             "--requests", "4", "--engine", engine, "--json"],
            capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout), out.stderr

    shared, _ = run("shared")
    tgi, err = run("tgi")
    assert tgi["tpot_ms"] == pytest.approx(shared["tpot_ms"], rel=1e-9)  # the same central value
    said = [w for w in tgi["warnings"] if "engine tgi has no published points" in w]
    assert len(said) == 1 and "widened by the spread between engine families" in said[0]
    assert not any("no published points" in w for w in shared["warnings"])
    between = E.load("shared").fit["between_families"]["decode"]
    width = math.log(tgi["tpot_ms_hi"] / tgi["tpot_ms"])
    assert width == pytest.approx(math.log(shared["tpot_ms_hi"] / shared["tpot_ms"]) + between,
                                  rel=1e-6)


def test_names_that_are_files_stay_files():
    with pytest.raises(KvsimError, match="no such file"):
        E.load("nosuch.json")
    with pytest.raises(KvsimError, match="no such file"):
        E.load("engines/vllm")


def test_an_nvidia_only_family_is_refused_on_amd():
    from kvsim.hw.costs import costs_for
    with pytest.raises(KvsimError, match="lmdeploy runs on nvidia GPUs only"):
        costs_for("mi300x", None, "lmdeploy")
    with pytest.raises(KvsimError, match="trtllm runs on nvidia GPUs only"):
        costs_for("mi300x", None, "tensorrt-llm")
    costs_for("mi300x", None, "gpt-fast")  # PyTorch runs on ROCm


def test_a_plan_with_an_unknown_engine_says_so_once(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "kvsim.cli", "plan", "--engine", "tgi", "--gpu", "h100-sxm",
         "--model", "llama-3.1-8b", "--context", "4096", "--output-len", "64", "--policy",
         "dense-resident", "--batch", "8", "--tp", "1", "--out", str(tmp_path / "p"),
         "--jobs", "1"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("engine tgi has no published points of its own") == 1
