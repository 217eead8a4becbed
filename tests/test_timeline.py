"""Timelines: valid Chrome-trace JSON, no overlap on one resource, steps as long as the engine's."""

import json

import numpy as np
import pytest

from conftest import run_cli
from kvsim.replay import ReplayConfig, run_replay


@pytest.mark.parametrize("policy", ["dense-offload", "dense-resident"])
def test_timeline_is_valid_and_resources_never_overlap(attn_trace, tmp_path, policy):
    out = tmp_path / "tl.json"
    r = run_replay(ReplayConfig(trace=attn_trace, policy=policy, gpu="h100-sxm", model="qwen3-4b",
                                context=8192, batch=4, output_len=6, timeline=out,
                                timeline_steps=5))
    d = json.loads(out.read_text())
    ev = [e for e in d["traceEvents"] if e["ph"] == "X"]
    assert d["otherData"]["decode_steps"] == 5
    for tid in {e["tid"] for e in ev}:
        spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in ev if e["tid"] == tid)
        starts, ends = np.array([s for s, _ in spans]), np.array([e for _, e in spans])
        assert (starts[1:] >= ends[:-1] - 1e-6).all(), f"overlap on tid {tid}"
    # the five decode steps (all of them: output 6), layer by layer, as long as the engine says
    heads = [e for e in ev if e["name"] == "LM head"]
    prefill = [e for e in ev if e["name"].startswith("prefill")][0]
    step_ms = (heads[-1]["ts"] + heads[-1]["dur"] - prefill["ts"] - prefill["dur"]) / 1e3 / 5
    assert step_ms == pytest.approx(r["tpot_ms"], rel=1e-6)
    names = {e["name"] for e in ev}
    assert ("L0 KV copy" in names) == (policy == "dense-offload")


def test_timeline_refuses_to_overwrite(attn_trace, tmp_path):
    out = tmp_path / "tl.json"
    out.write_text("keep")
    code, _, err = run_cli("replay", attn_trace, "--context", 4096, "--timeline", out)
    assert code == 2 and "exists" in err and out.read_text() == "keep"
