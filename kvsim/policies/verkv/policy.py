"""VerKV = PoissonComp + KVFetch: verify the sampled estimate before attending, fetch only what the
Bernstein certificate needs from host memory (the full cache stays there).

Budget (spec "Budget and accounting"): ``n_ctx / compression`` tokens per KV head cover sink,
local, the expected sample and the sketch (1.76% of the cache at any head dim). The ``perfect``
sketch reserves the same share, so both sketches draw the same sample under the same seed; it is
an upper bound on quality (exact weights everywhere, no shortlist read). The inclusion
probabilities are held as fp16 per context token; sketch and probabilities are the policy's
metadata (``meta_frac``).

Decisions taken on the spec's open points:

1. every non-resident token is in L: tau has a floor (``kvsim.attention.scoring.to_tau``), so
   ``r_i > 0`` always;
2. ``--variant independent`` (default) plans with sample-independent quantities (Theorem 2's
   precondition with an exact sketch); ``--variant paper`` is the deployed, sample-dependent one
   (see ``kvsim.policies.verkv.kvfetch``);
3. the 2-bit sketch's bias is not corrected: its violation rate is reported as measured, and
   ``certificate_denominator_ratio_mean`` (the certificate's D over the true D) shows the bias;
   ``--sketch bounded`` removes it by construction: the same sketch plus one fp16 per token
   bounds every logit's error, the certificate plans with upper weights and a lower D, and a
   second look reads the keys of what the bounds alone would fetch before fetching K+V (see
   ``kvsim.policies.verkv.sketch`` and ``kvfetch``);
4. shortlist score, per KV head and query row: the max over the group's query heads of the sketch
   log-weight ``s_i - max_j s_j`` (a log-probability up to each head's normaliser, so that no
   single head with large logits takes the whole shortlist); the shortlist is drawn from L in the
   independent variant, from L \\ S in the paper's;
5. host read per forward pass and KV head: keys of the non-resident shortlist and K+V of the
   fetched tokens, each byte once (the union over the pass's rows and query heads): at most 100%;
6. see the budget above; 7. a budget that cannot hold sink + local + sketch + one sampled token
   is one error naming sizes that fit.

Beyond the paper: ``--pass-plan shared`` plans a pass's rows in order, each taking the tokens
earlier rows made exact as exact (the pass reads their union once anyway; ``rows``, the default,
plans each row alone, as the paper's kernel); ``--eps-output`` also fetches until the output
certificate holds (``kvsim.policies.verkv.certificate.output_terms``: the error of the attention
output, relative to the norm of the values' per-dimension range, below eps_output with
probability 1 - delta).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from kvsim._torch import torch
from kvsim.attention.dense import logits
from kvsim.attention.sampling import poisson_compress
from kvsim.attention.scoring import to_tau
from kvsim.attention.weighted import logsumexp, row_chunks, weighted_from_logits
from kvsim.contract import DecodeCost, PrefillWork
from kvsim.errors import KvsimError
from kvsim.policies import options as O
from kvsim.policies.base import KV_ELEM_BYTES, Compressed, FetchPolicy, Reads, restate_share
from kvsim.policies.registry import register
from kvsim.policies.scorers import context_scores, scoring_work
from kvsim.policies.verkv.kvfetch import (
    VARIANTS,
    DecideConfig,
    decide,
    make_layer,
    pass_shortlist_planned,
    reweighted_log_factors,
)
from kvsim.policies.verkv.sketch import (
    NORM_BYTES,
    build_sketch,
    rope_pairs,
    sketch_bits_per_token,
    sketch_bytes,
)

SKETCHES = ("2bit", "bounded", "perfect")
SHRINKAGES = ("binary", "bounded")
PASS_PLANS = ("rows", "shared")
R_BYTES = 2  # fp16 inclusion probability per context token
PLANNED_CHUNKS = 4  # a pass of at most this many row chunks keeps its planned logits


@dataclass
class VerKVParams:
    compression: float = O.compression_field()
    eps: float = O.eps_field()
    delta: float = O.delta_field()
    sketch: str = field(default="2bit", metadata={
        "help": "weights the certificate plans with: 2bit (the paper's key sketch + a shortlist "
                "scored exactly), bounded (the 2-bit sketch + one fp16 per token bounding each "
                "logit's error: the certificate holds by construction) or perfect (exact "
                "weights: an upper bound)",
        "choices": list(SKETCHES)})
    scorer: str = O.scorer_field()
    sink: int = O.sink_field()
    local: int = O.local_field()
    shrinkage: str = field(default="binary", metadata={
        "help": "lambda: binary (lambda in {1, r}, what the paper deploys) or bounded "
                "(Theorem 1's MSE minimiser, by bisection)", "choices": list(SHRINKAGES)})
    shortlist: int = field(default=128, metadata={
        "help": "tokens per KV head and row whose keys are read from host and scored exactly "
                "(2bit and bounded sketches)"})
    pass_plan: str = field(default="rows", metadata={
        "help": "how the rows of one forward pass plan their fetches: rows (each row alone, as "
                "the paper's kernel) or shared (row by row, each taking what earlier rows "
                "fetched as exact: less read where rows overlap, one decide per row)",
        "choices": list(PASS_PLANS)})
    eps_output: float | None = field(default=None, metadata={
        "kind": float, "help": "also fetch until the output certificate holds: |o^ - o| <= "
                               "eps_output |R| with probability 1 - delta, R the per-dimension "
                               "range of the values (off when not given)"})
    variant: str = field(default="independent", metadata={
        "help": "independent: plan only with sample-independent weights (Theorem 2 holds with "
                "an exact sketch); paper: exact weights on the resident sample, as deployed",
        "choices": list(VARIANTS)})

    def validate(self) -> None:
        if self.eps_output is not None and not (isinstance(self.eps_output, (int, float))
                                                and math.isfinite(self.eps_output)
                                                and self.eps_output > 0):
            raise KvsimError(f"--eps-output must be > 0; got {self.eps_output}")
        if int(self.shortlist) != self.shortlist or self.shortlist < 0:
            raise KvsimError(f"--shortlist must be a whole number >= 0; got {self.shortlist}")


@register
class VerKV(FetchPolicy):
    name = "verkv"
    Params = VerKVParams
    needs_attention = True
    summary = ("PoissonComp sample + sketch on the GPU, full cache in host memory; per step a "
               "Bernstein certificate decides which tokens to fetch so the error stays under eps "
               "with probability 1 - delta")

    def config(self) -> DecideConfig:
        p = self.params
        return DecideConfig(eps=p.eps, delta=p.delta, shrinkage=p.shrinkage,
                            shortlist=int(p.shortlist) if p.sketch != "perfect" else 0,
                            variant=p.variant, eps_output=p.eps_output)

    def compress(self, k, v, scores, obs_q, obs_pos, generator, layer, obs_k=None):
        p = self.params
        n_kv, n_ctx, d = k.shape
        # the perfect sketch reserves the 2-bit sketch's share (the same sample, seed for seed)
        sk_bytes = sketch_bytes(n_ctx, d, bounded=p.sketch == "bounded")
        token_bytes = 2 * d * KV_ELEM_BYTES
        sample_budget = self.budget(n_ctx, sketch_tokens=sk_bytes / token_bytes)
        tau = to_tau(context_scores(p.scorer, scores, k, obs_q, obs_pos, obs_k))
        smp = poisson_compress(tau, *self.sink_local, sample_budget, generator)
        sketch = build_sketch(k, rope_pairs(d, self.rope.get("type")),
                              bounded=p.sketch == "bounded") if p.sketch != "perfect" else None
        held = float(smp.resident.sum(-1).to(torch.float64).mean())
        v_range = None
        meta = sk_bytes + n_ctx * R_BYTES
        if p.eps_output is not None:  # fp16 min and max of each value dimension
            v_range = (v.amin(1), v.amax(1))
            meta += 2 * d * 2
        return Compressed(make_layer(smp, sketch, k, p.variant, v_range), held,
                          held * token_bytes + meta,
                          meta, {"expected_tokens": float(smp.expected_kept().mean()),
                                 "sketch_bytes_per_token": sk_bytes / n_ctx},
                          resident=smp.resident)

    def summarize(self, infos: list[dict]) -> dict:
        """The sketch's GPU bytes per context token and KV head (the perfect sketch reserves the
        2-bit sketch's share, so both report it); the fp16 inclusion probability is apart."""
        return {"sketch_bytes_per_token": sum(i["sketch_bytes_per_token"] for i in infos)
                / len(infos), "r_bytes_per_token": float(R_BYTES)}

    def attend(self, state, q, q_pos, k, v):
        layer, p = state, self.params
        n_q, m, d = q.shape
        n_kv, n_ctx, _ = layer.k_host.shape
        g = n_q // n_kv
        cfg = self.config()
        sampled = layer.sample.sampled
        fetched_pass = torch.zeros(n_kv, n_ctx, dtype=torch.bool, device=q.device)
        short_pass = torch.zeros_like(fetched_pass)
        outs, logds, logds_own, rows = [], [], [], []
        extra_pos = torch.arange(n_ctx, k.shape[1], device=q.device)
        chunks = row_chunks(n_q, m, k.shape[1])
        shared = p.pass_plan == "shared"
        # one shortlist per KV head and pass; its planned logits serve the chunks' decisions
        short, planned = pass_shortlist_planned(q, q_pos, layer, cfg, chunks,
                                                keep=0 if shared else PLANNED_CHUNKS)
        made_exact = torch.zeros_like(fetched_pass)  # shared: what earlier rows made exact
        for i, sl in enumerate([slice(j, j + 1) for j in range(m)] if shared else chunks):
            qc, pc = q[:, sl], q_pos[sl]
            extra = logits(qc, k[:, n_ctx:], pc, extra_pos)
            dec = decide(qc, pc, layer, cfg, extra_logits=extra, short=short,
                         fetched=made_exact if shared else None,
                         planned=planned[i] if planned else None)
            own_plan = dec.own_exact  # what this decision asked for itself
            if shared:  # earlier rows' tokens are exact for this row's plan and attention too
                dec.exact_kv |= made_exact[:, None]
                dec.own_exact = own_plan | made_exact.repeat_interleave(g, 0)[:, None]
                made_exact |= dec.exact_kv.any(1)
            log_w, own_w = reweighted_log_factors(layer, dec, n_q)
            full = logits(qc, k, pc)
            true_logd = logsumexp(full)
            o, ld = weighted_from_logits(full.clone(), log_w, v)
            full[..., :n_ctx] += own_w
            ld_own = logsumexp(full)
            outs.append(o)
            logds.append(ld)
            logds_own.append(ld_own)
            new_kv = dec.exact_kv & ~sampled[:, None, :]  # (n_kv, mc, n) fetched after the union
            fetched_pass |= new_kv.any(1)
            short_pass |= (dec.shortlisted & ~sampled[:, None, :]).any(1)
            own_new = own_plan & ~sampled.repeat_interleave(g, 0)[:, None, :]
            per_kv = lambda x: x.repeat_interleave(g, 0).to(q.dtype)  # noqa: E731
            rows.append({
                "fetch": dec.k_star > 0,
                "made_exact": dec.k_star.to(q.dtype),
                "fetched_tokens": own_new.sum(-1).to(q.dtype),
                "kvhead_fetch": per_kv(dec.exact_kv.any(-1)),
                "kvhead_fetched_tokens": per_kv(new_kv.sum(-1)),
                "shortlist_size": per_kv(dec.shortlisted.sum(-1)),
                "eps_hat_before": dec.eps_before,
                "eps_hat_after": dec.eps_after,
                **({} if dec.out_after is None else {
                    "output_eps_hat_after": dec.out_after,
                    "value_range_norm": _range_norm(layer.v_range, v[:, n_ctx:], pc, n_ctx, g)}),
                # the certificate's D over the true D: 1 with the perfect sketch; the 2-bit
                # sketch's bias (it drops three quarters of the channels) shows here
                "certificate_denominator_ratio": torch.exp(torch.log(dec.denom_est) + dec.shift
                                                           - true_logd),
            })
        stats = {key: torch.cat([r[key] for r in rows], 1) for key in rows[0]}
        stats["log_denominator"] = torch.cat(logds, 1)
        stats["log_denominator_own"] = torch.cat(logds_own, 1)
        # K and V of the fetch set; K alone of the shortlist's second look (bounded sketch)
        return torch.cat(outs, 1), stats, Reads(fetched_pass, short_pass)

    def prefill_work(self, model):
        """Scoring the context, then one more pass over the keys to build the 2-bit sketch
        (sampling is linear in n on the scores; the full cache's copy to host memory is the
        simulator's KV write)."""
        f, f2, b, what = scoring_work(self.params.scorer, model)
        keys = model.layers * model.kv_heads * model.head_dim * model.kv_elem
        sketch = keys if self.params.sketch != "perfect" else 0.0
        return PrefillWork(f, f2, b + sketch, f"modelled: {what}; "
                           + ("the keys read once more for the sketch" if sketch else
                              "no sketch (perfect)"))

    def decide_kernel(self, device, model, context, seed=0):
        from kvsim.policies.verkv.bench import DecideBench
        return DecideBench(device, model, context, seed, dataclasses.asdict(self.params))

    def meta_bytes_per_token(self, head_dim: int) -> float:
        """The metadata's bytes per context token and KV head at ``head_dim``: the sketch (the
        perfect sketch reserves the 2-bit one's share) and the fp16 inclusion probability."""
        return sketch_bits_per_token(head_dim) / 8 + R_BYTES + \
            (NORM_BYTES if self.params.sketch == "bounded" else 0)

    def decode_cost(self, stats, model):
        """The resident share as measured (the budget is a share of the cache whatever the
        head size); the metadata's share and the decide step's bytes per token for ``model``'s
        head size and KV element: the sketch, or with the perfect sketch every key."""
        p = self.params
        res, read = stats["resident_frac"], stats["kv_read_frac"]
        meta = self.meta_bytes_per_token(model.head_dim)
        decide_bytes = meta if p.sketch != "perfect" else \
            model.head_dim * model.kv_elem + R_BYTES  # exact weights: every key, each step
        meta_frac = restate_share(stats["meta_frac"], self.meta_bytes_per_token(
            stats["head_dim"]), meta, stats["head_dim"], model)
        return DecodeCost(resident_frac=res, hbm_read_frac=min(1.0, res + read),
                          host_read_frac=min(1.0, read), host_frac=1.0, overlap=False,
                          copies_per_layer=2.0 if p.sketch != "perfect" else 1.0, path="gather",
                          staging_layers=1, decide_bytes_per_token=decide_bytes,
                          meta_frac=min(res, meta_frac), decide_kernel=self.name)


def _range_norm(v_range: tuple, v_extra: torch.Tensor, q_pos: torch.Tensor, n_ctx: int,
                g: int) -> torch.Tensor:
    """(n_q, m) |R| of each row: the norm of the per-dimension value range over the context and
    the later tokens the row sees (what the output certificate is relative to)."""
    lo, hi = v_range[0][:, None], v_range[1][:, None]  # (n_kv, 1, d)
    if v_extra.shape[1]:
        seen = min(v_extra.shape[1], int(q_pos.max()) - n_ctx + 1)
        if seen > 0:
            cmin = torch.cummin(v_extra[:, :seen], 1).values
            cmax = torch.cummax(v_extra[:, :seen], 1).values
            at = (q_pos - n_ctx).clamp(-1, seen - 1)  # -1: the row sees no later token
            idx = at.clamp_min(0)
            has = (at >= 0)[None, :, None]
            lo = torch.where(has, torch.minimum(lo, cmin[:, idx]), lo)
            hi = torch.where(has, torch.maximum(hi, cmax[:, idx]), hi)
    return (hi - lo).norm(dim=-1).expand(lo.shape[0], len(q_pos)).repeat_interleave(g, 0)
