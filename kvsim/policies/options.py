"""Options the attention-path policies share: same name, type, default and meaning in every
policy that takes one, validated by one function; and the budget rule they share."""

from __future__ import annotations

import math
from dataclasses import field
from typing import NamedTuple

from kvsim.errors import KvsimError

SCORERS = ("snapkv", "kvzip", "oracle")  # implemented in kvsim.policies.scorers


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


EDGE_DEFAULT = 64  # sink and local tokens when not given, shrunk to fit a short context


def sink_field():
    return field(default=None, metadata={
        "kind": int, "help": f"first tokens always kept (attention sinks) [default: {EDGE_DEFAULT}, or a "
                f"quarter of the budget where that does not fit, with a warning]"})


def local_field():
    return field(default=None, metadata={
        "kind": int, "help": f"last context tokens always kept [default: {EDGE_DEFAULT}, or a quarter of "
                f"the budget where that does not fit, with a warning]"})


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
        v = getattr(p, name, None)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                              or not math.isfinite(v) or int(v) != v or v < 0):
            raise KvsimError(f"--{name} must be a whole number >= 0; got {getattr(p, name)}")
    if hasattr(p, "scorer") and p.scorer not in SCORERS:
        raise KvsimError(f"--scorer must be one of {', '.join(SCORERS)}; got {p.scorer!r}")


def check_choices(p, **allowed: tuple) -> None:
    """Each named option of ``p`` must be one of its allowed values."""
    for name, values in allowed.items():
        if getattr(p, name) not in values:
            raise KvsimError(f"--{name.replace('_', '-')} must be one of {', '.join(values)}; "
                             f"got {getattr(p, name)!r}")


class Budget(NamedTuple):
    left: float  # tokens per KV head for the sample, after sink, local and sketch
    sink: int
    local: int
    note: str  # what was shrunk, when a default did not fit


def check_budget(policy: str, n_ctx: int, compression: float, sink: int | None,
                 local: int | None, sketch_tokens: float = 0.0,
                 need_sample: bool = True) -> Budget:
    """The token budget per KV head (``n_ctx / compression``) after sink, local and sketch. A
    sink or local not given is ``EDGE_DEFAULT``, shrunk to a quarter of the budget (after the
    sketch) where that does not fit, and the note says so; sizes given that do not fit are one
    KvsimError line with one suggestion."""
    budget = n_ctx / compression
    need = 1.0 if need_sample else 0.0
    quarter = max(0, int((budget - sketch_tokens) // 4))
    s = EDGE_DEFAULT if sink is None else int(sink)
    l = EDGE_DEFAULT if local is None else int(local)  # noqa: E741
    note = ""
    if (sink is None or local is None) and (s + l > n_ctx or budget - s - l - sketch_tokens < need):
        s, l = (min(s, quarter) if sink is None else s), (min(l, quarter) if local is None else l)
        note = (f"{policy}: sink and local {s} + {l} (the default {EDGE_DEFAULT} shrunk to a "
                f"quarter of the {budget:.0f}-token budget at {compression:g}x of {n_ctx} "
                f"tokens; give --sink/--local to choose)")
    left = budget - s - l - sketch_tokens
    if s + l > n_ctx or left < need:
        sk = f" + sketch {sketch_tokens:.1f}" if sketch_tokens else ""
        hint = "lower --compression" if budget - sketch_tokens - need < 0 else \
            f"try --sink {quarter} --local {quarter}"
        raise KvsimError(f"policy {policy} at {compression:g}x of a {n_ctx}-token context has "
                         f"a budget of {budget:.1f} tokens per KV head, not enough for sink "
                         f"{s} + local {l}{sk}{' and a sample' if need_sample else ''}: {hint}")
    return Budget(left, s, l, note)
