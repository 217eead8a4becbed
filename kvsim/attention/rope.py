"""RoPE as Hugging Face models apply it, and its exact inverse.

HF-style ("rotate_half": pairs (i, i + d_rot/2)) or interleaved (pairs (2i, 2i+1)); the angles are
formed exactly as HF does (float32 inv_freq and float32 ``pos * inv_freq``), then cos and sin in
float64, so un-rotation is the inverse of the model's own rotation. Partial rotary dims and HF's
``attention_scaling`` are honoured; scaling schemes need an explicit ``inv_freq``.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvsim._torch import torch
from kvsim.errors import KvsimError


@dataclass(frozen=True)
class Rope:
    inv_freq: torch.Tensor  # (d_rot / 2,) float32, as the model holds it
    style: str  # "half" (HF rotate_half / neox) or "interleaved" (GPT-J)
    rot_dim: int  # leading dims of the head that are rotated (partial rotary)
    scaling: float = 1.0  # HF attention_scaling: cos and sin are multiplied by it

    def key(self) -> dict:
        """What must match between a basis and a trace (JSON-able)."""
        return {"style": self.style, "rot_dim": self.rot_dim, "scaling": self.scaling,
                "inv_freq_sum": float(self.inv_freq.double().sum())}


_HALF = {"default", "half", "rotate_half", "neox", "llama", "hf"}
_INTERLEAVED = {"interleaved", "gptj", "gpt-j"}


def rope_from_meta(rope: dict, head_dim: int) -> Rope:
    """The rotation a trace's ``attention.rope`` describes (theta, optional type, inv_freq,
    partial_rotary_factor, attention_scaling); unknown scaling schemes are an error."""
    if not isinstance(rope, dict):
        raise KvsimError("trace RoPE settings are not a dict")
    style = str(rope.get("style", rope.get("type", rope.get("rope_type", "default")))).lower()
    if style in _HALF:
        style = "half"
    elif style in _INTERLEAVED:
        style = "interleaved"
    elif "inv_freq" not in rope:
        raise KvsimError(f"RoPE type {style!r} is not supported by the VarRate codec (supported: "
                         f"default/rotate_half, interleaved, or an explicit inv_freq list)")
    else:
        style = "half"
    rot_dim = int(rope.get("rot_dim", round(head_dim * float(rope.get("partial_rotary_factor",
                                                                           1.0)))))
    if rot_dim % 2 or not 0 < rot_dim <= head_dim:
        raise KvsimError(f"RoPE rotary dim {rot_dim} does not fit head dim {head_dim}")
    if "inv_freq" in rope:
        inv = torch.as_tensor(rope["inv_freq"], dtype=torch.float32).flatten()
    else:
        if "theta" not in rope and "rope_theta" not in rope:
            raise KvsimError("trace RoPE settings give neither theta nor inv_freq")
        scaling = rope.get("scaling") or rope.get("rope_scaling")
        if scaling:
            raise KvsimError(f"RoPE scaling {scaling!r} needs an explicit inv_freq in the trace")
        base = float(rope.get("theta", rope.get("rope_theta")))
        inv = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.float) / rot_dim))
    if inv.numel() != rot_dim // 2:
        raise KvsimError(f"RoPE inv_freq has {inv.numel()} entries, expected {rot_dim // 2}")
    return Rope(inv, style, rot_dim, float(rope.get("attention_scaling", 1.0)))


def rotate(x: torch.Tensor, pos: torch.Tensor, rope: Rope, inverse: bool = False) -> torch.Tensor:
    """Apply (or undo, ``inverse``) RoPE to ``x`` (..., n, d) at positions ``pos`` (n,).

    Works in ``x``'s dtype promoted to at least float32; cos/sin in float64 from float32 angles.
    """
    work = torch.promote_types(x.dtype, torch.float32)
    ang = pos.to(torch.float32)[:, None] * rope.inv_freq.to(x.device)[None, :]  # as HF
    cos = (torch.cos(ang.double()) * rope.scaling).to(work)
    sin = (torch.sin(ang.double()) * rope.scaling).to(work)
    if inverse:  # the inverse of [[c, -s], [s, c]] * a is [[c, s], [-s, c]] / a
        cos, sin = cos / rope.scaling ** 2, -sin / rope.scaling ** 2
    x = x.to(work)
    h = rope.rot_dim // 2
    out = x.clone()
    if rope.style == "half":
        x1, x2 = x[..., :h], x[..., h:rope.rot_dim]
        out[..., :h] = x1 * cos - x2 * sin
        out[..., h:rope.rot_dim] = x2 * cos + x1 * sin
    else:
        x1, x2 = x[..., 0:rope.rot_dim:2], x[..., 1:rope.rot_dim:2]
        out[..., 0:rope.rot_dim:2] = x1 * cos - x2 * sin
        out[..., 1:rope.rot_dim:2] = x2 * cos + x1 * sin
    return out
