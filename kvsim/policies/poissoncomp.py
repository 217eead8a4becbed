"""PoissonComp (Algorithm 1 of the VerKV paper) without fetching: attention from the sample.

Per layer and KV head: sink + local tokens always kept, ``r_i = min(1, c tau_i)`` for the others
with ``c`` solved so that the expected kept count equals the whole budget
``n_ctx / compression`` (no sketch is held, so none is paid: spec point 6), an independent
Bernoulli sample. Attention uses the unbiased estimator (lambda = 1): weight ``w_i`` on H and
``w_i / r_i`` on sampled tokens; unsampled tokens are gone (host_frac 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvsim.kernels.poisson import PoissonSample, poisson_compress
from kvsim.kernels.scoring import to_tau
from kvsim.kernels.weighted import weighted_attention_chunked
from kvsim.policies import _measure as M
from kvsim.policies.base import Policy, register
from kvsim.trace import Trace

R_BYTES = 2  # an fp16 inclusion probability per sampled token


@dataclass
class PoissonState:
    sample: PoissonSample
    expected_tokens: float  # per KV head: sum of r
    held_tokens: float  # per KV head: |H| + |S| of this draw
    held_bytes: float


@register
class PoissonComp(Policy):
    name = "poissoncomp"
    Params = M.NoFetchParams
    needs_attention = True
    summary = ("Poisson sample of the cache by token scores (expected size 1/compression), "
               "unbiased reweighting, no fetch")

    def compress(self, k, v, scores, obs_q, obs_pos, generator, layer):
        p = self.params
        n_kv, n_ctx, d = k.shape
        sample_budget = M.check_budget(self.name, n_ctx, p.compression, p.sink, p.local)
        tau = to_tau(M.context_scores(scores, p.scorer, k, obs_q, obs_pos))
        smp = poisson_compress(tau, p.sink, p.local, sample_budget, generator)
        held = float(smp.resident.sum(-1).to(torch.float64).mean())
        n_s = float(smp.sampled.sum(-1).to(torch.float64).mean())
        return PoissonState(smp, float(smp.expected_kept().mean()), held,
                            held * 2 * d * M.KV_ELEM_BYTES + n_s * R_BYTES)

    @staticmethod
    def log_weights(smp: PoissonSample, n_q: int) -> torch.Tensor:
        """(n_q, 1, n_ctx): 0 on H, -log r on S, -inf elsewhere."""
        lw = torch.where(smp.sampled, -torch.log(smp.r), torch.zeros_like(smp.r))
        lw = lw.masked_fill(~smp.resident, float("-inf"))
        return lw.repeat_interleave(n_q // smp.r.shape[0], dim=0)[:, None, :]

    def attend(self, state, q, q_pos, k, v):
        log_w = self.log_weights(state.sample, q.shape[0]).to(q.dtype)
        out, log_d = weighted_attention_chunked(q, q_pos, k, v, log_w)
        return out, {"log_denominator": log_d}

    def analyze(self, trace: Trace | None, seed: int = 0):
        return M.analyze_no_fetch(self, trace, seed)
