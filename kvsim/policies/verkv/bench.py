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

from kvsim import trace as T
from kvsim._torch import torch
from kvsim.policies.bench_requests import CompactBench, needs_kvzip, on_device
from kvsim.policies.spec import make
from kvsim.policies.verkv.kvfetch import decide, reweighted_log_factor


class DecideBench(CompactBench):
    def __init__(self, device, m, n: int, seed: int = 0, options: dict | None = None,
                 attention: T.Attention | None = None):
        """``m``: a model shape (``q_heads``, ``kv_heads``, ``head_dim``); ``n``: context;
        ``attention``: the layer to decide on (default: one request's synthetic layer of
        ``seed``; :meth:`stack` passes a stack of requests)."""
        self.options = options
        la = self._request(device, m, n, seed, attention, needs_kvzip(options))
        a = self.trace.attention

        def f32(x):
            return on_device(x, device)
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
        smp = self.layer.sample
        self._layout(smp.resident, self._decision()[0])

    def _of(self, attention: T.Attention) -> DecideBench:
        return DecideBench(self.device, self.m, self.n, self.seed, self.options,
                           attention=attention)

    def _kvzip(self) -> bool:
        return needs_kvzip(self.options)

    def _decision(self):
        """The certificate's fetch beyond the sample (sketch scores, shortlist, shrinkage,
        certificate, GQA union) and VerKV's reweighting of every context token."""
        lay = self.layer
        dec = decide(self.q, self.q_pos, lay, self.cfg)
        fetched = dec.exact_kv[:, 0] & ~lay.sample.sampled  # (n_kv, n)
        log_w = reweighted_log_factor(lay, dec, self.q_heads)
        return fetched, log_w.view(self.kv_heads, self.q_heads // self.kv_heads, self.n)
