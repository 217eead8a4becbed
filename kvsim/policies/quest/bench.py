"""Quest's decide step on a synthetic attention layer of a model's head shape: the kernel that
``kvsim profile`` times (table ``kernel_decide_quest``) and ``kvsim validate`` runs inside real
decode steps. Every :meth:`QuestBench.plan` bounds every page for the decode query, picks the
budget's pages per KV head and lays out their rows for the gather, as a decode step does.
A batch stacks requests along the head axis (:meth:`QuestBench.stack`), as VerKV's bench does."""

from __future__ import annotations

import dataclasses

import numpy as np

from kvsim import trace as T
from kvsim._torch import torch
from kvsim.model.synthetic import synthetic_attention_trace
from kvsim.policies.bench_requests import Stacking, request_kwargs
from kvsim.policies.quest.pages import select
from kvsim.policies.spec import make


class QuestBench(Stacking):
    def __init__(self, device, m, n: int, seed: int = 0, params=None,
                 attention: T.Attention | None = None):
        self.options = dataclasses.asdict(params) if params is not None else {}
        if attention is None:
            attention = synthetic_attention_trace(**request_kwargs(m, n, seed)).attention
        self.trace = T.Trace(T.new_meta("kvsim.policies.quest.bench", model="synthetic",
                                        context=n, notes=attention.provenance), None, attention)
        la = attention.layers[0]
        self.kv_heads, self.q_heads = la.k.shape[0], la.q_question.shape[0]
        self.batch = self.kv_heads // m.kv_heads
        self.device, self.seed, self.m, self.n = device, seed, m, n
        self._requests = [attention] if self.batch == 1 else None

        def f32(x):
            return torch.from_numpy(np.ascontiguousarray(x)).to(device).to(torch.float32)
        self.policy = make("quest", self.options)
        self.pages = self.policy.compress(f32(la.k[:, :n]), f32(la.v[:, :n]), {}, None, None,
                                          None, layer=0).state
        self.q = f32(la.q_decode)
        self.q_pos = torch.tensor([n], device=device)
        p = self.policy.params
        self.budget = p.token_budget // p.page_size
        self.resident = self.pages.resident.sum(-1)
        fetched = self._fetched()
        self.t_max = int((self.resident + fetched.sum(-1)).max())
        self.fetched_frac = float(fetched.float().mean())
        res_idx = torch.sort((~self.pages.resident).to(torch.int8), dim=-1, stable=True).indices
        self.res_cols = res_idx[:, :int(self.resident.max())]

    def _fetched(self) -> torch.Tensor:
        return select(self.q, self.q_pos, self.pages, self.budget)[:, 0] & ~self.pages.resident

    def _of(self, attention: T.Attention) -> QuestBench:
        return QuestBench(self.device, self.m, self.n, self.seed, self.policy.params,
                          attention=attention)

    def plan(self):
        """One layer and the whole stack: the fetched pages' host rows (sorted by KV head),
        their slots in the compact layout (resident tokens first), a zero logit bias over that
        layout (-inf on unused slots: Quest does not reweight) and the rows per KV head."""
        fetched = self._fetched()
        n_kv = self.kv_heads
        h, t = fetched.nonzero(as_tuple=True)
        counts = fetched.sum(-1)
        start = torch.cumsum(counts, 0) - counts
        rank = torch.arange(h.numel(), device=h.device) - start[h]
        slot = h * self.t_max + self.resident[h] + rank
        valid = torch.zeros(n_kv, self.t_max, dtype=torch.bool, device=h.device)
        r = self.res_cols.shape[1]
        valid[:, :r] = torch.arange(r, device=h.device)[None, :] < self.resident[:, None]
        valid.view(-1)[slot] = True
        g = self.q_heads // n_kv
        bias = torch.zeros(n_kv, g, self.t_max, device=h.device).masked_fill(
            ~valid[:, None, :], float("-inf"))
        return h * self.n + t, slot, bias, counts
