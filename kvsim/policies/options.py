"""Options the policies share and the budget rule they share.

A shared option has one name, help, kind and check in every policy that takes it (each policy
gives its own default): a policy declares it with :func:`shared` (or one of the ``*_field``
helpers), never with a field of its own. :func:`check_common` runs those checks, and the choices
check of every option, for every policy (``kvsim.policies.spec.params`` calls it).

The shared options are the policy options a command line takes as flags (``--eps 0.05``); every
other option is a policy's own, written in its spec (``--policy verkv:sketch=perfect``), and two
policies may each have one of the same name. This module stays torch-free: a command's parser
reads :data:`SHARED` without loading any policy."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import field, fields
from typing import NamedTuple

from kvsim.errors import KvsimError

SCORERS = ("snapkv", "kvzip", "oracle")  # implemented in kvsim.policies.scorers
EDGE_DEFAULT = 64  # sink and local tokens when not given, shrunk to fit a short context


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _whole(v) -> bool:
    return v is None or (_finite(v) and int(v) == v and v >= 0)


class Shared(NamedTuple):
    """A shared option: its one help, its kind and choices, and its one check (``must`` says
    what the check requires, in the error line)."""
    help: str
    kind: type
    ok: Callable[[object], bool]
    must: str
    choices: tuple = ()


EDGE_NOTE = (f"(a policy with a budget and no value given: {EDGE_DEFAULT}, or a quarter of the "
             f"budget where that does not fit, with a warning)")
SHARED = {
    "compression": Shared(
        "budget: 1/compression of the full 16-bit KV cache (8, 16, 32 = 8x..32x smaller; 1 = "
        "all of it)", float, lambda v: _finite(v) and v >= 1,
        "be >= 1 (the budget is 1/compression of the cache)"),
    "eps": Shared(
        "tolerance on the attention denominator's relative error: fetching policies fetch "
        "until their certificate is below it; others report how often it is exceeded", float,
        lambda v: _finite(v) and v > 0, "be > 0"),
    "delta": Shared(
        "failure probability delta of the Bernstein certificate, in (0, 1)", float,
        lambda v: _finite(v) and 0 < v < 1, "lie strictly between 0 and 1"),
    "scorer": Shared(
        "token scores: snapkv (last 64 question queries, pooled), kvzip (the trace's scores), "
        "oracle (the future attention: an upper bound)", str, lambda v: v in SCORERS,
        f"be one of {', '.join(SCORERS)}", SCORERS),
    "sink": Shared(f"first tokens always kept (attention sinks) {EDGE_NOTE}", int, _whole,
                   "be a whole number >= 0"),
    "local": Shared(f"last context tokens always kept {EDGE_NOTE}", int, _whole,
                    "be a whole number >= 0"),
}


def shared(name: str, default):
    """The dataclass field of the shared option ``name`` with a policy's ``default``."""
    s = SHARED[name]
    meta = {"help": s.help, "kind": s.kind}
    if s.choices:
        meta["choices"] = list(s.choices)
    return field(default=default, metadata=meta)


def compression_field(default: float = 16.0):
    return shared("compression", default)


def eps_field():
    return shared("eps", 0.05)


def delta_field():
    return shared("delta", 0.1)


def scorer_field():
    return shared("scorer", "snapkv")


def sink_field():
    return shared("sink", None)


def local_field():
    return shared("local", None)


def check_common(p) -> None:
    """Validate the shared options a Params instance has (the same check for every policy) and
    every option's declared choices; one clear KvsimError line."""
    for f in fields(p):
        v = getattr(p, f.name)
        s = SHARED.get(f.name)
        if s is not None and not s.ok(v):
            raise KvsimError(f"--{f.name} must {s.must}; got {v!r}")
        choices = f.metadata.get("choices")
        if choices and v not in choices:
            raise KvsimError(f"--{f.name.replace('_', '-')} must be one of "
                             f"{', '.join(map(str, choices))}; got {v!r}")


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
    l = EDGE_DEFAULT if local is None else int(local)
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
