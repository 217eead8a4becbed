"""VerKV per forward pass: sketch -> shortlist -> estimated weights -> shrinkage -> certificate ->
fetch set (GQA union), then the reweighted attention.

Two variants of what the certificate may look at (Theorem 2 needs lambda, the fetch order and
k* to be independent of the sample):

* ``independent`` (default): lambda, the order g, k* and the certificate's D come only from
  quantities that do not depend on which tokens were sampled: exact weights for H and for the
  shortlist, sketch weights for every other token of L (sampled or not); the shortlist is chosen
  among all of L. Theorem 2's precondition (lambda and the order fixed before the sample is
  looked at) then holds whenever the sketch is exact, and the fetch-exact set does not depend on
  the sample. Sampled tokens are resident, so a shortlisted sampled token costs no host read.
* ``paper``: the deployed algorithm: resident tokens (H and the sample S) get exact weights, the
  shortlist is chosen among the non-resident tokens L \\ S; lambda, the order and D then depend
  on the sample.

With the bounded sketch (``KeySketch.bounded``) every planned logit carries a half-width e
(0 where it is exact): the certificate's terms (beta, V, b) use the upper weights
``exp(s^ + e)`` and its D the lower ones ``exp(s^ - e)``. Lemma 1's bound grows with beta, V and
b and shrinks with D, so it is then a bound on the true eps_hat whatever the keys: Theorem 2
holds by construction, not only with an exact sketch. The shortlist takes the largest upper
logits.

GQA: each query head orders and cuts its own L; its KV head fetches the union of the heads'
selections, and every head of the group then treats the whole union as exact (more exact tokens
only lower a head's certificate, and the union is as sample-independent as its parts).
Tokens after the context (question and decoded tokens) are always exact and never in L.
All of it is vectorised over query heads and rows, or on the CPU with numba a compiled loop per
row that gives the same bits (certificate.py, _rows.py); the only sorts are heads of
``FETCH_HEAD`` / ``SHRINK_HEAD`` tokens in a stable descending order with a full-sort fallback
(see certificate.py). ``VerKV.attend`` scores a pass's planned logits once for its shortlist and its
decisions (:func:`pass_shortlist_planned`) and takes both log factors from the sampled tokens
alone (:func:`reweighted_log_factors`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

from kvsim._torch import F, lazy, torch
from kvsim.attention.sampling import PoissonSample
from kvsim.policies.verkv import certificate as C
from kvsim.policies.verkv.sketch import KeySketch, logit_halfwidth, shortlist, sketch_logits

_rows = lazy("kvsim.policies.verkv._rows")  # torch and numba: loaded on first use

VARIANTS = ("independent", "paper")
WEIGHT_FLOOR = {"float32": 1e-15, "float16": 1e-3, "bfloat16": 1e-15,  # by torch dtype name
                "float64": 1e-150}


@dataclass
class DecideConfig:
    eps: float = 0.05
    delta: float = 0.1
    shrinkage: str = "binary"  # "binary" | "bounded"
    shortlist: int = 128
    variant: str = "independent"
    fetch_head: int | None = C.FETCH_HEAD
    shrink_head: int | None = C.SHRINK_HEAD
    report_after: bool = True  # compute eps_hat after the GQA union (a statistic, not a decision)
    eps_output: float | None = None  # also fetch until the output certificate is below it


@dataclass
class VerKVLayer:
    """What VerKV holds for one layer after compress (context tokens only)."""
    sample: PoissonSample  # r, H, L, S per KV head (n_kv, n_ctx)
    sketch: KeySketch | None  # None: the perfect sketch (exact weights everywhere)
    k_host: torch.Tensor  # (n_kv, n_ctx, d) the full keys in host memory (shortlist, fetch)
    known_idx: torch.Tensor  # (n_kv, R) context tokens with exact weights before any read
    factors: C.Factors  # per-token constants of r, (n_kv, 1, n_ctx), zero outside L
    v_range: tuple | None = None  # (lo, hi) (n_kv, d) of the context's values: output certificate
    _known_keys: tuple | None = dataclasses.field(default=None, repr=False, compare=False)

    def known_keys(self) -> torch.Tensor:
        """(n_kv, R, d) the host keys at ``known_idx``, gathered once (for the same tensors)."""
        kept = self._known_keys
        if kept is None or kept[0] is not self.k_host or kept[1] is not self.known_idx:
            idx = self.known_idx
            keys = self.k_host.gather(1, idx[:, :, None].expand(-1, -1, self.k_host.shape[-1]))
            self._known_keys = kept = (self.k_host, idx, keys)
        return kept[2]


def make_layer(sample: PoissonSample, sketch: KeySketch | None, k_host: torch.Tensor,
               variant: str, v_range: tuple | None = None) -> VerKVLayer:
    known = sample.in_h if variant == "independent" else sample.resident
    count = known.sum(-1)
    width = int(count.max())
    # pad each head's index list with its first index (a duplicate scatter of the same value)
    order = torch.sort((~known).to(torch.int8), dim=-1, stable=True).indices[:, :max(width, 1)]
    pos = torch.arange(order.shape[-1], device=order.device)[None, :]
    known_idx = torch.where(pos < count[:, None], order, order[:, :1])
    f = C.token_factors(sample.r.to(k_host.dtype), sample.in_l)
    f = C.Factors(*(x[:, None, :] for x in (f.r, f.odds, f.one_minus_r, f.bfac)))
    return VerKVLayer(sample, sketch, k_host, known_idx, f, v_range)


@dataclass
class Decision:
    """One forward pass; per-decision tensors are (n_q, m), masks (n_q, m, n) or (n_kv, m, n)."""
    k_star: torch.Tensor  # (n_q, m) tokens made exact by each decision
    own_exact: torch.Tensor  # (n_q, m, n) bool
    exact_kv: torch.Tensor  # (n_kv, m, n) bool, union over the query heads of each KV head
    shortlisted: torch.Tensor  # (n_kv, m, n) bool: keys read and scored exactly (shortlist; with
    # the bounded sketch also the keys its first plan would fetch)
    eps_before: torch.Tensor  # (n_q, m) eps_hat(L)
    eps_after: torch.Tensor  # (n_q, m) eps_hat(L \ exact_kv), after the union
    denom_est: torch.Tensor  # (n_q, m) the certificate's D, shifted by ``shift``
    shift: torch.Tensor  # (n_q, m) the logit shift of the weights (log of the largest weight)
    shrink: C.BinaryShrink | torch.Tensor  # lambda: sparse binary form or dense (n_kv, g*m, n)
    out_after: torch.Tensor | None = None  # (n_q, m) the output certificate after the union

    def lam(self, f: C.Factors) -> torch.Tensor:
        """Dense lambda (n_q, m, n) (1 outside L)."""
        lam = self.shrink.lam(f) if isinstance(self.shrink, C.BinaryShrink) else self.shrink
        return lam.reshape(self.own_exact.shape)


def _planned_logits(q: torch.Tensor, layer: VerKVLayer, visible: torch.Tensor | None):
    """Grouped logits (n_kv, g*m, n) of the query rows before any host read: exact everywhere
    with the perfect sketch, else sketch logits with exact ones at ``known_idx``; -inf where a
    row does not see the token. With a bounded sketch also their half-widths (0 where exact),
    else None."""
    n_q, m, d = q.shape
    n_kv = layer.k_host.shape[0]
    g = n_q // n_kv
    qg = q.reshape(n_kv, g * m, d)
    if layer.sketch is None:
        return _exact_logits(q, layer, visible), None
    s = sketch_logits(layer.sketch, q).view(n_kv, g * m, -1)
    idx = layer.known_idx  # (n_kv, R)
    exact_known = torch.matmul(qg, layer.known_keys().transpose(1, 2)) / math.sqrt(d)
    at = idx[:, None, :].expand(-1, g * m, -1)
    s.scatter_(-1, at, exact_known)
    e = None
    if layer.sketch.bounded:
        e = logit_halfwidth(layer.sketch, q).view(n_kv, g * m, -1)
        e.scatter_(-1, at, 0.0)
    if visible is not None:
        s.masked_fill_(~visible.repeat(g, 1)[None], float("-inf"))
    return s, e


def _visible(q_pos: torch.Tensor, n: int) -> torch.Tensor | None:
    """(m, n) which context tokens each row sees; None when every row sees all of them."""
    if bool((q_pos >= n - 1).all()):
        return None
    return torch.arange(n, device=q_pos.device)[None, :] <= q_pos[:, None]


def candidates_of(layer: VerKVLayer, variant: str) -> torch.Tensor:
    """(n_kv, n) the tokens the shortlist and the certificate's L are drawn from."""
    smp = layer.sample
    return smp.in_l if variant == "independent" else smp.in_l & ~smp.sampled


def pass_shortlist(q: torch.Tensor, q_pos: torch.Tensor, layer: VerKVLayer, cfg: DecideConfig,
                   chunks: list[slice] | None = None):
    """The shortlist of one forward pass with query rows ``q`` (n_q, m, d) at ``q_pos``: per KV
    head, the ``cfg.shortlist`` candidates with the largest sketch log-weight relative to their
    row's largest planned logit (``s_i - max_j s_j``, a log-probability up to the row's
    normaliser), max over the group's query heads and the pass's rows (the spec's "over that
    head's query rows", read as the max). Scored over ``chunks`` of rows (memory); returns indices
    (n_kv, k) and which are real candidates (fewer where there are fewer), or None without a
    sketch or a shortlist."""
    return pass_shortlist_planned(q, q_pos, layer, cfg, chunks)[0]


def pass_shortlist_planned(q: torch.Tensor, q_pos: torch.Tensor, layer: VerKVLayer,
                           cfg: DecideConfig, chunks: list[slice] | None = None,
                           keep: int = 0):
    """:func:`pass_shortlist` and, when there are at most ``keep`` chunks, each chunk's planned
    logits, half-widths and rows' largest upper logit (what :func:`decide` takes as ``planned``
    for those rows instead of scoring them again), else None."""
    if layer.sketch is None or cfg.shortlist <= 0:
        return None, None
    n_kv, n, _ = layer.k_host.shape
    best = torch.full((n_kv, n), float("-inf"), dtype=q.dtype, device=q.device)
    seen = torch.zeros(n, dtype=torch.bool, device=q.device)
    chunks = chunks or [slice(0, q.shape[1])]
    planned = [] if len(chunks) <= keep else None
    for sl in chunks:
        visible = _visible(q_pos[sl], n)
        s, e = _planned_logits(q[:, sl], layer, visible)
        upper = s if e is None else s + e  # the bounded sketch ranks by the upper logit
        shift = upper.amax(-1)
        if planned is not None:
            planned.append((s, e, shift))
        best = torch.maximum(best, _pass_score(upper, shift))
        seen |= True if visible is None else visible.any(0)
    return _pick(best, seen, layer, cfg), planned


def _pass_score(s: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """(n_kv, n) the shortlist score of planned logits ``s`` with row maxima ``shift``: the
    log-weight relative to the row's largest, max over the rows."""
    if _rows.applies(s, shift):
        return torch.from_numpy(_rows.pass_score(s.contiguous().numpy(),
                                                 shift.contiguous().numpy()))
    return (s - shift[..., None]).amax(1)


def _pick(score: torch.Tensor, seen, layer: VerKVLayer, cfg: DecideConfig):
    """(indices (n_kv, k), real candidates) of the ``cfg.shortlist`` best candidates seen."""
    idx, valid, _ = shortlist(score[:, None],
                              (candidates_of(layer, cfg.variant) & seen)[:, None], cfg.shortlist)
    return idx[:, 0], valid[:, 0]


def estimated_logits(q: torch.Tensor, layer: VerKVLayer, visible: torch.Tensor | None,
                     short: tuple | None, cfg: DecideConfig, planned: tuple | None = None):
    """Grouped logits (n_kv, g*m, n) the certificate plans with (-inf where not visible), their
    half-widths (bounded sketch; else None), the rows' largest upper logit (n_kv, g*m) and the
    rows' shortlist mask (n_kv, m, n): the planned logits of :func:`_planned_logits`, exact at
    the pass's shortlist ``short`` (:func:`pass_shortlist`; None: these rows are the whole
    pass, scored here from the same logits) where a row sees it. Its keys are read once per
    pass."""
    n_q, m, d = q.shape
    n_kv, n, _ = layer.k_host.shape
    g = n_q // n_kv
    # s is overwritten; the rows' largest upper logit comes with the planned logits
    s, e, shift = (*_planned_logits(q, layer, visible), None) if planned is None else planned
    pick = short is None and layer.sketch is not None and cfg.shortlist > 0
    if pick or shift is None:  # the bounded sketch ranks by the upper logit
        upper = s if e is None else s + e
        shift = upper.amax(-1) if shift is None else shift
    if pick:
        short = _pick(_pass_score(upper, shift), True if visible is None else visible.any(0),
                      layer, cfg)
    if short is None:
        return s, e, shift, torch.zeros(n_kv, m, n, dtype=torch.bool, device=q.device)
    sidx, valid = short  # (n_kv, kk)
    skeys = layer.k_host[torch.arange(n_kv)[:, None], sidx]  # (n_kv, kk, d): gather's, faster
    exact_short = torch.matmul(q.reshape(n_kv, g * m, d), skeys.transpose(1, 2)) / math.sqrt(d)
    gidx = sidx[:, None].expand(-1, g * m, -1)
    vv = valid[:, None].expand(-1, g * m, -1)
    if visible is not None:  # each row uses the shortlisted tokens it sees
        vv = vv & visible[:, sidx].permute(1, 0, 2).repeat(1, g, 1)  # (n_kv, g*m, kk)
    s.scatter_(-1, gidx, torch.where(vv, exact_short, s.gather(-1, gidx)))
    if e is not None:
        e.scatter_(-1, gidx, torch.where(vv, 0.0, e.gather(-1, gidx)))
    short_max = exact_short.masked_fill(~vv, float("-inf")).amax(-1)
    rows = torch.zeros(n_kv, m, n, dtype=torch.bool, device=q.device)
    rows.scatter_(-1, sidx[:, None].expand(-1, m, -1), valid[:, None].expand(-1, m, -1))
    if visible is not None:
        rows &= visible[None]
    return s, e, torch.maximum(shift, short_max), rows


def decide(q: torch.Tensor, q_pos: torch.Tensor, layer: VerKVLayer, cfg: DecideConfig,
           extra_logits: torch.Tensor | None = None, short: tuple | None = None,
           fetched: torch.Tensor | None = None, planned: tuple | None = None) -> Decision:
    """VerKV's decide step for query rows ``q`` (n_q, m, d) at ``q_pos``: a forward pass, or
    some rows of one whose shortlist ``short`` (:func:`pass_shortlist`) was chosen over all of
    its rows (by default over the rows given).

    ``extra_logits`` (n_q, m, n_extra): exact logits of the tokens after the context (-inf where
    masked); they count in D and never in L. ``fetched`` (n_kv, n): context tokens the pass has
    already fetched for earlier rows (their plans did not look at the sample): exact and out of
    L for these rows, like H. ``planned``: these rows' planned logits (they are overwritten),
    half-widths and largest upper logits from :func:`pass_shortlist_planned`, instead of scoring
    them again.
    """
    n_q, m, d = q.shape
    n_kv, n, _ = layer.k_host.shape
    g = n_q // n_kv
    f = layer.factors
    visible = _visible(q_pos, n)
    s, e, shift, short = estimated_logits(q, layer, visible, short, cfg, planned)
    exact_logits = None
    if fetched is not None and bool(fetched.any()):
        f = dataclasses.replace(f, odds=f.odds * ~fetched[:, None], bfac=f.bfac * ~fetched[:, None],
                                one_minus_r=f.one_minus_r * ~fetched[:, None])
        exact_logits = _exact_logits(q, layer, visible)
        s, e, shift = _make_exact(s, e, shift, exact_logits, fetched[:, None])
    extra = None
    if extra_logits is not None and extra_logits.shape[-1]:
        extra = extra_logits.reshape(n_kv, g * m, -1)
        shift = torch.maximum(shift, extra.amax(-1))
    also = None if cfg.eps_output is None else C.output_terms(cfg.eps_output, cfg.delta, d)
    denom, shrink, (beta_i, var_i, b_i), totals, plan = _certify(s, e, shift, extra, f, cfg,
                                                                  also)
    if e is not None:
        # bounded sketch, second look: read the keys of what the bounds would fetch (its K
        # only), score them exactly, and plan again; K+V are fetched for the second plan alone
        keys = C.gqa_union(plan.exact.view(n_q, m, n), n_kv)  # (n_kv, m, n)
        rows = keys[:, None].expand(n_kv, g, m, n).reshape(n_kv, g * m, n)
        if exact_logits is None:
            exact_logits = _exact_logits(q, layer, visible)
        s, e, shift = _make_exact(s, e, shift, exact_logits, rows)
        denom, shrink, (beta_i, var_i, b_i), totals, plan = _certify(s, e, shift, extra, f, cfg,
                                                                  also)
        short = short | keys
    exact_kv = C.gqa_union(plan.exact.view(n_q, m, n), n_kv)
    eps_after = plan.eps_after  # before the union; lowered by it, computed below if asked
    out_after = None
    if cfg.report_after:  # eps_hat after the union: remove the union's contributions
        beta_a, var_a, b_a = C.outside_terms(beta_i, var_i, b_i, exact_kv, g, totals)
        eps_after = C.bernstein_eps(beta_a.clamp_min(0), var_a, b_a, denom,
                                    C.log_term(cfg.delta))
        if also is not None:
            out_after = C.output_eps(C.bernstein_eps(beta_a.clamp_min(0), var_a, b_a, denom,
                                                     also[1])).reshape(n_q, m)
    lead = (n_q, m)
    return Decision(plan.k_star.reshape(lead), plan.exact.reshape(n_q, m, n), exact_kv, short,
                    plan.eps_before.reshape(lead), eps_after.reshape(lead), denom.reshape(lead),
                    shift.reshape(lead), shrink, out_after)


def _exact_logits(q, layer: VerKVLayer, visible) -> torch.Tensor:
    """(n_kv, g*m, n) exact logits of every context token (-inf where a row does not see it)."""
    n_q, m, d = q.shape
    n_kv = layer.k_host.shape[0]
    s = torch.matmul(q.reshape(n_kv, -1, d), layer.k_host.transpose(1, 2)) / math.sqrt(d)
    if visible is not None:
        s.masked_fill_(~visible.repeat(n_q // n_kv, 1)[None], float("-inf"))
    return s


def _make_exact(s, e, shift, exact, mask):
    """Planned logits with ``exact`` ones (half-width 0) where ``mask`` (broadcast to ``s``)."""
    s = torch.where(mask, exact, s)
    if e is not None:
        e = e.masked_fill(mask, 0.0)
    return s, e, torch.maximum(shift, exact.masked_fill(~mask, float("-inf")).amax(-1))


def _certify(s, e, shift, extra, f: C.Factors, cfg: DecideConfig, also):
    """The certificate's D, lambda, per-token terms, their sums and the fetch plan from planned
    logits ``s``
    (half-widths ``e`` or None) and the exact logits ``extra`` of the later tokens."""
    # upper weights for the certificate's terms (the point weights but for a bounded sketch)
    # (n_kv, g*m, n); in place on the point logits, which the caller no longer needs (a fresh
    # tensor of this size costs more in page faults than the arithmetic)
    w = (s.sub_(shift[..., None]) if e is None else s + e - shift[..., None]).exp_()
    # weights under a tiny floor move D by < n * floor (the largest weight is 1): flush them to 0
    # so that squares stay out of subnormal arithmetic, which is ~100x slower on CPUs
    F.threshold_(w, _below_floor(w.dtype), 0.0)  # w < floor: 0
    denom = w.sum(-1) if e is None else torch.exp(s - e - shift[..., None]).sum(-1)
    if extra is not None:
        denom = denom + torch.exp(extra - shift[..., None]).sum(-1)
    if cfg.shrinkage == "binary":
        shrink = C.binary_shrink(w, f, head=cfg.shrink_head)
    else:
        shrink = C.bounded_shrinkage(w, f.r, f.odds > 0)
    terms = C.terms(w, f, shrink)
    totals = terms[0].sum(-1), terms[1].sum(-1)  # beta and V over L
    plan = C.fetch_plan_terms(*terms, denom, cfg.eps, cfg.delta, head=cfg.fetch_head, also=also,
                              totals=totals)
    return denom, shrink, terms, totals, plan


@functools.cache
def _below_floor(dtype: torch.dtype) -> float:
    """The largest value of ``dtype`` below its weight floor (``WEIGHT_FLOOR``)."""
    floor = torch.tensor(WEIGHT_FLOOR.get(str(dtype).removeprefix("torch."), 0.0), dtype=dtype)
    return float(torch.nextafter(floor, torch.zeros_like(floor)))


def reweighted_log_factor(layer: VerKVLayer, dec: Decision, n_q: int,
                          own: bool = False) -> torch.Tensor:
    """(n_q, m, n) additive log-weights on the exact context logits: 0 on H and on the tokens
    made exact, ``log(lambda_i / r_i)`` on sampled tokens still in L', -inf elsewhere. The
    tokens made exact are the KV head's union over its query heads (what is fetched), or with
    ``own`` the decision's own set (the spec's per-decision convention, for reporting)."""
    n_kv = layer.k_host.shape[0]
    g = n_q // n_kv
    smp = layer.sample
    if own:
        exact = smp.in_h.repeat_interleave(g, dim=0)[:, None, :] | dec.own_exact
    else:
        exact = (smp.in_h[:, None, :] | dec.exact_kv).repeat_interleave(g, dim=0)
    sampled = smp.sampled.repeat_interleave(g, dim=0)[:, None, :] & ~exact
    r = smp.r.to(dec.denom_est.dtype).repeat_interleave(g, dim=0)[:, None, :]
    lam = dec.lam(layer.factors)
    log_f = torch.where(sampled, torch.log(lam) - torch.log(r),
                        torch.full_like(lam, float("-inf")))
    return torch.where(exact, torch.zeros_like(log_f), log_f)


def reweighted_log_factors(layer: VerKVLayer, dec: Decision,
                           n_q: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`reweighted_log_factor` for the KV head's union and for the decision's own set, at
    once. With binary shrinkage lambda is r (log factor 0) or 1 (``-log r``) on a sampled token,
    so only the sampled tokens' logs are taken (the same values: log(r) - log(r) is 0 and
    log(1) - log(r) is -log(r), exactly)."""
    lam_dtype = layer.factors.r.dtype
    if not isinstance(dec.shrink, C.BinaryShrink) or lam_dtype != dec.denom_est.dtype:
        return (reweighted_log_factor(layer, dec, n_q),
                reweighted_log_factor(layer, dec, n_q, own=True))
    n_kv, n = layer.k_host.shape[0], layer.k_host.shape[1]
    g, m = n_q // n_kv, dec.k_star.shape[1]
    smp = layer.sample
    r = smp.r.to(lam_dtype)
    base = torch.full((n_kv, n), float("-inf"), dtype=lam_dtype, device=r.device)
    base[smp.sampled] = -torch.log(r[smp.sampled])
    if _rows.applies(base) and smp.in_h.device.type == "cpu":
        out, own = (_rows.empty_tensor((n_q, m, n), base) for _ in range(2))
        width = dec.shrink.idx.shape[-1]
        _rows.log_factors(base.numpy(), smp.in_h.contiguous().numpy(),
                          dec.exact_kv.contiguous().numpy(),
                          dec.own_exact.reshape(-1, n).contiguous().numpy(),
                          dec.shrink.idx.reshape(-1, width).contiguous().numpy(),
                          dec.shrink.count.reshape(-1).contiguous().numpy(),
                          smp.sampled.contiguous().numpy(), out.view(-1, n).numpy(),
                          own.view(-1, n).numpy())
        return out, own
    out = base[:, None, None, :].expand(n_kv, g, m, n).contiguous().view(n_q, m, n)
    # sampled tokens with lambda = r: log factor 0
    width = dec.shrink.idx.shape[-1]
    sel = torch.arange(width, device=r.device) < dec.shrink.count.reshape(-1, 1)
    rows, at = sel.nonzero(as_tuple=True)  # rows in (n_q, m) order, as the shrinkage's
    cols = dec.shrink.idx.reshape(-1, width)[rows, at]
    hit = smp.sampled[rows // (g * m), cols]
    out.view(-1, n)[rows[hit], cols[hit]] = 0.0
    own = out.view(n_kv, g, m, n).masked_fill(
        smp.in_h[:, None, None, :] | dec.own_exact.view(n_kv, g, m, n), 0.0).view(n_q, m, n)
    # the KV head's mask broadcast over its query heads (no copy per query head)
    out.view(n_kv, g, m, n).masked_fill_((smp.in_h[:, None, :] | dec.exact_kv)[:, None], 0.0)
    return out, own
