"""The trace file: the one schema every part of kvsim reads and writes.

A trace is a versioned ``.npz`` holding a JSON ``meta`` string and up to two sections:

* **hardware**: named tables of equal-length numeric columns (``hw/<table>/<column>``), e.g.
  ``link_h2d_pinned`` (bytes, seconds), ``kernel_decode_attn`` (context, batch, seconds), ``nvml``.
  ``meta["hardware"]`` names the device and, per table, its columns, units and provenance.
* **attention**: per captured layer, post-RoPE keys and values per KV head ``(n_kv, n, d)``,
  queries per query head for the question pass ``(n_q, m_q, d)`` and for decode steps
  ``(n_q, m_d, d)``, the positions of all rows, RoPE settings, and optional per-token scorer
  outputs ``(n_kv, n)``. Keys cover every token a query may see: context, question and decoded
  tokens; a query at position p attends to keys at positions <= p.

Loading validates everything and raises :class:`KvsimError` with one line naming the file.
Saving is atomic (temporary file + rename) and refuses to overwrite unless ``force``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvsim.errors import KvsimError
from kvsim.io import atomic_write, check_destination, read_npz

FORMAT = "kvsim-trace"
SCHEMA_VERSION = 1
FLOAT_DTYPES = (np.float16, np.float32, np.float64)
MAX_ABS = 1e4  # post-RoPE keys, values and queries of real models stay within ~1e3


DECIDE_TABLE = "kernel_decide_{}"  # a fetching policy's measured decide step, by policy name
# profiles made before decide tables were kept per policy hold one table, which timed VerKV's
LEGACY_DECIDE_TABLE, LEGACY_DECIDE_KERNEL = "kernel_decide", "verkv"


def decide_tables(tables: dict) -> dict[str, str]:
    """Decide kernel -> the name of its measured table among a hardware section's ``tables``:
    ``kernel_decide_<policy>``, or an older profile's ``kernel_decide`` (VerKV's)."""
    prefix = DECIDE_TABLE.format("")
    out = {name[len(prefix):]: name for name in sorted(tables) if name.startswith(prefix)}
    if LEGACY_DECIDE_TABLE in tables:
        out.setdefault(LEGACY_DECIDE_KERNEL, LEGACY_DECIDE_TABLE)
    return out


@dataclass
class LayerAttention:
    layer: int
    k: np.ndarray  # (n_kv, n, d) post-RoPE keys
    v: np.ndarray  # (n_kv, n, d)
    q_question: np.ndarray  # (n_q, m_q, d) queries of the question pass
    q_decode: np.ndarray  # (n_q, m_d, d) queries of the decode steps
    scores: dict[str, np.ndarray] = field(default_factory=dict)  # scorer -> (n_kv, n)


@dataclass
class Attention:
    layers: list[LayerAttention]
    context_len: int  # tokens of context proper; the question starts here
    question_pos: np.ndarray  # (m_q,) positions of question-pass query rows
    decode_pos: np.ndarray  # (m_d,) positions of decode-step query rows
    rope: dict  # {"theta": float, "type": str, ...}
    provenance: str = ""

    @property
    def n_kv_heads(self) -> int:
        return self.layers[0].k.shape[0]

    @property
    def n_q_heads(self) -> int:
        return self.layers[0].q_question.shape[0]

    @property
    def head_dim(self) -> int:
        return self.layers[0].k.shape[2]

    @property
    def n_tokens(self) -> int:
        return self.layers[0].k.shape[1]


@dataclass
class Hardware:
    device: dict  # identity: name, kind ("cuda"/"cpu"), uuid, driver, ...
    tables: dict[str, dict[str, np.ndarray]]  # table -> column -> 1-D array
    units: dict[str, dict[str, str]] = field(default_factory=dict)
    provenance: str = ""
    missing: list[str] = field(default_factory=list)  # measurements the machine could not give
    extra: dict = field(default_factory=dict)  # fitted parameters and other small facts


@dataclass
class Trace:
    meta: dict
    hardware: Hardware | None = None
    attention: Attention | None = None

    def describe(self) -> str:
        parts = []
        if self.hardware:
            parts.append(f"hardware of {self.hardware.device.get('name', '?')} "
                         f"({len(self.hardware.tables)} tables; {self.hardware.provenance})")
        if self.attention:
            a = self.attention
            parts.append(f"attention of {len(a.layers)} layers x {a.n_tokens} tokens "
                         f"({a.provenance})")
        return "; ".join(parts) or "empty"


# ----------------------------------------------------------------------------------- saving

def save(trace: Trace, path: str | os.PathLike, force: bool = False) -> Path:
    """Validate ``trace`` and write it atomically; refuse to overwrite without ``force``."""
    path = Path(path)
    if path.suffix != ".npz":
        raise KvsimError(f"{path}: a trace file must end in .npz")
    check_destination(path, force)
    arrays, meta = _to_arrays(trace)
    _validate(meta, arrays, str(path))
    arrays["meta"] = np.array(json.dumps(meta, sort_keys=True))
    return atomic_write(path, lambda f: np.savez_compressed(f, **arrays), force)


def new_meta(recorded_by: str, machine: dict | None = None, model: str | None = None,
             context: int | None = None, notes: str = "") -> dict:
    """The top of every trace's meta; sections add their own provenance on save."""
    import datetime
    import platform

    from kvsim import __version__
    return {
        "format": FORMAT,
        "schema_version": SCHEMA_VERSION,
        "recorded_by": recorded_by,
        "kvsim_version": __version__,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine or {"host": platform.node(), "platform": platform.platform()},
        "model": model,
        "context": context,
        "notes": notes,
    }


def _to_arrays(trace: Trace) -> tuple[dict[str, np.ndarray], dict]:
    meta = dict(trace.meta)
    meta["format"], meta["schema_version"] = FORMAT, SCHEMA_VERSION
    arrays: dict[str, np.ndarray] = {}
    meta.pop("hardware", None)
    meta.pop("attention", None)
    if trace.hardware is not None:
        hw = trace.hardware
        meta["hardware"] = {
            "device": hw.device, "provenance": hw.provenance, "missing": hw.missing,
            "extra": hw.extra,
            "tables": {t: {"columns": list(cols), "units": hw.units.get(t, {})}
                       for t, cols in hw.tables.items()},
        }
        for t, cols in hw.tables.items():
            for c, arr in cols.items():
                arrays[f"hw/{t}/{c}"] = np.asarray(arr)
    if trace.attention is not None:
        a = trace.attention
        scorers = sorted(set().union(*(la.scores.keys() for la in a.layers))) if a.layers else []
        meta["attention"] = {
            "layers": [la.layer for la in a.layers], "context_len": int(a.context_len),
            "rope": a.rope, "provenance": a.provenance, "scores": scorers,
        }
        arrays["attn/question_pos"] = np.asarray(a.question_pos)
        arrays["attn/decode_pos"] = np.asarray(a.decode_pos)
        for la in a.layers:
            p = f"attn/L{la.layer}"
            arrays[f"{p}/k"], arrays[f"{p}/v"] = la.k, la.v
            arrays[f"{p}/q_question"], arrays[f"{p}/q_decode"] = la.q_question, la.q_decode
            for s, arr in la.scores.items():
                arrays[f"{p}/score/{s}"] = arr
    return arrays, meta


# ---------------------------------------------------------------------------------- loading

def load(path: str | os.PathLike) -> Trace:
    """Read and validate a trace; every problem is one :class:`KvsimError` line."""
    where = str(path)
    meta, arrays = read_npz(path, "trace", FORMAT)
    if meta.get("schema_version") != SCHEMA_VERSION:
        raise KvsimError(f"{where}: schema version {meta.get('schema_version')!r} is not "
                         f"supported (this kvsim reads version {SCHEMA_VERSION})")
    _validate(meta, arrays, where)
    return _from_arrays(meta, arrays)


def _from_arrays(meta: dict, arrays: dict[str, np.ndarray]) -> Trace:
    hardware = attention = None
    if "hardware" in meta:
        h = meta["hardware"]
        tables = {t: {c: arrays[f"hw/{t}/{c}"] for c in spec["columns"]}
                  for t, spec in h["tables"].items()}
        hardware = Hardware(device=h["device"], tables=tables,
                            units={t: s.get("units", {}) for t, s in h["tables"].items()},
                            provenance=h.get("provenance", ""), missing=h.get("missing", []),
                            extra=h.get("extra", {}))
    if "attention" in meta:
        a = meta["attention"]
        layers = []
        for l in a["layers"]:
            p = f"attn/L{l}"
            scores = {s: arrays[f"{p}/score/{s}"] for s in a["scores"]
                      if f"{p}/score/{s}" in arrays}
            layers.append(LayerAttention(l, arrays[f"{p}/k"], arrays[f"{p}/v"],
                                         arrays[f"{p}/q_question"], arrays[f"{p}/q_decode"],
                                         scores))
        attention = Attention(layers, a["context_len"], arrays["attn/question_pos"],
                              arrays["attn/decode_pos"], a["rope"], a.get("provenance", ""))
    return Trace(meta, hardware, attention)


class _Check:
    """Checks of a trace's arrays, each failing with one line that names the file."""

    def __init__(self, arrays: dict[str, np.ndarray], where: str):
        self.arrays, self.where = arrays, where

    def fail(self, msg: str):
        raise KvsimError(f"{self.where}: {msg}")

    def need(self, key: str, ndim: int, kind: str) -> np.ndarray:
        if key not in self.arrays:
            self.fail(f"missing array {key!r}")
        arr = self.arrays[key]
        if arr.ndim != ndim:
            self.fail(f"{key} has {arr.ndim} dimensions, expected {ndim}")
        if kind == "float" and arr.dtype.type not in FLOAT_DTYPES:
            self.fail(f"{key} has dtype {arr.dtype}, expected float16/32/64")
        if kind == "int" and not np.issubdtype(arr.dtype, np.integer):
            self.fail(f"{key} has dtype {arr.dtype}, expected integers")
        if kind == "number" and not (np.issubdtype(arr.dtype, np.number)
                                     or arr.dtype == np.bool_):
            self.fail(f"{key} has dtype {arr.dtype}, expected numbers")
        if kind in ("float", "number") and np.issubdtype(arr.dtype, np.floating) \
                and not np.isfinite(arr).all():
            self.fail(f"{key} holds NaN or Inf values")
        return arr


def _validate(meta: dict, arrays: dict[str, np.ndarray], where: str) -> None:
    c = _Check(arrays, where)
    if "hardware" not in meta and "attention" not in meta:
        c.fail("the trace has neither a hardware nor an attention section")
    if "hardware" in meta:
        _validate_hardware(meta["hardware"], c)
    if "attention" in meta:
        _validate_attention(meta["attention"], c)


def _validate_hardware(h, c: _Check) -> None:
    if not isinstance(h, dict) or not isinstance(h.get("tables"), dict) \
            or not isinstance(h.get("device"), dict):
        c.fail("meta.hardware must hold 'device' and 'tables'")
    for t, spec in h["tables"].items():
        if not isinstance(spec, dict) or not isinstance(spec.get("columns", []), list):
            c.fail(f"hardware table {t!r}: its spec must be an object with a 'columns' list")
        cols = spec.get("columns") or []
        if not cols:
            c.fail(f"hardware table {t!r} has no columns")
        lengths = {c.need(f"hw/{t}/{col}", 1, "number").shape[0] for col in cols}
        if len(lengths) != 1:
            c.fail(f"hardware table {t!r} has columns of different lengths {sorted(lengths)}")
        if lengths == {0}:
            c.fail(f"hardware table {t!r} is empty")


def _validate_attention(a, c: _Check) -> None:
    fail = c.fail
    if not isinstance(a, dict) or not a.get("layers"):
        fail("meta.attention must list at least one layer")
    for key in ("context_len", "rope", "scores"):
        if key not in a:
            fail(f"meta.attention lacks {key!r}")
    layers = a["layers"]
    if not isinstance(layers, list) or not all(type(l) is int and l >= 0 for l in layers):
        fail(f"meta.attention.layers must be a list of layer numbers, got {layers!r}")
    if len(set(layers)) != len(layers):
        fail(f"meta.attention.layers lists a layer twice: {layers}")
    if type(a["context_len"]) is not int:
        fail(f"context_len must be a whole number of tokens, got {a['context_len']!r}")
    if not isinstance(a["rope"], dict):
        fail(f"meta.attention.rope must be an object (theta, type, ...), got {a['rope']!r}")
    if not isinstance(a["scores"], list) or not all(isinstance(x, str) for x in a["scores"]):
        fail(f"meta.attention.scores must be a list of scorer names, got {a['scores']!r}")
    qpos = c.need("attn/question_pos", 1, "int")
    dpos = c.need("attn/decode_pos", 1, "int")
    shape0 = None
    for l in a["layers"]:
        shape = _validate_layer(f"attn/L{l}", a["scores"], qpos, dpos, c)
        if shape0 is not None and shape != shape0:
            fail(f"attn/L{l}: shapes differ from the first captured layer")
        shape0 = shape
    n = shape0[0][1]
    if not 0 < a["context_len"] <= n:
        fail(f"context_len {a['context_len']} outside 1..{n} tokens")
    for name, pos in (("question_pos", qpos), ("decode_pos", dpos)):
        if pos.size and (pos.min() < 0 or pos.max() >= n):
            fail(f"attn/{name} has positions outside 0..{n - 1}")


def _validate_layer(p: str, scores: list, qpos, dpos, c: _Check) -> tuple:
    """One captured layer's arrays; returns its shape (keys, query heads)."""
    fail = c.fail
    k, v = c.need(f"{p}/k", 3, "float"), c.need(f"{p}/v", 3, "float")
    qq, qd = c.need(f"{p}/q_question", 3, "float"), c.need(f"{p}/q_decode", 3, "float")
    n_kv, n, d = k.shape
    if not (n_kv and n and d):
        fail(f"{p}/k has shape {k.shape}: KV heads, tokens and head dim must be > 0")
    if not qq.shape[0]:
        fail(f"{p}/q_question has no query heads")
    if not (qq.shape[1] or qd.shape[1]):
        fail(f"{p} has no query rows (neither question nor decode)")
    if max(float(np.abs(x).max(initial=0.0)) for x in (k, v, qq, qd)) > MAX_ABS:
        fail(f"{p} holds values beyond {MAX_ABS:g} in magnitude: attention logits would "
             f"overflow")
    if v.shape != k.shape:
        fail(f"{p}/v has shape {v.shape}, keys have {k.shape}")
    for name, q, pos in (("q_question", qq, qpos), ("q_decode", qd, dpos)):
        if q.shape[2] != d:
            fail(f"{p}/{name} has head dim {q.shape[2]}, keys have {d}")
        if q.shape[1] != pos.shape[0]:
            fail(f"{p}/{name} has {q.shape[1]} rows but {pos.shape[0]} positions")
        if q.shape[0] % n_kv:
            fail(f"{p}/{name} has {q.shape[0]} query heads, not a multiple of {n_kv} KV heads")
    if qq.shape[0] != qd.shape[0]:
        fail(f"{p}: question and decode queries differ in head count")
    for s in scores:
        key = f"{p}/score/{s}"
        if key in c.arrays and c.need(key, 2, "float").shape != (n_kv, n):
            fail(f"{key} has shape {c.arrays[key].shape}, expected {(n_kv, n)}")
    return k.shape, qq.shape[0]
