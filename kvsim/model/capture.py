"""Capture a trace of real attention: one task prompt through the model, stock (dense) attention.

Recorded per chosen layer: post-RoPE keys and values of every token (context, question, decoded),
the question-pass and decode-step queries per query head, and per-token scorer outputs computed
with the model: "snapkv" (observation window = the last context rows) and "kvzip" (max attention
from a reconstruction pass that re-feeds the context after a repeat instruction, over the query
heads of each KV head). Scores cover the context; entries past ``context_len`` are zero.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from kvsim import trace as tr
from kvsim.errors import KvsimError
from kvsim.model.hooks import Controller
from kvsim.model.runner import (
    KVZIP_CHUNK,
    KVZIP_PROMPT,
    SNAPKV_WINDOW,
    cache_kv,
    generate,
    prefill,
    truncate,
)
from kvsim.model.tasks import Prompt, score


def parse_layers(text: str | None, total: int) -> list[int]:
    if not text or text == "all":
        return list(range(total))
    try:
        given = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise KvsimError(f"--layers {text!r}: give layer numbers separated by commas") from None
    from kvsim.checks import distinct
    layers = sorted(distinct(given, "--layers"))
    bad = [l for l in layers if not 0 <= l < total]
    if bad or not layers:
        raise KvsimError(f"--layers {text!r}: the model has layers 0..{total - 1}")
    return layers


@torch.no_grad()
def capture(lm, prompt: Prompt, layers: list[int], decode_steps: int = 8,
            progress: bool = True, notes: str = "") -> tr.Trace:
    """Run ``prompt`` through ``lm`` and return its attention trace (fp16 tensors)."""
    from tqdm import tqdm
    if decode_steps < 0:
        raise KvsimError("--decode-steps must be >= 0")
    model, codec = lm.model, lm.codec
    bar = tqdm(total=4, desc="capture", disable=None if progress else True, unit="stage")
    t0 = time.perf_counter()
    ctx_ids, q_ids = codec.layout(prompt.context, prompt.question, prompt.answer_prefix)
    n_ctx = len(ctx_ids)
    bar.set_postfix_str("prefill, SnapKV, KVzip")
    kv_ids = codec.encode(KVZIP_PROMPT + prompt.context)
    pre = prefill(model, ctx_ids, kvzip_ids=kv_ids)
    bar.update(2)
    bar.set_postfix_str("question + decode")
    ctl = Controller(mode="stock", record_layers=set(layers))
    gen = generate(model, codec, pre, q_ids, decode_steps + 1, stop=False, crop=False,
                   controller=ctl)
    bar.update(1)
    m_q = len(q_ids)
    n_tot = n_ctx + m_q + decode_steps
    out_layers = []
    for l in layers:
        k, v = cache_kv(pre.cache, l)
        if k.shape[1] != n_tot:
            raise RuntimeError(f"layer {l}: cache holds {k.shape[1]} tokens, expected {n_tot}")
        qs = torch.cat(ctl.queries[l], dim=1)  # (n_q, m_q + decode_steps, d)
        scores = {}
        for name, s in (("snapkv", pre.scores[l]["snapkv"]), ("kvzip", pre.scores[l]["kvzip"])):
            full = torch.zeros(s.shape[0], n_tot, dtype=torch.float32)
            full[:, :n_ctx] = s.float()
            scores[name] = full.numpy()
        out_layers.append(tr.LayerAttention(
            l, _f16(k), _f16(v), _f16(qs[:, :m_q]), _f16(qs[:, m_q:]), scores))
    truncate(pre.cache, n_ctx)
    bar.update(1)
    bar.close()
    info = lm.info
    correct = score(gen.text.strip().split("\n")[0], prompt.answers, prompt.match)
    prov = (f"captured by kvsim capture from {lm.description}, stock attention via "
            f"transformers.AttentionInterface; {len(layers)} of {info['layers']} layers; "
            f"K/V post-RoPE fp16; queries pre-scaled to the 1/sqrt(d) convention")
    meta = tr.new_meta("kvsim capture", model=lm.description, context=n_ctx + m_q, notes=notes)
    meta.update({
        "task": prompt.task, "prompt_id": prompt.id, "answers": prompt.answers,
        "answer_prefix": prompt.answer_prefix, "prediction": gen.text,
        "dense_correct": correct, "model_info": info, "layers_captured": layers,
        "decode_steps": decode_steps, "question_rows": m_q,
        "how": {"snapkv": f"softmax attention of the last {SNAPKV_WINDOW} context rows "
                          f"(kvsim.attention.scoring.snapkv_scores), per KV head",
                "kvzip": f"context re-fed after {KVZIP_PROMPT.strip()!r} in chunks of "
                         f"{KVZIP_CHUNK}; score = max softmax attention a context token gets "
                         f"from the reconstruction rows, max over the KV head's query heads",
                "scores_past_context": "zero (scores describe context tokens only)",
                "decode": "greedy with dense attention; decode_pos are the rows of the "
                          "decode steps (the tokens fed back)"},
        "seconds": round(time.perf_counter() - t0, 1),
    })
    attn = tr.Attention(out_layers, n_ctx, np.arange(n_ctx, n_ctx + m_q),
                        np.arange(n_ctx + m_q, n_tot), dict(info["rope"]), prov)
    return tr.Trace(meta, attention=attn)


def _f16(x: torch.Tensor) -> np.ndarray:
    return x.detach().to(torch.float16).cpu().numpy()
