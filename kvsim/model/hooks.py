"""kvsim's attention function, registered in ``transformers.AttentionInterface`` as "kvsim".

The model computes its own projections, RoPE and cache; this function receives post-RoPE queries,
keys and values (the whole cache so far) for each layer and, depending on the active
:class:`Controller`, runs the stock SDPA attention (recording queries), a KVzip reconstruction
pass (recording per-token attention maxima), or a policy's ``attend``. With no controller active
it is exactly SDPA. The model only routes attention: what a policy read is counted by the call its
caller hands the controller (``kvsim.measure.traffic.attend``), so the model imports no measuring
code. The mask function is registered under the same name, or no mask would reach
SDPA for multi-token passes.

Batch size 1, one sequence, no padding: a query row's position is ``keys - rows + i``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvsim.attention.dense import logits

ATTN_NAME = "kvsim"
_active: Controller | None = None
_registered = False


@dataclass
class Controller:
    mode: str = "stock"  # "stock" | "kvzip" | "policy"
    record_layers: set[int] | None = None  # layers whose queries are kept (None: all)
    record_last: int | None = None  # keep only the last rows of each pass (SnapKV window)
    queries: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # layer -> (n_q, m, d)
    n_ctx: int = 0  # context length, for KVzip scores
    kvzip: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> (n_kv, n_ctx) max
    policy: object = None
    states: dict = field(default_factory=dict)  # layer -> what the policy kept (Compressed)
    stats: list = field(default_factory=list)  # (layer, m, stats dict) per policy call
    # policy mode: attend(policy, compressed, q, q_pos, k, v) -> (output, stats), the caller's
    # counting call (kvsim.measure.traffic.attend); None: the policy's own attend, uncounted
    attend: Callable | None = None
    calls: int = 0

    def __call__(self, module, query, key, value, attention_mask, dropout, scaling, kwargs):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        if query.shape[0] != 1:
            raise RuntimeError("kvsim attention runs one sequence at a time (batch size 1)")
        self.calls += 1
        layer = module.layer_idx
        d = query.shape[-1]
        m, n = query.shape[2], key.shape[2]
        # policies and traces use the 1/sqrt(d) convention; fold any other scaling into q
        s = 1.0 if scaling is None else float(scaling) * d ** 0.5
        q = (query[0] * s) if s != 1.0 else query[0]  # (n_q, m, d)
        q_pos = torch.arange(n - m, n, device=query.device)
        if self.mode == "stock" and (self.record_layers is None or layer in self.record_layers):
            rec = q if self.record_last is None else q[:, -self.record_last:]
            self.queries.setdefault(layer, []).append(rec.detach().clone())
        if self.mode == "stock":
            return sdpa_attention_forward(module, query, key, value, attention_mask,
                                          dropout=dropout, scaling=scaling, **kwargs)
        if self.mode == "kvzip":
            # max over rows of p = exp(s - logsumexp(s)), without materialising p; the output
            # comes from SDPA with the mask, as in stock mode
            lg = logits(q.float(), key[0].float(), q_pos)
            lse = torch.logsumexp(lg, dim=-1, keepdim=True)
            top = (lg[:, :, :self.n_ctx] - lse).amax(dim=1).exp()  # (n_q, n_ctx)
            del lg
            top = top.view(key.shape[1], -1, self.n_ctx).amax(dim=1)  # max over the group
            prev = self.kvzip.get(layer)
            self.kvzip[layer] = top if prev is None else torch.maximum(prev, top)
            return sdpa_attention_forward(module, query, key, value, attention_mask,
                                          dropout=dropout, scaling=scaling, **kwargs)
        if self.mode == "policy":
            call = self.attend or policy_attend
            out, stats = call(self.policy, self.states[layer], q, q_pos, key[0], value[0])
            self.stats.append((layer, m, stats))
        else:
            raise ValueError(f"unknown controller mode {self.mode!r}")
        return out.to(query.dtype).transpose(0, 1).unsqueeze(0).contiguous(), None


def policy_attend(policy, compressed, q, q_pos, k, v) -> tuple[torch.Tensor, dict]:
    """``policy.attend`` on what it kept of the layer (its ``Compressed``): the output and the
    policy's own statistics, with nothing counted (a fetching policy's reads are dropped)."""
    got = policy.attend(compressed.state, q, q_pos, k, v)
    return got[0], got[1]


def _attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    if _active is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
    return _active(module, query, key, value, attention_mask, dropout, scaling, kwargs)


def register() -> None:
    """Register the attention function and its (SDPA) mask function under ``ATTN_NAME``."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    AttentionInterface.register(ATTN_NAME, _attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_NAME, sdpa_mask)
    _registered = True


def install(model) -> None:
    """Route ``model``'s attention through kvsim (plain SDPA until a controller is active)."""
    register()
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(ATTN_NAME)
    else:  # older transformers
        model.config._attn_implementation = ATTN_NAME


@contextlib.contextmanager
def active(ctl: Controller):
    global _active
    prev, _active = _active, ctl
    try:
        yield ctl
    finally:
        _active = prev
