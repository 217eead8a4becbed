"""The VarRate codec for one layer (``../shared/spec/varrate.md``; paper Sec. 3, Algorithm 1).

Every context token is kept: anchors every ``stride`` tokens and the last ``window`` tokens
exactly (the exact set E), every other token (the coded set C) as a residual to the mean of its
``c`` nearest anchors, projected on a shared per-layer basis ``V`` (R x D, orthonormal rows) and
truncated to a per-token rank ``r_t`` water-filled from SnapKV salience. Keys are coded in their
pre-RoPE form; the joint vector of a token is
``z_t = [k~_t of all KV heads ; v_t of all KV heads]``.

Decisions (documented because the paper leaves them open):

* Nearest anchors are searched over *all* anchors of the context, earlier or later: the whole
  context is coded at once after its prefill, and decoding only needs the stored anchors, so no
  causal restriction is needed (this is the paper's Eq. 2 as written).
* The basis is the top-R right singular vectors of the (uncentred) residual matrix, computed as the
  eigenvectors of its D x D Gram matrix in float64; reconstruction is ``z_bar + V^T c`` with no mean
  term, so no centring.
* The budget in coefficients is ``B = floor(D * (kappa * L - |E|))`` (an integer, so that integer
  ranks can meet it exactly). Coefficient quantization leaves B (the allocation) unchanged, as in
  the paper; it only shrinks the bytes.
* Group quantization (asymmetric min-max, b-bit unsigned codes, bit-packed, an fp16 scale and an
  fp16 zero per group). Default grouping is per channel: a group is coefficient j of up to
  ``group`` consecutive coded tokens that keep j (one singular direction shares a scale: the
  coefficients' spread falls with j, so per-token groups waste resolution); ``axis="token"``
  groups ``group`` consecutive coefficients of one token instead. ``bits=16`` stores the kept
  coefficients as fp16 without scales.
* Stored bytes (the measured footprint): exact tokens at 2 bytes a scalar (a 16-bit cache; they are
  kept bit-identical to the input), the packed coefficients, scales and zeros, the anchor indices
  (uint16 while there are at most 65536 anchors, else int32) and each coded token's rank (uint16:
  a decoder needs it to split the coefficient stream). Exact-set and coded-set positions are
  implicit (stride and window). The reference is the full cache at 2 bytes a scalar.
* Salience: SnapKV's smoothing is ``avg_pool1d(kernel 5, padding 2)`` counting the zero padding
  (KVPress's SnapKV, which the paper builds on); a constant signal min-maxes to all ones (flat).
* RoPE: un-rotation is the exact inverse of the model's rotation (``kvsim.attention.rope``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvsim._torch import F, torch
from kvsim.attention.dense import logits
from kvsim.attention.rope import Rope, rotate
from kvsim.errors import KvsimError

CACHE_BYTES = 2  # bytes per scalar of the reference (uncompressed, 16-bit) KV cache
BITS = (16, 8, 4, 3)


# ------------------------------------------------------------------------- the joint vector

def joint(k_pre: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """(G, n, d) pre-RoPE keys and values -> (n, D) with D = 2 G d: [keys of all heads ; values]."""
    g, n, d = k_pre.shape
    return torch.cat([k_pre.permute(1, 0, 2).reshape(n, g * d),
                      v.to(k_pre.dtype).permute(1, 0, 2).reshape(n, g * d)], dim=1)


def split(z: torch.Tensor, g: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`joint`: (n, D) -> keys, values (G, n, d)."""
    n = z.shape[0]
    k = z[:, :g * d].reshape(n, g, d).permute(1, 0, 2)
    v = z[:, g * d:].reshape(n, g, d).permute(1, 0, 2)
    return k, v


def layout(n: int, stride: int, window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Anchor positions (0, stride, ...), the exact-set mask (anchors + last ``window``), and the
    coded positions, for a context of ``n`` tokens."""
    anchors = torch.arange(0, n, stride)
    exact = torch.zeros(n, dtype=torch.bool)
    exact[anchors] = True
    exact[max(0, n - window):] = True
    return anchors, exact, torch.nonzero(~exact).flatten()


def nearest_anchors(z_c: torch.Tensor, z_a: torch.Tensor, c: int,
                    chunk: int = 4096) -> torch.Tensor:
    """Indices (n_c, c) into the anchors of the ``c`` nearest (Euclidean) to each coded row."""
    c = min(c, z_a.shape[0])
    out = []
    for i in range(0, z_c.shape[0], chunk):  # chunks bound the distance matrix, not a token loop
        dist = torch.cdist(z_c[i:i + chunk], z_a)
        out.append(torch.topk(dist, c, dim=1, largest=False).indices)
    return torch.cat(out) if out else torch.zeros(0, c, dtype=torch.long)


@dataclass
class Prepared:
    """A layer's context un-rotated and split into exact and coded sets, with residuals."""
    z: torch.Tensor  # (n, D) joint vectors, pre-RoPE keys
    anchors: torch.Tensor  # (n_a,) anchor positions
    exact: torch.Tensor  # (n,) bool
    coded: torch.Tensor  # (n_c,) coded positions
    anchor_ids: torch.Tensor  # (n_c, c) indices into ``anchors``
    z_bar: torch.Tensor  # (n_c, D) mean of the c nearest anchors
    resid: torch.Tensor  # (n_c, D)


def prepare(k: torch.Tensor, v: torch.Tensor, rope: Rope, stride: int, c: int,
            window: int) -> Prepared:
    """Steps 1-3 of Algorithm 1 for context keys/values ``k``, ``v`` (G, n, d), positions 0..n-1."""
    g, n, d = k.shape
    pos = torch.arange(n)
    z = joint(rotate(k, pos, rope, inverse=True), v)
    anchors, exact, coded = layout(n, stride, window)
    z_a = z[anchors]
    ids = nearest_anchors(z[coded], z_a, c)
    z_bar = z_a[ids].mean(dim=1)
    return Prepared(z, anchors, exact, coded, ids, z_bar, z[coded] - z_bar)


def fit_basis(resid: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``rank`` right singular vectors (rank, D) of the residual rows, ordered by singular
    value, and the singular values."""
    r = resid.double()
    return basis_from_gram(r.T @ r, rank)


def basis_from_gram(gram: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Basis and singular values from the Gram matrix ``E^T E`` (D, D) of residual rows ``E``:
    its eigenvectors are E's right singular vectors (float64 eigendecomposition)."""
    evals, evecs = torch.linalg.eigh(gram.double())
    order = torch.argsort(evals, descending=True)[:rank]
    basis = evecs[:, order].T.contiguous()
    # a deterministic sign: the largest-magnitude entry of each row is positive
    sign = torch.sign(basis.gather(1, basis.abs().argmax(dim=1, keepdim=True)))
    basis = basis * torch.where(sign == 0, torch.ones_like(sign), sign)
    return basis, evals[order].clamp(min=0).sqrt()


# ---------------------------------------------------------------------------------- salience

def snapkv_salience(obs_q: torch.Tensor, obs_pos: torch.Tensor, k: torch.Tensor,
                    kernel: int = 5) -> torch.Tensor:
    """Attention the window queries (n_q, w, d) put on each context key (G, n, d), averaged over
    queries and query heads, smoothed by a length-``kernel`` moving average (SnapKV's avg-pool,
    zero-padded, divided by ``kernel``). Softmax is over the context keys a query sees."""
    s = logits(obs_q.float(), k.float(), obs_pos)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # a query seeing no key contributes nothing
    sal = p.mean(dim=(0, 1))
    return F.avg_pool1d(sal[None, None], kernel, stride=1, padding=kernel // 2)[0, 0]


def minmax(s: torch.Tensor) -> torch.Tensor:
    """Min-max to [0, 1]; a constant signal becomes all ones (the flat allocation)."""
    lo, hi = s.min(), s.max()
    if not hi > lo:
        return torch.ones_like(s)
    return (s - lo) / (hi - lo)


# ------------------------------------------------------------------------------- water-filling

def waterfill(s_hat: torch.Tensor, budget: int, r_min: int, r_max: int,
              iters: int = 200) -> torch.Tensor:
    """Integer ranks ``clip(r_min + lambda * s_hat, r_min, r_max)`` summing to ``budget`` exactly.

    lambda by bisection (float64), then largest-remainder rounding within [r_min, r_max].
    """
    n = s_hat.numel()
    if n == 0:
        return torch.zeros(0, dtype=torch.long)
    if budget < n * r_min:
        raise KvsimError(f"the coded budget ({budget} coefficients, {budget / n:.1f} per coded "
                         f"token) cannot give {n} coded tokens the rank floor {r_min}; lower "
                         f"--r-min, raise the budget, or raise --stride / shrink --window")
    if budget > n * r_max:
        raise KvsimError(f"the coded budget ({budget} coefficients) exceeds {n} coded tokens at "
                         f"the rank cap {r_max}; raise --rank-cap or lower the budget")
    s = s_hat.double().clamp(0, 1)

    def total(lam):
        return torch.clamp(r_min + lam * s, r_min, r_max).sum()

    pos = s[s > 0]
    lo, hi = 0.0, (r_max - r_min) / float(pos.min()) if pos.numel() else 0.0
    for _ in range(iters if hi > 0 else 0):
        mid = 0.5 * (lo + hi)
        if total(mid) <= budget:
            lo = mid
        else:
            hi = mid
    real = torch.clamp(r_min + lo * s, r_min, r_max)  # sum <= budget
    ranks = torch.floor(real + 1e-9).long().clamp(r_min, r_max)
    deficit = budget - int(ranks.sum())
    room = ranks < r_max
    if deficit > 0:
        if deficit <= int(room.sum()):  # largest remainders first, among tokens under the cap
            rem = torch.where(room, real - ranks, torch.full_like(real, -1.0))
            ranks[torch.argsort(rem, descending=True, stable=True)[:deficit]] += 1
        else:  # degenerate (tokens with s_hat = 0 must rise above the floor): fill headroom
            head = (r_max - ranks)
            order = torch.argsort(s, descending=True, stable=True)
            before = torch.cumsum(head[order], 0) - head[order]
            ranks[order] += torch.clamp(deficit - before, min=0).minimum(head[order])
    return ranks


# ------------------------------------------------------------------------------ quantization

def pack_bits(vals: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned ``bits``-bit integers -> a uint8 bit stream (little-endian within bytes)."""
    b = ((vals.long()[:, None] >> torch.arange(bits)) & 1).flatten().to(torch.uint8)
    b = F.pad(b, (0, (-b.numel()) % 8))
    return (b.reshape(-1, 8).long() << torch.arange(8)).sum(1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    b = ((packed.long()[:, None] >> torch.arange(8)) & 1).flatten()[:count * bits]
    return (b.reshape(count, bits) << torch.arange(bits)).sum(1)


@dataclass
class Coefficients:
    """The kept coefficients of every coded token, as stored."""
    bits: int
    group: int
    count: int  # kept coefficients in all
    data: torch.Tensor  # fp16 stream (bits 16) or packed uint8 codes
    scale: torch.Tensor | None = None  # (n_groups,) fp16
    zero: torch.Tensor | None = None  # (n_groups,) fp16
    axis: str = "channel"  # grouping (see _groups)


def _groups(ranks: torch.Tensor, width: int, group: int,
            axis: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Group id of each coefficient slot (n_c, width) and the kept mask.

    ``axis="channel"``: a group is up to ``group`` consecutive coded tokens' coefficient j (only
    tokens that keep j), so one group shares one singular direction and its scale;
    ``axis="token"``: a group is up to ``group`` consecutive coefficients of one token.
    """
    j = torch.arange(width)
    kept = j[None, :] < ranks[:, None]
    if axis == "token":
        per = (ranks + group - 1) // group
        first = torch.cumsum(per, 0) - per
        return first[:, None] + j[None, :] // group, kept
    kc = kept.long()
    within = torch.cumsum(kc, 0) - kc  # index of the token among those keeping coefficient j
    per = (kc.sum(0) + group - 1) // group
    first = torch.cumsum(per, 0) - per
    return first[None, :] + within // group, kept


def quantize(coef: torch.Tensor, ranks: torch.Tensor, bits: int, group: int,
             axis: str = "channel") -> Coefficients:
    """Keep each row's leading ``ranks`` coefficients of ``coef`` (n_c, R) and store them:
    fp16 (``bits=16``) or ``bits``-bit asymmetric min-max codes with an fp16 scale and zero per
    group (see :func:`_groups`)."""
    if bits == 16:
        x = coef[torch.arange(coef.shape[1])[None, :] < ranks[:, None]].float()
        return Coefficients(16, group, x.numel(), x.half(), axis=axis)
    gid, kept = _groups(ranks, coef.shape[1], group, axis)
    x = coef[kept].float()
    g = gid[kept]
    n_groups = int(g.max()) + 1 if g.numel() else 0
    inf = torch.full((n_groups,), float("inf"))
    lo = inf.scatter_reduce(0, g, x, "amin")
    hi = (-inf).scatter_reduce(0, g, x, "amax")
    zero = lo.half()
    scale = ((hi - zero.float()) / (2 ** bits - 1)).half()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # a single-valued group
    q = torch.round((x - zero.float()[g]) / scale.float()[g]).clamp(0, 2 ** bits - 1)
    return Coefficients(bits, group, x.numel(), pack_bits(q, bits), scale, zero, axis)


def dequantize(qc: Coefficients, ranks: torch.Tensor, width: int) -> torch.Tensor:
    """The stored coefficients back as a (n_c, width) float32 matrix, zero past each rank."""
    out = torch.zeros(ranks.numel(), width)
    if qc.bits == 16:
        out[torch.arange(width)[None, :] < ranks[:, None]] = qc.data.float()
    else:
        gid, kept = _groups(ranks, width, qc.group, qc.axis)
        g = gid[kept]
        q = unpack_bits(qc.data, qc.bits, qc.count).float()
        out[kept] = q * qc.scale.float()[g] + qc.zero.float()[g]
    return out


# ------------------------------------------------------------------------------ the code

@dataclass
class Code:
    """Everything stored for one layer's context; :meth:`nbytes` is the measured footprint."""
    n: int
    g: int
    d: int
    stride: int
    window: int
    rank_cap: int
    k_exact: torch.Tensor  # (G, n_e, d) post-RoPE keys of the exact set, bit-identical
    v_exact: torch.Tensor  # (G, n_e, d)
    anchor_ids: torch.Tensor  # (n_c, c) uint16 / int32
    ranks: torch.Tensor  # (n_c,) uint16
    coef: Coefficients

    def nbytes(self) -> dict:
        """Stored bytes by part, and the full (uncompressed, 16-bit) cache of this layer."""
        c = self.coef
        return {
            "exact": (self.k_exact.numel() + self.v_exact.numel()) * CACHE_BYTES,
            "coef": c.data.numel() * c.data.element_size(),
            "scales": 0 if c.scale is None else
            (c.scale.numel() + c.zero.numel()) * c.scale.element_size(),
            "anchor_ids": self.anchor_ids.numel() * self.anchor_ids.element_size(),
            "ranks": self.ranks.numel() * self.ranks.element_size(),
            "full": self.n * 2 * self.g * self.d * CACHE_BYTES,
        }


def coded_budget(n: int, n_exact: int, dim: int, kappa: float, detail: str = "") -> int:
    """``floor(D * (kappa * n - |E|))``; an error when kappa cannot even hold the exact set."""
    b = math.floor(dim * (kappa * n - n_exact) + 1e-6)
    if b <= 0:
        raise KvsimError(f"a budget of kappa={kappa:.4g} ({kappa * n:.1f} of {n} tokens) cannot "
                         f"hold the {n_exact} exact tokens ({detail or 'anchors + recent window'}"
                         f"); lower --compression, or raise --stride / shrink --window")
    return b


def encode(k: torch.Tensor, v: torch.Tensor, basis: torch.Tensor, rope: Rope, kappa: float,
           s_hat_fn, r_min: int, rank_cap: int, stride: int, c: int, window: int,
           bits: int, group: int, prep: Prepared | None = None,
           axis: str = "channel") -> tuple[Code, dict]:
    """Code one layer's context ``k``, ``v`` (G, n, d); ``s_hat_fn(prep) -> s_hat`` (n_c,) gives
    the normalised salience over the coded set (a constant gives the flat codec)."""
    g, n, d = k.shape
    prep = prep or prepare(k, v, rope, stride, c, window)
    dim = 2 * g * d
    if basis.shape[1] != dim:
        raise KvsimError(f"basis has width {basis.shape[1]}, the layer's joint vector has {dim}")
    rank_cap = min(rank_cap, basis.shape[0])
    n_c = prep.coded.numel()
    budget = coded_budget(n, n - n_c, dim, kappa, f"{prep.anchors.numel()} anchors every "
                          f"{stride} tokens + the last {min(window, n)}")
    if n_c == 0:
        raise KvsimError(f"no token of the {n}-token context is coded (all exact)")
    unspent = max(0, budget - n_c * rank_cap)  # more than the cap can use: all at rank R
    budget -= unspent
    s_hat = s_hat_fn(prep)
    ranks = waterfill(s_hat, budget, r_min, rank_cap)
    V = basis[:rank_cap].to(prep.resid.dtype)
    coef = prep.resid @ V.T
    qc = quantize(coef, ranks, bits, group, axis)
    n_a = prep.anchors.numel()
    ids = prep.anchor_ids.to(torch.int32 if n_a > 65536 else torch.uint16)
    exact = prep.exact
    code = Code(n, g, d, stride, window, rank_cap, k[:, exact].clone(), v[:, exact].clone(), ids,
                ranks.to(torch.uint16), qc)
    info = {"budget": budget, "budget_unspent": unspent, "s_hat": s_hat, "ranks": ranks,
            "n_coded": n_c, "n_exact": n - n_c, "coef": coef}
    return code, info


def decode(code: Code, basis: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, torch.Tensor]:
    """Rebuild the layer's post-RoPE keys and values (G, n, d) from what is stored only.

    Exact tokens come back bit-identical (in their stored dtype); coded tokens are
    ``z_bar + V^T (kept coefficients)``, split and the key re-rotated.
    """
    n, g, d = code.n, code.g, code.d
    anchors, exact, coded = layout(n, code.stride, code.window)
    pos_e = torch.nonzero(exact).flatten()
    # anchors are the exact tokens at anchor positions; un-rotate them as the encoder did
    where_a = torch.searchsorted(pos_e, anchors)
    k_a = rotate(code.k_exact[:, where_a], anchors, rope, inverse=True)
    z_a = joint(k_a, code.v_exact[:, where_a])
    ranks = code.ranks.long()
    z_bar = z_a[code.anchor_ids.long()].mean(dim=1)
    V = basis[:code.rank_cap].to(z_bar.dtype)
    z_hat = z_bar + dequantize(code.coef, ranks, code.rank_cap).to(z_bar.dtype) @ V
    k_c, v_c = split(z_hat, g, d)
    k_c = rotate(k_c, coded, rope)
    dtype = code.k_exact.dtype
    k_out = torch.empty(g, n, d, dtype=dtype)
    v_out = torch.empty(g, n, d, dtype=code.v_exact.dtype)
    k_out[:, exact], v_out[:, exact] = code.k_exact, code.v_exact
    k_out[:, coded], v_out[:, coded] = k_c.to(dtype), v_c.to(code.v_exact.dtype)
    return k_out, v_out
