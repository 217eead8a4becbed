"""Shrinkage, the Bernstein certificate and the KVFetch order (VerKV Sections 4.2, App. A.2, B).

Every function works on rows of tokens: tensors ``(..., n)`` whose leading dimensions are
independent decisions (KV head x query head x row); inputs broadcast. Per row: weights ``w``
(shifted, ``exp(s - m)``: every quantity is a ratio, so the shift cancels), inclusion
probabilities ``r`` and the set L (``0 < r < 1``). Per-token constants that only depend on r are
precomputed once per layer (:func:`token_factors`) and are zero outside L, so tokens outside L
(and tokens a row cannot see, whose ``w`` is 0) contribute nothing without any masking.

    MSE(lambda) = (sum_L w (1 - lambda))^2 + sum_L lambda^2 w^2 (1 - r) / r
    eps_hat(L') = [beta + b l / 3 + sqrt((b l / 3)^2 + 2 V l)] / D,   l = ln(2 / delta)
    beta = sum_L' w (1 - lambda), V = sum_L' lambda^2 w^2 (1 - r) / r,
    b = max_L' lambda w / r * max(r, 1 - r)

Sorting: the binary-shrinkage prefix and the fetch order only need the head of a descending
order. With ``head=K`` only the top K are selected; rows whose answer lies beyond the head are
recomputed with a full sort, so the result equals ``head=None`` (full sort). Every order is
:func:`top_desc`'s: descending, equal values by increasing token index (a stable sort's), so a
head is exactly the start of the full order, except that a head of fewer than n tokens keeps
``torch.topk``'s order among equal positive values (which of two tied tokens is shrunk or fetched
is that order's choice): rows with such ties take ``torch.topk`` itself where that order could
change the result (the fetch plan: :func:`_topk_rows`).

Compiled loops: on float32 CPU tensors with numba installed, the fetch plan, the binary
shrinkage's first head and the binary terms run as per-row loops (:mod:`._rows`) that repeat
this module's torch operations in the same order, with torch's square roots and row sums, so
the results are the same to the bit (``tests/test_verkv_rows.py`` checks them against this
code with the loops off); anything else (other dtypes, a NaN, a GPU) takes the torch code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvsim._torch import lazy, torch

_rows = lazy("kvsim.policies.verkv._rows")  # torch and numba: loaded on first use

FETCH_HEAD = 4096  # the paper's kernel sorts the top 4096 and falls back to a full sort
SHRINK_HEAD = 512
SHRINK_FIRST = 32  # the shrinkage prefix is tried on this many tokens before SHRINK_HEAD


def _key_sortable(x: torch.Tensor) -> bool:
    """Whether numpy's key sort applies: float32 on the CPU, every value >= 0 and finite."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or not x.numel():
        return False
    lo_hi = torch.aminmax(x)
    return float(lo_hi.min) >= 0 and float(lo_hi.max) < math.inf


def top_desc(x: torch.Tensor, k: int, values: bool = True):
    """(values, indices) of the ``k`` largest entries of each row of ``x`` (..., n), descending,
    equal values in increasing index order: the first ``k`` of a stable descending sort (without
    ``values`` the values may be None).

    On the CPU, float32 rows of non-negative finite values take a faster way: a short head
    (``16 k <= n``) is ``torch.topk`` with its ties put in index order (rows with a tie across
    the cut are sorted in full); a long one is numpy's SIMD sort of one 64-bit key per token (the
    value's bits, which order like the values when they are >= 0, then the index). Anything else
    takes torch's stable sort."""
    n = x.shape[-1]
    k = min(k, n)
    if not _key_sortable(x):
        vals, idx = torch.sort(x, dim=-1, descending=True, stable=True)
        return vals[..., :k], idx[..., :k]
    if 16 * k > n:
        idx = _sorted_keys(x)[..., :k]
        return (x.gather(-1, idx) if values else None), idx
    vals, idx = torch.topk(x, k + 1, dim=-1)
    # equal values in index order: sort by index, then stably by value
    by_idx, at = idx[..., :k].sort(dim=-1)
    v, at2 = vals[..., :k].gather(-1, at).sort(dim=-1, descending=True, stable=True)
    idx = by_idx.gather(-1, at2)
    cut = (vals[..., k] == vals[..., k - 1]).reshape(-1).nonzero()[:, 0]
    if cut.numel():  # the topk may have kept any of the tokens tied at the cut
        full_i = _sorted_keys(x.reshape(-1, n)[cut])[:, :k]
        lead = x.shape[:-1]
        idx = idx.reshape(-1, k).index_put((cut,), full_i).reshape(*lead, k)
        v = x.gather(-1, idx)
    return v, idx


def topk_order(x: torch.Tensor, k: int):
    """``torch.topk(x, k, dim=-1)``: the same values and indices, faster on the CPU where the
    ``k + 1`` largest of a row are distinct (then every descending order of them is the same, and
    the key head of :func:`_desc_keys` gives it); rows with equal values among them, and
    anything :func:`_key_sortable` refuses, take torch.topk itself."""
    n = x.shape[-1]
    if k + 1 > n or not _key_sortable(x):
        return torch.topk(x, k, dim=-1)
    idx = _partial_order(x, k)[..., :k + 1]
    vals = x.gather(-1, idx)
    tied = (vals[..., 1:] == vals[..., :-1]).any(-1)
    vals, idx = vals[..., :k], idx[..., :k]
    if bool(tied.any()):
        at = tied.nonzero(as_tuple=True)
        vals[at], idx[at] = torch.topk(x[at], k, dim=-1)
    return vals, idx


def _desc_keys(x: torch.Tensor) -> np.ndarray:
    """(-1, n) 64-bit keys of float32 values >= 0 (-0.0 included) whose ascending order is the
    stable descending order of the values: (bits of +inf - bits of the value) * 2^32 + index
    (numpy: faster than torch's 64-bit integer arithmetic)."""
    bits = x.reshape(-1, x.shape[-1]).view(torch.int32).numpy()
    key = np.maximum(bits, 0, dtype=np.int64)  # -0.0's bits (negative) -> +0.0's
    np.subtract(0x7F800000, key, out=key)
    key <<= 32
    key |= np.arange(x.shape[-1], dtype=np.int64)
    return key


def _indices(key: np.ndarray, shape) -> torch.Tensor:
    """The token indices (..., c) held in the low half of the keys ``key`` (-1, c)."""
    key &= 0xFFFFFFFF
    return torch.from_numpy(key).reshape(*shape[:-1], key.shape[-1])


def _sorted_keys(x: torch.Tensor) -> torch.Tensor:
    """The stable descending order of float32 rows >= 0 by one numpy sort of
    :func:`_desc_keys`."""
    key = _desc_keys(x)
    key.sort(axis=-1)
    return _indices(key, x.shape)


def _fetch_head(g: torch.Tensor, k: int):
    """The first ``k < n`` tokens of :func:`top_desc`'s order of ``g`` (..., n), the other
    tokens in any order (None: those ``head`` leaves out) and the token just after the head
    (None: not looked for, as on :func:`top_desc`'s short-head way)."""
    n = g.shape[-1]
    if not _key_sortable(g):
        idx = torch.sort(g, dim=-1, descending=True, stable=True).indices
        return idx[..., :k], idx[..., k:], idx[..., k]
    if 16 * k <= n:
        return top_desc(g, k, values=False)[1], None, None
    idx = _partial_order(g, k)
    return idx[..., :k], idx[..., k:], idx[..., k]


def _partial_order(x: torch.Tensor, k: int) -> torch.Tensor:
    """Token indices (..., n) of float32 rows >= 0: the first ``k + 1`` (``k < n``) in the
    stable descending order, the others after them in any order (numpy's partition of
    :func:`_desc_keys`, then a sort of the head alone)."""
    key = _desc_keys(x)
    key.partition(k, axis=-1)  # the k smallest keys first, the next one at k
    key[:, :k].sort(axis=-1)
    return _indices(key, x.shape)


def _topk_rows(g, terms, head, after) -> torch.Tensor:
    """Flat rows whose head must take ``torch.topk``'s order, the one the fetch head keeps
    among equal positive gains: rows with such a tie in the head or across its cut (``after``:
    the token just past it; None: not known, then every such row) whose plan could depend on the
    order of tied tokens (``terms`` = (beta_i, V_i, b_i, k*)). Tied tokens with equal beta and V
    add the same sums in the same order; their b only moves the suffix max from positions
    inside their run of ties, where k* cannot move unless it lies in the run or just past it.
    So the stable order's plan stands unless tied tokens' beta or V differ, the cut lies inside
    a run (the head could hold other tokens of it), k* cuts a run (positions k* - 1 and k* tied)
    or tied b differ and k* - 1 ends a run."""
    n = g.shape[-1]
    at = head if after is None else torch.cat([head, after[..., None]], -1)
    at = at.reshape(-1, at.shape[-1])
    gv = g.reshape(-1, n).gather(-1, at)
    rows = ((gv[:, 1:] == gv[:, :-1]) & (gv[:, 1:] > 0)).any(-1).nonzero()[:, 0]
    if after is None or not rows.numel():
        return rows
    at, gv = at[rows], gv[rows]
    tie = gv[:, 1:] == gv[:, :-1]  # (rows, K): positions j and j + 1 tied

    def differ(t):
        tv = t.reshape(-1, n)[rows].gather(-1, at)
        return ((tv[:, 1:] != tv[:, :-1]) & tie).any(-1)

    def tied_at(j):  # False outside 0..K - 1
        inside = (j >= 0) & (j < tie.shape[-1])
        return tie.gather(-1, j.clamp(0, tie.shape[-1] - 1)[:, None])[:, 0] & inside

    beta_i, var_i, b_i, k_star = terms
    k_star = k_star.reshape(-1)[rows]
    moves = differ(beta_i) | differ(var_i) | tie[:, -1] | tied_at(k_star - 1)
    moves |= differ(b_i) & tied_at(k_star - 2)
    return rows[moves]


def log_term(delta: float) -> float:
    return math.log(2.0 / delta)


def bernstein_eps(beta, var, bmax, denom, l: float):
    """eps_hat from the bias ``beta``, variance ``var``, range ``bmax`` and denominator."""
    t = bmax * (l / 3.0)
    return (beta + t + torch.sqrt(t * t + 2.0 * l * var.clamp_min(0.0))) / denom


@dataclass
class Factors:
    """Per-token constants of r (broadcastable to the weights); ``r`` is 1 outside L, the others
    are zero there, so tokens outside L contribute nothing."""
    r: torch.Tensor
    odds: torch.Tensor  # (1 - r) / r
    one_minus_r: torch.Tensor  # 1 - r
    bfac: torch.Tensor  # max(r, 1 - r) / r


def token_factors(r: torch.Tensor, in_l: torch.Tensor) -> Factors:
    zero = torch.zeros((), dtype=r.dtype, device=r.device)
    rr = torch.where(in_l, r, torch.ones((), dtype=r.dtype, device=r.device))
    return Factors(rr,
                   torch.where(in_l, (1 - rr) / rr, zero), torch.where(in_l, 1 - rr, zero),
                   torch.where(in_l, torch.maximum(rr, 1 - rr) / rr, zero))


def _take_rows(x: torch.Tensor, shape, rows: torch.Tensor) -> torch.Tensor:
    """Rows ``rows`` of ``x`` broadcast to ``shape`` and flattened to (-1, n), without
    materialising the broadcast."""
    x = x.reshape((1,) * (len(shape) - x.dim()) + tuple(x.shape))
    idx, rest = [], rows
    for size in reversed(shape[:-1]):  # torch.unravel_index, faster
        idx.insert(0, rest % size)
        rest = rest // size
    # index x itself: indexing the broadcast view is slow
    return x[tuple(i if size > 1 else torch.zeros_like(i) for i, size in zip(idx, x.shape))]


def mse(w: torch.Tensor, r: torch.Tensor, lam: torch.Tensor, in_l: torch.Tensor) -> torch.Tensor:
    """MSE of the shrinkage estimator of D over L (Definition 2, eq. 6)."""
    bias = torch.where(in_l, w * (1 - lam), 0.0).sum(-1)
    var = torch.where(in_l, lam**2 * w**2 * (1 - r) / r, 0.0).sum(-1)
    return bias**2 + var


# ----------------------------------------------------------------------------- shrinkage

@dataclass
class BinaryShrink:
    """lambda_i = r_i on ``idx[..., :count]``, 1 elsewhere (sparse)."""
    idx: torch.Tensor  # (..., K) token indices in visiting order
    count: torch.Tensor  # (...) tokens shrunk
    u: torch.Tensor  # (..., n) w (1 - r) / r, reused for the variance

    def mask(self) -> torch.Tensor:
        sel = torch.arange(self.idx.shape[-1], device=self.idx.device) < self.count[..., None]
        hit = torch.zeros(self.u.shape, dtype=self.u.dtype, device=self.u.device)
        return hit.scatter_add_(-1, self.idx, sel.to(hit.dtype)) > 0

    def lam(self, f: Factors) -> torch.Tensor:
        return torch.where(self.mask(), f.r.expand(self.u.shape), torch.ones_like(self.u))


def binary_shrink(w: torch.Tensor, f: Factors, head: int | None = SHRINK_HEAD) -> BinaryShrink:
    """Appendix A.2: visit L in decreasing ``u_i = w_i (1 - r_i) / r_i`` and set
    ``lambda_i = r_i`` (adding ``a_i = w_i (1 - r_i)`` to beta) while ``u_i > 2 beta``."""
    shape = torch.Size(np.broadcast_shapes(w.shape, f.odds.shape))  # faster than torch's
    n = shape[-1]

    def prefix(uu, ww, omr, k):
        if k < n:  # torch.topk: its order of equal values is the one to keep
            vals, idx = topk_order(uu, k)
        else:
            vals, idx = top_desc(uu, k)
        a = ww.gather(-1, idx) * omr.expand(uu.shape).gather(-1, idx)
        before = torch.cumsum(a, dim=-1) - a
        return idx, (vals > 2 * before).cumprod(dim=-1).sum(dim=-1)

    # a head, then the full order for rows whose whole head is shrunk
    last = n if head is None else min(head, n)
    sizes = sorted({last, n})
    first = _shrink_first_compiled(w, f) if SHRINK_FIRST < last < n else None
    u = first[0] if first is not None else torch.mul(w, f.odds,
                                                      out=_rows.empty_tensor(shape, w))
    if first is not None:
        _, idx, count = first
        sizes = [SHRINK_FIRST] + sizes
    elif SHRINK_FIRST < last < n:  # most rows stop early: try SHRINK_FIRST tokens first
        vals, idx = torch.topk(u, SHRINK_FIRST + 1, dim=-1)
        a = w.expand(shape).gather(-1, idx) * f.one_minus_r.expand(shape).gather(-1, idx)
        before = torch.cumsum(a, dim=-1) - a
        count = (vals > 2 * before)[..., :SHRINK_FIRST].cumprod(dim=-1).sum(dim=-1)
        # without equal positive values among them, the first SHRINK_FIRST + 1 are in the order
        # the longer head has (a prefix's cumulative sums do not depend on what follows it)
        tied = ((vals[..., 1:] == vals[..., :-1]) & (vals[..., 1:] > 0)).any(-1)
        count = torch.where(tied, SHRINK_FIRST, count)  # such rows take the longer head
        idx = idx[..., :SHRINK_FIRST]
        sizes = [SHRINK_FIRST] + sizes
    else:
        idx, count = prefix(u, w.expand(shape), f.one_minus_r, sizes[0])
    for k, k_next in zip(sizes, sizes[1:]):
        redo = (count == k).reshape(-1).nonzero()[:, 0]
        if not redo.numel():
            break
        more_idx, more_count = prefix(u.reshape(-1, n)[redo], _take_rows(w, shape, redo),
                                      _take_rows(f.one_minus_r, shape, redo), k_next)
        # widen idx to the new head; rows not redone keep count < k, so their padding
        # columns (index 0, never selected) are never read
        width = idx.shape[-1]
        wide = torch.cat([idx, torch.zeros(*idx.shape[:-1], k_next - width, dtype=idx.dtype,
                                           device=idx.device)], -1).reshape(-1, k_next)
        wide[redo] = more_idx
        idx = wide.reshape(*shape[:-1], k_next)
        count = count.reshape(-1).index_put((redo,), more_count).reshape(count.shape)
    return BinaryShrink(idx, count, u)


def _row_blocks(x: torch.Tensor, shape) -> np.ndarray | None:
    """``x`` broadcast to ``shape`` as (-1, n) rows each standing for the same number of
    consecutive rows of ``shape`` (a numpy view), or None where it does not broadcast so."""
    lead = (1,) * (len(shape) - x.dim()) + tuple(x.shape[:-1])
    j = len(lead)
    while j and lead[j - 1] == 1:
        j -= 1
    if x.shape[-1] != shape[-1] or lead[:j] != tuple(shape[:j]) or x.dtype != torch.float32:
        return None
    return x.contiguous().reshape(-1, shape[-1]).numpy()


def _shrink_first_compiled(w, f: Factors):
    """``u`` and :func:`binary_shrink`'s first ``SHRINK_FIRST`` tokens (idx, count; rows with
    tied values get count ``SHRINK_FIRST``, as the torch code gives them) by
    :func:`_rows.shrink_first`, or None where it does not apply (no numba, not float32 on the
    CPU, broadcast weights, a NaN)."""
    shape = w.shape
    if not (_rows.applies(w) and np.broadcast_shapes(shape, f.odds.shape) == shape):
        return None
    odds, omr = (_row_blocks(x, shape) for x in (f.odds, f.one_minus_r))
    if odds is None or omr is None or len(odds) != len(omr):
        return None
    n = shape[-1]
    u = _rows.empty_tensor(shape, w)
    idx, count, tied, bad = _rows.shrink_first(w.contiguous().reshape(-1, n).numpy(), odds, omr,
                                               SHRINK_FIRST, u.view(-1, n).numpy())
    if bad:
        return None
    count[tied] = SHRINK_FIRST
    lead = shape[:-1]
    return (u, torch.from_numpy(idx).reshape(*lead, SHRINK_FIRST),
            torch.from_numpy(count).reshape(lead))


def binary_shrinkage(w: torch.Tensor, r: torch.Tensor, in_l: torch.Tensor,
                     head: int | None = SHRINK_HEAD) -> torch.Tensor:
    """Dense lambda (1 outside L) of :func:`binary_shrink`."""
    f = token_factors(r, in_l)
    return binary_shrink(w, f, head).lam(f)


def bounded_shrinkage(w: torch.Tensor, r: torch.Tensor, in_l: torch.Tensor,
                      iters: int | None = None) -> torch.Tensor:
    """Theorem 1: the unique MSE minimiser over the box, ``lambda_i = clip_[r_i, 1](beta r_i /
    (w_i (1 - r_i)))`` with ``beta = sum_L w_i (1 - lambda_i)``. The right side of the beta
    equation decreases in beta and the left side increases: bisection on beta in
    ``[0, sum_L w_i (1 - r_i)]`` (``iters`` halvings; default: enough for the dtype)."""
    w, r, in_l = torch.broadcast_tensors(w, r, in_l)
    iters = iters or (64 if w.dtype == torch.float64 else 32)
    u = torch.where(in_l, w * (1 - r) / r, torch.zeros_like(w))
    tiny = torch.finfo(u.dtype).tiny

    def lam_of(beta):
        ratio = torch.where(u > 0, beta[..., None] / u.clamp_min(tiny),
                            torch.full_like(u, float("inf")))
        return torch.where(in_l, torch.minimum(torch.maximum(ratio, r), torch.ones_like(r)),
                           torch.ones_like(r))

    hi = torch.where(in_l, w * (1 - r), 0.0).sum(-1)
    lo = torch.zeros_like(hi)
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        excess = torch.where(in_l, w * (1 - lam_of(mid)), 0.0).sum(-1) - mid
        lo = torch.where(excess > 0, mid, lo)
        hi = torch.where(excess > 0, hi, mid)
    return lam_of(0.5 * (lo + hi))


# --------------------------------------------------------------------------- certificate

def terms(w: torch.Tensor, f: Factors, lam: torch.Tensor | BinaryShrink):
    """Per-token contributions (beta_i, V_i, b_i), zero outside L. ``lam`` dense, or the sparse
    binary form (then only the shrunk tokens are patched)."""
    if isinstance(lam, BinaryShrink):
        got = _binary_terms_compiled(w, f, lam)
        if got is not None:
            return got
        var_i = w * lam.u  # lambda = 1: w^2 (1 - r) / r
        b_i = w * f.bfac
        shape = var_i.shape
        sel = torch.arange(lam.idx.shape[-1], device=w.device) < lam.count[..., None]
        r_at = f.r.expand(shape).gather(-1, lam.idx)
        scale = torch.where(sel, r_at, torch.ones_like(r_at))
        # multiplicative / additive patches, so padded duplicate indices (scale 1, a 0) are no-ops
        var_i.scatter_reduce_(-1, lam.idx, scale * scale, reduce="prod")
        b_i.scatter_reduce_(-1, lam.idx, scale, reduce="prod")
        a_at = w.expand(shape).gather(-1, lam.idx) * f.one_minus_r.expand(shape).gather(
            -1, lam.idx)
        beta_i = torch.zeros_like(var_i).scatter_add_(-1, lam.idx, torch.where(sel, a_at, 0.0))
        return beta_i, var_i, b_i
    lw = lam * w
    return w * (1 - lam) * (f.odds > 0), lw * lw * f.odds, lw * f.bfac


def _binary_terms_compiled(w, f: Factors, lam: BinaryShrink):
    """:func:`terms` of binary shrinkage by :func:`_rows.binary_terms`; None where it does not
    apply (no numba, not float32 on the CPU, broadcast weights)."""
    shape = lam.u.shape
    if not (_rows.applies(w, lam.u) and w.shape == shape):
        return None
    rows = [_row_blocks(x, shape) for x in (f.bfac, f.r, f.one_minus_r)]
    if any(x is None for x in rows) or len({len(x) for x in rows}) > 1:
        return None
    n = shape[-1]
    out = [_rows.empty_tensor(shape, w) for _ in range(3)]
    _rows.binary_terms(w.contiguous().reshape(-1, n).numpy(), lam.u.reshape(-1, n).numpy(),
                       *rows, lam.idx.reshape(-1, lam.idx.shape[-1]).numpy(),
                       lam.count.reshape(-1).numpy(), *(x.view(-1, n).numpy() for x in out))
    return tuple(out)


def outside_terms(beta_i, var_i, b_i, exact: torch.Tensor, g: int, totals=None):
    """(beta, V, b) of the rows (n_kv, g * m, n) over the tokens outside each KV head's exact
    set ``exact`` (n_kv, m, n): eps_hat's terms after the GQA union (beta not clamped).
    ``totals``: ``beta_i.sum(-1), var_i.sum(-1)`` if known."""
    n_kv, m, n = exact.shape
    beta, var = totals or (beta_i.sum(-1), var_i.sum(-1))
    if (_rows.applies(beta_i, var_i, b_i)
            and beta_i.shape == var_i.shape == b_i.shape == (n_kv, g * m, n)):
        inside = [torch.from_numpy(_rows.scratch(name, beta_i.shape, np.float32))
                  for name in ("beta_in", "var_in")]
        rows = (x.contiguous().view(-1, n).numpy() for x in (beta_i, var_i, b_i))
        b_out, ok = _rows.outside(*rows, exact.contiguous().numpy(), g,
                                  *(x.view(-1, n).numpy() for x in inside))
        if ok:
            return (beta - inside[0].sum(-1), var - inside[1].sum(-1),
                    torch.from_numpy(b_out).view(n_kv, g * m))
    ex = exact[:, None]
    view = lambda x: x.view(n_kv, g, m, n)  # noqa: E731
    return (beta - (view(beta_i) * ex).sum(-1).reshape(n_kv, g * m),
            var - (view(var_i) * ex).sum(-1).reshape(n_kv, g * m),
            view(b_i).masked_fill(ex, 0.0).amax(-1).reshape(n_kv, g * m))


def eps_hat(w, r, lam, in_l, denom, delta: float) -> torch.Tensor:
    """Lemma 1's eps_hat(L) over the tokens in ``in_l`` (0 for an empty set)."""
    beta_i, var_i, b_i = terms(w, token_factors(r, in_l), lam)
    return bernstein_eps(beta_i.sum(-1), var_i.sum(-1), b_i.amax(-1), denom, log_term(delta))


@dataclass
class FetchPlan:
    k_star: torch.Tensor  # (...) tokens of L made exact by this decision
    exact: torch.Tensor  # (..., n) bool: L_g[:k*]
    eps_before: torch.Tensor  # (...) eps_hat(L)
    eps_after: torch.Tensor  # (...) eps_hat(L_g[k*:])


def output_terms(eps_out: float, delta: float, head_dim: int) -> tuple[float, float]:
    """(threshold, log term) of the output certificate at ``eps_out``: per value dimension j and
    for D, Lemma 1 at delta / (d + 1) each (a union bound over d + 1 events) gives
    ``|o^_j - o_j| <= R_j e' / (1 - e')`` with ``e' = eps_hat`` at ``l' = ln(2 (d + 1) / delta)``
    and ``R_j`` the range of value dimension j (every term of the numerator is a term of D times
    ``v_ij - o_j``, and ``|v_ij - o_j| <= R_j``). So ``||o^ - o|| <= eps_out ||R||`` when
    ``e' <= eps_out / (1 + eps_out)``."""
    return eps_out / (1.0 + eps_out), math.log(2.0 * (head_dim + 1) / delta)


def output_eps(eps_prime):
    """The output certificate ``e' / (1 - e')`` (inf where ``e' >= 1``)."""
    return torch.where(eps_prime < 1, eps_prime / (1 - eps_prime).clamp_min(1e-300),
                       torch.full_like(eps_prime, float("inf")))


def fetch_plan_terms(beta_i, var_i, b_i, denom, eps: float, delta: float,
                     head: int | None = FETCH_HEAD,
                     also: tuple[float, float] | None = None, totals=None) -> FetchPlan:
    """KVFetch steps 3-5 from per-token terms: order L by ``g_i = eps_hat(L) - eps_hat(L \\ {i})``
    descending, take the smallest k with ``eps_hat(L_g[k:]) < eps``. Suffix sums (beta, V) and a
    suffix max (b) give every k at once. Tokens with all-zero terms (outside L, invisible, or
    underflowed) are never made exact. ``also`` = (threshold, log term): a second condition the
    cut must meet (the output certificate, :func:`output_terms`); the order then uses its log
    term, the larger one. ``totals``: ``beta_i.sum(-1), var_i.sum(-1)`` if known."""
    l = log_term(delta) if also is None else max(log_term(delta), also[1])
    shape, n = beta_i.shape, beta_i.shape[-1]
    denom = torch.broadcast_to(denom, shape[:-1])
    beta, var = totals or (beta_i.sum(-1), var_i.sum(-1))
    k = n if head is None else min(head, n)
    rows = lambda x, at: x.reshape(-1, *x.shape[len(shape) - 1:])[at]  # noqa: E731
    compiled = _plan_compiled(beta_i, var_i, b_i, beta, var, denom, eps, delta, k, also, l)
    if compiled is not None:
        tied_gain, plan, found, tied = compiled
        if k == n:
            return plan
        gain = None  # the compiled loops keep the gains of the tied rows alone
    else:
        gain = _gains(beta_i, var_i, b_i, beta, var, l)
        if k == n:
            return _plan_on(top_desc(gain, n, values=False)[1], None, beta_i, var_i, b_i, beta,
                            var, denom, eps, delta, also)[0]
        idx, rest, after = _fetch_head(gain, k)
        plan, found = _plan_on(idx, rest, beta_i, var_i, b_i, beta, var, denom, eps, delta, also)
        tied = _topk_rows(gain, (beta_i, var_i, b_i, plan.k_star), idx, after)
    tensors = (beta_i, var_i, b_i, beta, var, denom)
    if tied.numel():
        more = [rows(x, tied) for x in tensors]
        if compiled is not None:
            sub, sub_found = _plan_topk_compiled(tied_gain, *more, k, eps, delta, also)
        else:
            sub, sub_found = _plan_on(torch.topk(rows(gain, tied), k, dim=-1).indices, None,
                                      *more, eps, delta, also)
        found = found.reshape(-1).index_put((tied,), sub_found)
        _put_rows(plan, tied, sub)
    if not bool(found.all()):  # rows whose cut lies beyond the head: a full sort
        redo = (~found).reshape(-1).nonzero()[:, 0]
        more = [rows(x, redo) for x in tensors]
        got = _plan_compiled(*more, eps, delta, n, also, l) if compiled is not None else None
        if got is not None:
            full = got[1]
        else:
            g = rows(gain, redo) if gain is not None else _gains(*more[:5], l)
            full = _plan_on(top_desc(g, n, values=False)[1], None, *more, eps, delta, also)[0]
        _put_rows(plan, redo, full)
    return plan


def _gains(beta_i, var_i, b_i, beta, var, l: float) -> torch.Tensor:
    """(..., n) the gains ``D g_i = D (eps_hat(L) - eps_hat(L \\ {i}))`` with log term ``l``."""
    n = beta_i.shape[-1]
    top = torch.topk(b_i, min(2, n), dim=-1)
    bmax = top.values[..., 0]
    second = top.values[..., 1] if n > 1 else torch.zeros_like(bmax)
    # D * g_i = beta_i + sqrt(c1) - sqrt(c1 - 2 l V_i), written without cancellation; b is
    # held at bmax for every token but the argmax of b, which is corrected below
    t = bmax * (l / 3.0)
    t2 = second * (l / 3.0)
    c1 = t * t + 2.0 * l * var
    root1 = torch.sqrt(c1)[..., None]
    x = (2.0 * l) * var_i
    # gain = beta_i + x / (root1 + sqrt(max(c1 - x, 0))).clamp_min(tiny), in place (the same
    # operations: IEEE addition commutes)
    den = c1[..., None] - x
    den.clamp_min_(0.0).sqrt_().add_(root1).clamp_min_(torch.finfo(x.dtype).tiny)
    gain = x.div_(den).add_(beta_i)
    del den
    arg = top.indices[..., :1]
    c2 = (t2 * t2)[..., None] + 2.0 * l * (var[..., None] - var_i.gather(-1, arg)).clamp_min(0.0)
    gain_arg = beta_i.gather(-1, arg) + (t - t2)[..., None] + (c1[..., None] - c2) / (
        root1 + torch.sqrt(c2)).clamp_min(torch.finfo(x.dtype).tiny)
    return gain.scatter_(-1, arg, gain_arg)


ROW_BLOCK = 16  # rows per visit of the fetch order's loops, so that a block's rows stay cached


def _plan_compiled(beta_i, var_i, b_i, beta, var, denom, eps: float, delta: float, k: int,
                   also, l: float):
    """The fetch plan on the head of ``k`` tokens, which rows found k* in it, the rows whose
    plan could depend on torch.topk's order of equal gains (:func:`_topk_rows`) and their gains,
    by the compiled row loops (:mod:`._rows`: the torch code's float32 operations row by row,
    with torch's row sums); None where they do not apply (no numba, not float32 on the CPU, a
    gain that is not finite and >= 0). The order is found ``ROW_BLOCK`` rows at a time."""
    if not (_rows.applies(beta_i, var_i, b_i, denom)
            and var_i.shape == b_i.shape == beta_i.shape):
        return None
    shape, n = beta_i.shape, beta_i.shape[-1]
    lead = shape[:-1]
    bi, vi, mi = (x.contiguous().reshape(-1, n).numpy() for x in (beta_i, var_i, b_i))
    var_np = var.contiguous().reshape(-1).numpy()
    rows = len(bi)
    head = _rows.scratch("head", (rows, k), np.int32)
    hb, hv, cb, cv, cm = (_rows.scratch(name, (rows, k), np.float32)
                          for name in ("hb", "hv", "cb", "cv", "cm"))
    tail_b, nxt = np.empty(rows, np.float32), np.empty(rows, np.int64)
    tie = np.empty(rows, np.bool_)
    tie_gain = []  # the gains of rows with ties, for their order's choices
    for lo in range(0, rows, ROW_BLOCK):
        s = slice(lo, min(lo + ROW_BLOCK, rows))
        gain = _order_block(bi[s], vi[s], mi[s], var_np[s], k, l, head[s], hb[s], hv[s], cb[s],
                            cv[s], cm[s], tail_b[s], tie[s], nxt[s])
        if gain is None:
            return None
        tie_gain += [gain[j].copy() for j in np.flatnonzero(tie[s])] if k < n else []
    d = denom.contiguous().reshape(-1).numpy()
    totals = beta.reshape(-1), var.reshape(-1)
    plan, found = _cut_compiled(head, hb, hv, (cb, cv, cm), tail_b, mi, *totals, d, eps, delta,
                                also)
    ties = np.flatnonzero(tie) if k < n else np.zeros(0, np.int64)
    g = np.array(tie_gain, np.float32).reshape(-1, n)
    if len(ties):  # rows whose plan could depend on torch.topk's order of equal gains
        at = np.arange(len(ties))
        keep = _rows.tie_moves(at, head[ties], nxt[ties], g, bi[ties], vi[ties], mi[ties],
                               plan.k_star.numpy()[ties])
        ties, g = ties[keep], g[keep]
    if len(ties):
        keep = ~_any_order(ties, head[ties], nxt[ties], g, (bi, vi, mi), totals, d, plan, found,
                           eps, delta, also)
        ties, g = ties[keep], g[keep]
    plan = FetchPlan(*(getattr(plan, f).reshape(*lead, *getattr(plan, f).shape[1:])
                       for f in ("k_star", "exact", "eps_before", "eps_after")))
    return torch.from_numpy(g), plan, found.reshape(lead), torch.from_numpy(ties)


def _order_block(bi, vi, mi, var, k: int, l: float, head, hb, hv, cb, cv, cm, tail_b, tie, nxt):
    """The gains of a block of rows and :func:`_rows.head_terms`'s outputs for their fetch order
    (into ``head`` .. ``nxt``); returns the gains (a buffer reused by the next block), or None
    where a b or a gain is not finite and >= 0."""
    rows, n = bi.shape
    f32, sqrt = np.float32, _rows.torch_sqrt_
    arg, top, second, ambiguous, ok = _rows.top_two(mi)
    if not ok:
        return None
    if ambiguous.any():  # b's largest value held twice: the token torch.topk takes
        at = np.flatnonzero(ambiguous)
        arg[at] = torch.topk(torch.from_numpy(mi[at]), 2, dim=-1).indices[:, 0].numpy()
    l2, l3 = f32(2.0 * l), f32(l / 3.0)
    gain = _rows.scratch("gain", bi.shape, np.float32)
    c1, c2, dt = _rows.gain_prep(vi, var, top, second, arg, l2, l3, gain)
    key = _rows.scratch("key", bi.shape, np.int64)
    if not _rows.gain_keys(bi, vi, sqrt(gain), c1, c2, dt, sqrt(c1.copy()), sqrt(c2.copy()),
                           arg, l2, f32(torch.finfo(torch.float32).tiny), key):
        return None
    if k < n:
        key.partition(k, axis=-1)  # the k smallest keys first, the next one at k
        key[:, :k].sort(axis=-1)
        nxt[:] = key[:, k] & 0xFFFFFFFF
    else:
        key.sort(axis=-1)
    tail_b[:], tie[:] = _rows.head_terms(key, k, gain, bi, vi, mi, head, hb, hv, cb, cv, cm)
    return gain


TIE_PAIRS = 3  # rows with up to this many pairs of equal gains try every order of them


def _any_order(rows, head, nxt, gain, terms, totals, d, plan: FetchPlan, found, eps: float,
               delta: float, also) -> np.ndarray:
    """Which of the flat ``rows`` (their ordered heads ``head``, next tokens ``nxt`` and gains
    ``gain``) have the same plan and ``found`` on every head ``torch.topk`` could give
    (:func:`_rows.tie_swaps`): then its order among equal gains does not matter and the stable
    order's plan is its plan."""
    pairs, owner, heads = _rows.tie_swaps(np.arange(len(rows)), head, nxt, gain, TIE_PAIRS)
    same = pairs > 0
    if not len(owner):
        return same
    at = rows[owner]
    hb, hv, cb, cv, cm = (np.empty(heads.shape, np.float32) for _ in range(5))
    bi, vi, mi = (x[at] for x in terms)
    tail_b = _rows.head_values(heads, bi, vi, mi, hb, hv, cb, cv, cm)
    at_t = torch.from_numpy(at)
    alt, alt_found = _cut_compiled(heads, hb, hv, (cb, cv, cm), tail_b, mi,
                                   *(x[at_t] for x in totals), d[at], eps, delta, also)
    equal = (alt.k_star == plan.k_star[at_t]) & (alt_found == found[at_t]) \
        & (alt.exact == plan.exact[at_t]).all(-1)
    for f in ("eps_before", "eps_after"):
        equal &= getattr(alt, f).view(torch.int32) == getattr(plan, f)[at_t].view(torch.int32)
    same[owner[~equal.numpy()]] = False
    return same


def _cut_compiled(head, hb, hv, parts, tail_b, mi, beta, var, d, eps: float, delta: float,
                  also):
    """(flat FetchPlan, found) on the ordered heads ``head`` (R, k) of rows with b ``mi``
    (R, n): ``_plan_on``'s plan by the compiled loops; ``hb``, ``hv`` the head's beta and V,
    ``parts`` the head's part of the suffixes (:func:`_rows.head_terms`), ``tail_b`` the
    largest b outside it, ``beta`` and ``var`` the rows' totals (tensors)."""
    k, n = head.shape[1], mi.shape[1]
    f32, sqrt = np.float32, _rows.torch_sqrt_
    if k < n:
        tail_beta = (beta - torch.from_numpy(hb).sum(-1)).clamp_min(0).numpy()
        tail_var = (var - torch.from_numpy(hv).sum(-1)).clamp_min(0).numpy()
    else:
        tail_beta = tail_var = np.zeros(len(hb), np.float32)
    suffix = (k, *parts, tail_beta, tail_var, tail_b)
    # k*: the first position whose eps_hat is below eps, over growing spans of positions
    # for the rows still looking (the square roots are torch's)
    lt = log_term(delta)
    rows = len(hb)
    k_star, found = np.zeros(rows, np.int64), np.zeros(rows, np.bool_)
    eps_before, eps_after = np.empty(rows, np.float32), np.empty(rows, np.float32)
    todo, lo, span = np.arange(rows), 0, 64
    while len(todo) and lo <= k:
        hi = min(lo + span, k + 1)
        roots = []
        for lg in (lt,) if also is None else (lt, also[1]):
            root = np.empty((len(todo), hi - lo), np.float32)
            _rows.eps_args(todo, lo, hi, *suffix, f32(lg / 3.0), f32(2.0 * lg), root)
            roots.append(sqrt(root))
        a_root, a_l3, a_eps = ((np.empty((0, 0), np.float32), f32(0.0), f32(0.0))
                               if also is None else (roots[1], f32(also[1] / 3.0), f32(also[0])))
        _rows.first_ok(todo, lo, hi, *suffix, roots[0], d, f32(lt / 3.0), f32(eps), a_root, a_l3,
                       a_eps, k_star, found, eps_after, eps_before)
        todo, lo, span = todo[~found[todo]], hi, span * 4
    eps_after[~found] = eps_before[~found]  # k* = 0
    exact = _rows.exact_mask(head, hb, hv, mi, k_star)
    return FetchPlan(*map(torch.from_numpy, (k_star, exact, eps_before, eps_after))), \
        torch.from_numpy(found)


def _plan_topk_compiled(g, bi, vi, mi, beta, var, d, k: int, eps: float, delta: float, also):
    """``_plan_on`` on ``torch.topk``'s head of the gains ``g`` (R, n) by the compiled loops
    (rows from :func:`_plan_compiled`)."""
    head = torch.topk(g, k, dim=-1).indices.to(torch.int32).numpy()
    hb, hv, cb, cv, cm = (np.empty(head.shape, np.float32) for _ in range(5))
    tail_b = _rows.head_values(head, bi.numpy(), vi.numpy(), mi.numpy(), hb, hv, cb, cv, cm)
    return _cut_compiled(head, hb, hv, (cb, cv, cm), tail_b, mi.numpy(), beta, var, d.numpy(),
                         eps, delta, also)


def _put_rows(plan: FetchPlan, at: torch.Tensor, sub: FetchPlan) -> None:
    """Writes ``sub``'s rows into the flat rows ``at`` of ``plan``."""
    for name in ("k_star", "eps_before", "eps_after", "exact"):
        whole, part = getattr(plan, name), getattr(sub, name)
        lead = plan.k_star.dim()
        flat = whole.reshape(-1, *whole.shape[lead:]).clone()
        flat[at] = part
        setattr(plan, name, flat.reshape(whole.shape))


def _plan_on(head, rest, bi, vi, bb, tot_beta, tot_var, d, eps: float, delta: float, also):
    """The fetch plan on the head ``head`` (..., k) of the fetch order (all of it when k = n),
    ``rest`` the other tokens (None: those ``head`` leaves out), and whether k* lies in it."""
    n, k = bb.shape[-1], head.shape[-1]
    hb, hv, hm = bi.gather(-1, head), vi.gather(-1, head), bb.gather(-1, head)
    # the suffix of the order from a position: its part in the head, from reversed cumulative
    # sums (exactly 0 past the last token, however small eps), plus the tail (the tokens
    # outside the head) as total minus head
    if k == n:
        tail_beta = tail_var = tail_b = torch.zeros_like(hb[..., :1])
    else:
        tail_beta = (tot_beta[..., None] - hb.sum(-1, keepdim=True)).clamp_min(0)
        tail_var = (tot_var[..., None] - hv.sum(-1, keepdim=True)).clamp_min(0)
        if rest is not None:  # b >= 0: the tail's max is the max outside the head
            tail_b = bb.gather(-1, rest).amax(-1, keepdim=True)
        else:
            in_head = torch.zeros(bb.shape, dtype=torch.bool, device=bb.device).scatter_(
                -1, head, True)
            tail_b = bb.masked_fill(in_head, 0.0).amax(-1, keepdim=True)
    # column j: the head's last j + 1 tokens
    ext_beta, ext_var = hb.flip(-1).cumsum_(-1), hv.flip(-1).cumsum_(-1)
    k_star, found, eps_at = _first_ok(ext_beta, ext_var, hm.flip(-1), tail_beta, tail_var,
                                      tail_b, d, eps, log_term(delta), also)
    # the first k* tokens of each row, those with a contribution (the others never are exact)
    counts = k_star.reshape(-1)
    rows = torch.repeat_interleave(torch.arange(counts.numel(), device=head.device), counts)
    pos = torch.arange(rows.numel(), device=head.device) - (counts.cumsum(0) - counts)[rows]
    live = (hb.reshape(-1, k)[rows, pos] > 0) | (hv.reshape(-1, k)[rows, pos] > 0) \
        | (hm.reshape(-1, k)[rows, pos] > 0)
    exact = torch.zeros(bb.shape, dtype=torch.bool, device=bb.device)
    exact.view(-1, n)[rows[live], head.reshape(-1, k)[rows[live], pos[live]]] = True
    return FetchPlan(k_star, exact, eps_at(torch.zeros_like(k_star)), eps_at(k_star)), found


SCAN_CELLS = 1 << 17  # above this many (row, k) cells, bisect for k* instead of scanning all k


def _first_ok(ext_beta, ext_var, rev_b, tail_beta, tail_var, tail_b, d, eps: float, l: float,
              also):
    """(k*, found, eps_at): the smallest k in 0..K whose suffix has eps_hat below ``eps`` (and
    the output certificate's bound, ``also``), k* = 0 where none is, and a function giving
    eps_hat of the suffix from given positions. The suffix from position k < K is column
    K - 1 - k of ``ext_*`` (the head's last K - k tokens' sums) and of the running max of
    ``rev_b`` (the head's b, last token first), plus the tail's; from K the tail's alone: the
    same operations as summing the flipped head from 0, then the tail. The suffix quantities do
    not increase with k, and every step of eps_hat is a monotone IEEE operation of them, so "ok"
    does not decrease with k (a NaN can only hide a prefix of k): on many cells a bisection
    finds the first ok k, the one a scan finds, reading the running max at its columns alone."""
    K = ext_beta.shape[-1]
    dd = d[..., None]
    scan = ext_beta[..., 0].numel() * (K + 1) <= SCAN_CELLS
    run_b = rev_b.cummax(-1).values if scan else _RunningMax(rev_b)

    def at(pos):  # (..., c) positions -> the suffix quantities there
        col, empty = (K - 1 - pos).clamp_min(0), pos >= K
        sb, sv = (x.gather(-1, col).masked_fill_(empty, 0.0) for x in (ext_beta, ext_var))
        sm = (run_b.gather(-1, col) if scan else run_b.at(col)).masked_fill_(empty, 0.0)
        return sb + tail_beta, sv + tail_var, sm.maximum(tail_b)

    def ok(sb, sv, sm):
        good = bernstein_eps(sb, sv, sm, dd, l) < eps
        if also is not None:
            good &= bernstein_eps(sb, sv, sm, dd, also[1]) < also[0]
        return good

    def eps_at(pos):
        return bernstein_eps(*at(pos[..., None]), dd, l)[..., 0]

    if scan:
        zero = torch.zeros_like(ext_beta[..., :1])
        sb, sv, sm = (torch.cat([zero, x], -1) for x in (ext_beta, ext_var, run_b))
        good = ok(sb + tail_beta, sv + tail_var, sm.maximum(tail_b)).flip(-1)
        return good.int().argmax(-1), good.any(-1), eps_at
    lead = ext_beta.shape[:-1]
    lo = torch.zeros(lead, dtype=torch.long, device=ext_beta.device)
    hi = torch.full(lead, K + 1, dtype=torch.long, device=ext_beta.device)  # K + 1: none
    while bool((lo < hi).any()):  # positions below lo fail; hi is ok, or K + 1
        mid = (lo + hi) // 2
        open_ = lo < hi
        good = ok(*at(mid.clamp_max(K)[..., None]))[..., 0] & (mid <= K) & open_
        hi = torch.where(good, mid, hi)
        lo = torch.where(open_ & ~good, mid + 1, lo)
    found = hi <= K
    return torch.where(found, hi, 0), found, eps_at


class _RunningMax:
    """The running max of rows ``x`` (..., K) read at a few columns: the running max of whole
    blocks of ``BLOCK`` columns, then the block holding the column up to it (a full cummax
    costs more than a bisection's reads; max is exact, so the values are cummax's)."""

    BLOCK = 64

    def __init__(self, x: torch.Tensor):
        self.x = x
        whole = x.shape[-1] // self.BLOCK
        blocks = x[..., :whole * self.BLOCK].unflatten(-1, (whole, self.BLOCK)).amax(-1)
        # column j + 1: the max of the first j + 1 whole blocks; column 0: none (0, as b >= 0)
        self.before = torch.cat([blocks.new_zeros(*blocks.shape[:-1], 1),
                                 blocks.cummax(-1).values], -1)

    def at(self, col: torch.Tensor) -> torch.Tensor:
        """max(x[..., :c + 1]) for the columns ``col`` (..., c)."""
        block = col // self.BLOCK
        start = block * self.BLOCK
        span = (start[..., None] + torch.arange(self.BLOCK, device=col.device)).minimum(
            col[..., None])  # the block's columns up to col (col repeated past it)
        lead = self.x.shape[:-1]
        part = self.x.gather(-1, span.reshape(*lead, -1)).reshape(span.shape).amax(-1)
        return part.maximum(self.before.gather(-1, block))


def fetch_plan(w, r, lam, in_l, denom, eps: float, delta: float,
               head: int | None = FETCH_HEAD) -> FetchPlan:
    """KVFetch with a dense lambda (see :func:`fetch_plan_terms`)."""
    return fetch_plan_terms(*terms(w, token_factors(r, in_l), lam), denom, eps, delta, head)


def gqa_union(mask: torch.Tensor, n_kv: int) -> torch.Tensor:
    """(n_q, m, n) per-query-head token masks -> (n_kv, m, n): the union over the query heads
    that share each KV head (head j serves query heads j*g .. (j+1)*g - 1)."""
    n_q = mask.shape[0]
    heads = mask.reshape(n_kv, n_q // n_kv, *mask.shape[1:]).unbind(1)
    union = heads[0].clone()
    for h in heads[1:]:  # an or per head: faster than any() over the group's dimension
        union |= h
    return union
