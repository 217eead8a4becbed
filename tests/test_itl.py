"""Inter-token latency (ITL): every decode token's gap to its sequence's previous token, prefill
stalls included, as vLLM's and SGLang's benchmarks report it beside TPOT."""

import math

import numpy as np
import pytest
from conftest import replay_json

from kvsim.sim import metrics
from kvsim.sim.metrics import Gaps


def _brute(values, weights):
    return np.repeat(np.asarray(values, float), np.asarray(weights, int))


@pytest.mark.parametrize("u,v,k,tokens", [(0.010, 0.0, 50, 3), (0.010, 1e-5, 2000, 7),
                                          (0.020, 4e-4, 300, 1), (1e-3, 2e-3, 64, 16)])
def test_a_linear_run_is_counted_as_its_steps_one_by_one(u, v, k, tokens):
    """add_linear (closed form, bucket by bucket) against each step added alone, and both
    against numpy's percentiles of every gap: within the sketch's relative error."""
    fast, slow = Gaps(), Gaps()
    fast.add_linear(u, v, k, tokens)
    steps = u + v * np.arange(k)
    slow.add_steps(steps, tokens)
    every = _brute(steps, [tokens] * k)
    assert fast.n == slow.n == len(every)
    assert fast.mean() == pytest.approx(every.mean(), rel=1e-12)
    assert np.allclose(fast.buckets, slow.buckets)  # the same bucket for every step
    for q in (1, 50, 90, 99, 100):
        assert fast.percentile(q) == pytest.approx(np.percentile(every, q),
                                                   rel=2 * metrics.REL_ERR)


def test_gaps_merge_and_add_as_their_parts():
    a, b, both = Gaps(), Gaps(), Gaps()
    rng = np.random.default_rng(0)
    x, w = rng.uniform(0.005, 0.5, 200), rng.integers(1, 9, 200)
    a.add_steps(x[:120], w[:120])
    b.add_steps(x[120:], w[120:])
    both.add_steps(x, w)
    a.merge(b)
    assert a.n == both.n and a.total == pytest.approx(both.total)
    assert a.percentile(99) == both.percentile(99)
    assert math.isnan(Gaps().percentile(50)) and math.isnan(Gaps().mean())


@pytest.mark.parametrize("scheduler", ["chunked", "prefill-first"])
@pytest.mark.parametrize("load", [dict(concurrency=1, requests=2),
                                  dict(qps=3.0, requests=60), dict(concurrency=6, requests=24)])
def test_the_gaps_of_every_token_add_up_to_each_request_s_decode_time(scheduler, load):
    """Conservation: a sequence's gaps telescope to its last token's time minus its first's, so
    over a run the gaps' count is the decode tokens (output - 1 per request) and their sum
    is the requests' e2e - TTFT summed: ITL's mean x count = TPOT's mean x count, exactly,
    whatever the scheduler (prefill-first's waits are carried into the next gap)."""
    r = replay_json(policy="dense-resident", gpu="h100-sxm", model="qwen3-4b", context=8192,
                    output_len=64, batch=4, max_batched_tokens=2048, scheduler=scheduler,
                    **load)
    s = r["sim"]
    tokens = s["requests"] * 63
    assert s["itl_ms"] == pytest.approx(s["tpot_ms"], rel=1e-9)  # every request: 63 gaps
    assert s["itl_p50_ms"] <= s["itl_p90_ms"] <= s["itl_p99_ms"]
    assert tokens > 0


def test_a_long_prefill_chunk_stalls_the_decodes_beside_it():
    """Chunked prefill of 100K-token prompts with 8,192-token chunks: the decodes that share a
    step with a chunk wait for it, so ITL's p99 is many times its p50 while TPOT (each
    request's mean gap) hides it, as the issue measured (~0.45 s)."""
    r = replay_json(policy="dense-resident", gpu="h100-sxm", model="qwen3-4b", context=100_000,
                    output_len=256, batch=16, qps=0.3, requests=40)
    s = r["sim"]
    assert s["itl_p99_ms"] > 5 * s["itl_p50_ms"]
    assert s["itl_p99_ms"] > s["tpot_p99_ms"]
