"""VerKV's decide step on a synthetic attention layer of a model's head shape: the kernel that
``kvsim profile`` times (table ``kernel_decide_verkv``) and that ``kvsim validate`` runs inside real
decode steps.

The layer comes from :mod:`kvsim.model.synthetic` (spiky, with a sink and needles, so the
certificate has work to do), compressed by the VerKV policy with the options given; every call
of :meth:`DecideBench.plan` makes a real decision for the same decode query (sketch scores,
shortlist, shrinkage, certificate, GQA union), so a loop that runs it fetches what the policy's
statistics on the same layer say it fetches.

A batch: :meth:`DecideBench.stack` gives the same step for ``B`` requests decided in one call,
the requests stacked along the head axis (``B x kv_heads`` KV heads, ``B x q_heads`` query heads;
every stage of the pipeline works per KV head or per query row, so one call over the stack is
what a batched decide does). Request 0 is this bench's own layer; the others are synthetic
layers of their own seeds, generated once per bench (in worker processes when they are large)
and sliced for smaller batches.
"""

from __future__ import annotations

import numpy as np

from kvsim import trace as T
from kvsim._torch import torch
from kvsim.model.synthetic import synthetic_attention_trace
from kvsim.policies.bench_requests import Stacking, needs_kvzip, request_kwargs
from kvsim.policies.spec import make
from kvsim.policies.verkv.kvfetch import decide, reweighted_log_factor


class DecideBench(Stacking):
    def __init__(self, device, m, n: int, seed: int = 0, options: dict | None = None,
                 attention: T.Attention | None = None):
        """``m``: a model shape (``q_heads``, ``kv_heads``, ``head_dim``); ``n``: context;
        ``attention``: the layer to decide on (default: one request's synthetic layer of
        ``seed``; :meth:`stack` passes a stack of requests)."""
        if attention is None:
            self.trace = synthetic_attention_trace(
                **request_kwargs(m, n, seed, needs_kvzip(options)))
        else:
            self.trace = T.Trace(T.new_meta("kvsim.policies.verkv.bench", model="synthetic",
                                            context=n, notes=attention.provenance),
                                 None, attention)
        la, a = self.trace.attention.layers[0], self.trace.attention
        self.kv_heads, self.q_heads = la.k.shape[0], la.q_question.shape[0]
        self.batch = self.kv_heads // m.kv_heads  # requests in the stack
        self.device, self.seed, self.options = device, seed, options
        self._requests = [a] if self.batch == 1 else None

        def f32(x):  # half-precision values travel as such, and widen on the device
            return torch.from_numpy(np.ascontiguousarray(x)).to(device).to(torch.float32)
        pol = make("verkv", options)
        pol.bind(a.rope, m.head_dim)
        self.cfg = pol.config()
        scores = {k: f32(v[:, :n]) for k, v in la.scores.items()}  # kvzip, when it scores so
        self.layer = pol.compress(f32(la.k[:, :n]), f32(la.v[:, :n]), scores, f32(la.q_question),
                                  torch.as_tensor(a.question_pos, device=device),
                                  torch.Generator().manual_seed(seed), layer=0,
                                  obs_k=f32(la.k[:, n:])).state
        self.q = f32(la.q_decode)
        self.q_pos = torch.tensor([n], device=device)
        self.n, self.m = n, m
        smp = self.layer.sample
        fetched = decide(self.q, self.q_pos, self.layer, self.cfg).exact_kv[:, 0] & ~smp.sampled
        self.resident = smp.resident.sum(-1)  # (n_kv,)
        self.t_max = int((self.resident + fetched.sum(-1)).max())
        self.fetched_frac = float(fetched.float().mean())  # mean over the (stacked) KV heads
        # compact layout per KV head: resident tokens first (filled once), then fetched rows
        res_idx = torch.sort((~smp.resident).to(torch.int8), dim=-1, stable=True).indices
        self.res_cols = res_idx[:, :int(self.resident.max())]

    def _of(self, attention: T.Attention) -> DecideBench:
        return DecideBench(self.device, self.m, self.n, self.seed, self.options,
                           attention=attention)

    def _kvzip(self) -> bool:
        return needs_kvzip(self.options)

    def plan(self):
        """One layer and the whole stack: the fetch set as host row indices (sorted by KV head),
        their slots in the compact layout, VerKV's reweighting as an additive logit bias
        (n_kv, g, t_max) over that layout, and the rows fetched per KV head."""
        lay, n_kv = self.layer, self.kv_heads
        dec = decide(self.q, self.q_pos, lay, self.cfg)
        fetched = dec.exact_kv[:, 0] & ~lay.sample.sampled  # (n_kv, n)
        h, t = fetched.nonzero(as_tuple=True)
        counts = fetched.sum(-1)
        start = torch.cumsum(counts, 0) - counts
        rank = torch.arange(h.numel(), device=h.device) - start[h]
        slot = h * self.t_max + self.resident[h] + rank
        g = self.q_heads // n_kv
        log_w = reweighted_log_factor(lay, dec, self.q_heads).view(n_kv, g, self.n)
        cols = torch.zeros(n_kv, self.t_max, dtype=torch.long, device=h.device)
        valid = torch.zeros(n_kv, self.t_max, dtype=torch.bool, device=h.device)
        r = self.res_cols.shape[1]
        cols[:, :r] = self.res_cols
        valid[:, :r] = torch.arange(r, device=h.device)[None, :] < self.resident[:, None]
        cols.view(-1)[slot] = t
        valid.view(-1)[slot] = True
        bias = log_w.gather(-1, cols[:, None, :].expand(n_kv, g, self.t_max))
        bias = bias.masked_fill(~valid[:, None, :], float("-inf"))
        return h * self.n + t, slot, bias, counts
