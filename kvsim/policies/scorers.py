"""Token scorers by name: what top-k eviction and Poisson sampling rank a layer's context by.

A scorer maps a layer's context keys, the per-token scores the trace or model provides and the
observation window to (n_kv, n_ctx) scores. The harness adds an ``oracle`` score (the future
attention of the question and decode rows) to ``scores``; a model run adds ``kvzip`` when asked.
"""

from __future__ import annotations

from kvsim._torch import torch
from kvsim.attention.scoring import snapkv_scores
from kvsim.errors import KvsimError
from kvsim.policies.options import SCORERS

OBS_WINDOW = 64  # observation rows SnapKV pools over (the last question rows)


def _snapkv(scores, k, obs_q, obs_pos, obs_k):
    if obs_q.shape[1]:  # from the question window; a captured "snapkv" score otherwise
        return snapkv_scores(k, obs_q[:, -OBS_WINDOW:], obs_pos[-OBS_WINDOW:], k_after=obs_k)
    if "snapkv" in scores:
        return scores["snapkv"].to(k.dtype)
    raise KvsimError("scorer snapkv needs question rows in the trace (the observation "
                     "window) or captured 'snapkv' scores; use --scorer kvzip or oracle")


def _given(name: str):
    def score(scores, k, obs_q, obs_pos, obs_k):
        if name not in scores:
            have = ", ".join(sorted(scores)) or "none"
            raise KvsimError(f"the trace has no {name!r} scores (it has: {have}); "
                             f"use --scorer snapkv")
        return scores[name].to(k.dtype)
    return score


SCORER = {"snapkv": _snapkv, "kvzip": _given("kvzip"), "oracle": _given("oracle")}
assert tuple(SCORER) == SCORERS


def scoring_work(name: str, m) -> tuple[float, float, float, str]:
    """(FLOPs per token, per token squared, HBM bytes per token) of scorer ``name`` on model
    ``m`` after a context's prefill, all layers, and what the count is."""
    kv_read = m.layers * m.kv_heads * m.head_dim * m.kv_elem  # the keys, read once
    if name == "snapkv":  # the window's queries against every key: 2 d FLOPs per pair and head
        return (m.layers * m.q_heads * 2.0 * OBS_WINDOW * m.head_dim, 0.0, kv_read,
                f"SnapKV: {OBS_WINDOW} window queries x every context key, per query head")
    if name == "kvzip":  # KVzip re-feeds the context after a repeat prompt: a second prefill
        half = m.prefill_flops(1.0) - m.layers * 4.0 * m.q_heads * m.head_dim  # GEMMs per token
        return (half + m.layers * 2.0 * m.q_heads * m.head_dim,
                m.layers * 2.0 * m.q_heads * m.head_dim, m.kv_bytes_per_token,
                "KVzip: a second prefill of the context (the reconstruction pass)")
    return 0.0, 0.0, 0.0, "oracle: not a realisable scorer (it reads the future); charged nothing"


def context_scores(name: str, scores: dict[str, torch.Tensor], k: torch.Tensor,
                   obs_q: torch.Tensor, obs_pos: torch.Tensor,
                   obs_k: torch.Tensor | None = None) -> torch.Tensor:
    """The (n_kv, n_ctx) scores of scorer ``name`` for a layer's context ``k``; ``obs_k``: the
    keys after the context that the observation window sees (its question tokens)."""
    return SCORER[name](scores, k, obs_q, obs_pos, obs_k)
