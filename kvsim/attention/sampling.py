"""PoissonComp (Algorithm 1 of the VerKV paper) and top-k eviction: what stays on the GPU.

Per KV head: sink and local tokens are always kept (``r_i = 1``); the other ("candidate")
tokens get ``r_i = min(1, c * tau_i)`` with ``c`` solved exactly so that
``sum_candidates r_i = sample_budget`` (expected kept count = sink + local + sample_budget);
``H = {r_i = 1}``, ``L = {0 < r_i < 1}``; an independent Bernoulli(r_i) draw per token of L
gives the sample S. Every candidate has ``tau_i > 0`` (see :func:`kvsim.attention.scoring.to_tau`),
hence ``r_i > 0``: no token silently leaves both H and L (every non-resident token must be
samplable, or the estimator and the certificate would not see it).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvsim._torch import torch


def always_kept(n: int, n_sink: int, n_local: int, device=None) -> torch.Tensor:
    """(n,) bool: the first ``n_sink`` and the last ``n_local`` tokens."""
    pos = torch.arange(n, device=device)
    return (pos < n_sink) | (pos >= n - n_local)


def solve_c(tau: torch.Tensor, target: torch.Tensor | float,
            candidates: torch.Tensor) -> torch.Tensor:
    """c (h,) with ``sum_{i in candidates} min(1, c tau_i) = target`` for each row of ``tau``.

    Exact, by sorting: if the ``j`` largest tau saturate, ``c = (target - j) / (sum of the rest)``;
    the right ``j`` is the smallest one consistent with both ends. ``c = inf`` where the target
    reaches the number of candidates (everything kept). ``tau`` must be > 0 on candidates.
    """
    h, n = tau.shape
    tau = tau.to(torch.float64)
    t = torch.where(candidates, tau, torch.zeros_like(tau))
    srt, _ = torch.sort(t, dim=-1, descending=True)
    target = torch.as_tensor(target, dtype=tau.dtype, device=tau.device).expand(h)
    rest = srt.flip(-1).cumsum(-1).flip(-1)  # rest[j] = sum_{k >= j} srt[k]
    j = torch.arange(n, device=tau.device, dtype=tau.dtype)
    c = (target[:, None] - j) / rest.clamp_min(torch.finfo(tau.dtype).tiny)
    # j saturated tokens: c * srt[j-1] >= 1 (or j = 0) and c * srt[j] <= 1, c > 0
    prev = torch.cat([torch.full((h, 1), float("inf"), dtype=tau.dtype, device=tau.device),
                      srt[:, :-1]], dim=-1)
    ok = (c > 0) & (c * srt <= 1 + 1e-12) & (c * prev >= 1 - 1e-12) & (srt > 0)
    first = torch.where(ok.any(-1), ok.int().argmax(-1), torch.zeros(h, dtype=torch.long,
                                                                    device=tau.device))
    out = c.gather(-1, first[:, None])[:, 0]
    n_cand = candidates.sum(-1).to(tau.dtype)
    return torch.where(target >= n_cand, torch.full_like(out, float("inf")), out)


def inclusion_probs(tau: torch.Tensor, sample_budget: float, forced: torch.Tensor) -> torch.Tensor:
    """r (h, n): 1 on ``forced`` tokens, ``min(1, c tau_i)`` elsewhere with the expected number of
    sampled non-forced tokens equal to ``sample_budget``."""
    tau = tau.to(torch.float64)
    candidates = ~forced.expand_as(tau)
    c = solve_c(tau, sample_budget, candidates)
    r = torch.where(torch.isinf(c)[:, None], torch.ones_like(tau),
                    (c[:, None] * tau).clamp_max(1.0))
    return torch.where(candidates, r, torch.ones_like(r))


def bernoulli(r: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Independent Bernoulli(r_i) draws; uniforms come from ``generator`` on its own device, so a
    seed gives the same sample on CPU and CUDA."""
    u = torch.rand(r.shape, generator=generator, dtype=torch.float64,
                   device=generator.device).to(r.device)
    return u < r.to(torch.float64)


@dataclass
class PoissonSample:
    r: torch.Tensor  # (n_kv, n) inclusion probabilities, 1 on H
    in_h: torch.Tensor  # (n_kv, n) bool, r == 1
    in_l: torch.Tensor  # (n_kv, n) bool, 0 < r < 1
    sampled: torch.Tensor  # (n_kv, n) bool, S (a subset of L)

    @property
    def resident(self) -> torch.Tensor:
        return self.in_h | self.sampled

    def expected_kept(self) -> torch.Tensor:
        return self.r.sum(-1)


def poisson_compress(tau: torch.Tensor, n_sink: int, n_local: int, sample_budget: float,
                     generator: torch.Generator) -> PoissonSample:
    """Algorithm 1 for every KV head: ``tau`` (n_kv, n) in (0, 1]."""
    n = tau.shape[-1]
    forced = always_kept(n, n_sink, n_local, tau.device)[None, :]
    r = inclusion_probs(tau, sample_budget, forced)
    in_h = r >= 1.0
    in_l = ~in_h & (r > 0)
    assert not (~in_h & ~in_l).any(), "a token with r = 0 would leave the estimator"
    sampled = bernoulli(r, generator) & in_l
    return PoissonSample(r, in_h, in_l, sampled)


def topk_keep(scores: torch.Tensor, budget: int, n_sink: int, n_local: int) -> torch.Tensor:
    """(n_kv, n) bool: sink + local + the highest-scoring other tokens, exactly ``min(budget, n)``
    tokens per KV head (ties broken by position, deterministically)."""
    n_kv, n = scores.shape
    forced = always_kept(n, n_sink, n_local, scores.device)
    if budget >= n:
        return torch.ones(n_kv, n, dtype=torch.bool, device=scores.device)
    extra = budget - int(forced.sum())
    if extra < 0:
        raise ValueError(f"budget {budget} is smaller than sink {n_sink} + local {n_local}")
    keep = forced[None, :].expand(n_kv, n).clone()
    if extra > 0:
        s = scores.masked_fill(forced[None, :], float("-inf"))
        _, order = torch.sort(s, dim=-1, descending=True, stable=True)
        keep.scatter_(-1, order[:, :extra], True)
    return keep
