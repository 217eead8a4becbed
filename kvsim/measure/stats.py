"""The one aggregation of a policy's attention statistics, for trace replay and model evaluation.

A *call* is one ``attend`` of one layer in one forward pass (the question pass, or one decode
step); a *decision* is one query head of one query row in a call (the paper's "attention
decision"). ``attend`` returns per-decision tensors (n_q, m) under these names (a name a policy
does not return means "not applicable"; a policy that returns no traffic names fetches nothing):

``log_denominator``  log of the policy's estimate of the softmax denominator (same scale as
                     dense); the harness turns it into ``denominator_rel_err``
``log_denominator_own`` the same with only the decision's own fetches made exact (VerKV: the
                     spec's per-decision convention; the union over a KV head's query heads is
                     what is fetched): ``violation_rate_own``
``fetch``            the decision asked for tokens from host memory (bool; VerKV: k* > 0)
``fetched_tokens``   context tokens it asked for that were not resident (its own share, before
                     the GQA union)
``kvhead_fetch``     its KV head fetched anything at this row, after the GQA union (bool)
``kv_read_frac``     bytes its KV head read from host memory in this pass, as a share of that
                     head's full context cache (pass-level: the same on every row of the call)
anything else        reported as a mean (``eps_hat_before`` as ``eps_hat_mean``)

Per phase (``question``, ``decode``) and ``overall``:

* decision statistics are means over the phase's decisions: ``decisions_fetch_frac``,
  ``kvhead_steps_fetch_frac``, ``tokens_per_fetch_frac`` (fetched tokens of the decisions that
  fetch, as a share of the context), ``output_rel_err_mean``/``_max``,
  ``denominator_rel_err_mean``/``_max``, ``violation_rate`` (denominator error above eps);
  with an output certificate (VerKV ``--eps-output``; its ``attend`` returns
  ``value_range_norm``, the norm of the values' per-dimension range) ``output_range_err_mean``/
  ``_max`` (output error over that norm) and ``output_violation_rate`` (above eps_output);
* ``kv_read_frac`` is the mean over calls, i.e. per forward pass averaged over layers; overall it
  averages the question pass and every decode step alike, as the paper's Table 2 "Overall" does.

Headline keys: the traffic statistics of decode steps (what the simulator charges per step; of
the question pass when a trace has no decode rows, as ``traffic_basis`` says) and the quality
statistics over all decisions.
"""

from __future__ import annotations

from kvsim._torch import torch
from kvsim.policies.base import KV_ELEM_BYTES

TRAFFIC = ("decisions_fetch_frac", "kvhead_steps_fetch_frac", "tokens_per_fetch_frac",
           "kv_read_frac")
PHASES = ("question", "decode")
_NAMED = {"fetch", "fetched_tokens", "kvhead_fetch", "kv_read_frac", "denominator_rel_err",
          "output_rel_err", "denominator_rel_err_own", "output_range_err", "value_range_norm"}


class Calls:
    """Statistics of ``attend`` calls, added as they happen, summarized at the end."""

    def __init__(self):
        self.calls: dict[str, list[dict]] = {p: [] for p in PHASES}

    def add(self, phase: str, stats: dict, n_ctx: int) -> None:
        rec = {name: torch.as_tensor(val).detach().to(torch.float64).reshape(-1).cpu()
               for name, val in stats.items() if name != "log_denominator"}
        if "fetched_tokens" in rec:
            rec["fetched_tokens"] = rec["fetched_tokens"] / n_ctx
        self.calls[phase].append(rec)

    @property
    def decisions(self) -> int:
        return sum(next(iter(r.values())).numel() for c in self.calls.values() for r in c if r)

    def summary(self, eps: float | None = None, eps_output: float | None = None) -> dict:
        q, d = self.calls["question"], self.calls["decode"]
        parts = {"question": _summary(q, eps, eps_output), "decode": _summary(d, eps, eps_output),
                 "overall": _summary(q + d, eps, eps_output)}
        traffic = parts["decode"] if d else parts["question"]
        out: dict = {k: (traffic[k] if k in TRAFFIC else v) for k, v in parts["overall"].items()}
        out["traffic_basis"] = "decode steps" if d else "question pass (no decode rows)"
        return out | {p: s for p, s in parts.items() if s}


def kept(policy, compressed: list, n_ctx: int, head_dim: int) -> dict:
    """What ``policy`` kept of a context, from the ``Compressed`` of each layer: tokens and bytes
    per KV head (means over layers), as shares of the full 16-bit cache (``resident_frac``,
    ``meta_frac``), and the policy's own summary of its per-layer facts."""
    full = n_ctx * 2 * head_dim * KV_ELEM_BYTES  # one layer's K+V of one KV head
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return {"held_tokens": mean([c.held_tokens for c in compressed]),
            "held_bytes": mean([c.held_bytes for c in compressed]),
            "resident_frac": min(1.0, mean([c.held_bytes / full for c in compressed])),
            "meta_frac": min(1.0, mean([c.meta_bytes / full for c in compressed]))} \
        | policy.summarize([c.info for c in compressed])


def _cat(recs: list[dict], key: str) -> torch.Tensor | None:
    vals = [r[key] for r in recs if key in r]
    return torch.cat(vals) if vals else None


def _summary(recs: list[dict], eps: float | None, eps_output: float | None = None) -> dict:
    out: dict[str, float] = {}
    if not recs:
        return out
    fetch, fetched = _cat(recs, "fetch"), _cat(recs, "fetched_tokens")
    out["decisions_fetch_frac"] = float(fetch.mean()) if fetch is not None else 0.0
    kvf = _cat(recs, "kvhead_fetch")
    out["kvhead_steps_fetch_frac"] = float(kvf.mean()) if kvf is not None else 0.0
    if fetch is not None and fetched is not None and bool((fetch > 0).any()):
        out["tokens_per_fetch_frac"] = float(fetched[fetch > 0].mean())
    else:
        out["tokens_per_fetch_frac"] = 0.0
    per_call = [float(r["kv_read_frac"].mean()) for r in recs if "kv_read_frac" in r]
    out["kv_read_frac"] = sum(per_call) / len(per_call) if per_call else 0.0
    den = _cat(recs, "denominator_rel_err")
    if den is not None:
        out["denominator_rel_err_mean"] = float(den.mean())
        out["denominator_rel_err_max"] = float(den.max())
        if eps is not None:
            out["violation_rate"] = float((den > eps).to(torch.float64).mean())
    own = _cat(recs, "denominator_rel_err_own")
    if own is not None and eps is not None:  # each decision with its own fetch set alone
        out["violation_rate_own"] = float((own > eps).to(torch.float64).mean())
    err = _cat(recs, "output_rel_err")
    if err is not None:
        out["output_rel_err_mean"] = float(err.mean())
        out["output_rel_err_max"] = float(err.max())
    rng = _cat(recs, "output_range_err")
    if rng is not None:  # the output error over |R|, and how often it exceeds eps_output
        out["output_range_err_mean"] = float(rng.mean())
        out["output_range_err_max"] = float(rng.max())
        if eps_output is not None:
            out["output_violation_rate"] = float((rng > eps_output).to(torch.float64).mean())
    for key in sorted(set().union(*(r.keys() for r in recs)) - _NAMED):
        name = "eps_hat" if key == "eps_hat_before" else key
        out[f"{name}_mean"] = float(_cat(recs, key).mean())
    return out
