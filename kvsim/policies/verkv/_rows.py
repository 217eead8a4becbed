"""Compiled per-row loops of the certificate (numba), for float32 rows on the CPU.

Each kernel repeats, row by row and in the same order, the float32 operations of the torch code
in :mod:`kvsim.policies.verkv.certificate` that it stands for, so the results are the same to
the bit: every operation is an IEEE one (+ - * / sqrt, compare, max; no exp or log, no fused
multiply-add), Python floats enter as float32 (as torch casts a scalar operand to a float32
tensor's type) and torch's cumulative sums of float32 accumulate in float64, so these do too.
Row sums (``Tensor.sum``: a cascade whose order depends on the vector width) stay with torch.
Rows whose result would depend on ``torch.topk``'s order among equal values are flagged for
the torch code. Without numba (``AVAILABLE`` False) the torch code runs alone.
"""

from __future__ import annotations

import math
import threading

import numpy as np

try:
    import numba
except ImportError:  # pragma: no cover - numba is a dependency; the torch code still works
    numba = None

AVAILABLE = numba is not None
INDEX_BITS = 32  # a sort key: (bits of +inf - bits of the value) << 32 | token index
INF_BITS = 0x7F800000
NEG_ZERO_BITS = -0x80000000  # -0.0 as an int32
SCRATCH_BYTES = 1 << 28
_scratch = threading.local()
_NUMPY = {}  # torch dtype -> numpy dtype, filled below where torch is


def empty_tensor(shape, like):
    """An uninitialised tensor of ``like``'s dtype and device, on the CPU from numpy: numpy
    backs large arrays with huge pages, and a fresh torch tensor's first touch of its pages can
    cost more than the loops that fill it (4 ms per 10 MB on a 2-vCPU VM)."""
    import torch

    if like.device.type != "cpu" or like.dtype not in _NUMPY:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    return torch.from_numpy(np.empty(tuple(shape), _NUMPY[like.dtype]))


def scratch(name: str, shape, dtype) -> np.ndarray:
    """A buffer reused from call to call (per thread; up to ``SCRATCH_BYTES`` each): a fresh
    array's first touch of its pages can cost more than the loops that fill it."""
    size = math.prod(shape)
    if size * np.dtype(dtype).itemsize > SCRATCH_BYTES:
        return np.empty(shape, dtype)
    bufs = _scratch.__dict__.setdefault("bufs", {})
    buf = bufs.get((name, np.dtype(dtype)))
    if buf is None or buf.size < size:
        buf = bufs[(name, np.dtype(dtype))] = np.empty(size, dtype)
    return buf[:size].reshape(shape)


try:
    import torch as _torch

    _NUMPY.update({_torch.float32: np.float32, _torch.float64: np.float64, _torch.bool: np.bool_})
except ImportError:  # pragma: no cover
    pass


def applies(*tensors) -> bool:
    """Whether the loops stand for the torch code on ``tensors``: numba is here and every one is
    a float32 tensor on the CPU."""
    return AVAILABLE and all(t.device.type == "cpu" and t.dtype == _torch.float32
                             for t in tensors)


def torch_sqrt_(a: np.ndarray) -> np.ndarray:
    """``a``'s square roots in place, by torch (MKL's, which differ from an exact square root in
    the last bit for some float32 values: the torch code's)."""
    return _torch.from_numpy(a).sqrt_().numpy()


def _jit(fn):
    return numba.njit(cache=True, nogil=True, error_model="numpy")(fn) if AVAILABLE else fn


@_jit
def _bits_max(bits):
    """The largest of a float32 row's int32 bits, or -1 where a value is negative, -0.0 or NaN
    (only on the rest is the float order the order of the bits)."""
    lo, hi = bits[0], bits[0]
    for j in range(bits.shape[0]):
        lo = min(lo, bits[j])
        hi = max(hi, bits[j])
    return hi if lo >= 0 and hi <= INF_BITS else np.int32(-1)


@_jit
def shrink_first(w, odds, omr, s, u):
    """``u = w * odds`` into ``u`` (R, n) and the first ``s`` of binary shrinkage's visiting
    order per row (:func:`_first_s`), in one visit of each row. The factor rows ``odds``,
    ``omr`` stand for ``R // len(odds)`` consecutive rows each. Returns (idx (R, s), count
    (R,), tied (R,): equal positive values among the ``s + 1``, where torch.topk's order
    decides; bad: a NaN, a negative value or -0.0 in u (then the torch code))."""
    rows, n = w.shape
    per = rows // odds.shape[0]
    idx = np.zeros((rows, s), np.int64)
    count = np.zeros(rows, np.int64)
    tied = np.zeros(rows, np.bool_)
    k = s + 1
    vals = np.empty(k, np.int32)
    at = np.empty(k, np.int64)
    blocks = min(n, 4 * k)
    width = -(-n // blocks)
    tops = np.empty(blocks, np.int32)
    for q in range(rows):
        f = q // per
        wr, ur, od = w[q], u[q], odds[f]
        for j in range(n):
            ur[j] = wr[j] * od[j]
        bits = ur.view(np.int32)
        if _bits_max(bits) < 0:
            return idx, count, tied, True
        for b in range(blocks):
            m = np.int32(0)
            for j in range(b * width, min(n, (b + 1) * width)):
                m = max(m, bits[j])
            tops[b] = m
        cut = np.sort(tops)[blocks - k] if blocks >= k else np.int32(0)
        count[q], tied[q] = _first_s(bits, cut, wr, omr[f], s, vals, at, idx[q])
    return idx, count, tied, False


@_jit
def _first_s(bits, cut, wr, orow, s, vals, at, idx):
    """The ``s + 1`` largest of a row of ``u`` >= 0 (``bits``: its int32 bits, which order as
    u; only tokens at or above ``cut`` are visited, in order) descending, their first ``s``
    into ``idx``, ``a = w * (1 - r)`` there, ``before = cumsum(a) - a`` and the count of leading
    ``u > 2 before`` among the first ``s``. Returns (count, tied). The ``s + 1`` largest are at
    least the ``s + 1``-th largest of the maxima of ``4 (s + 1)`` blocks (that many blocks hold
    a value at least as large): :func:`shrink_first`'s ``cut``."""
    k = s + 1
    size = 0
    for j in range(bits.shape[0]):
        v = bits[j]
        if v < cut or (size == k and not v > vals[k - 1]):
            continue
        p = size if size < k else k - 1
        while p > 0 and vals[p - 1] < v:
            vals[p] = vals[p - 1]
            at[p] = at[p - 1]
            p -= 1
        vals[p] = v
        at[p] = j
        if size < k:
            size += 1
    ur = bits.view(np.float32)
    two = np.float32(2.0)
    acc = 0.0  # float64, as torch's cumsum of float32
    c = 0
    going = True
    for j in range(s):
        a = wr[at[j]] * orow[at[j]]
        acc += a
        before = np.float32(acc) - a
        if going and ur[at[j]] > two * before:
            c += 1
        else:
            going = False
        idx[j] = at[j]
    tied = False
    for j in range(k - 1):
        tied |= vals[j + 1] == vals[j] and vals[j + 1] > 0
    return c, tied


@_jit
def top_two(b_i):
    """Per row of ``b_i`` (R, n): the first token holding the largest value, that value, the
    second largest (the largest again where it is held twice: then ``ambiguous``, the token is
    torch.topk's choice) and whether every value is >= 0 and not NaN (-0.0 excluded): on such
    values the float order is the order of the bits, and these loops vectorise."""
    rows, n = b_i.shape
    first = np.zeros(rows, np.int64)
    top = np.zeros(rows, b_i.dtype)
    second = np.zeros(rows, b_i.dtype)
    ambiguous = np.zeros(rows, np.bool_)
    for r in range(rows):
        bb = b_i[r].view(np.int32)
        hi = _bits_max(bb)
        if hi < 0:
            return first, top, second, ambiguous, False
        count, below = 0, np.int32(0)
        for j in range(n):
            count += bb[j] == hi
            below = max(below, bb[j] if bb[j] < hi else np.int32(0))
        j = 0
        while bb[j] != hi:
            j += 1
        first[r], top[r] = j, b_i[r, j]
        if count > 1:
            second[r] = top[r]
            ambiguous[r] = True
        elif below > 0:
            j = 0
            while bb[j] != below:
                j += 1
            second[r] = b_i[r, j]
    return first, top, second, ambiguous, True


@_jit
def gain_prep(var_i, var, top, second, arg, l2, l3, out):
    """The gains' row constants (c1, c2, t - t2) and, in place of the gains, ``max(c1 - x, 0)``
    with ``x = 2 l V_i``: its square root is torch's (``torch.sqrt`` of float32 is MKL's on
    the CPU, not always the correctly rounded one), into ``out`` (R, n)."""
    rows, n = var_i.shape
    c1 = np.empty(rows, var_i.dtype)
    c2 = np.empty(rows, var_i.dtype)
    dt = np.empty(rows, var_i.dtype)
    zero = np.float32(0.0)
    for r in range(rows):
        t = top[r] * l3
        t2 = second[r] * l3
        c = t * t + l2 * var[r]
        vi, o = var_i[r], out[r]
        for j in range(n):
            d = c - l2 * vi[j]
            o[j] = zero if d < zero else d
        d2 = var[r] - vi[arg[r]]
        c1[r], c2[r], dt[r] = c, t2 * t2 + l2 * (zero if d2 < zero else d2), t - t2
    return c1, c2, dt


@_jit
def gain_keys(beta_i, var_i, root, c1, c2, dt, root1, root2, arg, l2, tiny, key):
    """The gains (``root`` from :func:`gain_prep`, square-rooted, is overwritten with them)
    and their sort keys into ``key`` (R, n): (bits of +inf - bits of the gain) << 32 | index,
    ascending in the stable descending order. False where a gain is not finite and >= 0."""
    rows, n = beta_i.shape
    for r in range(rows):
        bi, vi, g = beta_i[r], var_i[r], root[r]
        r1 = root1[r]
        for j in range(n):
            den = g[j] + r1
            g[j] = l2 * vi[j] / (tiny if den < tiny else den) + bi[j]
        a = arg[r]
        den = r1 + root2[r]
        g[a] = bi[a] + dt[r] + (c1[r] - c2[r]) / (tiny if den < tiny else den)
        gb = g.view(np.int32)
        kr = key[r]
        bad = 0
        for j in range(n):
            v = gb[j]
            bad += (v >= INF_BITS) | ((v < 0) & (v != NEG_ZERO_BITS))
            kr[j] = ((INF_BITS - np.int64(max(v, 0))) << INDEX_BITS) | j
        if bad:
            return False
    return True


@_jit
def head_terms(key, k, gain, beta_i, var_i, b_i, head, hb, hv, cb, cv, cm):
    """What ``_plan_on`` takes from the head of the fetch order, from the keys (R, n) of the
    gains ``gain`` (:func:`gain_keys`) whose first ``k`` are the head in order (and, when
    ``k < n``, the other tokens after them, the next token of the order at ``k``): the head's
    indices, beta and V into ``head``, ``hb``, ``hv`` (R, k) (for torch's row sums) and its
    part of the suffixes from each position (:func:`_head_suffixes`) into ``cb``, ``cv``,
    ``cm``. Returns
    the largest b outside the head (0 without a tail; b >= 0 (:func:`top_two`), so maxima are
    taken on the bits) and whether equal positive gains meet in the head or across its cut
    (where torch.topk's order decides)."""
    rows, n = key.shape
    mask = (np.int64(1) << INDEX_BITS) - 1
    tail_b = np.zeros(rows, np.int32)
    tie = np.zeros(rows, np.bool_)
    last = k + 1 if k < n else k
    for r in range(rows):
        kr, hr, hbr, hvr = key[r], head[r], hb[r], hv[r]
        bi, vi, bits = beta_i[r], var_i[r], b_i[r].view(np.int32)
        for j in range(k):
            hr[j] = kr[j] & mask
        for j in range(k):  # one loop per output: faster than one for both
            hbr[j] = bi[hr[j]]
        for j in range(k):
            hvr[j] = vi[hr[j]]
        if k < n:  # the tail: the tokens whose key is at least the one at k (in order: faster
            cut, gb = kr[k], gain[r].view(np.int32)  # than gathering those after the cut)
            m = np.int32(0)
            for i in range(n):
                own = ((INF_BITS - np.int64(max(gb[i], 0))) << INDEX_BITS) | i
                m = max(m, bits[i] if own >= cut else np.int32(0))
            tail_b[r] = m
        ties = 0
        for j in range(1, last):
            hi = kr[j] >> INDEX_BITS
            ties += (hi == kr[j - 1] >> INDEX_BITS) & (hi < INF_BITS)
        tie[r] = ties > 0
        _head_suffixes(hr, hbr, hvr, bits, cb[r], cv[r], cm[r].view(np.int32))
    return tail_b.view(np.float32), tie


@_jit
def _head_suffixes(hr, hbr, hvr, bits, cbr, cvr, cmr):
    """A head's part of the suffixes from each position: ``hb.flip(-1).cumsum(-1)`` (float64
    sums of float32, as torch's, rounded to float32), the same of ``hv``, and the running max
    of the b bits ``bits`` of its tokens (from the last)."""
    acc_b = 0.0
    acc_v = 0.0
    run = np.int32(0)
    for j in range(len(hr) - 1, -1, -1):
        acc_b += hbr[j]
        acc_v += hvr[j]
        cbr[j] = np.float32(acc_b)
        cvr[j] = np.float32(acc_v)
        run = max(run, bits[hr[j]])
        cmr[j] = run


@_jit
def head_values(head, beta_i, var_i, b_i, hb, hv, cb, cv, cm):
    """:func:`head_terms`'s outputs for given heads ``head`` (R, k) (torch.topk's): their beta
    and V into ``hb``, ``hv``, their part of the suffixes into ``cb``, ``cv``, ``cm``, and the
    largest b of each row outside its head (0 where there is none)."""
    rows, n = b_i.shape
    tail_b = np.zeros(rows, np.int32)
    out = np.ones(n, np.bool_)
    for r in range(rows):
        out[:] = True
        hr, bits = head[r], b_i[r].view(np.int32)
        for j in range(head.shape[1]):
            i = hr[j]
            hb[r, j] = beta_i[r, i]
            hv[r, j] = var_i[r, i]
            out[i] = False
        m = np.int32(0)
        for i in range(n):
            m = max(m, bits[i] if out[i] else np.int32(0))
        tail_b[r] = m
        _head_suffixes(hr, hb[r], hv[r], bits, cb[r], cv[r], cm[r].view(np.int32))
    return tail_b.view(np.float32)


@_jit
def _suffix(r, j, k, cb, cv, cm, tail_beta, tail_var, tail_b):
    """The certificate's beta, V and b of the order's suffix from position ``j`` of row ``r``
    (``_plan_on``): the head's part plus the tail's; position k: the tail alone. b >= 0 and
    not NaN nor -0.0 (:func:`top_two`), so max is the max of the bits."""
    tm = tail_b[r]
    if j < k:
        m = cm[r, j]
        return cb[r, j] + tail_beta[r], cv[r, j] + tail_var[r], m if m > tm else tm
    zero = np.float32(0.0)
    return zero + tail_beta[r], zero + tail_var[r], tm


@_jit
def eps_args(rows, lo, hi, k, cb, cv, cm, tail_beta, tail_var, tail_b, l3, l2, out):
    """``t * t + 2 l max(V, 0)`` with ``t = b l / 3`` (what bernstein_eps takes the square root
    of) at positions lo..hi - 1 of the suffixes (:func:`_suffix`) of ``rows``, into ``out``
    (len(rows), hi - lo)."""
    zero = np.float32(0.0)
    for i in range(len(rows)):
        r = rows[i]
        for j in range(lo, hi):
            _, v, m = _suffix(r, j, k, cb, cv, cm, tail_beta, tail_var, tail_b)
            t = m * l3
            out[i, j - lo] = t * t + l2 * (zero if v < zero else v)


@_jit
def first_ok(rows, lo, hi, k, cb, cv, cm, tail_beta, tail_var, tail_b, root, denom, l3, eps,
             also_root, also_l3, also_eps, k_star, found, eps_at, eps_before):
    """The first position in lo..hi - 1 whose eps_hat ``(beta + t + root) / D`` is below
    ``eps`` (and the output certificate's, ``also_root`` given) for each of ``rows``: sets
    ``k_star``, ``found`` and ``eps_at`` (eps_hat there) where there is one, and eps_hat at
    position 0 (eps_hat(L)) into ``eps_before``."""
    also = also_root.shape[1] > 0
    for i in range(len(rows)):
        r = rows[i]
        d = denom[r]
        for j in range(lo, hi):
            sb, _, sm = _suffix(r, j, k, cb, cv, cm, tail_beta, tail_var, tail_b)
            e = (sb + sm * l3 + root[i, j - lo]) / d
            if j == 0:
                eps_before[r] = e
            ok = e < eps
            if ok and also:
                ok = (sb + sm * also_l3 + also_root[i, j - lo]) / d < also_eps
            if ok:
                k_star[r], found[r], eps_at[r] = j, True, e
                break


@_jit
def exact_mask(head, hb, hv, b_i, k_star):
    """(R, n) the first k* tokens of each row's order with a contribution."""
    rows, n = b_i.shape
    exact = np.zeros((rows, n), np.bool_)
    for r in range(rows):
        for j in range(k_star[r]):
            i = head[r, j]
            if hb[r, j] > 0 or hv[r, j] > 0 or b_i[r, i] > 0:
                exact[r, i] = True
    return exact


@_jit
def binary_terms(w, u, bfac, r, omr, idx, count, beta_i, var_i, b_i):
    """``terms`` for binary shrinkage into ``beta_i``, ``var_i``, ``b_i`` (R, n), row by row
    (:func:`_terms_row`). The factor rows ``bfac``, ``r``, ``omr`` stand for
    ``R // len(bfac)`` consecutive rows each."""
    per = w.shape[0] // bfac.shape[0]
    for q in range(w.shape[0]):
        f = q // per
        _terms_row(w[q], u[q], bfac[f], r[f], omr[f], idx[q], count[q], beta_i[q], var_i[q],
                   b_i[q])


@_jit
def _terms_row(wr, ur, fr, rr, orow, idx, count, br, vr, mr):
    """A row's binary-shrinkage terms: ``V = w u``, ``b = w max(r, 1 - r) / r``, ``beta = 0``,
    then at the first ``count`` tokens of ``idx`` (lambda = r): ``V r^2``, ``b r``,
    ``beta = w (1 - r)``."""
    zero = np.float32(0.0)
    for j in range(wr.shape[0]):  # one loop per output: faster than one for all three
        vr[j] = wr[j] * ur[j]
    for j in range(wr.shape[0]):
        mr[j] = wr[j] * fr[j]
    br[:] = zero
    for p in range(count):
        i = idx[p]
        s = rr[i]
        vr[i] = vr[i] * (s * s)
        mr[i] = mr[i] * s
        br[i] = zero + wr[i] * orow[i]


@_jit
def outside(beta_i, var_i, b_i, exact, g, beta_in, var_in):
    """The terms a KV head's exact set ``exact`` (n_kv, m, n) covers, for the rows (R, n) of
    its query heads ((kv, head, row) order, ``g`` heads): beta and V there (0 elsewhere) into
    ``beta_in``, ``var_in`` (the sums are torch's), and the largest b outside it (R,).
    False where b holds a NaN, a negative value or -0.0 (then torch's max): b's maxima are
    taken on the bits."""
    rows, n = beta_i.shape
    m = exact.shape[1]
    b_out = np.zeros(rows, np.int32)
    for q in range(rows):
        ex = exact[q // (g * m), q % m]
        bi, vi, bits = beta_i[q], var_i[q], b_i[q].view(np.int32)
        bo, vo = beta_in[q], var_in[q]
        for j in range(n):  # one loop per output: faster than one for both
            bo[j] = bi[j] * np.float32(ex[j])
        for j in range(n):
            vo[j] = vi[j] * np.float32(ex[j])
        top, lo, hi = np.int32(0), bits[0], bits[0]
        for j in range(n):
            v = bits[j]
            lo = min(lo, v)
            hi = max(hi, v)
            top = max(top, np.int32(0) if ex[j] else v)
        if lo < 0 or hi > INF_BITS:
            return b_out.view(np.float32), False
        b_out[q] = top
    return b_out.view(np.float32), True


@_jit
def tie_moves(rows, head, after, gain, beta_i, var_i, b_i, k_star):
    """``certificate._topk_rows`` for the flat ``rows`` (whose head ``head`` (R, k) and next
    token ``after`` hold equal positive gains): whether the plan could depend on the order of
    tied tokens (then ``torch.topk``'s order decides)."""
    k = head.shape[1]
    moves = np.zeros(len(rows), np.bool_)
    for i in range(len(rows)):
        r = rows[i]
        hr, g = head[r], gain[r]
        ks = k_star[r]
        m = bd = near = False
        for j in range(k):  # positions j and j + 1 (the token after the head at k)
            a = hr[j]
            b = hr[j + 1] if j + 1 < k else after[r]
            if g[a] != g[b]:
                continue
            # the cut or k* inside a run of ties, tied tokens with different beta or V, or
            # tied tokens with different b anywhere while k* - 1 ends a run
            m = j == k - 1 or j == ks - 1 or beta_i[r, a] != beta_i[r, b] \
                or var_i[r, a] != var_i[r, b]
            bd = bd or b_i[r, a] != b_i[r, b]
            near = near or j == ks - 2
            m = m or (bd and near)
            if m:
                break
        moves[i] = m
    return moves


@_jit
def tie_swaps(rows, head, after, gain, most):
    """The other heads ``torch.topk`` could give the flat ``rows`` (head ``head`` (R, k), next
    token ``after``) where its order among equal gains is all that differs from the stable
    one and is a choice of few: every gain of the head and the next token positive, equal
    ones in pairs (no three equal), at most ``most`` pairs. Each pair may come either way
    round (a pair across the cut: either token in the head). Returns the rows' pair counts
    (-1: not such a row), and per other head (2^pairs - 1 per row) its row's position in
    ``rows`` and the head (A, k)."""
    k = head.shape[1]
    at = np.zeros((len(rows), most), np.int64)  # each pair's first position
    pairs = np.zeros(len(rows), np.int64)
    total = 0
    for i in range(len(rows)):
        r = rows[i]
        hr, g = head[r], gain[r]
        c = 0
        for j in range(k + 1):
            t = hr[j] if j < k else after[r]
            if not g[t] > 0:
                c = -1
                break
            if j and g[t] == g[hr[j - 1]]:
                if c == most or (j > 1 and g[hr[j - 2]] == g[t]):
                    c = -1
                    break
                at[i, c] = j - 1
                c += 1
        pairs[i] = c
        total += (1 << c) - 1 if c > 0 else 0
    owner = np.empty(total, np.int64)
    heads = np.empty((total, k), head.dtype)
    a = 0
    for i in range(len(rows)):
        r = rows[i]
        for mask in range(1, (1 << pairs[i]) if pairs[i] > 0 else 1):
            h = heads[a]
            h[:] = head[r]
            for p in range(pairs[i]):
                if mask >> p & 1:
                    j = at[i, p]
                    if j + 1 < k:
                        h[j], h[j + 1] = h[j + 1], h[j]
                    else:  # across the cut: the next token in the head instead
                        h[j] = after[r]
            owner[a] = i
            a += 1
    return pairs, owner, heads


@_jit
def pass_score(s, shift):
    """(n_kv, n) ``(s - shift[..., None]).amax(1)`` for planned logits ``s`` (n_kv, rows, n):
    each KV head's largest log-weight relative to its row's largest, NaN where any is."""
    n_kv, rows, n = s.shape
    out = np.full((n_kv, n), -np.inf, s.dtype)
    for h in range(n_kv):
        o = out[h]
        for q in range(rows):
            sr, c = s[h, q], shift[h, q]
            for j in range(n):
                v = sr[j] - c
                o[j] = v if (v > o[j] or v != v) else o[j]
    return out


@_jit
def log_factors(base, in_h, exact_kv, own_exact, idx, count, sampled, out, own):
    """:func:`kvfetch.reweighted_log_factors` with binary shrinkage, row by row: ``out`` and
    ``own`` (R, n), R = (KV head, query head, row), start from the KV head's ``base`` (-log r
    on sampled tokens, -inf elsewhere) and are 0 on H (``in_h``), on the first ``count`` tokens
    of ``idx`` that are sampled (lambda = r) and on the KV head's union ``exact_kv`` (n_kv, m,
    n) (``out``) or the row's own set ``own_exact`` (R, n) (``own``)."""
    rows, n = out.shape
    n_kv, m = exact_kv.shape[0], exact_kv.shape[1]
    per = rows // n_kv
    zero = np.float32(0.0)
    for r in range(rows):
        kv = r // per
        b, h, e, oe, o, ow = base[kv], in_h[kv], exact_kv[kv, r % m], own_exact[r], out[r], own[r]
        for j in range(n):
            v = b[j]
            o[j] = zero if h[j] | e[j] else v
            ow[j] = zero if h[j] | oe[j] else v
        for t in range(min(count[r], idx.shape[1])):
            c = idx[r, t]
            if sampled[kv, c]:
                o[c] = zero
                ow[c] = zero
