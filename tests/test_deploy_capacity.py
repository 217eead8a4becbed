"""The SLO search's answer is a rate a long replay sustains within the SLO, and 10% more is not.

For each kind of policy (the cache in HBM, streamed from host memory, fetched per decision) at a
TPOT limit that binds, a 2,000-request replay at ``slo_max_qps`` serves at least 95% of its
arrivals over the measured window, at a served rate of at least 0.9x the answer, with p99 TPOT
within the limit; the same replay at 1.1x the answer fails the SLO check."""

import pytest

from kvsim.plan import slo
from kvsim.plan.executors import LocalExecutor
from kvsim.plan.sweep import SweepSpec, sweep
from kvsim.replay import configure, run_replay


def _replay(policy: str, qps: float, tpot: float):
    return run_replay(configure(policy=policy, gpu="h100-sxm", model="qwen3-4b",
                             context=8192, batch=16, qps=qps, requests=2000,
                             slo={"tpot_ms": tpot}))


@pytest.mark.parametrize("policy,tpot_ms", [
    ("dense-resident", 15), ("dense-offload", 200),
    pytest.param("verkv", 200, marks=pytest.mark.slow)])  # verkv: three replays a rate, ~40 s
def test_the_answer_is_sustained_and_ten_percent_more_is_not(policy, tpot_ms):
    limits = [slo.Limit("tpot_ms", tpot_ms)]
    spec = SweepSpec(gpus=["h100-sxm"], models=["qwen3-4b"], contexts=[8192],
                     policies=[policy], batches=[16], slo=limits)
    row = sweep(spec, LocalExecutor(1), progress=False).iloc[0]
    q = row.slo_max_qps
    assert q > 0 and row.slo_qps_fails / q <= 1.02 + 1e-9
    assert "TPOT" in row.slo_fails_because  # the limit binds, not the queue
    at = _replay(policy, q, tpot_ms)
    s = at.serving
    assert s.served_frac_window >= 0.95 and s.requests_per_s >= 0.9 * q
    assert slo.check(at, limits)[0]
    assert not slo.check(_replay(policy, 1.1 * q, tpot_ms), limits)[0]


def test_a_queue_too_slow_to_show_in_a_short_run_fails_the_search():
    """Without a limit that binds first the queue does: the answer is sustained on 2,000
    requests, where the short probes' old answer (5.35 req/s) served 84%."""
    spec = SweepSpec(gpus=["h100-sxm"], models=["qwen3-4b"], contexts=[8192],
                     policies=["dense-resident"], batches=[16], slo=[slo.Limit("tpot_ms", 50)])
    q = sweep(spec, LocalExecutor(1), progress=False).iloc[0].slo_max_qps
    assert q < 5.0
    s = _replay("dense-resident", q, 50).serving
    assert s.served_frac_window >= 0.95 and s.requests_per_s >= 0.9 * q
    over = _replay("dense-resident", 1.1 * q, 50)
    assert not slo.sustained(over)[0]
    assert not slo.sustained(_replay("dense-resident", 5.35, 50))[0]
