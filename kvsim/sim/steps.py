"""What engine steps cost: decode tokens of the running sequences and, in the same forward pass,
prefill chunks of newly admitted prompts. Vectorised over a run of steps.

Per layer of a step with ``D`` decoding sequences holding ``tokens`` KV tokens and prefill chunks
(``size`` new tokens after ``prefix`` cached ones each):

    c = GEMMs + decode attention (KV read from HBM) + chunk attention
        GEMMs = max(decode GEMM time(D), one pass over the layer's weights (of an MoE layer:
                    the experts the step's tokens route to),
                    2 * active_layer_params * (D + chunk tokens) / FLOP/s)
        chunk attention = causal attention FLOPs of the chunks (ModelSpec.prefill_flops) / FLOP/s
    d = the policy's decide step, per decoding sequence
    x = the policy's KV transfer of the decoding sequences over the host link

and the layers form the pipeline of :mod:`kvsim.sim.pipeline`. Per step: the LM head for every
sequence that emits a token (decodes and chunks that finish a prompt), the policy's own prefill
work (:class:`kvsim.contract.PrefillWork`) for every prompt that finishes, and, for policies that
keep the cache in host memory, the chunks' KV written to host memory (D2H, overlapped with the
step). A step without chunks is a plain decode step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from kvsim.contract import DecodeCost, PrefillWork
from kvsim.hw.catalog import ModelSpec
from kvsim.hw.costs import CostModel
from kvsim.sim.pipeline import step_time


@dataclass
class Chunks:
    """Per step of a run of steps: the prefill work riding along, each (S,)."""
    tokens: np.ndarray  # prompt tokens prefilled
    attn_flops: np.ndarray  # their causal attention FLOPs, all layers
    count: np.ndarray  # chunks
    done: np.ndarray  # prompts that finish (each emits a token)
    work_flops: np.ndarray  # the policy's prefill work for those prompts
    work_bytes: np.ndarray


@dataclass
class StepCosts:
    model: ModelSpec
    costs: CostModel
    policy: DecodeCost
    prefill_work: PrefillWork = field(default_factory=PrefillWork)

    def __post_init__(self):
        self._per_batch: dict[int, tuple[float, float]] = {}
        m, c, p = self.model, self.costs, self.policy
        self.overlap = c.overlap_for(p.overlap)
        self.overhead = c.step_overhead
        self.decide = c.decide_model(p.decide_kernel, m, p.decide_bytes_per_token) \
            if p.decide_bytes_per_token > 0 else None
        if self.decide is not None and c.tp > 1:  # each GPU decides for its share of the heads
            self.decide = dataclasses.replace(self.decide, **{
                f: getattr(self.decide, f) / c.tp
                for f in ("per_layer_us", "per_ktoken_us", "per_kfetched_us")})

    def per_batch(self, B: int) -> tuple[float, float]:
        """(GEMM seconds per layer, LM head seconds) of a decode batch of ``B`` sequences,
        remembered: a run asks for the same few batch sizes thousands of times."""
        got = self._per_batch.get(B)
        if got is None:
            m, c = self.model, self.costs
            got = self._per_batch[B] = (float(c.gemm_time(B, m)), float(c.head_time(B, m)))
        return got

    def host_bytes(self, tokens) -> np.ndarray:
        """Bytes of KV the policy keeps in host memory for ``tokens`` tokens."""
        return self.policy.host_frac * self.model.kv_bytes_per_token * np.asarray(tokens, float)

    def layer_costs(self, D, tokens) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per-layer (decode compute, decide, link) seconds of steps whose decodes are ``D``
        sequences holding ``tokens`` KV tokens, each (S,)."""
        m, c, p = self.model, self.costs, self.policy
        tokens = np.asarray(tokens, float)
        kv_layer = m.kv_bytes_per_token / m.layers * tokens  # bytes of one layer's KV
        gemm = (self.per_batch(D)[0] if D else 0.0) if isinstance(D, int) else \
            np.where(np.asarray(D) > 0, c.gemm_time(D, m), 0.0)
        compute = gemm + c.attention_time(p.hbm_read_frac * kv_layer, p.hbm_read_frac * tokens) \
            + c.allreduce_time(D, m)
        link = c.link_time(p.host_read_frac * kv_layer, p.path,
                           copies=c.copies(p.copies_per_layer, D)) \
            if p.host_read_frac > 0 else np.zeros_like(tokens)
        decide = self.decide.seconds(D, tokens, p.host_read_frac) \
            if self.decide is not None else np.zeros_like(tokens)
        return compute, decide, link

    def run(self, D, tokens, chunks: Chunks | None = None):
        """(step, GPU-busy, link-busy, decodes-alone) seconds of each of a run of steps, (S,)
        each; decodes-alone is what the decode tokens of the step would take without chunks.
        Every step pays the engine's per-step overhead (time the GPU is not busy)."""
        m, c, p = self.model, self.costs, self.policy
        L, ovh = m.layers, self.overhead
        D = np.asarray(D, float)
        if D.any():
            compute, decide, link = self.layer_costs(D, tokens)
            head = np.where(D > 0, c.head_time(D, m), 0.0)
            alone = np.where(D > 0, step_time(compute, decide, link, L, self.overlap) + head
                             + ovh, 0.0)
        else:  # prefill only: no decode work at all
            compute = decide = link = head = alone = np.zeros_like(D)
        if chunks is None:
            return alone, L * (compute + decide) + head, L * link, alone
        dec_gemm = np.where(D > 0, c.gemm_time(D, m), 0.0) if D.any() else 0.0
        weights = m.layer_weight_bytes(D + chunks.tokens) / c.hbm_bw  # a pass over the weights
        gemm = np.maximum(np.maximum(dec_gemm, weights),
                          2.0 * m.active_layer_params * (D + chunks.tokens) / c.flops)
        compute = compute - dec_gemm + gemm + chunks.attn_flops / L / c.flops \
            + c.allreduce_time(D + chunks.tokens, m) - c.allreduce_time(D, m)
        layers = step_time(compute, decide, link, L, self.overlap)
        emit = D + chunks.done
        extra = np.where(emit > 0, c.head_time(emit, m), 0.0) + np.maximum(
            chunks.work_flops / c.flops, chunks.work_bytes / c.hbm_bw)
        write = c.link_time(self.host_bytes(chunks.tokens), "d2h",
                            copies=2 * L * c.copies(1.0, chunks.count)) \
            if p.host_frac > 0 else np.zeros_like(layers)
        return (np.maximum(layers + extra, write) + ovh, L * (compute + decide) + extra,
                L * link + write, alone)

    def step(self, D: int, tokens: float, chunk_tokens: float, attn_flops: float, count: int,
             done: np.ndarray) -> tuple[float, float, float, float]:
        """:meth:`run` for one step, in scalars (the engine's hot path: most runs of prefill
        steps are one step long): ``D`` decodes holding ``tokens`` KV tokens, ``count`` chunks
        of ``chunk_tokens`` tokens in all with ``attn_flops`` of attention, ``done``: the
        lengths of the prompts that finish. ``tests/test_serving.py`` holds the two equal."""
        m, c, p = self.model, self.costs, self.policy
        L, work, ovh = m.layers, self.prefill_work, self.overhead
        gemm_d = attn = link = decide = alone = 0.0
        if D:
            gemm_d, head_d = self.per_batch(D)
            kv_layer = m.kv_bytes_per_token / L * tokens
            attn = float(c.attention_time(p.hbm_read_frac * kv_layer, p.hbm_read_frac * tokens))
            if p.host_read_frac > 0:
                link = float(c.link_time(p.host_read_frac * kv_layer, p.path,
                                         copies=c.copies(p.copies_per_layer, D)))
            if self.decide is not None:
                decide = float(self.decide.seconds(D, tokens, p.host_read_frac))
            alone = float(step_time(gemm_d + attn + float(c.allreduce_time(D, m)), decide, link, L,
                                    self.overlap)) + head_d + ovh
        weights = float(m.layer_weight_bytes(D + chunk_tokens)) / c.hbm_bw
        gemm = max(gemm_d, weights, 2.0 * m.active_layer_params * (D + chunk_tokens) / c.flops)
        reduce = float(c.allreduce_time(D + chunk_tokens, m))  # tensor parallel: all-reduces
        compute = attn + gemm + attn_flops / L / c.flops + reduce
        layers = float(step_time(compute, decide, link, L, self.overlap))
        emit = D + len(done)
        extra = (self.per_batch(emit)[1] if emit else 0.0) + (float(np.maximum(
            work.flops(done) / c.flops, work.bytes(done) / c.hbm_bw).sum())
            if work.flops_per_token or work.flops_per_token_sq or work.bytes_per_token else 0.0)
        write = float(c.link_time(self.host_bytes(chunk_tokens), "d2h",
                                  copies=2 * L * c.copies(1.0, count))) \
            if p.host_frac > 0 and count else 0.0
        return (max(layers + extra, write) + ovh, L * (compute + decide) + extra,
                L * link + write, alone)

    def decode(self, ctx: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Times of the next ``k`` decode steps of a fixed batch with contexts ``ctx`` (each step
        adds a token per sequence): (step, GPU-busy, link-busy) seconds, each (k,). The hot
        path of the engine: :meth:`run` without chunks, for a batch size that does not change."""
        L, B, j = self.model.layers, len(ctx), np.arange(k, dtype=float)
        compute, decide, link = self.layer_costs(B, float(ctx.sum()) + B * j)
        head = self.per_batch(B)[1]
        return (step_time(compute, decide, link, L, self.overlap) + head + self.overhead,
                L * (compute + decide) + head, L * link)
