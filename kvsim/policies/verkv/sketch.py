"""The 2-bit key sketch (VerKV Appendix A.1) and the per-KV-head shortlist.

Per KV head: keep the ``d / 8`` RoPE channel pairs (a quarter of the channels; 16 pairs at head
dim 128) with the largest mean key energy; RoPE rotates within a pair, so the choice needs no
queries. Each kept channel is quantized to 2 bits, uniformly between its min and max over each
group of 128 tokens, with an fp16 zero point and scale per group and channel. Cost per token and
KV head: ``c * 2 + c * 2 * 16 / 128`` bits for ``c = d / 4`` kept channels, i.e. 1.76% of a
16-bit K+V cache at any head dim.

Sketch logits: ``q`` restricted to the kept channels against the dequantized keys, scaled by
``1 / sqrt(d)`` like the exact logits. They drop three quarters of the channels, so they are
biased, not only noisy; the certificate that uses them inherits that bias.

The *bounded* sketch is the same sketch made rigorous, plus one fp16 per token: the
norm of the key's dropped channels, rounded up. Zero points are rounded down and scales up to
fp16, so every kept channel's dequantization error is at most half a step. For any query,

    |s - s^| <= e = ( sum_kept |q_j| step_j / 2 + |q_dropped| |k_dropped| ) / sqrt(d)

(Cauchy-Schwarz on the dropped channels), so ``w^ e^-e <= w <= w^ e^e`` for every token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvsim._torch import torch

GROUP = 128
BITS = 2
META_BITS = 16  # fp16 zero point and scale, per group and channel


def rope_pairs(d: int, rope_type: str | None = None) -> torch.Tensor:
    """(d/2, 2) channel indices of the RoPE pairs.

    Hugging Face models rotate channel j with j + d/2 ("rotate_half", the default); GPT-J /
    interleaved RoPE rotates 2j with 2j+1 (pass a type containing "interleav" or "gptj").
    """
    half = d // 2
    j = torch.arange(half)
    t = (rope_type or "").lower()
    if "interleav" in t or "gptj" in t or "gpt-j" in t:
        return torch.stack([2 * j, 2 * j + 1], dim=-1)
    return torch.stack([j, j + half], dim=-1)


def sketch_bits_per_token(d: int, group: int = GROUP) -> float:
    c = kept_channels(d)
    return c * BITS + c * 2 * META_BITS / group


def kept_channels(d: int) -> int:
    return 2 * max(1, d // 8)


NORM_BYTES = 2  # the bounded sketch's fp16 norm of the dropped channels, per token


def sketch_bytes(n: int, d: int, group: int = GROUP, bounded: bool = False) -> float:
    """Bytes of the sketch of ``n`` tokens for one KV head (partial last group paid in full)."""
    c = kept_channels(d)
    return n * c * BITS / 8 + math.ceil(n / group) * c * 2 * META_BITS / 8 \
        + (n * NORM_BYTES if bounded else 0)


@dataclass
class KeySketch:
    channels: torch.Tensor  # (n_kv, c) kept channel indices per KV head
    codes: torch.Tensor  # (n_kv, n, c) uint8 in 0..3
    zero: torch.Tensor  # (n_kv, groups, c) fp16-representable
    scale: torch.Tensor  # (n_kv, groups, c) fp16-representable
    keys: torch.Tensor  # (n_kv, n, c) dequantized keys (kept for speed; costed as 2 bits)
    head_dim: int
    group: int = GROUP
    dropped_norm: torch.Tensor | None = None  # (n_kv, n) bounded sketch: |k_dropped|, rounded up

    @property
    def n_tokens(self) -> int:
        return self.codes.shape[1]

    @property
    def bounded(self) -> bool:
        return self.dropped_norm is not None

    def nbytes_per_head(self) -> float:
        return sketch_bytes(self.n_tokens, self.head_dim, self.group, self.bounded)


def _fp16(x: torch.Tensor, direction: int = 0) -> torch.Tensor:
    """``x`` rounded to fp16 (nearest; ``direction`` -1 / +1: the fp16 value at or below /
    above), as float32."""
    h = x.half().float()
    if direction < 0:
        h = torch.where(h > x, torch.nextafter(h.half(), torch.tensor(-math.inf).half()).float(), h)
    elif direction > 0:
        h = torch.where(h < x, torch.nextafter(h.half(), torch.tensor(math.inf).half()).float(), h)
    return h


def build_sketch(k: torch.Tensor, pairs: torch.Tensor | None = None,
                 group: int = GROUP, bounded: bool = False) -> KeySketch:
    """Sketch of keys ``k`` (n_kv, n, d); ``pairs`` from :func:`rope_pairs`; ``bounded`` adds
    the dropped channels' norms and rounds the group ranges outwards (see the module note)."""
    n_kv, n, d = k.shape
    pairs = rope_pairs(d) if pairs is None else pairs
    pairs = pairs.to(k.device)
    kf = k.to(torch.float32)
    energy = kf.pow(2).mean(dim=1)  # (n_kv, d)
    pair_energy = energy[:, pairs[:, 0]] + energy[:, pairs[:, 1]]  # (n_kv, d/2)
    n_pairs = kept_channels(d) // 2
    top = torch.topk(pair_energy, n_pairs, dim=-1).indices.sort(dim=-1).values
    channels = pairs[top].reshape(n_kv, -1)  # (n_kv, c)
    sel = kf.gather(-1, channels[:, None, :].expand(n_kv, n, channels.shape[-1]))
    n_groups = math.ceil(n / group)
    pad = n_groups * group - n
    padded = torch.cat([sel, sel[:, -1:].expand(n_kv, pad, -1)], dim=1) if pad else sel
    g = padded.view(n_kv, n_groups, group, -1)
    lo = _fp16(g.amin(dim=2), -1 if bounded else 0)
    hi = g.amax(dim=2)
    levels = 2 ** BITS - 1
    scale = _fp16((hi - lo) / levels, 1 if bounded else 0)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = ((g - lo[:, :, None]) / safe[:, :, None]).round().clamp(0, levels)
    deq = lo[:, :, None] + codes * scale[:, :, None]
    deq = deq.reshape(n_kv, n_groups * group, -1)[:, :n]
    codes = codes.reshape(n_kv, n_groups * group, -1)[:, :n].to(torch.uint8)
    norm = None
    if bounded:
        dropped = torch.ones(n_kv, d, dtype=torch.bool, device=k.device)
        dropped.scatter_(-1, channels, False)
        norm = _fp16(kf.masked_fill(~dropped[:, None, :], 0.0).norm(dim=-1), 1)
    return KeySketch(channels, codes, lo, scale, deq.to(k.dtype), d, group, norm)


def sketch_logits(sk: KeySketch, q: torch.Tensor) -> torch.Tensor:
    """(n_q, m, n) sketch logits of the query rows ``q`` (n_q, m, d) against every token."""
    n_q, m, d = q.shape
    n_kv, c = sk.channels.shape
    g = n_q // n_kv
    ch = sk.channels.repeat_interleave(g, dim=0)  # (n_q, c)
    q_sel = q.gather(-1, ch[:, None, :].expand(n_q, m, c))
    s = torch.matmul(q_sel.reshape(n_kv, g * m, c), sk.keys.transpose(1, 2).to(q.dtype))
    return s.view(n_q, m, -1).div_(math.sqrt(d))


def logit_halfwidth(sk: KeySketch, q: torch.Tensor) -> torch.Tensor:
    """(n_q, m, n) the bounded sketch's ``e``: ``|s - s^| <= e`` for every token and row.

    The dequantized keys are held in float32 (exactly what fp16 codes, zero and scale give), and
    the sum is inflated by a relative 1e-5 for the float32 arithmetic of s and s^."""
    n_q, m, d = q.shape
    n_kv, c = sk.channels.shape
    g = n_q // n_kv
    qa = q.abs().to(torch.float32)
    ch = sk.channels.repeat_interleave(g, dim=0)
    q_kept = qa.gather(-1, ch[:, None, :].expand(n_q, m, c)).reshape(n_kv, g * m, c)
    q_drop = (qa.pow(2).sum(-1) - q_kept.reshape(n_q, m, c).pow(2).sum(-1)).clamp_min(0).sqrt()
    half_step = (sk.scale / 2).repeat_interleave(sk.group, dim=1)[:, :sk.n_tokens]  # (n_kv, n, c)
    e = torch.matmul(q_kept, half_step.transpose(1, 2)).view(n_q, m, -1)
    e = e + q_drop[..., None] * sk.dropped_norm.repeat_interleave(g, dim=0)[:, None, :]
    k_norm = (sk.keys.norm(dim=-1) + sk.dropped_norm).repeat_interleave(g, dim=0)[:, None, :]
    slack = (qa.norm(dim=-1)[..., None] * k_norm + e) * 1e-5
    return ((e + slack) / math.sqrt(d)).to(q.dtype)


def shortlist(score: torch.Tensor, candidates: torch.Tensor, size: int):
    """Per KV head and query row, the ``size`` candidates with the largest ``score``
    (n_kv, m, n). Returns indices (n_kv, m, k), which of them are real candidates (fewer where
    there are fewer candidates) and the same set as a (n_kv, m, n) bool mask."""
    s = score.masked_fill(~candidates, float("-inf"))
    kk = min(size, s.shape[-1])
    vals, idx = torch.topk(s, kk, dim=-1)
    valid = vals > float("-inf")
    mask = torch.zeros(s.shape, dtype=torch.bool, device=s.device).scatter_(-1, idx, valid)
    return idx, valid, mask
