"""Replaying a policy on a trace's attention tensors, plus the options and budget rules the
attention-path policies (topk, poissoncomp, verkv, ...) share.

:func:`measure` is generic: for each captured layer it calls ``policy.compress`` on the context,
``policy.attend`` once for the question pass (all question rows, one forward pass) and once per
decode step (one row each), compares every output with float64 dense attention, and aggregates
the per-decision statistics ``attend`` returns. Conventions for those statistics (all tensors of
shape (n_q, m); a key a policy does not return means "not applicable"; a policy that returns no
traffic keys fetches nothing):

``log_denominator``  log of the policy's estimate of the softmax denominator (same scale as
                     dense: logsumexp of the unshifted logits); gives the denominator error
``fetch``            the decision asked for tokens from host memory (bool; VerKV: k* > 0)
``fetched_tokens``   context tokens it asked for that were not resident (its own share, before
                     the GQA union); ``tokens_per_fetch_frac`` is their mean over the decisions
                     that fetch, as a share of the context
``kvhead_fetch``     its KV head fetched anything at this row, after the GQA union (bool,
                     the same value for every query head of the group)
``kv_read_frac``     bytes its KV head read from host memory in this forward pass, as a share of
                     that head's full context cache (pass-level, repeated on every row)
``eps_hat_before``, ``eps_hat_after``, ``shortlist_size``, ... anything else: reported as means

Headline keys: traffic (``decisions_fetch_frac``, ``kvhead_steps_fetch_frac``,
``tokens_per_fetch_frac``, ``kv_read_frac``) over decode steps, which the simulator charges per
step (the question pass is reported with a ``question_`` prefix); quality
(``violation_rate``, ``output_rel_err_mean``, ``denominator_rel_err_mean``, ``eps_hat_mean``)
over all decisions (question rows and decode steps), with ``question_`` / ``decode_`` splits.

Bytes assume a 16-bit KV cache (2 bytes per element), whatever the trace's dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from kvsim.errors import KvsimError
from kvsim.kernels.attention import dense_attention
from kvsim.kernels.scoring import attention_mass
from kvsim.policies.base import DecodeCost
from kvsim.trace import Trace

OBS_WINDOW = 64
KV_ELEM_BYTES = 2
SCORERS = ("snapkv", "kvzip", "oracle")

# ---------------------------------------------------------------------- shared options
# Same name => same type, default and meaning in every policy that takes it.


def compression_field():
    return field(default=16.0, metadata={
        "help": "GPU budget as a fraction of the full cache: 1/compression (8, 16, 32 = 8x..32x)"})


def eps_field(note: str = ""):
    return field(default=0.05, metadata={
        "help": "tolerance eps on the relative error of the attention denominator" + note})


def delta_field():
    return field(default=0.1, metadata={
        "help": "failure probability delta of the Bernstein certificate, in (0, 1)"})


def scorer_field():
    return field(default="snapkv", metadata={
        "help": "token scores: snapkv (last 64 question queries, pooled), kvzip (the trace's "
                "scores), oracle (the future attention: an upper bound)", "choices": list(SCORERS)})


def sink_field():
    return field(default=64, metadata={"help": "first tokens always kept (attention sinks)"})


def local_field():
    return field(default=64, metadata={"help": "last context tokens always kept"})


def analyze_no_fetch(policy, trace: Trace | None, seed: int):
    """``analyze`` of a policy that keeps a share of the cache in HBM and never fetches."""
    require_attention(trace, policy.name)
    stats = measure(policy, trace, seed)
    res = stats["resident_frac"]
    cost = DecodeCost(resident_frac=res, hbm_read_frac=res, host_read_frac=0.0, host_frac=0.0,
                      overlap=False, copies_per_layer=0.0)
    return policy.result(cost, stats, provenance(trace, policy.name, seed))


@dataclass
class NoFetchParams:
    """Options of the policies that never fetch from host memory (top-k eviction, PoissonComp)."""
    compression: float = compression_field()
    eps: float = eps_field(" (only reported: the share of decisions whose true error exceeds "
                           "it; these policies never fetch)")
    scorer: str = scorer_field()
    sink: int = sink_field()
    local: int = local_field()

    def validate(self) -> None:
        check_common(self)


def check_common(p) -> None:
    """Validate the shared options a Params instance has; one clear KvsimError line."""
    if hasattr(p, "compression") and not (isinstance(p.compression, (int, float))
                                          and math.isfinite(p.compression) and p.compression >= 1):
        raise KvsimError(f"--compression must be >= 1 (the budget is 1/compression of the "
                         f"cache); got {p.compression}")
    if hasattr(p, "eps") and not (math.isfinite(p.eps) and p.eps > 0):
        raise KvsimError(f"--eps must be > 0; got {p.eps}")
    if hasattr(p, "delta") and not (0 < p.delta < 1):
        raise KvsimError(f"--delta must lie strictly between 0 and 1; got {p.delta}")
    for name in ("sink", "local"):
        if hasattr(p, name) and (int(getattr(p, name)) != getattr(p, name)
                                 or getattr(p, name) < 0):
            raise KvsimError(f"--{name} must be a whole number >= 0; got {getattr(p, name)}")
    if hasattr(p, "scorer") and p.scorer not in SCORERS:
        raise KvsimError(f"--scorer must be one of {', '.join(SCORERS)}; got {p.scorer!r}")


def check_budget(policy: str, n_ctx: int, compression: float, sink: int, local: int,
                 sketch_tokens: float = 0.0, need_sample: bool = True) -> float:
    """Token budget per KV head (``n_ctx / compression``) after sink, local and sketch; raises a
    one-line KvsimError naming sink/local sizes that fit when they do not."""
    budget = n_ctx / compression
    left = budget - sink - local - sketch_tokens
    if sink + local > n_ctx or left < (1.0 if need_sample else 0.0):
        room = budget - sketch_tokens - (1.0 if need_sample else 0.0)
        sk = f" + sketch {sketch_tokens:.1f}" if sketch_tokens else ""
        if room < 0:
            hint = "no sink/local sizes fit; lower --compression"
        else:
            half = max(0, int((budget - sketch_tokens) // 4))
            most = int(room // 2)
            hint = (f"--sink {half} --local {half} would leave half of it to the sample; "
                    f"at most {most} + {most} fit") if need_sample else \
                f"at most --sink {most} --local {most} fit"
        raise KvsimError(f"policy {policy} at {compression:g}x of a {n_ctx}-token context has "
                         f"a budget of {budget:.1f} tokens per KV head, not enough for sink "
                         f"{sink} + local {local}{sk}"
                         f"{' and a sample' if need_sample else ''}: {hint}")
    return left


def context_scores(scores: dict[str, torch.Tensor], scorer: str, k: torch.Tensor,
                   obs_q: torch.Tensor, obs_pos: torch.Tensor) -> torch.Tensor:
    """The (n_kv, n_ctx) scores of ``scorer`` for a layer's context."""
    from kvsim.kernels.scoring import snapkv_scores
    if scorer == "snapkv":  # from the question window; a captured "snapkv" score otherwise
        if obs_q.shape[1]:
            return snapkv_scores(k, obs_q, obs_pos)
        if "snapkv" in scores:
            return scores["snapkv"].to(k.dtype)
        raise KvsimError("scorer snapkv needs question rows in the trace (the observation "
                         "window) or captured 'snapkv' scores; use --scorer kvzip or oracle")
    if scorer not in scores:
        have = ", ".join(sorted(scores)) or "none"
        raise KvsimError(f"the trace has no {scorer!r} scores (it has: {have}); "
                         f"use --scorer snapkv")
    return scores[scorer].to(k.dtype)


def provenance(trace: Trace, policy: str, seed: int) -> str:
    meta = trace.meta
    a = trace.attention
    if meta.get("synthetic"):
        source = "a synthetic attention trace (not a model)"
    else:
        source = f"the attention of model {meta.get('model') or '(unnamed)'}"
    return (f"measured by policy {policy} (seed {seed}) on {source} at "
            f"{a.context_len} context tokens, {len(a.layers)} captured layers, "
            f"{len(a.decode_pos)} decode steps; trace recorded by {meta.get('recorded_by', '?')}")


def require_attention(trace: Trace | None, policy: str) -> None:
    if trace is None or trace.attention is None:
        raise KvsimError(f"policy {policy} needs a trace with an attention section "
                         f"(kvsim capture)")


# ------------------------------------------------------------------------------ replay

def _layer_seed(seed: int, layer: int) -> int:
    return (seed * 1_000_003 + layer * 7_919 + 12_345) % (2**63 - 1)


def measure(policy, trace: Trace, seed: int = 0, dtype: torch.dtype = torch.float64,
            device: str | torch.device = "cpu") -> dict:
    """Replay ``policy`` on every captured layer of ``trace``; run-level statistics (JSON-able).

    The observation window for compress is the last ``OBS_WINDOW`` question rows; an ``oracle``
    score (attention mass of every question and decode row over the context) is added to the
    scores unless the trace has one. Compress gets its own seeded generator per layer.
    """
    require_attention(trace, policy.name)
    a = trace.attention
    policy.bind(a.rope, a.head_dim)
    n_ctx = int(a.context_len)
    qpos = torch.as_tensor(a.question_pos, dtype=torch.long, device=device)
    dpos = torch.as_tensor(a.decode_pos, dtype=torch.long, device=device)
    parts = {"question": [], "decode": []}
    held_tokens, held_bytes, full_bytes = [], [], []
    for la in a.layers:
        t = lambda x: torch.as_tensor(x, device=device).to(dtype)  # noqa: E731
        k, v, qq, qd = t(la.k), t(la.v), t(la.q_question), t(la.q_decode)
        n_kv, _, d = k.shape
        scores = {name: t(s)[:, :n_ctx] for name, s in la.scores.items()}
        if "oracle" not in scores:
            rows, pos = torch.cat([qq, qd], 1), torch.cat([qpos, dpos])
            if rows.shape[1]:
                scores["oracle"] = attention_mass(k[:, :n_ctx], rows, pos)
        w = min(OBS_WINDOW, qq.shape[1])
        gen = torch.Generator().manual_seed(_layer_seed(seed, int(la.layer)))
        state = policy.compress(k[:, :n_ctx], v[:, :n_ctx], scores, qq[:, qq.shape[1] - w:],
                                qpos[qpos.shape[0] - w:], gen, layer=int(la.layer))
        if getattr(state, "held_tokens", None) is not None:
            held_tokens.append(float(state.held_tokens))
            held_bytes.append(float(state.held_bytes))
        full_bytes.append(n_ctx * 2 * d * KV_ELEM_BYTES)
        passes = [("question", qq, qpos)] if qq.shape[1] else []
        passes += [("decode", qd[:, j:j + 1], dpos[j:j + 1]) for j in range(qd.shape[1])]
        for kind, q, pos in passes:
            out, st = policy.attend(state, q, pos, k, v)
            ref, ref_logd = dense_attention(q.to(torch.float64), k.to(torch.float64),
                                            v.to(torch.float64), pos)
            rec = {name: val.detach().to(torch.float64).reshape(-1).cpu()
                   for name, val in st.items() if name != "log_denominator"}
            err = (out.to(torch.float64) - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-300)
            rec["output_rel_err"] = err.reshape(-1).cpu()
            if "log_denominator" in st:
                den = (st["log_denominator"].to(torch.float64) - ref_logd).exp() - 1
                rec["denominator_rel_err"] = den.abs().reshape(-1).cpu()
            parts[kind].append(rec)
    stats = _aggregate(parts, n_ctx, getattr(policy.params, "eps", None))
    stats.update({"context_tokens": n_ctx, "layers": len(a.layers),
                  "decisions": int(sum(r["output_rel_err"].numel()
                                       for p in parts.values() for r in p))})
    if held_tokens:
        stats["held_tokens"] = sum(held_tokens) / len(held_tokens)
        stats["held_bytes"] = sum(held_bytes) / len(held_bytes)
        stats["resident_frac"] = min(1.0, sum(hb / fb for hb, fb in zip(held_bytes, full_bytes))
                                     / len(held_bytes))
    return stats


def _cat(recs: list[dict], key: str) -> torch.Tensor | None:
    vals = [r[key] for r in recs if key in r]
    return torch.cat(vals) if vals else None


def _summary(recs: list[dict], n_ctx: int, eps: float | None) -> dict:
    out: dict[str, float] = {}
    if not recs:
        return out
    keys = sorted(set().union(*(r.keys() for r in recs)))
    fetch = _cat(recs, "fetch")
    fetched = _cat(recs, "fetched_tokens")
    out["decisions_fetch_frac"] = float(fetch.mean()) if fetch is not None else 0.0
    kvf = _cat(recs, "kvhead_fetch")
    out["kvhead_steps_fetch_frac"] = float(kvf.mean()) if kvf is not None else 0.0
    if fetch is not None and fetched is not None and bool((fetch > 0).any()):
        out["tokens_per_fetch_frac"] = float(fetched[fetch > 0].mean()) / n_ctx
    else:
        out["tokens_per_fetch_frac"] = 0.0
    kvr = _cat(recs, "kv_read_frac")
    out["kv_read_frac"] = float(kvr.mean()) if kvr is not None else 0.0
    den = _cat(recs, "denominator_rel_err")
    if den is not None:
        out["denominator_rel_err_mean"] = float(den.mean())
        out["denominator_rel_err_max"] = float(den.max())
        if eps is not None:
            out["violation_rate"] = float((den > eps).to(torch.float64).mean())
    err = _cat(recs, "output_rel_err")
    out["output_rel_err_mean"] = float(err.mean())
    out["output_rel_err_max"] = float(err.max())
    special = {"fetch", "fetched_tokens", "kvhead_fetch", "kv_read_frac", "denominator_rel_err",
               "output_rel_err"}
    for key in keys:
        if key not in special:
            name = "eps_hat" if key == "eps_hat_before" else key
            out[f"{name}_mean"] = float(_cat(recs, key).mean())
    return out


def _aggregate(parts: dict[str, list[dict]], n_ctx: int, eps: float | None) -> dict:
    q = _summary(parts["question"], n_ctx, eps)
    dcd = _summary(parts["decode"], n_ctx, eps)
    both = _summary(parts["question"] + parts["decode"], n_ctx, eps)
    stats: dict[str, float | str] = {}
    traffic = ("decisions_fetch_frac", "kvhead_steps_fetch_frac", "tokens_per_fetch_frac",
               "kv_read_frac")
    base = dcd if parts["decode"] else q
    stats["traffic_basis"] = "decode steps" if parts["decode"] else "question pass (no decode rows)"
    for key, val in both.items():
        stats[key] = base[key] if key in traffic else val
    for prefix, d in (("question_", q), ("decode_", dcd)):
        for key, val in d.items():
            stats[prefix + key] = val
    return stats
