"""What one engine step costs: decode tokens of the running sequences and, in the same forward
pass, prefill chunks of newly admitted prompts.

Per layer of a step with ``D`` decoding sequences and prefill chunks (``size`` new tokens after
``prefix`` cached ones each):

    c = GEMMs + decode attention (KV read from HBM) + chunk attention
        GEMMs = max(decode GEMM time(D), 2 * layer_params * (D + chunk tokens) / FLOP/s): one
                pass over the weights for every token of the step, memory-bound for a few decode
                tokens, compute-bound once chunks ride along
        chunk attention = 4 * q_heads * head_dim * (size * prefix + size (size + 1) / 2) / FLOP/s
    d = the policy's decide step per decoding sequence
    x = the policy's KV transfer of the decoding sequences over the host link

and the layers form the pipeline of :mod:`kvsim.sim.pipeline`. Per step: the LM head for every
sequence that emits a token (decodes and chunks that finish a prompt), the policy's own prefill
work (:class:`kvsim.contract.PrefillWork`) for every prompt that finishes, and, for policies that
keep the cache in host memory, the chunks' KV written to host memory (D2H, overlapped with the
step). A step without chunks is the decode step the engine vectorises over many steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvsim.contract import DecodeCost, PrefillWork
from kvsim.hw.catalog import ModelSpec
from kvsim.hw.costs import CostModel
from kvsim.sim.pipeline import step_time


@dataclass
class StepCosts:
    model: ModelSpec
    costs: CostModel
    policy: DecodeCost
    prefill_work: PrefillWork = field(default_factory=PrefillWork)

    def host_bytes(self, tokens) -> np.ndarray:
        """Bytes of KV the policy keeps in host memory for ``tokens`` tokens."""
        return self.policy.host_frac * self.model.kv_bytes_per_token * np.asarray(tokens, float)

    def layer_costs(self, ctx: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per-layer (compute, decide, link) seconds of the next ``k`` decode steps, each (k,).

        ``ctx``: tokens held by each sequence of the batch; each step adds one per sequence.
        """
        m, c, p = self.model, self.costs, self.policy
        B = len(ctx)
        j = np.arange(k, dtype=float)
        tokens = float(ctx.sum()) + B * j  # KV tokens of the batch at each step
        kv_layer = m.kv_bytes_per_token / m.layers * tokens  # bytes of one layer's KV
        compute = c.gemm_time(B, m) + c.attention_time(p.hbm_read_frac * kv_layer,
                                                       p.hbm_read_frac * tokens)
        link = c.link_time(p.host_read_frac * kv_layer, p.path, copies=p.copies_per_layer * B) \
            if p.host_read_frac > 0 and B else np.zeros(k)
        decide = np.zeros(k)
        if p.decide_bytes_per_token > 0 and B:
            per_seq = c.decide_time(ctx[None, :] + j[:, None], m, p.decide_bytes_per_token)
            decide = per_seq.sum(axis=1)
        return compute + np.zeros(k), decide, link

    def decode(self, ctx: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Times of the next ``k`` decode steps: (step, GPU-busy, link-busy) seconds, each (k,)."""
        L = self.model.layers
        compute, decide, link = self.layer_costs(ctx, k)
        layer_total = step_time(compute, decide, link, L, self.policy.overlap)
        head = self.costs.head_time(len(ctx), self.model)
        return layer_total + head, L * (compute + decide) + head, L * link

    def mixed(self, ctx: np.ndarray, size: np.ndarray, prefix: np.ndarray,
              finished: np.ndarray) -> tuple[float, float, float]:
        """(step, GPU-busy, link-busy) seconds of one step: a decode token for each sequence of
        ``ctx`` and prefill chunks (``size`` tokens after ``prefix``); ``finished``: the prompt
        lengths of the chunks that complete their prompt (they emit a first token and the
        policy does its prefill work on them)."""
        m, c, p = self.model, self.costs, self.policy
        L, D = m.layers, len(ctx)
        size, prefix = np.asarray(size, float), np.asarray(prefix, float)
        dec_compute, decide, link = (x[0] for x in self.layer_costs(ctx, 1)) if D else (0, 0, 0)
        dec_gemm = float(c.gemm_time(D, m)) if D else 0.0
        weights = m.layer_params * m.dtype_bytes / c.hbm_bw  # one pass over the layer's weights
        step_tokens = D + float(size.sum())
        gemm = max(dec_gemm, weights, 2.0 * m.layer_params * step_tokens / c.flops)
        chunk_attn = (float(m.prefill_flops(size, prefix).sum()) / L
                      - 2.0 * m.layer_params * float(size.sum())) / c.flops
        compute = dec_compute - dec_gemm + gemm + chunk_attn
        layers = float(step_time(compute, decide, link, L, p.overlap))
        done = np.asarray(finished, float)
        work = self.prefill_work
        extra = float(c.head_time(D + len(done), m)) + float(np.maximum(
            work.flops(done) / c.flops, work.bytes(done) / c.hbm_bw).sum())
        gpu = L * (compute + decide) + extra
        write = float(c.link_time(self.host_bytes(size.sum()), "d2h", copies=2 * L * len(size))) \
            if p.host_frac > 0 and len(size) else 0.0
        return max(layers + extra, write), gpu, L * link + write
