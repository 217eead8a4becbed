"""Options the attention-path policies share: same name, type, default and meaning in every
policy that takes one, validated by one function; and the budget rule they share."""

from __future__ import annotations

import math
from dataclasses import field

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


def sink_field():
    return field(default=64, metadata={"help": "first tokens always kept (attention sinks)"})


def local_field():
    return field(default=64, metadata={"help": "last context tokens always kept"})


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


def check_choices(p, **allowed: tuple) -> None:
    """Each named option of ``p`` must be one of its allowed values."""
    for name, values in allowed.items():
        if getattr(p, name) not in values:
            raise KvsimError(f"--{name.replace('_', '-')} must be one of {', '.join(values)}; "
                             f"got {getattr(p, name)!r}")


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
