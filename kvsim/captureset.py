"""The capture set file: one long context's attention, viewed as a trace at each of several lengths.

Written by ``kvsim capture --lengths`` (:mod:`kvsim.model.nested`). A ``.npz`` with a JSON
``meta`` (``format: kvsim-captures``) holding, per captured layer, the post-RoPE keys and values
of the longest context for the KV heads kept (``ctx/L<l>/k|v``, (h, n, d) fp16), and per length
and question the part that follows the length's prefix: suffix keys and values, question-pass and
decode-step queries of the kept heads' query heads (``len<j>/q<i>/L<l>/...``), plus the length's
SnapKV scores (``len<j>/L<l>/snapkv``). Each layer has a weight: how many of the model's layers it
stands for in a layer sample (1 each when every layer is kept).

:meth:`CaptureSet.views` gives one ordinary :class:`kvsim.trace.Trace` per (length, question),
validated like any trace file, so every policy runs on it unchanged.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvsim import trace as tr
from kvsim.errors import KvsimError
from kvsim.io import atomic_write, check_destination, read_npz

FORMAT = "kvsim-captures"
VERSION = 1


@dataclass
class Suffix:
    k: np.ndarray  # (h, m_q + steps, d)
    v: np.ndarray
    q_question: np.ndarray  # (h * g, m_q, d)
    q_decode: np.ndarray  # (h * g, steps, d)


@dataclass
class Asked:
    question: str
    answers: list[str]
    answer_prefix: str
    depth: float
    prediction: str
    dense_correct: float
    question_rows: int
    layers: dict[int, Suffix] = field(default_factory=dict)


@dataclass
class Length:
    target: int  # the prompt length asked for
    context_len: int  # context tokens of this length's prefix
    snapkv: dict[int, np.ndarray]  # layer -> (h, context_len)
    asked: list[Asked]


@dataclass
class CaptureSet:
    meta: dict
    layers: list[int]
    heads: dict[int, list[int]]  # layer -> KV heads kept
    weights: dict[int, float]  # layer -> model layers it stands for
    ctx_k: dict[int, np.ndarray]  # layer -> (h, n_max, d)
    ctx_v: dict[int, np.ndarray]
    lengths: list[Length]
    rope: dict
    provenance: str = ""

    @property
    def task(self) -> str:
        return self.meta.get("task", "?")

    def views(self, where: str = "capture set"):
        """(length index, question index, Trace) for every question of every length."""
        for j, ln in enumerate(self.lengths):
            for i, _asked in enumerate(ln.asked):
                yield j, i, self.view(j, i, where)

    def view(self, j: int, i: int, where: str = "capture set") -> tr.Trace:
        ln, a = self.lengths[j], self.lengths[j].asked[i]
        n = ln.context_len
        layers = []
        for l in self.layers:
            s = a.layers[l]
            layers.append(tr.LayerAttention(
                l, np.concatenate([self.ctx_k[l][:, :n], s.k], 1),
                np.concatenate([self.ctx_v[l][:, :n], s.v], 1), s.q_question, s.q_decode,
                {"snapkv": np.concatenate([ln.snapkv[l], np.zeros((s.k.shape[0], s.k.shape[1]),
                                                                  np.float32)], 1)}))
        m_q, steps = a.question_rows, s.q_decode.shape[1]
        attn = tr.Attention(layers, n, np.arange(n, n + m_q), np.arange(n + m_q, n + m_q + steps),
                            self.rope, f"{self.provenance}; length {ln.target}, question {i + 1}")
        meta = tr.new_meta("kvsim capture --lengths", model=self.meta.get("model"),
                           context=n + m_q)
        meta.update({"task": self.task, "answers": a.answers, "prediction": a.prediction,
                     "dense_correct": a.dense_correct, "model_info": self.meta.get("model_info"),
                     "capture_set": {"length": ln.target, "question": i, "depth": a.depth}})
        view = tr.Trace(meta, attention=attn)
        arrays, m = tr._to_arrays(view)
        tr._validate(m, arrays, f"{where} (length {ln.target}, question {i + 1})")
        return view


def save(c: CaptureSet, path: str | os.PathLike, force: bool = False) -> Path:
    path = Path(path)
    if path.suffix != ".npz":
        raise KvsimError(f"{path}: a capture set file must end in .npz")
    check_destination(path, force)
    arrays: dict[str, np.ndarray] = {}
    for l in c.layers:
        arrays[f"ctx/L{l}/k"], arrays[f"ctx/L{l}/v"] = c.ctx_k[l], c.ctx_v[l]
    lengths = []
    for j, ln in enumerate(c.lengths):
        for l in c.layers:
            arrays[f"len{j}/L{l}/snapkv"] = ln.snapkv[l].astype(np.float32)
        asked = []
        for i, a in enumerate(ln.asked):
            for l, s in a.layers.items():
                p = f"len{j}/q{i}/L{l}"
                arrays[f"{p}/k"], arrays[f"{p}/v"] = s.k, s.v
                arrays[f"{p}/q_question"], arrays[f"{p}/q_decode"] = s.q_question, s.q_decode
            asked.append({"question": a.question, "answers": a.answers,
                          "answer_prefix": a.answer_prefix, "depth": a.depth,
                          "prediction": a.prediction, "dense_correct": a.dense_correct,
                          "question_rows": a.question_rows})
        lengths.append({"target": ln.target, "context_len": ln.context_len, "asked": asked})
    meta = dict(c.meta) | tr.new_meta("kvsim capture --lengths", model=c.meta.get("model"),
                                      notes=c.meta.get("notes", "")) | {
        "format": FORMAT, "version": VERSION, "layers": c.layers,
        "heads": {str(l): h for l, h in c.heads.items()},
        "weights": {str(l): w for l, w in c.weights.items()}, "lengths": lengths,
        "rope": c.rope, "provenance": c.provenance}
    arrays["meta"] = np.array(json.dumps(meta, sort_keys=True))
    return atomic_write(path, lambda f: np.savez_compressed(f, **arrays), force)


def load(path: str | os.PathLike) -> CaptureSet:
    where = str(path)
    meta, arrays = read_npz(path, "capture set", FORMAT)

    def fail(msg):
        raise KvsimError(f"{where}: {msg}")

    if meta.get("version") != VERSION:
        fail(f"capture set version {meta.get('version')!r} is not supported (this kvsim reads "
             f"version {VERSION})")
    try:
        layers = [int(l) for l in meta["layers"]]
        heads = {int(l): [int(h) for h in hs] for l, hs in meta["heads"].items()}
        weights = {int(l): float(w) for l, w in meta["weights"].items()}
        if sorted(heads) != sorted(layers) or sorted(weights) != sorted(layers) or \
                len(set(layers)) != len(layers) or not layers:
            fail("layers, heads and weights do not name the same layers")
        if not all(np.isfinite(w) and w > 0 for w in weights.values()):
            fail("layer weights must be finite and positive")
        get = lambda k: arrays[k] if k in arrays else fail(f"missing array {k!r}")  # noqa: E731
        lengths = []
        for j, ln in enumerate(meta["lengths"]):
            asked = []
            for i, a in enumerate(ln["asked"]):
                sfx = {l: Suffix(*(get(f"len{j}/q{i}/L{l}/{x}")
                                   for x in ("k", "v", "q_question", "q_decode")))
                       for l in layers}
                asked.append(Asked(str(a["question"]), list(a["answers"]),
                                   str(a["answer_prefix"]), float(a["depth"]),
                                   str(a["prediction"]), float(a["dense_correct"]),
                                   int(a["question_rows"]), sfx))
            lengths.append(Length(int(ln["target"]), int(ln["context_len"]),
                                  {l: get(f"len{j}/L{l}/snapkv") for l in layers}, asked))
        c = CaptureSet(meta, layers, heads, weights, {l: get(f"ctx/L{l}/k") for l in layers},
                       {l: get(f"ctx/L{l}/v") for l in layers}, lengths, dict(meta["rope"]),
                       str(meta.get("provenance", "")))
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        fail(f"malformed capture set meta ({type(e).__name__}: {e})")
    if not c.lengths or not any(ln.asked for ln in c.lengths):
        fail("the capture set holds no question")
    n_max = next(iter(c.ctx_k.values())).shape[1]
    if any(not 0 < ln.context_len <= n_max for ln in c.lengths):
        fail(f"a length's context is outside 1..{n_max} tokens")
    return c


def kv_heads_for(layer: int, per_layer: int, n_kv: int) -> list[int]:
    """The KV heads a capture keeps of ``layer``: ``per_layer`` of them, rotating with the
    layer so that every head index is sampled across depth."""
    return sorted({(layer + i) % n_kv for i in range(per_layer)})


def subset(c: CaptureSet, layers: list[int], heads_per_layer: int,
           weights: dict[int, float]) -> CaptureSet:
    """A layer (and KV head) sample of ``c``, as a capture with those settings would record it."""
    n_kv = int(c.meta["model_info"]["kv_heads"])
    g = int(c.meta["model_info"]["q_heads"]) // n_kv
    missing = [l for l in layers if l not in c.layers]
    if missing:
        raise KvsimError(f"layers {missing} are not in the capture set")
    pick, rows = {}, {}
    for l in layers:
        want = kv_heads_for(l, heads_per_layer, n_kv)
        if not set(want) <= set(c.heads[l]):
            raise KvsimError(f"layer {l}: heads {want} are not all in the capture set")
        pick[l] = [c.heads[l].index(h) for h in want]
        rows[l] = [p * g + i for p in pick[l] for i in range(g)]
    lengths = [Length(ln.target, ln.context_len, {l: ln.snapkv[l][pick[l]] for l in layers},
                      [Asked(a.question, a.answers, a.answer_prefix, a.depth, a.prediction,
                             a.dense_correct, a.question_rows,
                             {l: Suffix(a.layers[l].k[pick[l]], a.layers[l].v[pick[l]],
                                        a.layers[l].q_question[rows[l]],
                                        a.layers[l].q_decode[rows[l]]) for l in layers})
                       for a in ln.asked]) for ln in c.lengths]
    prov = c.provenance.replace(f"{len(c.layers)} of", f"{len(layers)} of", 1)
    prov = prov.replace(f"{len(c.heads[c.layers[0]])} of {n_kv} KV heads",
                        f"{heads_per_layer} of {n_kv} KV heads", 1)
    return CaptureSet(dict(c.meta), list(layers),
                      {l: [c.heads[l][p] for p in pick[l]] for l in layers},
                      {l: float(weights.get(l, 1.0)) for l in layers},
                      {l: c.ctx_k[l][pick[l]] for l in layers},
                      {l: c.ctx_v[l][pick[l]] for l in layers}, lengths, c.rope,
                      prov + f"; layer weights {weights}")
