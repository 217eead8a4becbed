"""The policies that keep a scored share of the context in HBM and never fetch (the top-k
eviction and PoissonComp of the VerKV paper): one scorer call, one selection hook, one attention.

A subclass overrides :meth:`ScoredPolicy.sample_budget` (the budget rule) and
:meth:`ScoredPolicy.select` (scores -> additive log-weights on the context logits: 0 on a kept
token, ``-log r`` on a reweighted sample, ``-inf`` on a dropped token); attention is
:meth:`MaskPolicy.attend` over those weights. The scores are :meth:`ScoredPolicy.score`'s: by
default the named scorer of the ``scorer`` option (:mod:`kvsim.policies.scorers`); a policy with
a scorer of its own overrides :meth:`~ScoredPolicy.score` (and :meth:`~ScoredPolicy.prefill_work`,
what scoring costs), as kvpress's scorer presses do, e.g. a top-k subclass that keeps H2O's heavy
hitters (``tests/examples/h2o.py``).
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass

from kvsim._torch import torch
from kvsim.contract import DecodeCost, PrefillWork
from kvsim.policies import options as O
from kvsim.policies.base import KV_ELEM_BYTES, Compressed, MaskPolicy, restate_share
from kvsim.policies.scorers import context_scores, scoring_work


@dataclass
class NoFetchParams:
    compression: float = O.compression_field()
    eps: float = O.eps_field()
    scorer: str = O.scorer_field()
    sink: int = O.sink_field()
    local: int = O.local_field()


class ScoredPolicy(MaskPolicy):
    Params = NoFetchParams
    needs_attention = True

    @abstractmethod
    def sample_budget(self, n_ctx: int) -> float:
        """Tokens per KV head the selection may spend beyond sink and local (raises if none)."""

    @abstractmethod
    def select(self, scores: torch.Tensor, budget: float, generator: torch.Generator):
        """(log-weights (n_kv, n_ctx), resident mask (n_kv, n_ctx), metadata bytes per KV head,
        per-layer info) from the scorer's (n_kv, n_ctx) scores."""

    def score(self, k: torch.Tensor, scores: dict[str, torch.Tensor], obs_q: torch.Tensor,
              obs_pos: torch.Tensor, obs_k: torch.Tensor | None = None) -> torch.Tensor:
        """(n_kv, n_ctx) scores of the context tokens (higher: more worth keeping), from the
        arguments of :meth:`~kvsim.policies.base.Policy.compress`. Default: the named scorer of
        the ``scorer`` option."""
        return context_scores(self.params.scorer, scores, k, obs_q, obs_pos, obs_k)

    def compress(self, k, v, scores, obs_q, obs_pos, generator, layer, obs_k=None):
        n_kv, n_ctx, d = k.shape
        budget = self.sample_budget(n_ctx)
        s = self.score(k, scores, obs_q, obs_pos, obs_k)
        log_w, resident, meta, info = self.select(s, budget, generator)
        held = float(resident.sum(-1).to(torch.float64).mean())
        return Compressed(log_w, held, held * 2 * d * KV_ELEM_BYTES + meta, meta, info,
                          resident=resident)

    def prefill_work(self, model) -> PrefillWork:
        """Scoring the context with the named scorer (the selection itself, a top-k or a sample,
        is linear in n and reads the scores only: left out); a policy that overrides
        :meth:`score` states its own."""
        f, f2, b, what = scoring_work(self.params.scorer, model)
        return PrefillWork(f, f2, b, f"modelled: {what}")

    def decode_cost(self, stats: dict, model) -> DecodeCost:
        """The kept share as measured; the metadata (bytes per kept token that do not depend
        on the head size, e.g. an fp16 inclusion probability) restated as a share of
        ``model``'s KV."""
        meta = restate_share(stats["meta_frac"], 1.0, 1.0, stats["head_dim"], model)
        res = min(1.0, stats["resident_frac"] - stats["meta_frac"] + meta)
        return DecodeCost(resident_frac=res, hbm_read_frac=res, host_read_frac=0.0,
                          host_frac=0.0, overlap=False, copies_per_layer=0.0,
                          meta_frac=min(res, meta))
