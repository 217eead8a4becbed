"""VarRate calibration: per-layer residual bases from unlabeled calibration traces.

The paper calibrates each layer's basis once, offline, on six unlabeled contexts of the real model
and reuses it for every sequence (it is not charged to the per-sequence budget). Here the contexts
are captured traces (``kvsim capture``): for every layer the context's keys are un-rotated, the
exact set and the anchor residuals are formed exactly as the codec does, and the residuals' Gram
matrices are summed over the traces; the basis is its top-R eigenvectors (= right singular vectors
of the stacked residuals).

A basis file is a ``.npz`` with a JSON ``meta`` (format, traces, layers, D, R, RoPE, codec settings)
and per layer ``L<l>/basis`` (R, D) float32 and ``L<l>/sv`` (R,) singular values. Written
atomically; never overwritten without ``force``.
"""

from __future__ import annotations

import datetime
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvsim._torch import torch
from kvsim.attention import rope as rp
from kvsim.errors import KvsimError
from kvsim.io import atomic_write, check_destination, read_npz
from kvsim.policies.varrate import codec as vc
from kvsim.trace import Trace
from kvsim.trace import load as load_trace

FORMAT = "kvsim-varrate-basis"
VERSION = 1


@dataclass
class Basis:
    meta: dict
    layers: dict[int, torch.Tensor]  # layer -> (R, D) float32, orthonormal rows
    sv: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> (R,) singular values
    path: str = ""

    @property
    def rank(self) -> int:
        return int(self.meta["R"])

    def check(self, trace: Trace, rope: rp.Rope) -> None:
        """One-line errors when this basis cannot code ``trace``'s layers."""
        a = trace.attention
        where = self.path or "basis"
        dim = 2 * a.n_kv_heads * a.head_dim
        if dim != self.meta["D"]:
            raise KvsimError(f"{where}: basis is for D={self.meta['D']} (2 x KV heads x head dim), "
                             f"the trace has D={dim} ({a.n_kv_heads} KV heads x {a.head_dim})")
        missing = sorted({la.layer for la in a.layers} - set(self.layers))
        if missing:
            raise KvsimError(f"{where}: no basis for trace layer(s) {missing}; it holds layers "
                             f"{sorted(self.layers)}")
        ref = self.meta.get("rope_key") or {}
        key = rope.key()
        if ref and (ref.get("style") != key["style"] or ref.get("rot_dim") != key["rot_dim"]
                    or abs(ref.get("inv_freq_sum", 0) - key["inv_freq_sum"])
                    > 1e-6 * max(1.0, abs(key["inv_freq_sum"]))):
            raise KvsimError(f"{where}: basis was calibrated with RoPE {self.meta.get('rope')}, "
                             f"the trace uses {a.rope}")


def _layer_tensors(la, ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.from_numpy(np.ascontiguousarray(la.k[:, :ctx])).float(),
            torch.from_numpy(np.ascontiguousarray(la.v[:, :ctx])).float())


def calibrate(paths: list[str], rank: int | None = None, stride: int = 16, c: int = 4,
              window: int = 64, layers: list[int] | None = None) -> Basis:
    """Per-layer bases from the contexts of the traces at ``paths`` (all their common layers,
    or ``layers``). ``rank`` defaults to D (every direction, ordered)."""
    if not paths:
        raise KvsimError("calibration needs at least one trace")
    grams: dict[int, torch.Tensor] = {}
    rows: dict[int, int] = {}
    first = None
    sources = []
    for p in paths:
        tr = load_trace(p)
        a = tr.attention
        if a is None:
            raise KvsimError(f"{p}: the trace has no attention section to calibrate on")
        rope = rp.rope_from_meta(a.rope, a.head_dim)
        shape = (a.n_kv_heads, a.head_dim, rope.key())
        if first is None:
            first = (shape, a.rope, tr.meta.get("model"))
        elif shape != first[0]:
            raise KvsimError(f"{p}: KV heads/head dim/RoPE differ from {paths[0]} "
                             f"({shape[:2]} vs {first[0][:2]})")
        have = {la.layer for la in a.layers}
        want = set(layers) if layers is not None else have
        if layers is not None and want - have:
            raise KvsimError(f"{p}: lacks layer(s) {sorted(want - have)}")
        for la in a.layers:
            if la.layer not in want:
                continue
            k, v = _layer_tensors(la, a.context_len)
            prep = vc.prepare(k, v, rope, stride, c, window)
            r = prep.resid.double()
            grams[la.layer] = grams.get(la.layer, 0) + r.T @ r
            rows[la.layer] = rows.get(la.layer, 0) + r.shape[0]
        sources.append({"path": str(p), "model": tr.meta.get("model"),
                        "context_len": int(a.context_len), "layers": sorted(have & want),
                        "created": tr.meta.get("created")})
    common = set.intersection(*(set(s["layers"]) for s in sources))
    if not common:
        raise KvsimError("the calibration traces share no captured layer")
    (g, d, rkey), rope_meta, model = first
    dim = 2 * g * d
    rank = dim if rank is None else rank
    if not 0 < rank <= dim:
        raise KvsimError(f"--rank {rank} outside 1..D={dim}")
    bases, svs = {}, {}
    for l in sorted(common):
        b, sv = vc.basis_from_gram(grams[l], rank)
        bases[l], svs[l] = b.float(), sv.float()
    meta = {
        "format": FORMAT, "version": VERSION, "model": model, "traces": sources,
        "layers": sorted(common), "D": dim, "R": rank, "n_kv_heads": g, "head_dim": d,
        "rope": rope_meta, "rope_key": rkey,
        "codec": {"stride": stride, "anchors_c": c, "window": window},
        "residual_rows": {str(l): rows[l] for l in sorted(common)},
        "residual_energy": {str(l): float(torch.trace(grams[l])) for l in sorted(common)},
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    return Basis(meta, bases, svs)


def save(basis: Basis, path: str | os.PathLike, force: bool = False) -> Path:
    path = Path(path)
    if path.suffix != ".npz":
        raise KvsimError(f"{path}: a basis file must end in .npz")
    check_destination(path, force)
    arrays = {"meta": np.array(json.dumps(basis.meta, sort_keys=True))}
    for l, b in basis.layers.items():
        arrays[f"L{l}/basis"] = b.numpy().astype(np.float32)
        if l in basis.sv:
            arrays[f"L{l}/sv"] = basis.sv[l].numpy().astype(np.float32)
    return atomic_write(path, lambda f: np.savez(f, **arrays), force)


def load(path: str | os.PathLike) -> Basis:
    where = str(path)
    meta, arrays = read_npz(path, "VarRate basis (from kvsim calibrate)", FORMAT)
    if meta.get("version") != VERSION:
        raise KvsimError(f"{where}: basis version {meta.get('version')!r} is not supported "
                         f"(this kvsim reads {VERSION})")
    R, D, ls = meta.get("R"), meta.get("D"), meta.get("layers")
    if type(R) is not int or type(D) is not int or not 0 < R <= D or not isinstance(ls, list) \
            or not all(type(l) is int and l >= 0 for l in ls) or len(set(ls)) != len(ls):
        raise KvsimError(f"{where}: meta needs whole numbers 0 < R <= D and distinct layer "
                         f"numbers (got R={R!r}, D={D!r}, layers={ls!r})")
    layers, svs = {}, {}
    for l in ls:
        key = f"L{l}/basis"
        if key not in arrays:
            raise KvsimError(f"{where}: missing array {key!r}")
        b = arrays[key]
        if not np.issubdtype(b.dtype, np.floating):
            raise KvsimError(f"{where}: {key} has dtype {b.dtype}, expected real floats")
        if b.ndim != 2 or b.shape != (R, D) or not np.isfinite(b).all():
            raise KvsimError(f"{where}: {key} has shape {b.shape}, expected "
                             f"({R}, {D}) finite values")
        if not (np.abs(b).sum(axis=1) > 0).all():
            raise KvsimError(f"{where}: {key} has all-zero basis rows (not a basis)")
        layers[int(l)] = torch.from_numpy(b.astype(np.float32))
        if f"L{l}/sv" in arrays:
            svs[int(l)] = torch.from_numpy(arrays[f"L{l}/sv"].astype(np.float32))
    if not layers:
        raise KvsimError(f"{where}: the basis file holds no layer")
    return Basis(meta, layers, svs, where)
