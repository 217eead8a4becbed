"""Timelines: valid Chrome-trace JSON, no overlap on one resource, steps as long as the engine's,
for every registered policy; and the layer-pipeline rule both use against an event-driven
simpy model of the same pipeline."""

import json

import numpy as np
import pytest
from conftest import replay_json, run_cli

from kvsim.policies import load_all
from kvsim.policies.registry import deciding

FETCHING = deciding()  # those with a decide kernel: a decide span in every layer


@pytest.mark.parametrize("policy", ["dense-offload", "dense-resident"])
def test_timeline_is_valid_and_resources_never_overlap(attn_trace, tmp_path, policy):
    out = tmp_path / "tl.json"
    r = replay_json(trace=attn_trace, policy=policy, gpu="h100-sxm", model="qwen3-4b",
                    context=8192, batch=4, output_len=6, timeline=out,
                    timeline_steps=5, scheduler="prefill-first")
    d = json.loads(out.read_text())
    ev = [e for e in d["traceEvents"] if e["ph"] == "X"]
    assert d["otherData"]["decode_steps"] == 5
    for tid in {e["tid"] for e in ev}:
        spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in ev if e["tid"] == tid)
        starts, ends = np.array([s for s, _ in spans]), np.array([e for _, e in spans])
        assert (starts[1:] >= ends[:-1] - 1e-6).all(), f"overlap on tid {tid}"
    # the five decode steps (all of them: output 6), layer by layer, as long as the engine says
    end = max(e["ts"] + e["dur"] for e in ev)  # the last step's LM head or engine overhead
    prefill = [e for e in ev if e["name"].startswith("prefill")][0]
    step_ms = (end - prefill["ts"] - prefill["dur"]) / 1e3 / 5
    assert step_ms == pytest.approx(r["tpot_ms"], rel=1e-6)
    names = {e["name"] for e in ev}
    # overlapped copies on the bare hardware; the default engine (vLLM's) fetches serially
    assert bool(names & {"L0 KV copy", "L0 fetch"}) == (policy == "dense-offload")


def test_timeline_refuses_to_overwrite(attn_trace, tmp_path):
    out = tmp_path / "tl.json"
    out.write_text("keep")
    code, _, err = run_cli("replay", attn_trace, "--context", 4096, "--timeline", out)
    assert code == 2 and "exists" in err and out.read_text() == "keep"


# -------------------------------------------- the pipeline rule against an event-driven model

def _simpy_step(c: float, d: float, x: float, L: int, overlap: bool):
    """The layer pipeline of one step as a simpy simulation: a GPU stream and a copy engine that
    really serialise work, two staging buffers (a Container of 2) for the overlapped case.
    Returns (link starts, compute starts, end)."""
    import simpy
    env = simpy.Environment()
    gpu, link = simpy.Resource(env, 1), simpy.Resource(env, 1)
    slots = simpy.Container(env, capacity=2, init=2)
    copied = [env.event() for _ in range(L)]
    computed = [env.event() for _ in range(L)]
    link_at, comp_at = [0.0] * L, [0.0] * L

    def copier():  # layer after layer: a free buffer, then the link
        for l in range(L):
            yield slots.get(1)
            with link.request() as r:
                yield r
                link_at[l] = env.now
                yield env.timeout(x)
            copied[l].succeed()

    def computer():  # overlapped, a layer's decide runs on the GPU with its compute
        for l in range(L):
            yield copied[l]
            with gpu.request() as r:
                yield r
                comp_at[l] = env.now
                yield env.timeout(d + c)
            yield slots.put(1)  # layer l is done with its buffer
            computed[l].succeed()

    def serial():
        for l in range(L):
            with gpu.request() as r:
                yield r
                yield env.timeout(d)
            with link.request() as r:
                yield r
                link_at[l] = env.now
                yield env.timeout(x)
            with gpu.request() as r:
                yield r
                comp_at[l] = env.now
                yield env.timeout(c)

    if overlap:
        env.process(copier())
        done = env.process(computer())
    else:
        done = env.process(serial())
    env.run(until=done)
    return np.array(link_at), np.array(comp_at), env.now


@pytest.mark.parametrize("overlap", [True, False])
def test_pipeline_closed_form_equals_an_event_driven_simulation(overlap):
    from kvsim.sim.pipeline import layer_starts, step_time
    rng = np.random.default_rng(3)
    for _ in range(40):
        c, d, x = rng.uniform(0.1, 2.0, 3)
        L = int(rng.integers(1, 40))
        link_at, comp_at, end = _simpy_step(c, d, x, L, overlap)
        got_link, got_comp = layer_starts(c, d, x, L, overlap)
        np.testing.assert_allclose(got_comp, comp_at, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(got_link, link_at, rtol=1e-12, atol=1e-12)
        assert float(step_time(c, d, x, L, overlap)) == pytest.approx(end, rel=1e-12)


FIT = {"sink": 4, "local": 4, "r_min": 2, "window": 16, "obs_window": 16, "compression": 4.0}


@pytest.fixture(scope="module")
def synthetic_path(tmp_path_factory):
    from kvsim import trace as T
    from kvsim.model.synthetic import synthetic_attention_trace
    path = tmp_path_factory.mktemp("tl") / "syn.npz"
    T.save(synthetic_attention_trace(n_layers=1, n_q=4, n_kv=2, d=32, context=512, question=8,
                                     decode=2, seed=0), path)
    return path


@pytest.mark.parametrize("policy", sorted(load_all()))
def test_every_policy_timeline_matches_the_engine(synthetic_path, tmp_path, policy, monkeypatch):
    import dataclasses

    from kvsim.measure import harness
    monkeypatch.setattr(harness, "TIMING_REPEATS", 1)
    taken = {f.name for f in dataclasses.fields(load_all()[policy].Params)}
    out = tmp_path / "tl.json"
    r = replay_json(trace=synthetic_path, policy=policy,
                    policy_options={k: v for k, v in FIT.items() if k in taken},
                    gpu="h100-sxm", model="qwen3-4b", context=8192, batch=2,
                    output_len=4, timeline=out, timeline_steps=3,
                    scheduler="prefill-first")
    ev = [e for e in json.loads(out.read_text())["traceEvents"] if e["ph"] == "X"]
    for tid in {e["tid"] for e in ev}:
        spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in ev if e["tid"] == tid)
        assert all(b[0] >= a[1] - 1e-6 for a, b in zip(spans, spans[1:])), policy
    end = max(e["ts"] + e["dur"] for e in ev)  # the last step's LM head or engine overhead
    prefill = [e for e in ev if e["name"].startswith("prefill")][0]
    step_ms = (end - prefill["ts"] - prefill["dur"]) / 1e3 / 3
    assert step_ms == pytest.approx(r["tpot_ms"], rel=1e-6)
    assert any(e["name"].endswith("decide") for e in ev) == (policy in FETCHING)
    assert r["policy_cost"]["decide_kernel"] == (policy if policy in FETCHING else "")


def test_chunked_prefill_timeline_shows_mixed_steps_without_overlap(attn_trace, tmp_path):
    out = tmp_path / "tl.json"
    replay_json(trace=attn_trace, policy="dense-offload", gpu="h100-sxm",
                model="qwen3-4b", context=8192, batch=4, output_len=8, timeline=out,
                timeline_steps=12, max_batched_tokens=2048)
    ev = [e for e in json.loads(out.read_text())["traceEvents"] if e["ph"] == "X"]
    for tid in {e["tid"] for e in ev}:
        spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in ev if e["tid"] == tid)
        assert all(b[0] >= a[1] - 1e-6 for a, b in zip(spans, spans[1:])), tid
    assert any(e["name"].startswith("step: ") and "prefill tokens" in e["name"] for e in ev)


def test_an_eager_engines_steps_wait_for_its_host_launches(attn_trace, tmp_path):
    """An engine that launches eagerly at 400 us a layer: Qwen3-4B's decode layers take less
    on an H100, so each step waits for its launches, shown as such, and the steps are as
    long as the engine says (the layers' launches plus the per-step overhead)."""
    from kvsim.hw.engine import ROOFLINE
    eng = tmp_path / "eager.json"
    ROOFLINE.with_fields(launch="eager", launch_overhead_us=400.0,
                         step_overhead_ms=0.5).save(eng)
    out = tmp_path / "tl.json"
    r = replay_json(trace=attn_trace, policy="dense-resident", gpu="h100-sxm", model="qwen3-4b",
                    context=8192, batch=2, output_len=4, timeline=out, timeline_steps=3,
                    scheduler="prefill-first", engine=str(eng))
    ev = [e for e in json.loads(out.read_text())["traceEvents"] if e["ph"] == "X"]
    waits = [e for e in ev if e["name"] == "waiting for host launches"]
    assert len(waits) == 3
    assert r["tpot_ms"] == pytest.approx(36 * 0.4 + 0.5, rel=1e-9)  # 36 layers x 400 us
    end = max(e["ts"] + e["dur"] for e in ev)
    prefill = [e for e in ev if e["name"].startswith("prefill")][0]
    assert (end - prefill["ts"] - prefill["dur"]) / 1e3 / 3 == pytest.approx(r["tpot_ms"],
                                                                              rel=1e-6)
