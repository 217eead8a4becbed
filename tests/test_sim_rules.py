"""Scheduling rules chosen by name, and policy costs with fixed token counts charged per
sequence: ``DecodeCost.tokens(term, n) = min(n, frac n + tokens)``."""

import math

import numpy as np
import pytest

from kvsim.contract import DecodeCost
from kvsim.errors import KvsimError
from kvsim.hw import catalog
from kvsim.hw.costs import costs_for
from kvsim.sim import rules
from kvsim.sim.batching import Run
from kvsim.sim.engine import Memory, Simulator
from kvsim.sim.records import ChunkLog
from kvsim.sim.rules import RULES, Scheduling
from kvsim.sim.workload import Workload, poisson

M = catalog.model("qwen3-4b")
KV = M.kv_bytes_per_token
WINDOW = DecodeCost(0.0, 0.0, 0.0, 0.0, False, resident_tokens=1020, hbm_read_tokens=1020)
QUARTER = DecodeCost(0.25, 0.25, 0.0, 0.0, False)
PAGES = DecodeCost(0.0, 0.0, 0.0, 1.0, True, copies_per_layer=1, host_read_tokens=1024)


def sim_for(policy, scheduling=None, batch=16):
    costs, _ = costs_for("h100-sxm", None, "roofline")
    return Simulator(M, costs, policy, Memory(costs.hbm_bytes, 512 * 2**30, M.weight_bytes,
                                              2 * 2**30), batch, scheduling or Scheduling())


def finish_order(order: str) -> list[int]:
    """Requests arriving together, served one at a time: which finishes when (each told by its
    output length)."""
    sim = sim_for(QUARTER, Scheduling(admission_order=order), batch=1)
    work = Workload(np.zeros(4), np.array([4000, 1000, 3000, 2000]), np.array([1, 2, 3, 4]),
                    None, "")
    run = Run(sim, work)
    seen = []
    run.requests.record = lambda arrival, admitted, first, end, output: seen.extend(output)
    run.env.run(run.scheduler())
    return seen


def test_admission_orders():
    assert finish_order("arrival") == [1, 2, 3, 4]
    assert finish_order("shortest-prompt-first") == [2, 4, 3, 1]
    with pytest.raises(KvsimError, match="--admission-order must be one of arrival, "):
        Scheduling(admission_order="longest").check()
    assert {"arrival", "shortest-prompt-first"} <= set(RULES["order"])  # (more may be added)


def test_shortest_prompt_first_serves_the_same_work_sooner():
    work = poisson(4.0, 300, 4096, 64, 0)
    work.prompt[:] = np.random.default_rng(0).integers(256, 16384, work.n)
    res = {o: sim_for(QUARTER, Scheduling(admission_order=o), batch=4).run(work)
           for o in RULES["order"]}
    assert {r.requests.count for r in res.values()} == {300}
    assert res["shortest-prompt-first"].requests.ttft.total < res["arrival"].requests.ttft.total


@pytest.mark.parametrize("context", [2048, 32768])
def test_a_fixed_window_holds_the_same_hbm_at_every_context(context):
    """1,020 tokens' worth of KV per sequence at 2K and at 32K; a share grows with the context."""
    window, share = sim_for(WINDOW), sim_for(QUARTER)
    assert int(window.hbm_need(context)) == math.ceil(1020 * KV)
    assert int(share.hbm_need(context)) == math.ceil(0.25 * KV * context)
    assert int(window.hbm_need(500)) == math.ceil(500 * KV)  # never more than the sequence
    work = Workload(np.zeros(2), np.full(2, context), np.full(2, 8), 1, "")
    res = window.run(work)
    m = window.memory
    assert res.peak_hbm_bytes - m.weights_bytes - m.workspace_bytes == math.ceil(1020 * KV)


def test_a_fixed_read_costs_the_same_at_every_context_and_a_share_does_not():
    window, share = sim_for(WINDOW), sim_for(QUARTER)
    def ctx(n):
        return np.array([float(n)])
    w2, w32 = window.steps.decode(ctx(2048), 1)[0], window.steps.decode(ctx(32768), 1)[0]
    s2, s32 = share.steps.decode(ctx(2048), 1)[0], share.steps.decode(ctx(32768), 1)[0]
    assert w32[0] == pytest.approx(w2[0], rel=1e-12)  # 1,020 tokens read at both
    assert s32[0] - s2[0] > 3e-4  # a quarter of 30K tokens more


def test_a_fixed_page_budget_moves_that_many_tokens_over_the_link():
    """At 32K: 1,024 tokens per sequence and layer over the link, not a share of the context;
    a short sequence moves all it has."""
    sim = sim_for(PAGES)
    c, L = sim.costs, M.layers
    def link(tokens, seqs):
        return L * float(c.link_time(KV / L * tokens, "h2d", copies=c.copies(1.0, seqs)))

    assert sim.steps.decode(np.array([32768.0]), 1)[2][0] == pytest.approx(link(1024, 1))
    assert sim.steps.decode(np.array([32768.0, 600.0]), 1)[2][0] == pytest.approx(
        link(1024 + 600, 2))
    share = sim_for(DecodeCost(0.0, 0.0, 1024 / 32768, 1.0, True, copies_per_layer=1))
    assert share.steps.decode(np.array([2048.0]), 1)[2][0] == pytest.approx(link(64, 1))
    assert sim.steps.decode(np.array([2048.0]), 1)[2][0] == pytest.approx(link(1024, 1))


def test_fixed_terms_charge_runs_as_their_steps():
    """A run of decode steps (closed form off, per-sequence charges) and a simulated workload
    with short and long prompts agree with the step-by-step costs."""
    sim = sim_for(PAGES)
    held = np.array([700.0, 30000.0])
    k, seconds, _, link = sim.steps.decode_run(2, float(held.sum()), 500, np.inf, held)
    steps = sim.steps.decode(held, 500)
    assert k == 500 and seconds == pytest.approx(steps[0].sum(), rel=1e-12)
    assert link == pytest.approx(steps[2].sum(), rel=1e-12)
    work = Workload(np.linspace(0, 2, 12), np.tile([300, 9000, 40000], 4), np.full(12, 50),
                    None, "")
    res = sim.run(work)
    assert res.requests.count == 12 and res.chunks.link_busy > 0


def test_a_fixed_host_term_is_written_once_per_sequence():
    """Prefill chunks write to host memory what they add to the sequence's host term: a fixed
    1,024 tokens fill with the first chunk, later chunks add nothing."""
    steps = sim_for(DecodeCost(0.0, 0.0, 0.0, 0.0, False, host_tokens=1024)).steps
    assert steps.written([0], [8192]) == 1024
    assert steps.written([0, 8192], [600, 4096]) == 600
    assert steps.host_bytes(8192, steps.written([0], [8192])) == 1024 * KV
    one = steps.step(0, 0.0, 8192.0, 1e12, 1, [8192.0], written=1024.0)
    assert one[2] == pytest.approx(steps.costs.link_time(
        1024 * KV, "d2h", copies=2 * M.layers * steps.costs.copies(1.0, 1)))


def test_the_one_step_path_is_the_general_plans_one_step():
    """``Chunked.one_step`` (a policy of shares only: planned and carried out in short) takes
    the one step the general plan takes (its loop's, or ``_whole``'s where every prompt fits),
    chunks and all, and leaves a plan of several steps to ``Chunked.plan``, changing nothing."""
    budget = 8192
    sim = sim_for(QUARTER, Scheduling(max_batched_tokens=budget), batch=64)
    rng = np.random.default_rng(0)
    work = Workload(np.zeros(48), rng.integers(1, 9000, 48), np.full(48, 300), None, "")
    run = Run(sim, work)
    run.admit()  # all 48 arrive at once and start prefilling
    slots = list(run.prefilling)
    decodes = slots[:8]
    for i in decodes:  # 8 sequences decoding, the first finishing after 250 steps
        run.first_token[i], run.ctx[i], run.left[i] = 0.0, float(run.prompt[i] + 1), 250
    run.join(decodes)
    chunked = rules.Chunked()
    checked = {"single": 0, "whole": 0, "finishing": 0, "several": 0}
    for trial in range(400):
        run.prefilling = list(rng.choice(slots[8:], rng.integers(1, 8), replace=False))
        for i in run.prefilling:
            run.prefilled[i] = int(rng.integers(0, run.target[i]))
        run.running = decodes if trial % 2 else []
        run.clock = 249 if trial % 3 else 0  # a decode finishes with the next step, or not
        single = trial % 5 == 0
        plans = chunked.plan(run, single)
        before = list(run.prefilled)
        got = chunked.one_step(run, single)
        if got is None:
            assert len(plans) > 1 and run.prefilled == before
            checked["several"] += 1
            continue
        p = plans[0]
        assert len(plans) == 1
        assert got == (p.decodes, p.decode_tokens, p.chunk_tokens, p.chunk_flops,
                       len(p.assign), p.done, p.done_lengths)
        assert p[7:] == (0.0, 0.0, None, None, None)  # no prefill work, no charges
        for i, size in p.assign:
            before[i] += size
        assert run.prefilled == before
        checked["single" if single else "whole" if len(p.done) == len(run.prefilling) else
                "finishing"] += 1  # (plan's step where all fit is _whole's)
    assert min(checked.values()) > 20, checked


OFFLOAD = DecodeCost(0.05, 0.05, 0.95, 1.0, True, copies_per_layer=1, staging_layers=2)


def _turns(sim, work, short: bool) -> dict:
    """Everything a closed-loop run leaves, its turns taken in short (``Run._closed_turns``) or
    one by one."""
    run = Run(sim, work)
    assert run.closed_turns  # (the short path applies)
    run.closed_turns = short
    run.env.run(run.scheduler())
    q = run.requests
    return {"metrics": [(m.buf[:m.k].tolist(), m.n, m.total) for m in (q.ttft, q.tpot, q.e2e,
                                                                       q.wait)],
            "counts": (q.count, q.output_tokens, q.first_arrival, q.last_finish),
            "chunks": [tuple(None if x is None else np.asarray(x).tolist() for x in c)
                       for c in sim.chunks],
            "sums": {k: v for k, v in vars(sim.chunks).items() if k != "kept"},
            "run": (run.peak_hbm, run.peak_host, run.area, run.t, run.in_system, run.clock,
                    run.admissions, run.done, run.used_hbm, run.used_host, run.env.now)}


@pytest.mark.parametrize("policy", [QUARTER, OFFLOAD], ids=["resident", "offload"])
def test_a_closed_loops_turns_in_short_are_its_turns_one_by_one(policy):
    """A closed loop alone with reserve admission takes its turns in short (``_closed_turns``:
    admission, the one-step path and completion with the run's fields in locals); field by
    field it is the scheduler's turns one by one: varied prompts, outputs, concurrency, batch
    sizes, token budgets and admission orders, and HBM that holds only a few requests."""
    rng = np.random.default_rng(7)
    costs, _ = costs_for("h100-sxm", None, "roofline")
    for _ in range(16):
        n, conc = int(rng.integers(10, 90)), int(rng.integers(1, 40))
        work = Workload(np.zeros(n), rng.integers(1, 6000, n), rng.integers(1, 200, n), conc, "")
        sched = Scheduling(max_batched_tokens=int(rng.choice([256, 2048, 8192])),
                           admission_order=str(rng.choice(list(RULES["order"]))))
        kv_room = float(rng.choice([2**28, 2**30, 2**36]))  # HBM for a few requests, or many
        memory = Memory(M.weight_bytes + 2**30 + kv_room, 512 * 2**30, M.weight_bytes, 2**30)
        batch = int(rng.integers(1, 64))
        got = [_turns(Simulator(M, costs, policy, memory, batch, sched,
                                chunks=ChunkLog(keep=10**6)), work, short)
               for short in (True, False)]
        assert got[0] == got[1]
