"""A synthetic attention trace with the structure VerKV cares about, for tests and demos.

Not a model: keys are heavy-tailed Gaussian rows whose energy sits mostly in a few RoPE channel
pairs (as in real post-RoPE keys, so a quarter-channel sketch sees most of a logit); a few
"needle" keys per KV head point along a direction the question and decode queries share (spiky
attention a sampler can miss); token 0 is an attention sink; the last tokens get a mild recency
boost. A ``kvzip`` score entry stands in for KVzip's reconstruction scores: the maximum, over
the query heads of a KV head and over a set of independent "reconstruction" queries drawn like
the real ones, of the softmax attention each token receives. ``meta`` says all of this.
"""

from __future__ import annotations

import numpy as np

from kvsim import trace as T


def _softmax_rows(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    e = np.exp(x)
    return e / e.sum(axis=-1, keepdims=True)


def synthetic_attention_trace(n_layers: int = 2, n_q: int = 8, n_kv: int = 2, d: int = 64,
                              context: int = 2048, question: int = 16, decode: int = 8,
                              seed: int = 0, kvzip: bool = True) -> T.Trace:
    """A :class:`kvsim.trace.Trace` with an attention section only (float16 tensors); without
    ``kvzip`` the layers carry no score (its reconstruction attention is most of the work and
    of the memory at long contexts; the draws before it are the same)."""
    if n_q % n_kv or d % 2 or min(n_layers, n_q, n_kv, context, question) < 1 or decode < 0:
        raise ValueError("synthetic trace: need n_q a multiple of n_kv, even d, positive sizes")
    rng = np.random.default_rng(seed)
    n = context + question + decode
    g = n_q // n_kv
    half = d // 2
    # per-pair channel scale: a few pairs carry most of the energy (like low-frequency RoPE pairs)
    pair_scale = 0.35 + 1.6 * np.exp(-np.arange(half) / (half / 6.0))
    layers = []
    for li in range(n_layers):
        perm = rng.permutation(half)
        cs = np.concatenate([pair_scale[perm], pair_scale[perm]])  # layer-specific channel order
        # heavy-tailed background keys: Gaussian rows times a log-normal norm per token
        norms = rng.lognormal(mean=0.0, sigma=0.4, size=(n_kv, n, 1))
        k = rng.standard_normal((n_kv, n, d)) * cs * norms
        v = rng.standard_normal((n_kv, n, d))
        # the sink (token 0) and the needles align with per-KV-head directions the queries share
        sink_dir = rng.standard_normal((n_kv, d)) * cs
        sink_dir /= np.linalg.norm(sink_dir, axis=-1, keepdims=True)
        needle_dir = rng.standard_normal((n_kv, d)) * cs
        needle_dir /= np.linalg.norm(needle_dir, axis=-1, keepdims=True)
        n_needles = max(2, context // 256)
        for h in range(n_kv):
            k[h, 0] += 20.0 * sink_dir[h]
            pos = rng.choice(np.arange(1, context - 1), size=n_needles, replace=False)
            k[h, pos] += rng.uniform(6.0, 11.0, size=(n_needles, 1)) * needle_dir[h]
            v[h, pos] += 2.0 * rng.standard_normal((n_needles, d))
        recent = np.clip(1.0 - (context - 1 - np.arange(n)) / 64.0, 0.0, 1.0)  # last 64 tokens
        k += 2.0 * recent[None, :, None] * sink_dir[:, None, :]

        def queries(m):
            q = rng.standard_normal((n_q, m, d)) * cs[None, None, :] * 1.8
            kv_of = np.arange(n_q) // g
            q += rng.uniform(0.8, 1.6, size=(n_q, m, 1)) * 4.0 * needle_dir[kv_of][:, None, :]
            q += 3.0 * sink_dir[kv_of][:, None, :]
            return q

        qq, qd = queries(question), queries(decode)
        # kvzip stand-in: max attention over 32 reconstruction queries and the group's heads
        rec = queries(32)
        scores = {}
        if kvzip:
            logit = np.einsum("hmd,hnd->hmn", rec, np.repeat(k[:, :context], g, axis=0)) \
                / np.sqrt(d)
            ctx_scores = _softmax_rows(logit).max(axis=1).reshape(n_kv, g, context).max(axis=1)
            scores["kvzip"] = np.concatenate([ctx_scores, np.ones((n_kv, n - context))],
                                             axis=1).astype(np.float32)
        f16 = lambda x: x.astype(np.float16)  # noqa: E731
        layers.append(T.LayerAttention(li, f16(k), f16(v), f16(qq), f16(qd), scores))
    attention = T.Attention(layers, context, np.arange(context, context + question),
                            np.arange(context + question, n), {"theta": 10000.0, "type": "default"},
                            f"synthetic attention (kvsim.model.synthetic, seed {seed})")
    meta = T.new_meta("kvsim.model.synthetic", model="synthetic", context=context,
                      notes=("synthetic attention, not a model: heavy-tailed keys with energy in "
                             "a few RoPE pairs, an attention sink, needle keys the queries align "
                             "with; 'kvzip' scores are a reconstruction-attention stand-in"))
    meta["synthetic"] = True
    return T.Trace(meta, None, attention)


def synthetic_capture_set(lengths=(256, 512, 1024), questions: int = 3, tasks: int = 1,
                          n_layers: int = 2, seed: int = 0, task: str = "synthetic"):
    """A :class:`kvsim.captureset.CaptureSet` cut from synthetic traces (one per question, at the
    longest length): each length keeps a prefix of the context and the question's own question
    and decode rows. For tests of the capture-set and policy-profile code; not a model."""
    from kvsim import captureset as cs
    n_max = max(lengths)
    base = synthetic_attention_trace(n_layers=n_layers, n_q=4, n_kv=2, d=32, context=n_max,
                                     question=8, decode=3, seed=seed, kvzip=False)
    a = base.attention
    layers = [la.layer for la in a.layers]
    qtraces = [synthetic_attention_trace(n_layers=n_layers, n_q=4, n_kv=2, d=32, context=n_max,
                                         question=8, decode=3, seed=seed * 1000 + i + 1,
                                         kvzip=False).attention for i in range(questions)]
    out_lengths = []
    for n in lengths:
        asked = []
        for i, qa in enumerate(qtraces):
            sfx = {la.layer: cs.Suffix(qla.k[:, n_max:], qla.v[:, n_max:], qla.q_question,
                                       qla.q_decode) for la, qla in zip(a.layers, qa.layers)}
            asked.append(cs.Asked(f"q{i}", ["x"], "", (i + 1) / (questions + 1), "x", 1.0,
                                  qa.layers[0].q_question.shape[1], sfx))
        snap = {la.layer: np.abs(la.k[:, :n, 0]).astype(np.float32) for la in a.layers}
        out_lengths.append(cs.Length(n + 32, n, snap, asked))
    return cs.CaptureSet(
        meta={"task": task, "model": "synthetic", "seed": seed, "decode_steps": 3,
              "model_info": {"kv_heads": 2, "q_heads": 4, "layers": n_layers, "head_dim": 32}},
        layers=layers, heads={l: [0, 1] for l in layers}, weights={l: 1.0 for l in layers},
        ctx_k={la.layer: la.k[:, :n_max] for la in a.layers},
        ctx_v={la.layer: la.v[:, :n_max] for la in a.layers}, lengths=out_lengths,
        rope=dict(a.rope), provenance="synthetic capture set (tests)")
