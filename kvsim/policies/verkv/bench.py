"""VerKV's decide step on a synthetic attention layer of a model's head shape: the kernel that
``kvsim profile`` times (table ``kernel_decide``) and that ``kvsim validate`` runs inside real
decode steps.

The layer comes from :mod:`kvsim.model.synthetic` (spiky, with a sink and needles, so the
certificate has work to do), compressed by the VerKV policy with the options given; every call
of :meth:`DecideBench.plan` makes a real decision for the same decode query (sketch scores,
shortlist, shrinkage, certificate, GQA union), so a loop that runs it fetches what the policy's
statistics on the same layer say it fetches.
"""

from __future__ import annotations

import torch

from kvsim.model.synthetic import synthetic_attention_trace
from kvsim.policies.spec import make
from kvsim.policies.verkv.kvfetch import decide, reweighted_log_factor

QUESTION_ROWS = 4  # observation window for SnapKV scores, replayed by the analysis too


class DecideBench:
    def __init__(self, device, m, n: int, seed: int = 0, options: dict | None = None):
        """``m``: a model shape (``q_heads``, ``kv_heads``, ``head_dim``); ``n``: context."""
        self.trace = synthetic_attention_trace(n_layers=1, n_q=m.q_heads, n_kv=m.kv_heads,
                                               d=m.head_dim, context=n,
                                               question=QUESTION_ROWS, decode=1, seed=seed)
        la, a = self.trace.attention.layers[0], self.trace.attention
        f32 = lambda x: torch.as_tensor(x, dtype=torch.float32, device=device)  # noqa: E731
        pol = make("verkv", options)
        pol.bind(a.rope, m.head_dim)
        self.cfg = pol.config()
        self.layer = pol.compress(f32(la.k)[:, :n], f32(la.v)[:, :n], {}, f32(la.q_question),
                                  torch.as_tensor(a.question_pos, device=device),
                                  torch.Generator().manual_seed(seed), layer=0).state
        self.q = f32(la.q_decode)
        self.q_pos = torch.tensor([n], device=device)
        self.n, self.m = n, m
        smp = self.layer.sample
        fetched = decide(self.q, self.q_pos, self.layer, self.cfg).exact_kv[:, 0] & ~smp.sampled
        self.resident = smp.resident.sum(-1)  # (n_kv,)
        self.t_max = int((self.resident + fetched.sum(-1)).max())
        self.fetched_frac = float(fetched.float().mean())
        # compact layout per KV head: resident tokens first (filled once), then fetched rows
        res_idx = torch.sort((~smp.resident).to(torch.int8), dim=-1, stable=True).indices
        self.res_cols = res_idx[:, :int(self.resident.max())]

    def plan(self):
        """One layer and one sequence: the fetch set as host row indices (sorted by KV head),
        their slots in the compact layout, VerKV's reweighting as an additive logit bias
        (n_kv, g, t_max) over that layout, and the rows fetched per KV head."""
        lay, m = self.layer, self.m
        dec = decide(self.q, self.q_pos, lay, self.cfg)
        fetched = dec.exact_kv[:, 0] & ~lay.sample.sampled  # (n_kv, n)
        h, t = fetched.nonzero(as_tuple=True)
        counts = fetched.sum(-1)
        start = torch.cumsum(counts, 0) - counts
        rank = torch.arange(h.numel(), device=h.device) - start[h]
        slot = h * self.t_max + self.resident[h] + rank
        g = m.q_heads // m.kv_heads
        log_w = reweighted_log_factor(lay, dec, m.q_heads).view(m.kv_heads, g, self.n)
        cols = torch.zeros(m.kv_heads, self.t_max, dtype=torch.long, device=h.device)
        valid = torch.zeros(m.kv_heads, self.t_max, dtype=torch.bool, device=h.device)
        r = self.res_cols.shape[1]
        cols[:, :r] = self.res_cols
        valid[:, :r] = torch.arange(r, device=h.device)[None, :] < self.resident[:, None]
        cols.view(-1)[slot] = t
        valid.view(-1)[slot] = True
        bias = log_w.gather(-1, cols[:, None, :].expand(m.kv_heads, g, self.t_max))
        bias = bias.masked_fill(~valid[:, None, :], float("-inf"))
        return h * self.n + t, slot, bias, counts
