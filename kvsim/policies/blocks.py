"""Block-selecting fetching policies (Quest, InfLLM-style block retrieval): the full cache in host
memory, cut into blocks of ``block_size`` tokens; per layer a small index of the blocks stays in
HBM with the ``sink`` first and ``local`` last tokens, and each decision reads whole blocks, the
ones the index ranks best, within a token budget.

A subclass supplies what is its own:

* :meth:`BlockFetchPolicy.index`: the index of a layer's context keys (Quest: the channel-wise
  key min and max per page) and :meth:`BlockFetchPolicy.block_bytes`: its bytes per block and KV
  head for a model (the HBM it holds and the decide step reads every step);
* :meth:`BlockFetchPolicy.select`: per query row and KV head the tokens of the blocks to read
  (usually the scores of the blocks for the rows handed to :func:`top_blocks`).

The base does the rest the same way for every such policy: the resident set and the index
(``compress``), attention over resident + selected + later tokens with the fetch statistics and
the :class:`~kvsim.policies.base.Reads` (``attend``), the cost from the fetch budget
(:meth:`BlockFetchPolicy.fetch_budget`: ``token_budget`` tokens per step by default, or a share)
and the index's bytes for the planned model (``decode_cost``), and the decide step the profiler
times (:class:`BlockBench`).
"""

from __future__ import annotations

import math
from abc import abstractmethod
from dataclasses import dataclass

from kvsim import trace as T
from kvsim._torch import torch
from kvsim.attention.weighted import row_chunks, weighted_attention
from kvsim.contract import DecodeCost, HeadShape, kv_token_bytes
from kvsim.policies.base import KV_ELEM_BYTES, Compressed, FetchPolicy, Reads
from kvsim.policies.bench_requests import CompactBench, on_device


@dataclass
class BlockState:
    """What a block policy keeps of one layer: its index and the resident tokens."""
    index: object  # the subclass's (BlockFetchPolicy.index)
    resident: torch.Tensor  # (n_kv, n_ctx) bool: sink and local
    block_size: int
    n_ctx: int


def top_blocks(scores: torch.Tensor, q_pos: torch.Tensor, state: BlockState,
               budget: int) -> torch.Tensor:
    """(n_kv, m, n_ctx) bool: the tokens of the ``budget`` blocks with the highest ``scores``
    (n_kv, m, blocks: per KV head and query row) among the blocks that start at or before the
    row's position ``q_pos`` (m,)."""
    blocks = scores.shape[-1]
    start = torch.arange(blocks, device=scores.device) * state.block_size
    scores = scores.masked_fill(start[None, None, :] > q_pos[None, :, None], float("-inf"))
    top = scores.topk(min(budget, blocks), dim=-1)
    chosen = torch.zeros_like(scores, dtype=torch.bool).scatter_(
        -1, top.indices, top.values > float("-inf"))
    return chosen.repeat_interleave(state.block_size, -1)[..., :state.n_ctx]


class BlockFetchPolicy(FetchPolicy):
    """A fetching policy that reads whole blocks chosen by an index held in HBM. Its ``Params``
    has ``sink`` and ``local``, ``token_budget`` (unless :meth:`fetch_budget` says otherwise) and
    ``block_size`` (unless :attr:`block_size` says otherwise)."""
    needs_attention = True

    @property
    def block_size(self) -> int:
        return self.params.block_size

    @abstractmethod
    def index(self, k: torch.Tensor) -> object:
        """The index of the context keys ``k`` (n_kv, n_ctx, d) kept in HBM, per block."""

    @abstractmethod
    def block_bytes(self, model) -> int | float:
        """Bytes of one block's index per KV head on ``model`` (its ``head_dim``, ``kv_elem``)."""

    @abstractmethod
    def select(self, state: BlockState, q: torch.Tensor, q_pos: torch.Tensor,
               budget: int) -> torch.Tensor:
        """(n_kv, m, n_ctx) bool: per KV head the tokens of the (at most ``budget``) blocks each
        query row (``q``: (n_q, m, d) at positions ``q_pos``) reads; the query heads of a KV head
        share its fetch."""

    def fetch_budget(self) -> tuple[float, float]:
        """(share of the context, fixed tokens) each KV head reads per step: ``token_budget``
        tokens by default, whatever the context."""
        return 0.0, float(self.params.token_budget)

    def budget_blocks(self, n_ctx: int) -> int:
        share, tokens = self.fetch_budget()
        return int((share * n_ctx + tokens) // self.block_size)

    def compress(self, k, v, scores, obs_q, obs_pos, generator, layer, obs_k=None):
        p = self.params
        n_kv, n_ctx, d = k.shape
        pos = torch.arange(n_ctx, device=k.device)
        resident = ((pos < p.sink) | (pos >= n_ctx - p.local)).expand(n_kv, n_ctx)
        meta = math.ceil(n_ctx / self.block_size) * self.block_bytes(HeadShape(d))  # per KV head
        held = float(resident.sum(-1).to(torch.float64).mean())
        return Compressed(BlockState(self.index(k), resident, self.block_size, n_ctx), held,
                          held * 2 * d * KV_ELEM_BYTES + meta, meta, resident=resident)

    def attend(self, state: BlockState, q, q_pos, k, v):
        """Exact attention over the resident tokens, the selected blocks and the tokens after
        the context; a pass of several rows reads the union of its rows' blocks."""
        n_q, m, d = q.shape
        n_kv, n_ctx = state.resident.shape
        g = n_q // n_kv
        budget = self.budget_blocks(n_ctx)
        outs, logds, rows = [], [], []
        read = torch.zeros(n_kv, n_ctx, dtype=torch.bool, device=q.device)
        for sl in row_chunks(n_q, m, k.shape[1]):
            qc, pc = q[:, sl], q_pos[sl]
            chosen = self.select(state, qc, pc, budget)  # (n_kv, mc, n_ctx)
            fetched = chosen & ~state.resident[:, None]
            read |= fetched.any(1)
            keep = (chosen | state.resident[:, None]).repeat_interleave(g, 0)
            log_w = torch.zeros(keep.shape, dtype=q.dtype, device=q.device).masked_fill(
                ~keep, float("-inf"))
            o, ld = weighted_attention(qc, pc, k, v, log_w)
            outs.append(o)
            logds.append(ld)
            tokens = fetched.sum(-1).repeat_interleave(g, 0).to(q.dtype)
            rows.append({"fetch": tokens > 0, "fetched_tokens": tokens,
                         "kvhead_fetch": tokens > 0})
        stats = {key: torch.cat([r[key] for r in rows], 1) for key in rows[0]}
        stats["log_denominator"] = torch.cat(logds, 1)
        return torch.cat(outs, 1), stats, Reads(read)

    def decide_kernel(self, device, model, context, seed=0):
        return BlockBench(device, model, context, seed, self)

    def decode_cost(self, stats, model):
        """The fetch (:meth:`fetch_budget`) of K and V per KV head and step (a fixed count is
        capped at the context by the simulator); sink and local stay in HBM with the index of
        ``model``'s keys (:meth:`block_bytes` per block: a share of the cache), which the decide
        step reads each step."""
        p = self.params
        index = self.block_bytes(model) / self.block_size  # per context token and KV head
        meta = index / kv_token_bytes(model)
        share, tokens = self.fetch_budget()
        kept = float(p.sink + p.local)
        return DecodeCost(resident_frac=meta, hbm_read_frac=meta + share, host_read_frac=share,
                          host_frac=1.0, overlap=False, copies_per_layer=1.0, path="gather",
                          staging_layers=1, decide_bytes_per_token=index, meta_frac=meta,
                          decide_kernel=self.name, resident_tokens=kept,
                          hbm_read_tokens=kept + tokens, host_read_tokens=tokens)

    def provenance(self, stats):
        share, tokens = self.fetch_budget()
        fetch = " + ".join(([f"{share:.4g} of the context"] if share else [])
                           + ([f"{tokens:g} tokens"] if tokens else []))
        return (f"{self.name}'s fetch is {fetch} per KV head and step by definition; the trace "
                f"measures its error")


class BlockBench(CompactBench):
    """A block policy's decide step on a synthetic layer of a model's head shape: each
    :meth:`plan` selects the blocks for the decode query (``policy.select``) and lays out the
    fetched rows behind the resident tokens, without reweighting."""

    def __init__(self, device, m, n: int, seed: int, policy: BlockFetchPolicy,
                 attention: T.Attention | None = None):
        la = self._request(device, m, n, seed, attention)
        self.policy = type(policy)(policy.params)
        self.policy.bind(self.trace.attention.rope, m.head_dim)
        self.state = self.policy.compress(on_device(la.k[:, :n], device),
                                          on_device(la.v[:, :n], device), {}, None, None, None,
                                          layer=0).state
        self.q = on_device(la.q_decode, device)
        self.q_pos = torch.tensor([n], device=device)
        self.budget = self.policy.budget_blocks(n)
        self._layout(self.state.resident, self._decision()[0])

    def _of(self, attention: T.Attention) -> BlockBench:
        return BlockBench(self.device, self.m, self.n, self.seed, self.policy,
                          attention=attention)

    def _decision(self):
        chosen = self.policy.select(self.state, self.q, self.q_pos, self.budget)
        return chosen[:, 0] & ~self.state.resident, None
