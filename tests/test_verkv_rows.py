"""VerKV's compiled row loops (kvsim/policies/verkv/_rows.py, numba) against the torch code they
stand for, bit for bit: the same functions with the loops switched off (``_rows.AVAILABLE``),
on inputs with ties, zeros, a NaN, heads shorter than the row and the output certificate, and
the decisions of whole layers. Skipped without numba (then only the torch code runs)."""

import pytest
import torch
from conftest import verkv_layer

from kvsim.attention.dense import logits
from kvsim.policies.verkv import _rows
from kvsim.policies.verkv import certificate as C
from kvsim.policies.verkv import kvfetch as KF

pytestmark = pytest.mark.skipif(not _rows.AVAILABLE, reason="numba is not installed")
DELTA = 0.1


def same(a, b) -> bool:
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if a is None or b is None:
        return a is b
    if a.shape != b.shape:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def torch_only(fn, *args, **kw):
    """``fn`` with the compiled loops off."""
    was = _rows.AVAILABLE
    _rows.AVAILABLE = False
    try:
        return fn(*args, **kw)
    finally:
        _rows.AVAILABLE = was


def _weights(seed: int, shape, ties: bool):
    """Weights (a few values where ``ties``: equal gains, equal b) with zeros, and factors."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(shape, generator=g) * 4
    if ties:
        s = (s * 2).round() / 2
    w = torch.exp(s - s.amax(-1, keepdim=True))
    w[torch.rand(shape, generator=g) < 0.05] = 0.0
    r = torch.rand(shape[0], 1, shape[-1], generator=g).clamp(0.01, 1.0)
    if ties:
        r = (r * 8).ceil() / 8
    r[..., :3] = 1.0  # H
    return w, C.token_factors(r, r < 1)


@pytest.mark.parametrize("ties", [False, True])
def test_binary_shrink_and_terms_equal_the_torch_code(ties):
    for seed, n in enumerate([40, 600, 3000]):
        w, f = _weights(seed, (3, 7, n), ties)
        w[0, 0] *= 1e-3  # a row whose head of 32 is all shrunk (the longer head follows)
        got, want = C.binary_shrink(w, f), torch_only(C.binary_shrink, w, f)
        assert torch.equal(got.count, want.count) and torch.equal(got.mask(), want.mask())
        assert same(C.terms(w, f, got), torch_only(C.terms, w, f, want))
    w, f = _weights(0, (2, 3, 100), ties)
    w[1, 2, 5] = float("nan")  # the torch code's answer
    assert torch.equal(C.binary_shrink(w, f).mask(), torch_only(C.binary_shrink, w, f).mask())


@pytest.mark.parametrize("ties", [False, True])
def test_fetch_plan_equals_the_torch_code(ties):
    for seed, n in enumerate([50, 700, 2500]):
        w, f = _weights(seed, (3, 11, n), ties)
        terms = C.terms(w, f, C.binary_shrink(w, f))
        denom = w.sum(-1) * 1.02
        for eps in (1e-4, 0.01, 0.05, 0.3):
            for head in (None, 64, n // 3, n):
                for also in (None, C.output_terms(0.1, DELTA, 64)):
                    got = C.fetch_plan_terms(*terms, denom, eps, DELTA, head=head, also=also)
                    want = torch_only(C.fetch_plan_terms, *terms, denom, eps, DELTA, head=head,
                                      also=also)
                    for name in ("k_star", "exact", "eps_before", "eps_after"):
                        assert same(getattr(got, name), getattr(want, name)), (n, eps, head, name)
    for d in (torch.zeros_like(denom), torch.full_like(denom, float("nan"))):
        got = C.fetch_plan_terms(*terms, d, 0.05, DELTA, head=500)
        want = torch_only(C.fetch_plan_terms, *terms, d, 0.05, DELTA, head=500)
        assert all(same(getattr(got, x), getattr(want, x)) for x in ("k_star", "exact",
                                                                     "eps_before"))


def test_fetch_plan_on_banded_gains_equals_the_torch_code():
    """Gains in a narrow band beside a tiny and a huge one (values a few ulps apart inside the
    head and across its cut), with exact ties and zeros: the compiled loops order them as the
    torch code's stable sort."""
    for seed in range(2):
        g = torch.Generator().manual_seed(seed)
        rows, n = 6, 1500
        var_i = 1 + torch.rand(rows, n, generator=g) * 1e-3
        dup = torch.randint(0, n, (rows, n // 10), generator=g)
        var_i.scatter_(1, dup, var_i.gather(1, dup.roll(1, 1)))  # equal gains
        var_i[:, 0], var_i[:, 1] = 1e-30, 1e3
        var_i[torch.rand(rows, n, generator=g) < 0.05] = 0.0
        beta_i = torch.where(torch.rand(rows, n, generator=g) < 0.01, var_i * 0.3, 0.0)
        b_i = var_i.sqrt() * torch.rand(rows, n, generator=g)
        for scale in (1e-2, 1.0):
            denom = var_i.sum(-1) * scale
            for eps in (1e-3, 0.05, 0.3):
                for head in (n // 3, n // 2, n):
                    got = C.fetch_plan_terms(beta_i, var_i, b_i, denom, eps, DELTA, head=head)
                    want = torch_only(C.fetch_plan_terms, beta_i, var_i, b_i, denom, eps, DELTA,
                                      head=head)
                    for name in ("k_star", "exact", "eps_before", "eps_after"):
                        assert same(getattr(got, name), getattr(want, name)), (seed, head, name)


def test_tie_moves_equals_topk_rows():
    """The compiled ``_topk_rows`` on gains of few values (many ties, cuts inside runs)."""
    g = torch.Generator().manual_seed(3)
    rows, n, k = 300, 64, 30
    gain = torch.randint(1, 9, (rows, n), generator=g).float() / 8
    beta_i = torch.where(gain > 0.7, gain / 3, 0.0)
    var_i = gain * gain / 5
    odd = torch.rand(rows, 1, generator=g) < 0.3
    var_i = torch.where(odd, var_i * (1 + torch.rand(rows, n, generator=g) / 8), var_i)
    b_i = gain * torch.randint(1, 3, (rows, n), generator=g)
    k_star = torch.randint(0, k + 1, (rows,), generator=g)
    head, _, after = C._fetch_head(gain, k)
    want = C._topk_rows(gain, (beta_i, var_i, b_i, k_star), head, after)
    at = torch.arange(rows)
    moves = _rows.tie_moves(at.numpy(), head.numpy(), after.numpy(), gain.numpy(),
                            beta_i.numpy(), var_i.numpy(), b_i.numpy(), k_star.numpy())
    assert torch.equal(at[torch.from_numpy(moves)], want)


def _paired_terms(seed: int, n: int = 600, rows: int = 24):
    """Terms whose rows each hold a pair of equal gains at a chosen rank (from the first to
    past a head of n / 2): a token's beta and V copied to the next one in the order, its b
    copied or halved, every fourth row its V one ulp up (the gains may still round equal)."""
    w, f = _weights(seed, (1, rows, n), False)
    bi, vi, mi = (x.clone() for x in C.terms(w, f, C.binary_shrink(w, f)))
    g = C._gains(bi, vi, mi, bi.sum(-1), vi.sum(-1), C.log_term(DELTA))
    order = torch.sort(g, dim=-1, descending=True, stable=True).indices[0]
    for r in range(rows):
        p = [0, 1, 2, 5, 20, 60, n // 3 - 1, n // 3, n // 2][r % 9]
        a, b = order[r, p], order[r, p + 1]
        bi[0, r, b], vi[0, r, b] = bi[0, r, a], vi[0, r, a]
        mi[0, r, b] = mi[0, r, a] * (1 if r % 2 else 0.5)
        if r % 4 == 3:
            vi[0, r, b] = torch.nextafter(vi[0, r, a], torch.tensor(1.0))
    return w, bi, vi, mi


def test_tied_pairs_equal_the_torch_code(monkeypatch):
    """Rows with a pair of equal gains: the plan is the stable order's where every order of the
    pair gives the same one, torch.topk's otherwise, as the torch code's (both cases occur)."""
    settled, any_order = [], C._any_order

    def spy(*args):
        out = any_order(*args)
        settled.extend(out.tolist())
        return out

    monkeypatch.setattr(C, "_any_order", spy)
    for seed in range(3):
        w, bi, vi, mi = _paired_terms(seed)
        denom = w.sum(-1) * 1.02
        for eps in (1e-3, 0.02, 0.05, 0.3):
            for head in (200, 300):
                got = C.fetch_plan_terms(bi, vi, mi, denom, eps, DELTA, head=head)
                want = torch_only(C.fetch_plan_terms, bi, vi, mi, denom, eps, DELTA, head=head)
                for name in ("k_star", "exact", "eps_before", "eps_after"):
                    assert same(getattr(got, name), getattr(want, name)), (seed, eps, head, name)
    assert any(settled) and not all(settled)


@pytest.mark.parametrize("options", [{}, {"eps_output": 0.1}, {"variant": "paper"},
                                     {"pass_plan": "shared"}])
def test_decisions_and_attention_equal_the_torch_code(options):
    pol, state, a, k, v, qq, qd, qpos, dpos = verkv_layer(
        {"compression": 16, **options}, n_q=6, n_kv=2, d=32, context=5000, question=9, decode=2,
        seed=4)
    n = a.context_len
    for q, p in ((qq, qpos), (qd[:, :1], dpos[:1])):
        extra = logits(q, k[:, n:], p, torch.arange(n, k.shape[1]))
        got = KF.decide(q, p, state, pol.config(), extra_logits=extra)
        want = torch_only(KF.decide, q, p, state, pol.config(), extra_logits=extra)
        for name in ("k_star", "own_exact", "exact_kv", "shortlisted", "eps_before",
                     "eps_after", "denom_est", "shift", "out_after"):
            assert same(getattr(got, name), getattr(want, name)), name
        factors = KF.reweighted_log_factors(state, got, q.shape[0])  # union's and own
        assert all(map(same, factors, torch_only(KF.reweighted_log_factors, state, got,
                                                 q.shape[0])))
        o, st, reads = pol.attend(state, q, p, k, v)
        o2, st2, reads2 = torch_only(pol.attend, state, q, p, k, v)
        assert torch.equal(o, o2) and torch.equal(reads.kv, reads2.kv)
        assert all(same(st[key], st2[key]) for key in st)
