"""Task quality with a policy in the attention path of every layer of a real model.

Per prompt: one context prefill (stock attention) yields the cache, the SnapKV window and, when a
policy asks for them, KVzip reconstruction scores. Dense (stock attention) answers first (its
question and decode queries give the "oracle" scores when a policy asks for those); then each
policy compresses the context per layer and answers with the question pass and every decode step
through its ``attend``. Dense runs once per prompt however many policies are evaluated. The
policies' statistics are aggregated as on traces (:mod:`kvsim.measure.stats`: the same definition
of KV read, by phase and overall).
"""

from __future__ import annotations

import math
import sys
import time
import traceback

from kvsim._torch import torch
from kvsim.attention.scoring import attention_mass
from kvsim.errors import KvsimError
from kvsim.measure import traffic
from kvsim.measure.stats import Calls, kept
from kvsim.model.hooks import Controller
from kvsim.model.runner import KVZIP_PROMPT, cache_kv, generate, prefill
from kvsim.model.tasks import Prompt, score
from kvsim.policies import PolicySpec, make

DEFAULT_MAX_NEW = {"niah": 12, "mk": 12, "qa": 12, "mv": 40, "cwe": 48, "prompts": 32}


def _needs(policy, scorer: str) -> bool:
    """Whether a policy scores tokens with ``scorer`` (so the model must compute those scores)."""
    return getattr(policy.params, "scorer", None) == scorer


def _oracle_scores(pre, ctl: Controller, n_rows: int) -> None:
    """The "oracle" scorer: attention mass of dense's own question and decode rows over the
    context (an upper bound: eviction cannot see these queries)."""
    pos = torch.arange(pre.n_ctx, pre.n_ctx + n_rows)
    for l, qs in ctl.queries.items():
        k, _ = cache_kv(pre.cache, l)
        q = torch.cat(qs, dim=1)[:, :n_rows]
        pre.scores[l]["oracle"] = attention_mass(k[:, :pre.n_ctx], q.to(k.dtype), pos)


def evaluate(lm, prompts: list[Prompt], specs: list[PolicySpec], seed: int = 0,
             max_new_tokens: int | None = None, progress: bool = True) -> dict:
    """Accuracy of dense and of each policy on ``prompts``; fetch statistics; timing."""
    from tqdm import tqdm
    policies = [(s, make(s.name, s.options)) for s in specs]
    for _, pol in policies:
        pol.bind(lm.info["rope"], lm.info["head_dim"])
    want_kvzip = any(_needs(p, "kvzip") for _, p in policies)
    want_oracle = any(_needs(p, "oracle") for _, p in policies)
    model, codec = lm.model, lm.codec
    dense_scores: list[float] = []
    res = {s.label: {"scores": [], "calls": Calls(), "held": [], "seconds": 0.0, "forwards": 0,
                     "examples": []} for s, _ in policies}
    failures: list[dict] = []
    t_prefill = t_dense = 0.0
    tokens: list[int] = []
    bar = tqdm(total=len(prompts) * (1 + len(policies)), desc="eval", unit="run",
               disable=None if progress else True, file=sys.stderr, dynamic_ncols=True)
    max_pos = lm.info.get("max_position_embeddings")
    for i, p in enumerate(prompts):
        done = 0
        try:
            ctx_ids, q_ids = codec.layout(p.context, p.question, p.answer_prefix)
            max_new = max_new_tokens or DEFAULT_MAX_NEW.get(p.task, 32)
            t0 = time.perf_counter()
            kv_ids = codec.encode(KVZIP_PROMPT + p.context) if want_kvzip else None
            pre = prefill(model, ctx_ids, kvzip_ids=kv_ids)
            t1 = time.perf_counter()
            rec = Controller(mode="stock") if want_oracle else None  # records every layer
            d = generate(model, codec, pre, q_ids, max_new, controller=rec)
            if want_oracle:
                _oracle_scores(pre, rec, len(q_ids) + d.forwards - 1)
            t2 = time.perf_counter()
            t_prefill, t_dense = t_prefill + t1 - t0, t_dense + t2 - t1
            tokens.append(len(ctx_ids) + len(q_ids))
            row = {"scores": score(d.text, p.answers, p.match)}
            bar.update(1)
            done += 1
            outs = []
            for j, (s, pol) in enumerate(policies):
                t3 = time.perf_counter()
                g = generate(model, codec, pre, q_ids, max_new, policy=pol,
                             attend=traffic.attend, seed=seed * 100003 + i * 101 + j)
                outs.append((s, pol, g, time.perf_counter() - t3))
                bar.update(1)
                done += 1
        except Exception as e:  # one prompt failing is reported, not fatal
            failures.append({"prompt": p.id or i, "error": f"{type(e).__name__}: {e}",
                             "where": traceback.format_exc(limit=-2).strip().splitlines()[-3:]})
            bar.update(1 + len(policies) - done)
            continue
        dense_scores.append(row["scores"])
        for s, pol, g, secs in outs:
            _record(res[s.label], pol, g, secs, p, d.text, pre.n_ctx, lm.info["head_dim"])
    bar.close()
    n = len(dense_scores)
    if not n and failures:
        raise KvsimError(f"every prompt failed; the first: {failures[0]['error']}")
    dense_acc = sum(dense_scores) / n if n else float("nan")
    results = [_result(s, pol, res[s.label], n, dense_acc) for s, pol in policies]
    warnings = []
    if max_pos and tokens and max(tokens) > max_pos:
        warnings.append(f"prompts reach {max(tokens)} tokens, past the model's "
                        f"{max_pos}-token window: expect dense to fail too")
    return {
        "n": n, "n_failed": len(failures), "failures": failures, "dense_accuracy": dense_acc,
        "results": results, "prompt_tokens_mean": sum(tokens) / len(tokens) if tokens else None,
        "timing": {"prefill_s_per_prompt": t_prefill / n if n else None,
                   "dense_s_per_prompt": t_dense / n if n else None,
                   "model_load_s": lm.load_s},
        "kvzip_scores": want_kvzip, "oracle_scores": want_oracle, "warnings": warnings,
    }


def _record(r: dict, pol, g, secs: float, p: Prompt, dense_text: str, n_ctx: int,
            head_dim: int) -> None:
    """Add one prompt's generation through ``pol`` to its policy's running record ``r``."""
    r["scores"].append(score(g.text, p.answers, p.match))
    r["seconds"] += secs
    r["forwards"] += g.forwards
    for (_layer, _rows, st), ph in zip(g.stats, g.phases, strict=True):
        r["calls"].add(ph, st, n_ctx)
    r["held"].append(kept(pol, g.compressed, n_ctx, head_dim))
    if len(r["examples"]) < 3:
        r["examples"].append({"prompt": p.id, "answers": p.answers, "dense": dense_text,
                              "policy": g.text})


def _result(s, pol, r: dict, n: int, dense_acc: float) -> dict:
    """One policy's accuracy and statistics over the prompts that ran."""
    acc = sum(r["scores"]) / n if n else float("nan")
    stats = r["calls"].summary(getattr(pol.params, "eps", None))
    stats |= _mean_dicts(r["held"])
    return {
        "policy": s.label, "name": s.name, "options": s.options,
        "accuracy": acc, "dense_accuracy": dense_acc,
        "relative_accuracy": acc / dense_acc if dense_acc and not math.isnan(dense_acc)
        else None,
        "kv_read_frac": stats["kv_read_frac"],
        "question_kv_read_frac": stats.get("question", {}).get("kv_read_frac"),
        "decode_kv_read_frac": stats.get("decode", {}).get("kv_read_frac"),
        "overall_kv_read_frac": stats.get("overall", {}).get("kv_read_frac"),
        "kv_read_source": "measured: what the policy kept and read in each attend call "
                          "(kvsim.measure.traffic; kv_read_frac of decode steps; overall_ per "
                          "forward pass, question pass and decode steps alike; the same names "
                          "as kvsim replay's)",
        "n": n,
        "stats": stats,
        "seconds_per_prompt": r["seconds"] / n if n else None,
        "seconds_per_forward": r["seconds"] / r["forwards"] if r["forwards"] else None,
        "examples": r["examples"],
    }


def _mean_dicts(rows: list[dict]) -> dict:
    """Per key, the mean over prompts of the numbers (other values: the first prompt's)."""
    out = {}
    for key in rows[0] if rows else []:
        vals = [r[key] for r in rows]
        numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals)
        out[key] = sum(vals) / len(vals) if numeric else vals[0]
    return out
