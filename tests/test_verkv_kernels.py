"""VerKV kernels against independent computations: Monte-Carlo, brute force, scipy."""

import itertools
import math

import numpy as np
import pytest
import torch
from scipy.optimize import minimize

from kvsim.attention.sampling import (
    always_kept,
    inclusion_probs,
    poisson_compress,
    solve_c,
    topk_keep,
)
from kvsim.attention.scoring import to_tau
from kvsim.policies.verkv import certificate as C
from kvsim.policies.verkv.kvfetch import DecideConfig, decide, make_layer
from kvsim.policies.verkv.sketch import (
    build_sketch,
    rope_pairs,
    sketch_bits_per_token,
    sketch_bytes,
)

F64 = torch.float64
DELTA = 0.1


def rows_case(kind: str, n: int = 300, seed: int = 0):
    """(w, r) of one decision over L, and the exact mass of H."""
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(n, generator=g, dtype=F64)
    if kind == "heavy":  # Pareto weights, r following the weights
        w = (1 - u) ** (-1 / 1.2)
        r = (0.05 + 0.5 * torch.rand(n, generator=g, dtype=F64)).clamp(max=0.95)
    elif kind == "spiky":  # a few huge weights that were given small r
        w = torch.rand(n, generator=g, dtype=F64) * 0.2
        w[:5] = torch.tensor([40.0, 25.0, 12.0, 8.0, 5.0], dtype=F64)
        r = torch.full((n,), 0.3, dtype=F64)
        r[:5] = torch.tensor([0.9, 0.6, 0.3, 0.2, 0.15], dtype=F64)
    elif kind == "small_r":
        w = torch.exp(1.5 * torch.randn(n, generator=g, dtype=F64))
        r = 0.01 + 0.04 * torch.rand(n, generator=g, dtype=F64)
    elif kind == "large_r":
        w = torch.exp(torch.randn(n, generator=g, dtype=F64))
        r = 0.6 + 0.35 * torch.rand(n, generator=g, dtype=F64)
    else:
        raise ValueError(kind)
    return w, r, float(w.sum()) * 0.5


def draw(r: torch.Tensor, samples: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(samples, r.shape[-1], generator=g, dtype=F64) < r


def binomial_slack(p: float, n: int) -> float:
    return 3.0 * math.sqrt(p * (1 - p) / n) + 1.0 / n


CASES = ["heavy", "spiky", "small_r", "large_r"]


def shrunk_case(kind: str, shrink: str):
    """(w, r, H mass, L mask, lambda) of a case under one shrinkage rule."""
    w, r, h_mass = rows_case(kind)
    in_l = torch.ones_like(w, dtype=torch.bool)
    lam = {"unbiased": torch.ones_like(w),
           "binary": C.binary_shrinkage(w, r, in_l, head=None),
           "bounded": C.bounded_shrinkage(w, r, in_l)}[shrink]
    return w, r, h_mass, in_l, lam


# ------------------------------------------------------------------------ certificate

@pytest.mark.parametrize("kind", CASES)
@pytest.mark.parametrize("shrink", ["unbiased", "binary", "bounded"])
def test_bernstein_coverage_monte_carlo(kind, shrink):
    w, r, h_mass, in_l, lam = shrunk_case(kind, shrink)
    d_true = h_mass + float(w.sum())
    e = float(C.eps_hat(w, r, lam, in_l, d_true, DELTA))
    samples = 4000
    z = draw(r, samples, seed=1)
    d_hat = h_mass + (z * (lam * w / r)).sum(-1)
    rel = (d_hat - d_true).abs() / d_true
    rate = float((rel > e).double().mean())
    assert rate <= DELTA + binomial_slack(DELTA, samples), (kind, shrink, rate, e)
    # the test has power: a certificate ten times too small is violated far more often
    if kind in ("heavy", "small_r"):
        assert float((rel > 0.1 * e).double().mean()) > DELTA


@pytest.mark.parametrize("kind", CASES)
def test_kvfetch_output_coverage(kind):
    w, r, h_mass = rows_case(kind, seed=3)
    in_l = torch.ones_like(w, dtype=torch.bool)
    d_true = h_mass + float(w.sum())
    eps = 0.05
    lam = C.binary_shrinkage(w, r, in_l, head=None)
    plan = C.fetch_plan(w, r, lam, in_l, torch.tensor(d_true, dtype=F64), eps, DELTA)
    assert float(plan.eps_after) < eps
    samples = 4000
    z = draw(r, samples, seed=7)
    exact = plan.exact
    d_hat = h_mass + (w * exact).sum() + (z * ~exact * (lam * w / r)).sum(-1)
    rel = (d_hat - d_true).abs() / d_true
    rate = float((rel > eps).double().mean())
    assert rate <= DELTA + binomial_slack(DELTA, samples), (kind, rate)
    # without the fetch the same estimator misses eps more often than delta (except when
    # nothing had to be fetched)
    if int(plan.k_star) > 0 and kind != "large_r":
        d_nofetch = h_mass + (z * (lam * w / r)).sum(-1)
        assert float(((d_nofetch - d_true).abs() / d_true > eps).double().mean()) > rate


# ---------------------------------------------------------------------------- shrinkage

def test_bounded_shrinkage_matches_scipy():
    g = torch.Generator().manual_seed(5)
    for _ in range(4):
        n = 12
        w = torch.exp(2 * torch.randn(n, generator=g, dtype=F64))
        r = 0.02 + 0.9 * torch.rand(n, generator=g, dtype=F64)
        in_l = torch.ones(n, dtype=torch.bool)
        lam = C.bounded_shrinkage(w, r, in_l)
        wn, rn = w.numpy(), r.numpy()

        def f(x):
            bias = (wn * (1 - x)).sum()
            return bias**2 + (x**2 * wn**2 * (1 - rn) / rn).sum()

        def grad(x):
            bias = (wn * (1 - x)).sum()
            return -2 * bias * wn + 2 * x * wn**2 * (1 - rn) / rn

        best = None
        for x0 in (np.ones(n), rn.copy(), 0.5 * (1 + rn)):
            res = minimize(f, x0, jac=grad, bounds=list(zip(rn, np.ones(n))), method="L-BFGS-B",
                           options={"ftol": 1e-15, "gtol": 1e-12, "maxiter": 5000})
            if best is None or res.fun < best.fun:
                best = res
        m_ours = float(C.mse(w, r, lam, in_l))
        assert m_ours <= best.fun * (1 + 1e-7) + 1e-12
        assert abs(m_ours - best.fun) <= 1e-6 * best.fun
        np.testing.assert_allclose(lam.numpy(), best.x, atol=2e-4)
        # the fixed point of Theorem 1 holds
        beta = float((w * (1 - lam)).sum())
        fixed = torch.clamp(beta * r / (w * (1 - r)), min=r, max=torch.ones_like(r))
        torch.testing.assert_close(lam, fixed, atol=1e-9, rtol=1e-9)


def test_binary_shrinkage_is_best_prefix():
    g = torch.Generator().manual_seed(11)
    for _ in range(30):
        n = 9
        w = torch.exp(2 * torch.randn(n, generator=g, dtype=F64))
        r = 0.02 + 0.95 * torch.rand(n, generator=g, dtype=F64)
        in_l = torch.ones(n, dtype=torch.bool)
        lam = C.binary_shrinkage(w, r, in_l, head=None)
        order = torch.argsort(w * (1 - r) / r, descending=True)
        prefix_mse = []
        for p in range(n + 1):
            lp = torch.ones_like(w)
            lp[order[:p]] = r[order[:p]]
            prefix_mse.append(float(C.mse(w, r, lp, in_l)))
        assert float(C.mse(w, r, lam, in_l)) == pytest.approx(min(prefix_mse), rel=1e-12)
        # and it is a prefix of that order
        shrunk = (lam < 1).nonzero()[:, 0]
        assert set(shrunk.tolist()) == set(order[: len(shrunk)].tolist())
        # bounded shrinkage is at least as good (it minimises over the whole box)
        assert float(C.mse(w, r, C.bounded_shrinkage(w, r, in_l), in_l)) <= min(prefix_mse) + 1e-9


def test_mse_change_formula():
    g = torch.Generator().manual_seed(2)
    n = 20
    w = torch.exp(torch.randn(n, generator=g, dtype=F64))
    r = 0.05 + 0.9 * torch.rand(n, generator=g, dtype=F64)
    in_l = torch.ones(n, dtype=torch.bool)
    lam = torch.where(torch.rand(n, generator=g, dtype=F64) < 0.4, r, torch.ones_like(r))
    for i in (lam == 1).nonzero()[:, 0].tolist():
        beta = float((w * (1 - lam)).sum())
        after = lam.clone()
        after[i] = r[i]
        change = float(C.mse(w, r, after, in_l) - C.mse(w, r, lam, in_l))
        a = float(w[i] * (1 - r[i]))
        assert change == pytest.approx(a * (2 * beta - float(w[i] * (1 - r[i]) / r[i])),
                                       rel=1e-9, abs=1e-12)


def test_binary_head_equals_full_sort():
    g = torch.Generator().manual_seed(4)
    w = torch.exp(2 * torch.randn(16, 2000, generator=g, dtype=F64))
    r = 0.001 + 0.3 * torch.rand(16, 2000, generator=g, dtype=F64)
    in_l = torch.rand(16, 2000, generator=g) < 0.9
    full = C.binary_shrinkage(w, r, in_l, head=None)
    for head in (4, 64, 4096):  # 4 forces the fallback on every row
        assert torch.equal(C.binary_shrinkage(w, r, in_l, head=head), full)


# ------------------------------------------------------------------------------- KVFetch

def brute_eps(w, r, lam, members, denom):
    """eps_hat of an explicit token list, straight from Lemma 1."""
    l = math.log(2 / DELTA)
    if not members:
        return 0.0
    idx = torch.tensor(members)
    wi, ri, li = w[idx], r[idx], lam[idx]
    beta = float((wi * (1 - li)).sum())
    var = float((li**2 * wi**2 * (1 - ri) / ri).sum())
    b = float((li * wi / ri * torch.maximum(ri, 1 - ri)).max())
    return (beta + b * l / 3 + math.sqrt((b * l / 3) ** 2 + 2 * var * l)) / denom


@pytest.mark.parametrize("kind", CASES)
def test_kstar_is_the_minimum_and_certificate_decreases(kind):
    w, r, h_mass = rows_case(kind, n=60, seed=9)
    in_l = torch.ones_like(w, dtype=torch.bool)
    in_l[::7] = False  # some tokens are in H: they never enter the order
    denom = h_mass + float(w.sum())
    lam = C.binary_shrinkage(w, r, in_l, head=None)
    members = in_l.nonzero()[:, 0].tolist()
    e_all = brute_eps(w, r, lam, members, denom)
    gains = {i: e_all - brute_eps(w, r, lam, [j for j in members if j != i], denom)
             for i in members}
    order = sorted(members, key=lambda i: -gains[i])
    curve = [brute_eps(w, r, lam, order[k:], denom) for k in range(len(order) + 1)]
    assert all(a >= b - 1e-12 for a, b in zip(curve, curve[1:]))  # non-increasing
    for eps in (0.3, 0.1, 0.05, 0.01):
        plan = C.fetch_plan(w, r, lam, in_l, torch.tensor(denom, dtype=F64), eps, DELTA)
        k_brute = min(k for k, e in enumerate(curve) if e < eps)
        assert int(plan.k_star) == k_brute
        assert set(plan.exact.nonzero()[:, 0].tolist()) == set(order[:k_brute])
        assert float(plan.eps_before) == pytest.approx(e_all, rel=1e-9)
        assert float(plan.eps_after) == pytest.approx(curve[k_brute], rel=1e-9, abs=1e-15)
        # no smaller fetch along the order would do
        assert k_brute == 0 or curve[k_brute - 1] >= eps


def test_fetch_head_equals_full_sort():
    g = torch.Generator().manual_seed(8)
    w = torch.exp(2.5 * torch.randn(12, 3000, generator=g, dtype=F64))
    r = 0.001 + 0.2 * torch.rand(12, 3000, generator=g, dtype=F64)
    in_l = torch.rand(12, 3000, generator=g) < 0.95
    lam = C.binary_shrinkage(w, r, in_l, head=None)
    denom = w.sum(-1)
    full = C.fetch_plan(w, r, lam, in_l, denom, 0.02, DELTA, head=None)
    assert int(full.k_star.max()) > 16  # the small head below must fall back
    for head in (16, 256, 4096):
        part = C.fetch_plan(w, r, lam, in_l, denom, 0.02, DELTA, head=head)
        assert torch.equal(part.k_star, full.k_star)
        assert torch.equal(part.exact, full.exact)


# --------------------------------------------------------------------- PoissonComp, top-k

def test_poisson_expected_count_equals_budget_and_every_token_in_h_or_l():
    g = torch.Generator().manual_seed(0)
    scores = torch.rand(3, 4000, generator=g, dtype=F64) ** 6
    scores[:, 100:200] = 0.0  # zero scores would give r = 0 without the floor
    tau = to_tau(scores)
    for budget in (50.0, 250.5, 1000.0):
        r = inclusion_probs(tau, budget, always_kept(4000, 16, 16)[None, :])
        middle = ~always_kept(4000, 16, 16)
        torch.testing.assert_close(r[:, middle].sum(-1), torch.full((3,), budget, dtype=F64),
                                   rtol=1e-10, atol=1e-8)
        assert bool((r > 0).all()) and bool((r <= 1).all())
        assert bool((r[:, ~middle] == 1).all())
    smp = poisson_compress(tau, 16, 16, 250.5, torch.Generator().manual_seed(1))
    assert bool((smp.in_h | smp.in_l).all()) and not bool((smp.in_h & smp.in_l).any())
    assert bool((smp.sampled <= smp.in_l).all())
    assert float(smp.expected_kept().mean()) == pytest.approx(32 + 250.5, rel=1e-10)
    # the draws average to the expected count
    counts = [poisson_compress(tau, 16, 16, 250.5, torch.Generator().manual_seed(s))
              .resident.sum(-1).double() for s in range(200)]
    assert float(torch.stack(counts).mean()) == pytest.approx(32 + 250.5, rel=0.01)


def test_solve_c_against_bisection():
    g = torch.Generator().manual_seed(3)
    tau = torch.rand(4, 500, generator=g, dtype=F64) ** 3 + 1e-4
    cand = torch.ones_like(tau, dtype=torch.bool)
    c = solve_c(tau, 120.0, cand)
    lo, hi = torch.zeros(4, dtype=F64), torch.full((4,), 1e6, dtype=F64)
    for _ in range(200):
        mid = (lo + hi) / 2
        big = (mid[:, None] * tau).clamp(max=1).sum(-1) > 120
        hi, lo = torch.where(big, mid, hi), torch.where(big, lo, mid)
    torch.testing.assert_close(c, lo, rtol=1e-9, atol=0)


def test_eviction_keeps_exactly_its_budget():
    g = torch.Generator().manual_seed(0)
    scores = torch.rand(4, 1000, generator=g)
    for budget in (8, 64, 333):
        keep = topk_keep(scores, budget, 4, 4)
        assert keep.sum(-1).tolist() == [budget] * 4
        assert bool(keep[:, :4].all()) and bool(keep[:, -4:].all())
        # the kept middle tokens are the best-scored ones
        mid = scores[:, 4:-4]
        kept_mid = keep[:, 4:-4]
        worst_kept = torch.where(kept_mid, mid, torch.inf).amin(-1)
        best_dropped = torch.where(kept_mid, -torch.inf, mid).amax(-1)
        assert bool((worst_kept >= best_dropped).all())


# --------------------------------------------------------------------------- the sketch

def test_sketch_costs_and_quantization():
    assert sketch_bits_per_token(128) == 72
    assert sketch_bytes(128 * 10, 128) * 8 / (128 * 10 * 2 * 128 * 16) == pytest.approx(0.017578125)
    g = torch.Generator().manual_seed(0)
    scale = torch.ones(64)
    scale[[3, 35, 10, 42]] = 5.0  # two rotate-half pairs (3, 35), (10, 42) carry the energy
    k = torch.randn(2, 300, 64, generator=g) * scale
    sk = build_sketch(k, rope_pairs(64))
    assert sk.channels.shape == (2, 16)
    for ch in (3, 35, 10, 42):
        assert bool((sk.channels == ch).any(-1).all())
    sel = k.gather(-1, sk.channels[:, None, :].expand(2, 300, 16))
    step = sk.scale.repeat_interleave(128, dim=1)[:, :300]
    assert bool(((sk.keys - sel).abs() <= step / 2 + 1e-2 * step + 1e-3).all())
    assert int(sk.codes.max()) <= 3


# ------------------------------------------------------------------ decide: GQA, sample

def layer_case(seed_sample: int, variant: str = "independent", sketch: bool = True):
    g = torch.Generator().manual_seed(0)
    n_kv, n_q, n, d = 2, 8, 1500, 32
    k = torch.randn(n_kv, n, d, generator=g, dtype=F64)
    k[:, 100:110] += 2.5  # a block of tokens the queries like
    q = torch.randn(n_q, 3, d, generator=g, dtype=F64) + 1.0
    tau = to_tau(torch.rand(n_kv, n, generator=g, dtype=F64) ** 4)
    smp = poisson_compress(tau, 4, 4, 100.0, torch.Generator().manual_seed(seed_sample))
    sk = build_sketch(k) if sketch else None
    return make_layer(smp, sk, k, variant), q, torch.full((3,), n + 5)


def test_fetch_set_does_not_depend_on_the_sample():
    cfg = DecideConfig(eps=0.05, delta=DELTA)
    a, q, pos = layer_case(1)
    b, _, _ = layer_case(2)
    assert not torch.equal(a.sample.sampled, b.sample.sampled)
    da, db = decide(q, pos, a, cfg), decide(q, pos, b, cfg)
    assert bool((da.k_star > 0).any())
    assert torch.equal(da.own_exact, db.own_exact)
    assert torch.equal(da.exact_kv, db.exact_kv)
    torch.testing.assert_close(da.eps_before, db.eps_before)
    # the paper's variant plans with exact weights on the (sample-dependent) resident tokens
    pa, pb = (decide(q, pos, layer_case(s, "paper")[0], cfg) for s in (1, 2))
    assert not torch.equal(pa.eps_before, pb.eps_before)


def test_gqa_union():
    layer, q, pos = layer_case(1)
    dec = decide(q, pos, layer, DecideConfig(eps=0.02, delta=DELTA))
    g = q.shape[0] // 2
    for j in range(2):
        union = dec.own_exact[j * g:(j + 1) * g].any(0)
        assert torch.equal(dec.exact_kv[j], union)
    # heads of a group disagree, so the union is strictly larger than some head's own set
    own = dec.own_exact.view(2, g, 3, -1).sum(-1)
    assert bool((dec.exact_kv.sum(-1)[:, None] >= own).all())
    assert bool((dec.exact_kv.sum(-1)[:, None] > own).any())
    # making more tokens exact can only lower the certificate
    assert bool((dec.eps_after <= torch.where(dec.k_star > 0, torch.full_like(dec.eps_after, 0.02),
                                              dec.eps_before) + 1e-12).all())


def test_decide_perfect_sketch_matches_dense_kernels():
    """With the perfect sketch, decide's weights, lambda and fetch set are those of the row
    kernels applied to exact softmax weights."""
    layer, q, pos = layer_case(1, sketch=False)
    cfg = DecideConfig(eps=0.05, delta=DELTA)
    dec = decide(q, pos, layer, cfg)
    s = torch.einsum("hmd,hnd->hmn", q, layer.k_host.repeat_interleave(4, 0)) / math.sqrt(32)
    w = torch.exp(s - s.amax(-1, keepdim=True))
    r = layer.sample.r.repeat_interleave(4, 0)[:, None, :]
    in_l = layer.sample.in_l.repeat_interleave(4, 0)[:, None, :]
    lam = C.binary_shrinkage(w, r, in_l, head=None)
    plan = C.fetch_plan(w, r, lam, in_l, w.sum(-1), 0.05, DELTA, head=None)
    assert torch.equal(dec.own_exact, plan.exact)
    torch.testing.assert_close(dec.eps_before, plan.eps_before)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_tiny_rows(n):
    w = torch.ones(n, dtype=F64)
    r = torch.full((n,), 0.5, dtype=F64)
    in_l = torch.ones(n, dtype=torch.bool)
    plan = C.fetch_plan(w, r, torch.ones_like(w), in_l, torch.tensor(float(n)), 1e-9, DELTA)
    assert int(plan.k_star) == n and bool(plan.exact.all())


def test_brute_force_best_subset_is_not_worse_than_greedy():
    """The greedy order is a heuristic for the largest L' with eps_hat < eps; brute force over
    every subset of a small L finds one at least as large (a sanity check of both)."""
    w, r, h_mass = rows_case("heavy", n=10, seed=1)
    in_l = torch.ones_like(w, dtype=torch.bool)
    denom = h_mass + float(w.sum())
    lam = C.binary_shrinkage(w, r, in_l, head=None)
    eps = 0.05
    plan = C.fetch_plan(w, r, lam, in_l, torch.tensor(denom, dtype=F64), eps, DELTA)
    best = max(len(s) for k in range(11) for s in itertools.combinations(range(10), k)
               if brute_eps(w, r, lam, list(s), denom) < eps)
    assert best >= 10 - int(plan.k_star)


def test_sparse_binary_terms_equal_dense_terms_after_fallback():
    g = torch.Generator().manual_seed(6)
    w = torch.exp(2 * torch.randn(3, 5, 400, generator=g, dtype=F64))
    r = (0.001 + 0.3 * torch.rand(3, 1, 400, generator=g, dtype=F64))
    in_l = torch.rand(3, 1, 400, generator=g) < 0.9
    f = C.token_factors(r, in_l)
    sparse = C.binary_shrink(w, f, head=4)  # every row falls back to a full sort
    assert sparse.idx.shape[-1] == 400
    dense = C.binary_shrinkage(w, r, in_l, head=None)
    torch.testing.assert_close(sparse.lam(f), torch.where(in_l, dense, torch.ones_like(dense)))
    for a, b in zip(C.terms(w, f, sparse), C.terms(w, f, dense)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-300)


def test_decide_coverage_over_samples_perfect_sketch():
    """End to end (Theorem 2): with exact weights the plan (lambda, union of exact tokens) does
    not depend on the sample, so over 2,000 independent samples the reweighted denominator of
    every decision misses eps in at most delta of them (plus binomial slack)."""
    layer, q, pos = layer_case(1, sketch=False)
    eps = 0.05
    dec = decide(q, pos, layer, DecideConfig(eps=eps, delta=DELTA))
    assert bool((dec.k_star > 0).any())
    n_q, m, n = dec.own_exact.shape
    s = torch.einsum("hmd,hnd->hmn", q, layer.k_host.repeat_interleave(4, 0)) / math.sqrt(32)
    w = torch.exp(s - s.amax(-1, keepdim=True))
    smp = layer.sample
    rep = lambda x: x.repeat_interleave(4, 0)[:, None, :]  # noqa: E731
    exact = rep(smp.in_h) | dec.exact_kv.repeat_interleave(4, 0)
    lam = dec.lam(layer.factors)
    rest = rep(smp.in_l) & ~exact
    r = rep(smp.r)
    fixed = (w * exact).sum(-1)
    d_true = w.sum(-1)
    samples = 2000
    z = torch.rand(samples, 2, n, generator=torch.Generator().manual_seed(5), dtype=F64) \
        < smp.r[None]
    z = z.repeat_interleave(4, dim=1)[:, :, None, :]  # a sample per KV head, shared by its group
    d_hat = fixed + (z * rest * (lam * w / r)).sum(-1)
    miss = ((d_hat - d_true).abs() / d_true > eps).double().mean(0)
    assert float(miss.max()) <= DELTA + binomial_slack(DELTA, samples), miss


def test_kv_read_counts_each_byte_once():
    """The attend statistic against a direct count: per KV head, keys of the non-resident
    shortlist and K+V of the fetched tokens (union over query heads and rows of the pass)."""
    from kvsim.policies import make
    layer, q, pos = layer_case(1)
    pol = make("verkv", {"sink": 4, "local": 4, "eps": 0.02, "pass_plan": "rows"})
    k = layer.k_host
    n_kv, n, d = k.shape
    extra_k = torch.randn(n_kv, 6, d, generator=torch.Generator().manual_seed(1), dtype=F64)
    k_all = torch.cat([k, extra_k], 1)
    _, stats = counted(pol, layer, q, pos, k_all, k_all)
    dec = decide(q, pos, layer, pol.config(),
                 extra_logits=torch.einsum("hmd,hnd->hmn", q, extra_k.repeat_interleave(4, 0))
                 / math.sqrt(d))
    s = layer.sample.sampled
    fetched = (dec.exact_kv & ~s[:, None]).any(1)
    short = (dec.shortlisted & ~s[:, None]).any(1)
    expect = ((fetched | short).sum(-1) + fetched.sum(-1)) / (2.0 * n)
    assert bool(fetched.any())
    torch.testing.assert_close(stats["kv_read_frac"][::4, 0], expect.to(F64))
    assert bool((stats["kv_read_frac"] <= 1).all())


@pytest.mark.parametrize("kind", CASES)
@pytest.mark.parametrize("shrink", ["unbiased", "binary", "bounded"])
def test_certificate_equals_lemma_1_written_out(kind, shrink):
    """eps_hat against Lemma 1 written out in plain Python floats (the spec's formula, term by
    term): a certificate 20% too small (or large) fails here, where Monte-Carlo coverage,
    which a loose Bernstein bound passes with room, could not tell."""
    w, r, h_mass, in_l, lam = shrunk_case(kind, shrink)
    d = h_mass + float(w.sum())
    l = math.log(2 / DELTA)
    ws, rs, ls = w.tolist(), r.tolist(), lam.tolist()
    beta = sum(wi * (1 - li) for wi, li in zip(ws, ls))
    var = sum(li * li * wi * wi * (1 - ri) / ri for wi, ri, li in zip(ws, rs, ls))
    b = max(li * wi / ri * max(ri, 1 - ri) for wi, ri, li in zip(ws, rs, ls))
    want = (beta + b * l / 3 + math.sqrt((b * l / 3) ** 2 + 2 * var * l)) / d
    got = float(C.eps_hat(w, r, lam, in_l, d, DELTA))
    assert got == pytest.approx(want, rel=1e-12)
    assert not 0.8 * want == pytest.approx(got, rel=1e-3)  # the power this test has


@pytest.mark.parametrize("causal", [False, True])
def test_shortlist_is_one_set_per_kv_head_and_forward_pass(causal):
    """A question pass of 3 rows (causal: the rows see different prefixes) shortlists, per KV head,
    the 128 non-resident tokens with the largest sketch log-weight over every query head and row
    of the pass (brute force in float64 below), reads those keys once, and each row scores the
    ones it sees exactly."""
    from kvsim.policies.verkv.sketch import sketch_logits
    layer, q, pos = layer_case(1)
    n_kv, n, d = layer.k_host.shape
    n_q, m, _ = q.shape
    g = n_q // n_kv
    if causal:
        pos = torch.tensor([700, 1100, n - 1])
    dec = decide(q, pos, layer, DecideConfig(eps=0.05, delta=DELTA, shortlist=128))
    vis = torch.arange(n)[None, :] <= pos[:, None]  # (m, n)
    s = sketch_logits(layer.sketch, q)  # (n_q, m, n): sketch logits, exact where known
    known = layer.known_idx
    for h in range(n_kv):
        rows = slice(h * g, (h + 1) * g)
        exact_known = torch.einsum("gmd,rd->gmr", q[rows], layer.k_host[h, known[h]]) / math.sqrt(d)
        s[rows, :, known[h]] = exact_known
    s = s.masked_fill(~vis[None], float("-inf"))
    score = (s - s.amax(-1, keepdim=True)).view(n_kv, g * m, n).amax(1)  # (n_kv, n)
    cand = layer.sample.in_l & vis.any(0)[None]
    for h in range(n_kv):
        sc = score[h].masked_fill(~cand[h], float("-inf"))
        want = set(torch.topk(sc, 128).indices.tolist())
        got = dec.shortlisted[h]  # (m, n)
        union = set(got.any(0).nonzero().flatten().tolist())
        assert union == want
        for r in range(m):  # each row: the pass's shortlist, where it sees
            assert set(got[r].nonzero().flatten().tolist()) == {i for i in want if vis[r, i]}


def test_a_pass_split_into_row_chunks_decides_as_one(monkeypatch):
    """Long contexts split a pass's rows into chunks (memory); the shortlist stays the pass's:
    outputs and every statistic equal the unsplit pass, and at most 128 keys are read."""
    import kvsim.policies.verkv.policy as P
    from kvsim.policies import make
    layer, q, _ = layer_case(1)
    n_kv, n, d = layer.k_host.shape
    extra = torch.randn(n_kv, 6, d, generator=torch.Generator().manual_seed(2), dtype=F64)
    k_all = torch.cat([layer.k_host, extra], 1)
    pos = torch.tensor([n, n + 2, n + 5])  # question rows, seeing the context and each other
    pol = make("verkv", {"sink": 4, "local": 4, "eps": 0.02})
    whole, stats, _ = pol.attend(layer, q, pos, k_all, k_all)
    monkeypatch.setattr(P, "row_chunks", lambda n_q, m, n: [slice(i, i + 1) for i in range(m)])
    split, stats_split, _ = pol.attend(layer, q, pos, k_all, k_all)
    torch.testing.assert_close(split, whole)
    for key in stats:
        torch.testing.assert_close(stats_split[key], stats[key], msg=key)
    assert float(stats["shortlist_size"].max()) <= 128


def counted(pol, layer, q, pos, k, v):
    """attend through the caller's count of the reads (and its check of them)."""
    from kvsim.measure import traffic
    from kvsim.policies.base import Compressed
    return traffic.attend(pol, Compressed(layer, 0.0, 0.0, resident=layer.sample.resident), q,
                          pos, k, v, verify=True)
