"""The one call of a policy's ``attend``: the caller, not the policy, counts what was read from
host memory, and refuses attention that used a context token the policy neither kept nor read.

A mask policy reads nothing from host memory. A fetching policy reports the tokens it read
(:class:`~kvsim.policies.base.Reads`); ``kv_read_frac`` is, per KV head, the bytes of K and V it
read beyond its resident tokens over the bytes of that head's full context cache (a token whose
K alone was read counts half), the same on every row of the call (the reads of a forward pass).

The check (``verify``): ``attend`` runs a second time on a cache whose context tokens outside the
allowed set (resident, K and V read; for K-only reads the V) are replaced by other values; an
output that changes used them. Weights of -inf on a dropped token make its values vanish exactly,
so an honest policy gives the same output to the bit.
"""

from __future__ import annotations

from kvsim._torch import torch
from kvsim.errors import KvsimError

VERIFY_RTOL = 1e-9


def attend(policy, compressed, q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor,
           v: torch.Tensor, verify: bool = False) -> tuple[torch.Tensor, dict]:
    """``policy.attend`` on ``compressed`` (its :class:`~kvsim.policies.base.Compressed`) with
    ``kv_read_frac`` counted here; with ``verify`` the reads are checked as the module says."""
    n_ctx = compressed.resident.shape[1] if compressed.resident is not None else None
    out, stats, reads = _call(policy, compressed.state, q, q_pos, k, v)
    if "kv_read_frac" in stats:
        raise KvsimError(f"policy {policy.name}: attend returned kv_read_frac; the caller counts "
                         f"traffic from what the policy kept and read")
    n_q, m = q.shape[:2]
    if reads is None:
        read = torch.zeros(n_q, dtype=torch.float64, device=q.device)
    else:
        n_ctx = reads.kv.shape[1]
        res = _resident(compressed, reads.kv)
        kv = reads.kv & ~res
        keys = kv | (reads.k & ~res) if reads.k is not None else kv
        per_kv = (keys.sum(-1) + kv.sum(-1)).to(torch.float64) / (2.0 * n_ctx)
        read = per_kv.repeat_interleave(n_q // k.shape[0])
    stats = dict(stats)
    stats["kv_read_frac"] = read[:, None].expand(n_q, m)
    if verify and n_ctx:
        _verify(policy, compressed, reads, q, q_pos, k, v, out, n_ctx)
    return out, stats


def _call(policy, state, q, q_pos, k, v):
    got = policy.attend(state, q, q_pos, k, v)
    if policy.fetches:
        if len(got) != 3:
            raise KvsimError(f"policy {policy.name} fetches: its attend must return (output, "
                             f"stats, Reads)")
        return got
    if len(got) != 2:
        raise KvsimError(f"policy {policy.name} keeps a mask and never fetches: its attend must "
                         f"return (output, stats)")
    return (*got, None)


def _resident(compressed, like: torch.Tensor) -> torch.Tensor:
    res = compressed.resident
    return torch.zeros_like(like) if res is None else res.to(like.device)


def _verify(policy, compressed, reads, q, q_pos, k, v, out, n_ctx) -> None:
    res = _resident(compressed, torch.zeros(k.shape[0], n_ctx, dtype=torch.bool,
                                            device=k.device))
    keys_ok, values_ok = res.clone(), res.clone()
    if reads is not None:
        values_ok |= reads.kv
        keys_ok |= reads.kv | (reads.k if reads.k is not None else reads.kv)
    gen = torch.Generator(device="cpu").manual_seed(7)

    def scrambled(x, ok):
        other = torch.randn(x.shape, generator=gen, dtype=torch.float64).to(x) * x.std() + 1.0
        y = x.clone()
        y[:, :n_ctx] = torch.where(ok[..., None], x[:, :n_ctx], other[:, :n_ctx])
        return y

    again, _, _ = _call(policy, compressed.state, q, q_pos, scrambled(k, keys_ok),
                        scrambled(v, values_ok))
    a, b = out.to(torch.float64), again.to(torch.float64)
    if not torch.allclose(a, b, rtol=VERIFY_RTOL, atol=VERIFY_RTOL * float(a.abs().max())):
        used = "its resident tokens" + (" and the tokens it read" if policy.fetches else "")
        raise KvsimError(f"policy {policy.name} attended to context tokens outside {used}: its "
                         f"output changed when only those tokens' values did")
