"""Running a policy on a trace's attention: the one caller of ``compress`` and ``attend`` on traces.

For each captured layer: ``compress`` on the context (its own seeded generator per layer, the
observation window the policy asks for), ``attend`` once for the question pass (all question rows,
one forward pass) and once per decode step (one row each); every output is compared with float64
dense attention and the per-decision statistics go to the one aggregator
(:mod:`kvsim.measure.stats`). The policy then turns the statistics into its decode cost.

An ``oracle`` score (attention mass of every question and decode row over the context) is added
to the scores unless the trace has one. Bytes assume a 16-bit KV cache (2 bytes per element),
whatever the trace's dtype (``kvsim.policies.base.KV_ELEM_BYTES``). Policies that ask for it
(``times_compress``) have ``compress`` timed
against one layer's dense causal prefill attention on this machine; those timings are reported
apart from the statistics, which the same seed reproduces exactly.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from kvsim._torch import F, torch
from kvsim.attention.dense import dense_attention, expand_kv
from kvsim.attention.scoring import attention_mass
from kvsim.contract import HeadShape, PolicyResult, by_definition
from kvsim.errors import KvsimError
from kvsim.measure import traffic
from kvsim.measure.stats import Calls, kept
from kvsim.trace import Trace

TIMING_LAYERS, TIMING_REPEATS = 4, 5  # timed layers spread over the trace, best of the repeats


def layer_seed(seed: int, layer: int) -> int:
    return (seed * 1_000_003 + layer * 7_919 + 12_345) % (2**63 - 1)


def require_attention(trace: Trace | None, policy: str) -> None:
    if trace is None or trace.attention is None:
        raise KvsimError(f"policy {policy} needs a trace with an attention section "
                         f"(kvsim capture)")


def observation(kind: str, qq, qpos, qd, dpos, n_ctx: int):
    """The observation window ``compress`` gets: every question row ("question"), or every row
    at a position inside the context ("context", in position order; often none)."""
    if kind == "question":
        return qq, qpos
    rows, pos = torch.cat([qq, qd], 1), torch.cat([qpos, dpos])
    order = torch.argsort(pos[pos < n_ctx])
    return rows[:, pos < n_ctx][:, order], pos[pos < n_ctx][order]


def _prefill_attention_seconds(k: torch.Tensor, n_q: int) -> float:
    """One layer's causal prefill attention over the context on this machine (SDPA, float32;
    the keys stand in for the queries, whose values do not change the time)."""
    kq = expand_kv(k.float(), n_q)[None]
    vq = kq.clone()
    t0 = time.perf_counter()
    F.scaled_dot_product_attention(kq, kq, vq, is_causal=True)
    return time.perf_counter() - t0


def run(policy, trace: Trace, seed: int = 0, dtype: torch.dtype = torch.float64,
        device: str | torch.device = "cpu", progress: bool = False,
        timed: bool = True, verify: str = "first") -> tuple[dict, dict]:
    """(statistics, timings) of ``policy`` replayed on every captured layer of ``trace``; with
    ``progress`` a bar over the layers on a terminal; ``timed=False`` skips the prefill
    timings (a policy profile, which runs layer by layer, needs none). ``verify``: on which
    layers the reads are checked (:mod:`kvsim.measure.traffic`): ``first``, ``all``, ``none``."""
    require_attention(trace, policy.name)
    a = trace.attention
    policy.bind(a.rope, a.head_dim)
    policy.check(trace)
    n_ctx = int(a.context_len)
    qpos = torch.as_tensor(a.question_pos, dtype=torch.long, device=device)
    dpos = torch.as_tensor(a.decode_pos, dtype=torch.long, device=device)
    ids = [la.layer for la in a.layers]
    timed = {ids[i] for i in np.linspace(0, len(ids) - 1, min(TIMING_LAYERS, len(ids)))
             .round().astype(int)} if policy.times_compress and timed else set()
    calls, compressed, t_comp, t_dense = Calls(), [], [], []
    eps = getattr(policy.params, "eps", None)
    by_layer: dict[int, list] = {}  # layer -> denominator errors of its decisions
    from tqdm import tqdm
    bar = tqdm(a.layers, desc=f"{policy.name} on the trace", unit="layer", leave=False,
               disable=None if progress else True)  # on a terminal, when asked
    for la in bar:
        t = lambda x: torch.as_tensor(x, device=device).to(dtype)  # noqa: E731
        k, v, qq, qd = t(la.k), t(la.v), t(la.q_question), t(la.q_decode)
        scores = {name: t(s)[:, :n_ctx] for name, s in la.scores.items()}
        if "oracle" not in scores:
            rows, pos = torch.cat([qq, qd], 1), torch.cat([qpos, dpos])
            if rows.shape[1]:
                scores["oracle"] = attention_mass(k[:, :n_ctx], rows, pos)
        args = (k[:, :n_ctx], v[:, :n_ctx], scores,
                *observation(policy.observation, qq, qpos, qd, dpos, n_ctx))
        # a window of question rows sees the question's own keys too (SnapKV's softmax)
        after = {"obs_k": k[:, n_ctx:]} if policy.observation == "question" else {}
        gen = lambda: torch.Generator().manual_seed(layer_seed(seed, int(la.layer)))  # noqa: E731
        c = policy.compress(*args, gen(), layer=int(la.layer), **after)
        compressed.append(c)
        if la.layer in timed:  # compress and dense prefill attention, interleaved
            tc, td = [], []
            for _ in range(TIMING_REPEATS):
                t0 = time.perf_counter()
                again = policy.compress(*args, gen(), layer=int(la.layer), **after)
                tc.append(time.perf_counter() - t0 - again.info.get("seconds_excluded", 0.0))
                td.append(_prefill_attention_seconds(args[0], a.n_q_heads))
            t_comp.append(min(tc))
            t_dense.append(min(td))
        passes = [("question", qq, qpos)] if qq.shape[1] else []
        passes += [("decode", qd[:, j:j + 1], dpos[j:j + 1]) for j in range(qd.shape[1])]
        check = verify == "all" or (verify == "first" and la is a.layers[0])
        for phase, q, pos in passes:
            rec = _compared(policy, c, q, pos, k, v, check)
            if "denominator_rel_err" in rec:
                by_layer.setdefault(int(la.layer), []).append(
                    rec["denominator_rel_err"].reshape(-1))
            calls.add(phase, rec, n_ctx)
    stats = calls.summary(eps, getattr(policy.params, "eps_output", None))
    if eps is not None and by_layer:  # the same decisions, per layer (spec: per decision)
        rates = {l: float((torch.cat(e) > eps).to(torch.float64).mean())
                 for l, e in by_layer.items()}
        stats["violation_rate_by_layer"] = {str(l): v for l, v in sorted(rates.items())}
        stats["violation_rate_max_layer"] = max(rates.values())
    stats |= {"context_tokens": n_ctx, "layers": len(a.layers), "decisions": calls.decisions,
              "head_dim": a.head_dim, **kept(policy, compressed, n_ctx, a.head_dim)}
    if policy.notes:
        stats["notes"] = sorted(policy.notes)
    _check_finite(policy, stats)
    return stats, _timings(compressed, t_comp, t_dense, n_ctx)


def _compared(policy, c, q, pos, k, v, verify: bool) -> dict:
    """One ``attend`` call's statistics, with its errors against float64 dense attention."""
    out, st = traffic.attend(policy, c, q, pos, k, v, verify=verify)
    f64 = torch.float64
    ref, ref_logd = dense_attention(q.to(f64), k.to(f64), v.to(f64), pos)
    rec = dict(st)
    gap = (out.to(f64) - ref).norm(dim=-1)
    rec["output_rel_err"] = gap / ref.norm(dim=-1).clamp_min(1e-300)
    if "value_range_norm" in st:  # what an output certificate bounds (VerKV)
        rec["output_range_err"] = gap / st["value_range_norm"].to(f64)
    if "log_denominator" in st:
        rec["denominator_rel_err"] = ((st["log_denominator"].to(f64) - ref_logd).exp() - 1).abs()
    if "log_denominator_own" in st:  # the decision's own fetch set (the spec's count)
        own = (st["log_denominator_own"].to(f64) - ref_logd).exp() - 1
        rec["denominator_rel_err_own"] = own.abs()
    return rec


def _check_finite(policy, stats: dict) -> None:
    bad = sorted(f"{part}.{k}" if part else k for part, d in
                 [("", stats)] + [(p, stats[p]) for p in ("question", "decode", "overall")
                                  if isinstance(stats.get(p), dict)]
                 for k, v in d.items() if isinstance(v, float) and not np.isfinite(v))
    if bad:
        raise KvsimError(f"policy {policy.name} on this trace gives non-finite statistics "
                         f"({', '.join(bad[:4])}{'...' if len(bad) > 4 else ''}): the trace's "
                         f"tensors are out of range for it")


def _timings(compressed, t_comp: list, t_dense: list, n_ctx: int) -> dict:
    out = {f"{key[8:]}_s_per_layer": float(np.mean([c.info[key] for c in compressed]))
           for key in compressed[0].info
           if key.startswith("seconds_") and key != "seconds_excluded"}
    if t_comp:
        comp = float(np.median(t_comp)) / (n_ctx / 1000)
        dense = float(np.median(t_dense)) / (n_ctx / 1000)
        out |= {"prefill_compress_s_per_1k_tokens_per_layer": comp,
                "prefill_dense_attention_s_per_1k_tokens_per_layer": dense,
                "prefill_compress_over_dense_attention": comp / dense if dense else None,
                "prefill_timing_note": "CPU, this machine; the paper's +44% is over the whole "
                                       "prefill (MLPs included) on a GPU, this is over attention "
                                       "only",
                "timed_layers": len(t_comp)}
    return out


def provenance(trace: Trace, policy, seed: int, timings: dict) -> str:
    meta, a = trace.meta, trace.attention
    if meta.get("synthetic"):
        source = "a synthetic attention trace (not a model)"
    else:
        source = f"the attention of model {meta.get('model') or '(unnamed)'}"
    text = (f"measured by policy {policy.name} (seed {seed}) on {source} at "
            f"{a.context_len} context tokens, {len(a.layers)} captured layers, "
            f"{len(a.decode_pos)} decode steps; trace recorded by {meta.get('recorded_by', '?')}")
    if "timed_layers" in timings:
        text += (f"; prefill timings on this machine (CPU torch, {torch.get_num_threads()} "
                 f"threads; compress vs one layer's SDPA causal attention, best of "
                 f"{TIMING_REPEATS} interleaved runs on {timings['timed_layers']} layer(s))")
    return text


def analyze(policy, trace: Trace | None, seed: int = 0, progress: bool = False) -> PolicyResult:
    """The policy's statistics (measured on ``trace`` when it needs attention, else by
    definition) and the decode cost it derives from them, stated for the trace's own head shape
    (a replay restates it for the planned model)."""
    if not policy.needs_attention:
        return by_definition(policy)
    stats, timings = run(policy, trace, seed, progress=progress)
    prov = provenance(trace, policy, seed, timings)
    note = policy.provenance(stats)
    prov += f"; {note}" if note else ""
    return PolicyResult(policy.name, dataclasses.asdict(policy.params),
                        policy.decode_cost(stats, HeadShape(stats["head_dim"])), stats, prov,
                        timings)
