"""Long workloads in bounded memory: streaming request metrics (exact, then a sketch within its
stated error), per-request state only while a request is in the system, and the closed-form
decode runs that keep the simulator fast, each against an independent computation."""

import numpy as np
import pytest

from kvsim.contract import DecodeCost
from kvsim.hw import catalog
from kvsim.hw.costs import costs_for
from kvsim.hw.engine import ROOFLINE
from kvsim.sim import metrics
from kvsim.sim.engine import Memory, Simulator
from kvsim.sim.metrics import Quantiles, Requests
from kvsim.sim.steps import StepCosts
from kvsim.sim.workload import poisson

QS = (0, 1, 10, 50, 90, 99, 99.9, 100)


def sample(n, seed):
    """Latency-like values: lognormal over six decades, with exact zeros among them."""
    rng = np.random.default_rng(seed)
    v = np.exp(rng.normal(-3.0, 2.0, n))
    v[rng.random(n) < 0.03] = 0.0
    return v


def feed(q, v, seed):
    """Into ``q`` in pieces of random sizes and one at a time, as a run completes requests."""
    rng, i = np.random.default_rng(seed), 0
    while i < len(v):
        m = int(rng.integers(1, 40))
        if m == 1:
            q.add_one(float(v[i]))
        else:
            q.add(v[i:i + m])
        i += m


def test_percentiles_are_numpys_while_exact_then_within_the_stated_error():
    small = sample(metrics.EXACT, 0)  # exactly as many as are kept
    q = Quantiles()
    feed(q, small, 1)
    assert q.exact and q.method() == "exact"
    for p in QS:
        assert q.percentile(p) == np.percentile(small, p)
    big = sample(3 * metrics.EXACT + 17, 2)
    q = Quantiles()
    feed(q, big, 3)
    assert not q.exact and "0.5%" in q.method()
    assert q.n == len(big) and q.mean() == pytest.approx(big.mean(), rel=1e-12)
    for p in QS:
        exact = np.percentile(big, p)
        assert abs(q.percentile(p) - exact) <= metrics.REL_ERR * exact + 1e-300, p
    # the bound is tight enough to mean something: buckets answer with their midpoint, not edge
    errs = [abs(q.percentile(p) - np.percentile(big, p)) / np.percentile(big, p)
            for p in np.linspace(5, 95, 91)]
    assert 0.3 * metrics.REL_ERR < max(errs) <= metrics.REL_ERR


def test_merged_sketches_are_the_sketch_of_all_values():
    a, b = sample(2 * metrics.EXACT, 4), sample(1000, 5)
    qa, qb, qall = Quantiles(), Quantiles(), Quantiles()
    qa.add(a)
    qb.add(b)
    qall.add(np.concatenate([a, b]))
    qa.merge(qb)
    assert qa.n == qall.n and qa.total == pytest.approx(qall.total, rel=1e-12)
    for p in QS:
        assert qa.percentile(p) == qall.percentile(p)
    small = Quantiles()  # two exact halves stay exact
    small.add(b[:500])
    other = Quantiles()
    other.add(b[500:])
    small.merge(other)
    assert small.exact and small.percentile(99) == np.percentile(b, 99)


def _synthetic_requests(seed: int, n: int, max_output: int, per_token: float):
    """The generator, then the arrival, admission and first-token times, output lengths and
    finish times of ``n`` requests arriving over 100 s."""
    rng = np.random.default_rng(seed)
    arrival = np.sort(rng.uniform(0, 100, n))
    admitted = arrival + rng.exponential(0.5, n)
    first = admitted + rng.exponential(0.2, n)
    output = rng.integers(1, max_output, n)
    finish = first + (output - 1) * per_token + rng.exponential(0.01, n)
    return rng, arrival, admitted, first, output, finish


def test_requests_recorded_in_any_blocks_are_recorded_alike():
    """The simulator hands finished requests to ``Requests.record`` in blocks: one request at a
    time and blocks of any size give the same figures, to the last bit and the last counter."""
    n = 2600
    rng, arrival, admitted, first, output, now = _synthetic_requests(7, n, 6, 0.03)
    slo = {"ttft_ms": 600.0, "tpot_ms": 31.0, "e2e_s": 1.0}
    one, blocks = Requests(slo, (20.0, 80.0)), Requests(slo, (20.0, 80.0))
    for j in range(n):
        one.record(arrival[j:j + 1], admitted[j:j + 1], first[j:j + 1], now[j:j + 1],
                   output[j:j + 1].astype(float))
    i = 0
    while i < n:
        m = int(rng.integers(1, 700))
        blocks.record(arrival[i:i + m], admitted[i:i + m], first[i:i + m], now[i:i + m],
                      output[i:i + m].astype(float))
        i += m
    for name in ("count", "output_tokens", "first_arrival", "last_finish", "meet_slo",
                 "done_by_t0", "done_by_t1"):
        assert getattr(one, name) == getattr(blocks, name), name
    assert 0 < one.meet_slo < n
    for name in ("ttft", "tpot", "e2e", "wait"):
        a, b = getattr(one, name), getattr(blocks, name)
        assert a.pending == b.pending and a.k == b.k and a._total == b._total, name
        assert np.array_equal(a.buf[:a.k], b.buf[:b.k]), name


def test_request_metrics_match_per_request_arrays():
    n = 5000
    rng, arrival, admitted, first, output, finish = _synthetic_requests(6, n, 50, 0.02)
    slo = {"ttft_ms": 800.0, "tpot_ms": 25.0}
    req = Requests(slo, (arrival[n // 5], arrival[-1]))
    order = np.argsort(finish)  # completions in time order, alone or in groups
    i = 0
    while i < n:
        m = int(rng.integers(1, 4))
        ids = order[i:i + m]
        for j in ids:  # a group finishes at the same instant
            finish[j] = finish[ids[-1]]
        req.record(arrival[ids], admitted[ids], first[ids], finish[ids], output[ids] * 1.0)
        i += m
    ttft, multi = first - arrival, output > 1
    tpot = (finish - first)[multi] / (output[multi] - 1)
    assert req.count == n and req.output_tokens == output.sum()
    assert req.ttft.percentile(99) == pytest.approx(np.percentile(ttft, 99), rel=1e-12)
    assert req.tpot.mean() == pytest.approx(tpot.mean(), rel=1e-12)
    assert req.wait.percentile(50) == pytest.approx(np.percentile(admitted - arrival, 50))
    tpot_all = np.where(multi, (finish - first) / np.maximum(output - 1, 1), np.nan)
    ok = (ttft * 1e3 <= 800) & (np.isnan(tpot_all) | (tpot_all * 1e3 <= 25))
    assert req.meet_slo == ok.sum() and 0 < ok.sum() < n
    t0, t1 = req.window
    assert req.done_by_t0 == (finish <= t0).sum() and req.done_by_t1 == (finish <= t1).sum()


def sim_for(policy: DecodeCost, engine="roofline", batch=16):
    m = catalog.model("qwen3-4b")
    costs, _ = costs_for("h100-sxm", None, engine)
    return Simulator(m, costs, policy, Memory(costs.hbm_bytes, 512 * 2**30, m.weight_bytes,
                                              2 * 2**30), batch)


DENSE = DecodeCost(1.0, 1.0, 0.0, 0.0, False)
OFFLOAD = DecodeCost(0.0, 0.0, 1.0, 1.0, True, copies_per_layer=2, staging_layers=2)
DECIDING = DecodeCost(0.2, 0.1, 0.08, 1.0, False, copies_per_layer=2, path="gather",
                      decide_bytes_per_token=2.0, meta_frac=0.05, decide_kernel="verkv")
# an eager engine whose host launches bind at small batches and contexts, not at large ones
EAGER = ROOFLINE.with_fields(launch="eager", launch_overhead_us=300.0, step_overhead_ms=0.2)


@pytest.mark.parametrize("policy, engine", [
    (DENSE, "roofline"), (DENSE, "vllm-paper"), (OFFLOAD, "roofline"),
    (OFFLOAD, "vllm-paper"), (DECIDING, "vllm-paper"), (DECIDING, "roofline"), (DENSE, EAGER),
    (OFFLOAD, EAGER)])
def test_closed_form_decode_runs_equal_the_stepwise_sums(policy, engine):
    """``decode_run`` in closed form against the same steps costed one by one (numpy)."""
    steps = sim_for(policy, engine).steps
    stepwise = StepCosts(steps.model, steps.costs, steps.policy, steps.prefill_work)
    stepwise._line = lambda B: None  # force the vectorised path
    rng, closed_forms = np.random.default_rng(7), 0
    for _ in range(60):
        B = int(rng.integers(1, 65))
        ctx = rng.integers(1, 200_000, B).astype(float)
        k = int(rng.integers(1, 2049))
        one = float(stepwise.decode(ctx, 1)[0][0])
        until = float(rng.choice([np.inf, rng.uniform(0, 1.5 * k * one), 0.0, 2.5 * one]))
        T0 = float(ctx.sum())
        got, want = steps.decode_run(B, T0, k, until), stepwise.decode_run(B, T0, k, until)
        assert got[0] == want[0], (B, k, until)
        assert got[1:] == pytest.approx(want[1:], rel=1e-9)
        closed_forms += steps._line(B) is not None
    assert closed_forms == 60  # roofline costs: every run was in closed form


@pytest.mark.parametrize("policy, engine", [
    (DENSE, "roofline"), (DENSE, "trtllm"), (OFFLOAD, "vllm-paper"), (DECIDING, "roofline")])
def test_batch_size_tables_are_one_size_at_a_time_to_the_bit(policy, engine):
    """``per_batch`` and ``_line`` remember every batch size up to 2B at the first ask (one
    numpy pass): each entry equals what the scalar cost functions give for that size alone."""
    steps = sim_for(policy, engine).steps
    m, c = steps.model, steps.costs
    for B in (64, 3, 130, 1):
        steps.per_batch(B)
        line = steps._line(B)
        assert line is not None
        for n in (1, 2, B, 2 * B - 1):
            assert steps.per_batch(n) == (float(c.gemm_time(n, m)), float(c.head_time(n, m)))
            parts = StepCosts.layer_costs(steps, n, np.array([1e3, 1e6]))
            want = tuple((float(p[0]) - (float(p[1]) - float(p[0])) / (1e6 - 1e3) * 1e3,
                          (float(p[1]) - float(p[0])) / (1e6 - 1e3)) for p in parts)
            assert steps._line(n) == want, (B, n)
    for size, prefix in ((1.0, 0.0), (517.0, 4096.0), (8192.0, 123457.0)):
        pairs = size * prefix + size * (size + 1) / 2
        assert m.flops_per_pair * pairs == m.attention_flops(size, prefix)


def test_overlap_that_changes_sides_falls_back_to_the_steps():
    """Offloaded KV at a context where the link and compute cross within the run."""
    steps = sim_for(OFFLOAD, "roofline").steps
    stepwise = StepCosts(steps.model, steps.costs, steps.policy, steps.prefill_work)
    stepwise._line = lambda B: None
    (c0, c1), (d0, d1), (x0, x1) = steps._line(1)
    cross = (x0 - c0 - d0) / (c1 + d1 - x1)  # tokens where the link's time equals compute's
    assert cross > 0
    ctx = np.array([cross - 100.0])
    T0 = float(ctx.sum())
    assert steps.decode_run(1, T0, 400) == pytest.approx(stepwise.decode_run(1, T0, 400),
                                                         rel=1e-12)


def test_per_request_state_follows_the_requests_in_the_system():
    """A long, light workload: the run's slots stay at its concurrency, not its length."""
    from kvsim.sim.batching import Run
    sim = sim_for(DENSE)
    work = poisson(2.0, 30_000, 2048, 128, 0)
    run = Run(sim, work)
    run.env.run(run.scheduler())
    assert run.requests.count == 30_000 and run.done == 30_000
    assert run.slots <= 256  # a few requests in the system at a time
    assert len(sim.chunks.kept) == sim.chunks.keep < sim.chunks.count


def test_requests_arriving_at_one_instant_are_seen_together():
    """Arrivals read from the workload when the scheduler looks: a burst of 4 at t = 0 and 4
    at t = 5 prefills as two steps of 4 prompts each, not one prompt and then the rest."""
    from kvsim.sim.batching import Run
    from kvsim.sim.workload import Workload
    sim = sim_for(DENSE)
    work = Workload(np.array([0.0] * 4 + [5.0] * 4), np.full(8, 1024), np.full(8, 8), None, "")
    run = Run(sim, work)
    run.env.run(run.scheduler())
    prefills = [c for c in sim.chunks if c.kind in ("prefill", "mixed") and c.prefill_tokens]
    assert [c.prefill_tokens for c in prefills] == [4 * 1024, 4 * 1024]
    assert run.requests.count == 8


@pytest.mark.parametrize("concurrency", [None, 6])
def test_requests_in_system_integrate_to_their_summed_latencies(concurrency):
    """Little's law, exactly: the integral of the number in system over the run is the sum of
    every request's arrival-to-finish time (arrivals are read late; their presence is not
    lost)."""
    from kvsim.sim.batching import Run
    from kvsim.sim.workload import Workload
    sim = sim_for(DENSE)
    rng = np.random.default_rng(11)
    n = 400
    work = Workload(np.sort(rng.uniform(0, 40, n)), rng.integers(100, 4000, n),
                    rng.integers(1, 200, n), concurrency, "")
    run = Run(sim, work)
    run.env.run(run.scheduler())
    run.mark(0)
    assert run.done == n and run.in_system == 0
    assert run.area == pytest.approx(run.requests.e2e.total, rel=1e-9)


def _counts(res):
    r, c = res.requests, res.chunks
    return [r.count, r.output_tokens, r.meet_slo, r.done_by_t1, res.peak_hbm_bytes,
            c.decode_steps, c.count, [(ch.kind, ch.steps, ch.batch) for ch in c]]


def _times(res):
    """Times, percentiles and sums: equal to rounding (a piece's clock starts at its first
    arrival, the serial run's gets there through its own steps; sums add in another order)."""
    r, c = res.requests, res.chunks
    return [r.first_arrival, r.last_finish, r.ttft.total, r.tpot.total, r.e2e.total,
            res.in_system_area, c.decode_seconds, c.gpu_busy, c.batch_seconds,
            *[ch.start for ch in c],
            *[getattr(r, m).percentile(p) for m in ("ttft", "tpot", "e2e", "wait")
              for p in (50, 90, 99)]]


def _pieces_run(work, jobs, bounds=None):
    from kvsim.sim import segments
    sim = sim_for(DENSE)
    sim.chunks.keep = 300  # the kept chunks span several pieces
    reqs = Requests({"ttft_ms": 400.0}, (float(work.arrival[500]), float(work.arrival[-1])))
    if bounds is None:
        return segments.run(sim, work, reqs, jobs, piece=700)
    orig = segments.cuts
    segments.cuts = lambda arrival, piece: bounds
    try:
        return segments.run(sim, work, reqs, jobs, piece=700)
    finally:
        segments.cuts = orig


def _serial(work):
    sim = sim_for(DENSE)
    sim.chunks.keep = 300
    reqs = Requests({"ttft_ms": 400.0}, (float(work.arrival[500]), float(work.arrival[-1])))
    return sim.run_whole(work, reqs)


@pytest.mark.parametrize("exact", [metrics.EXACT, 1000])
def test_a_long_open_loop_in_pieces_is_the_serial_run(exact, monkeypatch):
    """Cut where the server was empty, pieces in two processes: every count equal, times,
    percentiles and sums to rounding; the same result with one process or two. With fewer
    values kept exactly than the run has, both answer from the sketch (the pieces fold theirs
    before they come back)."""
    monkeypatch.setattr(metrics, "EXACT", exact)
    work = poisson(3.0, 5000, 2048, 128, 3)
    serial, two, one = _serial(work), _pieces_run(work, 2), _pieces_run(work, 1)
    assert two.pieces > 4 and serial.pieces == 1
    assert _counts(two) == _counts(serial)
    assert _times(two) == pytest.approx(_times(serial), rel=1e-12)
    assert _counts(one) == _counts(two) and _times(one) == _times(two)
    assert two.requests.method() == serial.requests.method()
    assert (serial.requests.method() == "exact") == (exact > work.n)


def test_cuts_inside_a_busy_period_are_dropped_until_every_cut_holds():
    """Bursts the server cannot clear before the next one: cuts placed inside the backlog fail
    their check and the pieces around them run again as one."""
    rng = np.random.default_rng(5)
    bursts = [np.sort(rng.uniform(0, 2.0, 400)) + 60.0 * b for b in range(6)]
    from kvsim.sim.workload import Workload
    arrival = np.concatenate(bursts)
    work = Workload(arrival, np.full(len(arrival), 2048), np.full(len(arrival), 64), None, "")
    busy = [0, 200, 400, 800, 1000, 1200, 1300, 1600, 2000, 2200, 2400]  # 200, 1000 .. in bursts
    res = _pieces_run(work, 2, busy)
    serial = _serial(work)
    assert res.pieces == 6  # only the cuts between bursts held
    assert _counts(res) == _counts(serial)
    assert _times(res) == pytest.approx(_times(serial), rel=1e-12)


def test_where_to_cut():
    from kvsim.sim.segments import cuts
    arrival = np.cumsum(np.random.default_rng(1).exponential(0.5, 10_000))
    assert cuts(arrival, 6000) == [0, 10_000]  # fewer than two pieces: whole
    c = cuts(arrival, 1000)
    assert c[0] == 0 and c[-1] == 10_000 and len(c) == 11
    gaps = np.diff(arrival)
    for k, at in enumerate(c[1:-1], 1):  # the longest gap near each multiple of the piece
        assert abs(at - 1000 * k) <= 20 and gaps[at - 1] == gaps[1000 * k - 21:1000 * k + 19].max()


def test_quantiles_travel_small_and_keep_working():
    """A piece's metrics cross a process boundary with only the values they hold, and take
    more values afterwards as if they had never moved."""
    import pickle
    v = sample(5000, 8)
    q = Quantiles()
    q.add(v[:3000])
    blob = pickle.dumps(q)
    assert len(blob) < 3000 * 8 + 2000  # not the whole EXACT-sized buffer
    back = pickle.loads(blob)
    back.add(v[3000:4000])
    for x in v[4000:]:
        back.add_one(float(x))
    for p in QS:
        assert back.percentile(p) == np.percentile(v, p)
