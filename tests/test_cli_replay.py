"""`kvsim replay` from the command line: JSON keys, and one-line errors with exit status 2."""

import json

import numpy as np
import pytest
from conftest import run_cli

KEYS = ["policy", "gpu", "model", "context", "batch", "tpot_ms", "throughput_tok_s", "ttft_ms",
        "e2e_s", "hbm_gib", "host_gib", "link_util", "kv_read_frac", "provenance"]


def test_json_has_the_interface_keys(attn_trace):
    code, out, err = run_cli("replay", attn_trace, "--policy", "dense-offload", "--gpu",
                             "h100-sxm", "--model", "qwen3-4b", "--context", 32768, "--batch", 1,
                             "--json")
    assert code == 0, err
    r = json.loads(out)
    assert all(k in r for k in KEYS)
    assert r["policy"] == "dense-offload" and r["gpu"] == "h100-sxm" and r["context"] == 32768
    assert "catalog h100-sxm" in r["provenance"]["hw.gpu"]


def test_human_output_is_a_table(attn_trace):
    code, out, _ = run_cli("replay", attn_trace, "--policy", "dense-resident", "--context", 4096)
    assert code == 0
    header = out.splitlines()[1]
    assert header.split()[0] == "tpot_ms" and "provenance" in out


@pytest.mark.parametrize("args, message", [
    (["--policy", "nope"], "unknown policy 'nope'"),
    (["--policy", "verkv:eps=abc"], "expected float"),
    (["--policy", "dense,verkv"], "replay runs one policy"),
    (["--gpu", "b999"], "unknown GPU"),
    (["--model", "gpt-9"], "unknown model"),
    (["--context", "0"], "--context must be positive"),
    (["--batch", "-3"], "--batch: must be a whole number >= 0, got -3"),
    (["--qps", "0"], "--qps must be a rate in [1e-06"),
    (["--qps", "nan"], "--qps: must be finite, got nan"),
    (["--host-gib", "nan"], "--host-gib: must be finite, got nan"),
    (["--requests", "0"], "--requests must be positive"),
    (["--concurrency", "0"], "--concurrency must be positive"),
    (["--gpu", ""], "--gpu is empty"),
    (["--jobs", "0"], "--jobs must be a whole number >= 1"),
    (["--batch", "1000000000"], "beyond what kvsim simulates"),
    (["--qps", "1", "--concurrency", "2"], "not allowed with"),
    (["--policy", "dense-resident", "--gpu", "a100-40gb", "--context", "300000"], "infeasible"),
    (["--workload", "/nonexistent.csv"], "cannot read"),
])
def test_bad_arguments_one_line_exit_2(attn_trace, args, message):
    code, out, err = run_cli("replay", attn_trace, *args)
    assert code == 2
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert out == ""


def test_bad_trace_files_one_line_exit_2(attn_trace, tmp_path):
    cut = tmp_path / "cut.npz"
    cut.write_bytes(attn_trace.read_bytes()[:300])
    nan = tmp_path / "nan.npz"
    with np.load(attn_trace) as z:
        arrays = {k: z[k] for k in z.files}
    arrays["attn/L0/v"] = arrays["attn/L0/v"].copy()
    arrays["attn/L0/v"][0, 0, 0] = np.inf
    np.savez(nan, **arrays)
    foreign = tmp_path / "foreign.npz"
    np.savez(foreign, weights=np.ones(4))
    for path, message in ((cut, "not a readable"), (nan, "NaN or Inf"),
                          (foreign, "not a kvsim trace"), (tmp_path / "none.npz", "no such")):
        code, out, err = run_cli("replay", path, "--policy", "dense-resident")
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_help_teaches():
    code, out, _ = run_cli("replay", "--help")
    assert code == 0 and "examples:" in out and "provenance" in out
    assert "'kvsim policies" in out  # where each policy explains itself


def test_flags_of_other_policies_are_ignored_with_a_warning(attn_trace):
    code, out, err = run_cli("replay", attn_trace, "--policy", "dense-offload", "--context", 4096,
                             "--eps", "0.1", "--delta", "0.2", "--json")
    assert code == 0
    r = json.loads(out)
    assert "--delta, --eps ignored: not options of dense-offload" in r["warnings"][0]
    assert "ignored" in err and r["policy_options"] == {}


def test_verkv_json_has_the_sketch_and_per_layer_violation_keys(attn_trace):
    """Issue 14's interface keys on a trace: violation_rate with its worst layer (the
    per-layer rates behind it), question_kv_read_frac and the sketch's bytes per token."""
    code, out, err = run_cli("replay", attn_trace, "--policy", "verkv", "--sink", "1",
                             "--local", "1", "--compression", "4", "--json")
    assert code == 0, err
    r = json.loads(out)
    by_layer = r["policy_stats"]["violation_rate_by_layer"]
    assert set(by_layer) == {"0", "3"}
    assert r["violation_rate_max_layer"] == max(by_layer.values()) >= r["violation_rate"]
    assert 0 <= r["question_kv_read_frac"] <= 1
    from kvsim.policies.verkv.sketch import sketch_bytes
    assert r["sketch_bytes_per_token"] == pytest.approx(sketch_bytes(56, 16) / 56)


@pytest.mark.parametrize("policy", ["verkv", "topk", "poissoncomp"])
def test_no_sizes_given_takes_the_profiles_sizes(policy):
    """`kvsim replay --policy P` with no sink or local runs on the shipped profile with the
    sizes it was measured with, says so, and equals the run that gives them."""
    code, out, err = run_cli("replay", "--policy", policy, "--json")
    assert code == 0, err
    bare = json.loads(out)
    code, out, err = run_cli("replay", "--policy", policy, "--sink", 4, "--local", 4, "--json")
    sized = json.loads(out)
    for key in ("tpot_ms", "kv_read_frac", "throughput_tok_s", "violation_rate"):
        assert bare.get(key) == sized.get(key), key
    assert bare["policy_options"]["sink"] == 4 and bare["policy_options"]["local"] == 4
    assert any("sizes the policy profile was measured with" in w for w in bare["warnings"])
    assert "policy profile" in bare["provenance"]["policy"]
