"""Quest against a brute-force reading of its definition, on small random layers."""

import math

import pytest
import torch

from kvsim.measure import traffic
from kvsim.policies import make
from kvsim.policies.quest.pages import page_bounds, select

F64 = torch.float64


def _layer(seed, n_kv=2, g=3, n=77, d=8):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(n_kv, n + 3, d, generator=gen, dtype=F64)  # 3 tokens after the context
    v = torch.randn(n_kv, n + 3, d, generator=gen, dtype=F64)
    q = torch.randn(n_kv * g, 2, d, generator=gen, dtype=F64)
    return k, v, q, n


@pytest.mark.parametrize("seed", range(4))
def test_the_page_bound_holds_for_every_key_and_is_reached_by_the_box(seed):
    k, _, q, n = _layer(seed)
    lo, hi = page_bounds(k[:, :n], 8)
    for h in range(k.shape[0]):
        for p in range(lo.shape[1]):
            keys = k[h, 8 * p:min(8 * p + 8, n)]
            assert torch.equal(lo[h, p], keys.amin(0)) and torch.equal(hi[h, p], keys.amax(0))
            for qh in q[3 * h:3 * h + 3, 0]:
                bound = sum(max(a * b, a * c) for a, b, c in zip(qh, lo[h, p], hi[h, p]))
                assert float((keys @ qh).max()) <= float(bound) + 1e-12


@pytest.mark.parametrize("seed", range(4))
def test_selection_and_attention_equal_a_brute_force_reading(seed):
    k, v, q, n = _layer(seed)
    page, budget, sink, local = 8, 24, 2, 3
    pol = make("quest", {"page_size": page, "token_budget": budget, "sink": sink,
                         "local": local})
    c = pol.compress(k[:, :n], v[:, :n], {}, None, None, None, layer=0)
    pos = torch.tensor([n, n + 2])
    out, stats = traffic.attend(pol, c, q, pos, k, v, verify=True)
    n_kv, d = k.shape[0], k.shape[2]
    g = q.shape[0] // n_kv
    pages = math.ceil(n / page)
    read = torch.zeros(n_kv, n, dtype=torch.bool)
    for h in range(n_kv):
        for r in range(2):
            bounds = []
            for p in range(pages):
                keys = k[h, p * page:min(p * page + page, n)]
                ub = max(sum(max(float(a) * float(b), float(a) * float(c_))
                             for a, b, c_ in zip(q[h * g + j, r], keys.amin(0), keys.amax(0)))
                         for j in range(g)) / math.sqrt(d)
                bounds.append(ub)
            chosen = sorted(range(pages), key=lambda p: -bounds[p])[:budget // page]
            keep = torch.zeros(n, dtype=torch.bool)
            for p in chosen:
                keep[p * page:p * page + page] = True
            keep[:sink] = True
            keep[n - local:] = True
            read[h] |= keep & ~c.resident[h]
            for j in range(g):
                qh = q[h * g + j, r]
                idx = torch.cat([keep.nonzero().flatten(), torch.arange(n, pos[r] + 1)])
                s = k[h, idx] @ qh / math.sqrt(d)
                w = torch.softmax(s, 0)
                torch.testing.assert_close(out[h * g + j, r], w @ v[h, idx])
    got = stats["kv_read_frac"][::g, 0]
    torch.testing.assert_close(got, read.sum(-1).to(F64) / n)
    assert float(got.max()) <= 2 * budget / n + 1e-12  # two rows: the union of two budgets
    _, one = traffic.attend(pol, c, q[:, 1:], pos[1:], k, v)
    assert float(one["kv_read_frac"].max()) <= budget / n + 1e-12  # one row: the budget


def test_the_selection_never_takes_a_page_after_the_row():
    k, _, q, n = _layer(9)
    pol = make("quest", {"page_size": 8, "token_budget": 64})
    state = pol.compress(k[:, :n], k[:, :n], {}, None, None, None, layer=0).state
    chosen = select(q[:, :1], torch.tensor([20]), state, 8)
    assert not bool(chosen[..., 24:].any())  # pages from 24 on start after position 20


def test_quests_decide_bench_is_the_block_bench_and_decides_as_the_policy():
    """Quest's decide step is the block policies' bench: the policy's own page selection for the
    decode query on the bench's layer, laid out behind the resident tokens, no reweighting."""
    from kvsim.hw.catalog import model
    from kvsim.policies.base import DecideKernel
    from kvsim.policies.blocks import BlockBench
    n = 1024
    pol = make("quest", {"page_size": 8, "token_budget": 128})
    bench = pol.decide_kernel(torch.device("cpu"), model("smollm2-135m"), n, 0)
    assert isinstance(bench, BlockBench) and isinstance(bench, DecideKernel)
    idx, slot, bias, counts = bench.plan()
    want = select(bench.q, bench.q_pos, bench.state, 128 // 8)[:, 0] & ~bench.state.resident
    assert torch.equal(torch.stack([idx // n, idx % n]), torch.stack(want.nonzero(as_tuple=True)))
    assert torch.equal(counts, want.sum(-1)) and int(counts.max()) <= 128
    assert bool((bias[torch.isfinite(bias)] == 0).all())
