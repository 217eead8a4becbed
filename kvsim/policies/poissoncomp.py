"""PoissonComp (Algorithm 1 of the VerKV paper) without fetching: attention from the sample.

Per layer and KV head: sink + local tokens always kept, ``r_i = min(1, c tau_i)`` for the others
with ``c`` solved so that the expected kept count equals the whole budget
``n_ctx / compression``, an independent Bernoulli sample. Spec point 6 asks for "the budget minus
the sketch"; this PoissonComp never fetches, so it holds no key sketch and there is nothing to
subtract: at the same compression it holds what VerKV holds for its sample plus VerKV's sketch,
which is the comparison at equal GPU bytes (``tests/test_policy_contract.py`` checks the
expected count). Attention uses the unbiased estimator (lambda = 1): weight ``w_i`` on H and
``w_i / r_i`` on sampled tokens; unsampled tokens are gone (host_frac 0). The sampled tokens'
fp16 inclusion probabilities are metadata.
"""

from __future__ import annotations

from kvsim._torch import torch
from kvsim.attention.sampling import PoissonSample, poisson_compress
from kvsim.attention.scoring import to_tau
from kvsim.policies.registry import register
from kvsim.policies.scored import ScoredPolicy

R_BYTES = 2  # an fp16 inclusion probability per sampled token


def log_weights(smp: PoissonSample) -> torch.Tensor:
    """(n_kv, n_ctx): 0 on H, -log r on S, -inf elsewhere."""
    lw = torch.where(smp.sampled, -torch.log(smp.r), torch.zeros_like(smp.r))
    return lw.masked_fill(~smp.resident, float("-inf"))


@register
class PoissonComp(ScoredPolicy):
    name = "poissoncomp"
    summary = ("Poisson sample of the cache by token scores (expected size 1/compression), "
               "unbiased reweighting, no fetch")

    def sample_budget(self, n_ctx):
        return self.budget(n_ctx)

    def select(self, scores, budget, generator):
        smp = poisson_compress(to_tau(scores), *self.sink_local, budget, generator)
        n_s = float(smp.sampled.sum(-1).to(torch.float64).mean())
        return log_weights(smp), smp.resident, n_s * R_BYTES, \
            {"expected_tokens": float(smp.expected_kept().mean())}
