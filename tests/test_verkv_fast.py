"""VerKV's fast CPU kernels against straightforward references, bit for bit: the sort order, the
binary-shrinkage prefix, the k* search (bisection or scan) and the reweighted log factors, on
small random inputs with ties, -0.0, k at its bounds and extreme eps. The references are the
previous implementation written plainly (``torch.topk`` heads, every k scanned), so equal values
must also come out in the same order."""

import math

import pytest
import torch
from conftest import verkv_layer

from kvsim.attention.dense import expand_kv, gqa_einsum, logits
from kvsim.attention.weighted import logsumexp, weighted_attention, weighted_from_logits
from kvsim.policies.verkv import certificate as C
from kvsim.policies.verkv import kvfetch as KF

DELTA = 0.1


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shapes and values, NaN where the other is NaN."""
    if a.shape != b.shape:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def _rows(seed: int, shape, ties: bool, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if ties:  # few distinct values, many zeros, some -0.0
        x = torch.randint(0, 5, shape, generator=g).to(dtype) / 4
        x[torch.rand(shape, generator=g) < 0.1] = -0.0
        return x
    return torch.rand(shape, generator=g, dtype=dtype) ** 6


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_top_desc_is_a_stable_descending_sort(ties, dtype):
    for seed, n in enumerate([1, 2, 15, 16, 17, 64, 300]):
        x = _rows(seed, (3, 4, n), ties, dtype)
        ref_v, ref_i = torch.sort(x, dim=-1, descending=True, stable=True)
        for k in sorted({1, 2, max(1, n // 16), n // 16 + 1, n // 2 + 1, n - 1, n}):
            k = max(1, min(k, n))
            v, i = C.top_desc(x, k)
            assert torch.equal(i, ref_i[..., :k]), (n, k)
            assert torch.equal(v, ref_v[..., :k])
        for k in sorted({1, n // 16, n // 2, n - 1} & set(range(1, n))):  # the fetch head
            head, rest, after = C._fetch_head(x, k)
            assert torch.equal(head, ref_i[..., :k]), (n, k)
            if rest is not None:
                assert torch.equal(rest.sort(-1).values, ref_i[..., k:].sort(-1).values)
            if after is not None:
                assert torch.equal(after, ref_i[..., k])


@pytest.mark.parametrize("ties", [False, True])
def test_topk_order_is_torch_topk(ties):
    """Values and indices of torch.topk to the bit, ties (its own order), zeros, -0.0, a NaN and
    a negative value (both handed to torch.topk) included."""
    for seed, n in enumerate([2, 17, 300, 3000]):
        x = _rows(seed, (3, 4, n), ties)
        if seed == 2:
            x[0, 1, 3] = float("nan")
        if seed == 3:
            x[2, 0, 7] = -1.0
        for k in sorted({1, 2, n // 16 + 1, n // 2, n - 1} & set(range(1, n))):
            v, i = C.topk_order(x, k)
            want_v, want_i = torch.topk(x, k, dim=-1)
            assert torch.equal(i, want_i), (n, k)
            assert same(v, want_v) and torch.equal(v.view(torch.int32).nan_to_num(),
                                                   want_v.view(torch.int32).nan_to_num())


def _reference_shrink(w, f, head):
    """Appendix A.2 as it was written before: the prefix on a ``torch.topk`` head, or on a full
    stable sort (``head=None``, or rows whose whole head is shrunk)."""
    u = w * f.odds
    n = u.shape[-1]

    def prefix(k):
        if k < n:
            vals, idx = torch.topk(u, k, dim=-1)
        else:
            vals, idx = torch.sort(u, dim=-1, descending=True, stable=True)
        a = w.expand(u.shape).gather(-1, idx) * f.one_minus_r.expand(u.shape).gather(-1, idx)
        before = torch.cumsum(a, dim=-1) - a
        return idx, (vals > 2 * before).cumprod(dim=-1).sum(dim=-1)

    k = n if head is None else min(head, n)
    idx, count = prefix(k)
    if k < n:
        full_idx, full_count = prefix(n)
        redo = count == k
        count = torch.where(redo, full_count, count)
        idx = torch.where(redo[..., None], full_idx, torch.cat(
            [idx, torch.zeros(*idx.shape[:-1], n - k, dtype=idx.dtype)], -1))
    return idx, count


def _reference_plan(beta_i, var_i, b_i, denom, eps, delta, head, also=None):
    """KVFetch's k* search as it was written before (every k scanned; the head by a stable
    sort; the full-sort fallback)."""
    l = C.log_term(delta) if also is None else max(C.log_term(delta), also[1])
    n = beta_i.shape[-1]
    beta, var = beta_i.sum(-1), var_i.sum(-1)
    top = torch.topk(b_i, min(2, n), dim=-1)
    bmax = top.values[..., 0]
    second = top.values[..., 1] if n > 1 else torch.zeros_like(bmax)
    t, t2 = bmax * (l / 3.0), second * (l / 3.0)
    c1 = t * t + 2.0 * l * var
    root1 = torch.sqrt(c1)[..., None]
    x = (2.0 * l) * var_i
    tiny = torch.finfo(x.dtype).tiny
    gain = beta_i + x / (root1 + torch.sqrt((c1[..., None] - x).clamp_min(0.0))).clamp_min(tiny)
    arg = top.indices[..., :1]
    c2 = (t2 * t2)[..., None] + 2.0 * l * (var[..., None] - var_i.gather(-1, arg)).clamp_min(0.0)
    gain.scatter_(-1, arg, beta_i.gather(-1, arg) + (t - t2)[..., None] + (c1[..., None] - c2)
                  / (root1 + torch.sqrt(c2)).clamp_min(tiny))

    def evaluate(k):
        if k < n:
            idx = torch.topk(gain, k, dim=-1).indices
        else:
            idx = torch.sort(gain, dim=-1, descending=True, stable=True).indices
        hb, hv, hm = beta_i.gather(-1, idx), var_i.gather(-1, idx), b_i.gather(-1, idx)
        zero = torch.zeros_like(hb[..., :1])
        if k >= n:
            tb = tv = tm = zero
        else:
            tb = (beta[..., None] - hb.sum(-1, keepdim=True)).clamp_min(0)
            tv = (var[..., None] - hv.sum(-1, keepdim=True)).clamp_min(0)
            in_head = torch.zeros(b_i.shape, dtype=torch.bool).scatter_(-1, idx, True)
            tm = b_i.masked_fill(in_head, 0.0).amax(-1, keepdim=True)
        sb = torch.cat([hb.flip(-1).cumsum(-1).flip(-1), zero], -1) + tb
        sv = torch.cat([hv.flip(-1).cumsum(-1).flip(-1), zero], -1) + tv
        sm = torch.cat([hm.flip(-1).cummax(-1).values.flip(-1), zero], -1).maximum(tm)
        eps_k = C.bernstein_eps(sb, sv, sm, denom[..., None], C.log_term(delta))
        ok = eps_k < eps
        if also is not None:
            ok &= C.bernstein_eps(sb, sv, sm, denom[..., None], also[1]) < also[0]
        k_star = ok.int().argmax(-1)
        live = (hb > 0) | (hv > 0) | (hm > 0)
        sel = (torch.arange(k) < k_star[..., None]) & live
        exact = torch.zeros(b_i.shape, dtype=torch.bool).scatter_(-1, idx, sel)
        return (k_star, exact, eps_k[..., 0], eps_k.gather(-1, k_star[..., None])[..., 0],
                ok.any(-1))

    k = n if head is None else min(head, n)
    *got, found = evaluate(k)
    if k < n:  # rows whose cut lies beyond the head: the full sort's answer
        full = evaluate(n)
        got = [torch.where(found.reshape(found.shape + (1,) * (a.dim() - found.dim())), a, b)
               for a, b in zip(got, full[:4], strict=True)]
    return got


def _inputs(seed: int, n: int, ties: bool):
    g = torch.Generator().manual_seed(seed)
    shape = (2, 3, n)
    s = torch.randn(shape, generator=g) * 3
    if ties:
        s = s.round()
    w = torch.exp(s - s.amax(-1, keepdim=True))
    w[torch.rand(shape, generator=g) < 0.1] = 0.0
    r = torch.rand(2, 1, n, generator=g).clamp(0.02, 1.0)
    if ties:
        r = (r * 4).ceil() / 4
    r[..., :2] = 1.0  # H
    in_l = r < 1
    return w, C.token_factors(r, in_l), w.sum(-1) * 1.05


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("scan_cells", [0, 1 << 30])  # bisection / full scan
def test_fetch_plan_equals_the_reference_bit_for_bit(ties, scan_cells, monkeypatch):
    monkeypatch.setattr(C, "SCAN_CELLS", scan_cells)
    for seed, n in enumerate([1, 3, 40, 130]):
        w, f, denom = _inputs(seed, n, ties)
        for head in (None, 2, 16, 40, 100, n + 5):
            idx, count = _reference_shrink(w, f, head)
            sh = C.binary_shrink(w, f, head=head)
            assert torch.equal(sh.count, count)
            assert torch.equal(sh.mask(), torch.zeros(w.shape, dtype=torch.bool).scatter_(
                -1, idx, torch.arange(idx.shape[-1]) < count[..., None]) & (sh.u > -1))
        terms = C.terms(w, f, C.binary_shrink(w, f))
        for eps in (1e-9, 0.01, 0.05, 0.3, 1e9):
            for head in (None, 1, 8, n // 2 + 1, max(n - 1, 1), n):
                for also in (None, C.output_terms(0.1, DELTA, 64)):
                    plan = C.fetch_plan_terms(*terms, denom, eps, DELTA, head=head, also=also)
                    ref = _reference_plan(*terms, denom, eps, DELTA, head, also)
                    for name, want in zip(("k_star", "exact", "eps_before", "eps_after"), ref,
                                          strict=True):
                        assert same(getattr(plan, name), want), (n, eps, head, name)


def test_fetch_plan_nan_and_zero_denominator_match_the_reference():
    w, f, denom = _inputs(3, 50, False)
    terms = C.terms(w, f, C.binary_shrink(w, f))
    for d in (torch.zeros_like(denom), torch.full_like(denom, math.nan)):
        plan = C.fetch_plan_terms(*terms, d, 0.05, DELTA, head=None)
        ref = _reference_plan(*terms, d, 0.05, DELTA, None)
        assert all(same(getattr(plan, name), want) for name, want in
                   zip(("k_star", "exact", "eps_before", "eps_after"), ref, strict=True))


@pytest.mark.parametrize("options", [{}, {"shrinkage": "bounded"}, {"sketch": "perfect"},
                                     {"pass_plan": "shared"}])
def test_attend_log_factors_and_softmax_equal_the_plain_forms(options):
    pol, state, a, k, v, qq, _, qpos, _ = verkv_layer(
        {"compression": 8, **options}, n_q=4, n_kv=2, d=16, context=300, question=6, decode=1,
        seed=2)
    n = a.context_len
    dec = KF.decide(qq, qpos, state, pol.config(),
                    extra_logits=logits(qq, k[:, n:], qpos, torch.arange(n, k.shape[1])))
    union, own = KF.reweighted_log_factors(state, dec, qq.shape[0])
    assert torch.equal(union, KF.reweighted_log_factor(state, dec, qq.shape[0]))
    assert torch.equal(own, KF.reweighted_log_factor(state, dec, qq.shape[0], own=True))
    # the softmax as it was written: logits, cat, logsumexp, exp, einsum over expanded values
    s = logits(qq, k, qpos)
    s = torch.cat([s[..., :n] + union, s[..., n:]], dim=-1)
    ld = torch.logsumexp(s, dim=-1)
    o = torch.einsum("hmn,hnd->hmd", torch.exp(s - ld[..., None]), expand_kv(v, qq.shape[0]))
    got_o, got_ld = weighted_attention(qq, qpos, k, v, union)
    assert torch.equal(got_o, o) and torch.equal(got_ld, ld)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gqa_einsum_equals_einsum_over_expanded_heads(dtype):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the grouped products (several threads: einsum itself)
    try:
        g = torch.Generator().manual_seed(0)
        for n_q, n_kv in ((9, 3), (4, 4), (8, 2)):
            for m, n, d in ((1, 1, 8), (1, 300, 64), (6, 1, 16), (36, 2092, 64), (5, 77, 1)):
                q = torch.randn(n_q, m + 2, d, generator=g, dtype=dtype)[:, 1:m + 1]  # a slice
                k, v = (torch.randn(n_kv, n, d, generator=g, dtype=dtype) for _ in range(2))
                p = torch.rand(n_q, m, n, generator=g, dtype=dtype)
                assert torch.equal(gqa_einsum("hmd,hnd->hmn", q, k),
                                   torch.einsum("hmd,hnd->hmn", q, expand_kv(k, n_q)))
                assert torch.equal(gqa_einsum("hmn,hnd->hmd", p, v),
                                   torch.einsum("hmn,hnd->hmd", p, expand_kv(v, n_q)))
                assert torch.equal(expand_kv(k, n_q), k.repeat_interleave(n_q // n_kv, 0))
    finally:
        torch.set_num_threads(threads)


def test_running_max_reads_equal_cummax():
    g = torch.Generator().manual_seed(1)
    for k in (1, 63, 64, 65, 200, 4096):
        x = _rows(k, (2, 3, k), ties=k % 2 == 1)
        col = torch.randint(0, k, (2, 3, 5), generator=g)
        assert same(C._RunningMax(x.abs()).at(col), x.abs().cummax(-1).values.gather(-1, col))


def test_logits_mask_as_written_before():
    """The causal mask on the keys after each row's position, masked in place from the first
    key any row can miss (k_pos None), as the masked_fill over every key was."""
    g = torch.Generator().manual_seed(2)
    k = torch.randn(2, 100, 16, generator=g)
    for rows in ([0, 1, 2], [5, 9, 20], [-3, 2], [99, 100], [150, 160], [], [40, 10, 70]):
        q_pos = torch.tensor(rows, dtype=torch.long)
        q = torch.randn(6, len(rows), 16, generator=g)
        for k_pos in (None, torch.arange(30, 130), torch.arange(100).flip(0)):
            at = torch.arange(100) if k_pos is None else k_pos
            want = (torch.einsum("hmd,hnd->hmn", q, expand_kv(k, 6)) / 4.0).masked_fill(
                at[None, None, :] > q_pos[None, :, None], float("-inf"))
            assert torch.equal(logits(q, k, q_pos, k_pos), want)


@pytest.mark.parametrize("k", [20, 37, 50])
def test_rows_kept_in_stable_order_plan_as_torch_topk_order(k):
    """Rows :func:`C._topk_rows` leaves in the stable order get the plan ``torch.topk``'s order
    of their tied gains gives (the order the fetch head keeps): gains of few values, tied tokens
    with equal beta and V but for some rows, b free, heads cut inside runs of ties."""
    g = torch.Generator().manual_seed(k)
    rows, n = 400, 64
    gain = torch.randint(1, 17, (rows, n), generator=g).float() / 16
    gain[torch.rand(rows, n, generator=g) < 0.1] = 0.0
    beta_i = torch.where(gain > 0.9, gain / 3, 0.0)  # equal for equal gains
    var_i = gain * gain / 5
    odd = torch.rand(rows, 1, generator=g) < 0.3  # rows where tied tokens' V differ
    var_i = torch.where(odd, var_i * (1 + torch.rand(rows, n, generator=g) / 8), var_i)
    b_i = gain * torch.rand(rows, n, generator=g)
    denom = torch.full((rows,), 2.0)
    stable, rest, after = C._fetch_head(gain, k)
    topk = torch.topk(gain, k, dim=-1).indices
    for eps in (0.05, 0.3, 1.0):
        args = (beta_i, var_i, b_i, beta_i.sum(-1), var_i.sum(-1), denom, eps, DELTA, None)
        plan, _ = C._plan_on(stable, rest, *args)
        want, _ = C._plan_on(topk, None, *args)
        redo = C._topk_rows(gain, (beta_i, var_i, b_i, plan.k_star), stable, after)
        keep = torch.ones(rows, dtype=torch.bool).index_fill_(0, redo, False)
        assert 0 < int(keep.sum()) < rows
        for name in ("k_star", "exact", "eps_before", "eps_after"):
            assert same(getattr(plan, name)[keep], getattr(want, name)[keep]), (eps, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_logsumexp_and_softmax_with_masked_entries_equal_torch(dtype):
    """logsumexp and weighted_from_logits' exp with -inf entries off exp's slow path: torch's
    logsumexp and exp bit for bit, rows of -inf only, with a NaN or +inf among them."""
    g = torch.Generator().manual_seed(3)
    for trial in range(60):
        rows, n = int(torch.randint(1, 12, (1,), generator=g)), int(torch.randint(1, 3000, (1,),
                                                                                 generator=g))
        s = (torch.randn(2, rows, n, generator=g) * float(torch.rand(1, generator=g) * 60))
        s[torch.rand(2, rows, n, generator=g) < float(torch.rand(1, generator=g))] = -math.inf
        s[0, 0] = -math.inf if trial % 5 == 0 else s[0, 0]
        if trial % 7 == 0:
            s[1, -1, 0] = math.inf
        if trial % 9 == 0:
            s[1, 0, -1] = math.nan
        s = s.to(dtype)
        assert same(logsumexp(s), torch.logsumexp(s, dim=-1))
        log_w = torch.zeros(n, dtype=dtype)
        v = torch.randn(1, n, 4, generator=g).to(dtype)
        o, ld = weighted_from_logits(s.clone(), log_w, v)
        want_ld = torch.logsumexp(s, dim=-1)
        p = (s - want_ld[..., None]).exp()
        assert same(ld, want_ld)
        assert same(o, torch.einsum("hmn,hnd->hmd", p, expand_kv(v, 2)))
