"""Where a replay's policy statistics come from: a policy profile at the planned context (the
default when no trace is named) or exactly one trace.

``--policy-profile FILE`` names a profile, ``default`` the shipped one, ``none`` none. Without the
flag, a replay of the shipped default trace uses the shipped profile for the policies it holds
(and says so); a trace named with ``--trace``/``TRACE`` means exactly that trace. A setting the
profile holds the policy for but not the setting (beyond its grid, or off it in more than one
option) is an error that names the nearest settings; one between two grid values of one option is
interpolated (:meth:`kvsim.policy_profile.Profile.between`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from kvsim import policy_profile as pp
from kvsim.contract import PolicyResult
from kvsim.errors import KvsimError


@dataclasses.dataclass
class Source:
    analysis: PolicyResult
    applied: pp.Applied | None = None  # the profile's estimate, when a profile gave it
    lo: PolicyResult | None = None  # the analysis at the low and high ends of the KV read
    hi: PolicyResult | None = None
    warnings: list = dataclasses.field(default_factory=list)


def profile_for(choice: str | None, trace_named: bool) -> tuple[pp.Profile | None, bool]:
    """(profile or None, whether the user named it)."""
    if choice in (None, "default"):
        if choice is None and trace_named:
            return None, False
        if not pp.DEFAULT.exists():
            if choice == "default":
                raise KvsimError(f"the shipped policy profile {pp.DEFAULT} is missing")
            return None, False
        return pp.load(pp.DEFAULT), choice == "default"
    if choice == "none":
        return None, True
    return pp.load(choice), True


def unset_from_profile(prof: pp.Profile, name: str, params: dict) -> dict:
    """Options left unset (None: sink and local) that every setting of ``name`` in the profile
    holds at one value: that value (the sizes the profile was measured with)."""
    same = [p for n, p in prof.settings if n == name]
    out = {}
    for key, v in params.items():
        held = {p.get(key) for p in same}
        if v is None and len(held) == 1 and None not in held:
            out[key] = next(iter(held))
    return out


def from_profile(prof: pp.Profile, cfg, n_tokens: int, model) -> Source:
    policy, name = cfg.policy, cfg.policy.name
    params = dataclasses.asdict(policy.params)
    filled = unset_from_profile(prof, name, params)
    if filled:  # the policy with the sizes the profile was measured with
        from kvsim.policies import make
        policy = make(name, {**cfg.options, **filled})
        params = dataclasses.asdict(policy.params)
    a = prof.at(name, params, n_tokens)

    def result(kv_read: float | None) -> PolicyResult:
        stats = dict(a.stats) if kv_read is None else {**a.stats, "kv_read_frac": kv_read}
        return PolicyResult(name, params, policy.decode_cost(stats, model), stats,
                            a.provenance, {})

    key = "decode.kv_read_frac" if "decode" in a.stats else "question.kv_read_frac"
    lo, hi = a.intervals.get(key, (None, None))
    said = [f"{name}: {', '.join(f'{k} {v}' for k, v in filled.items())}: the sizes the "
            f"policy profile was measured with (not given; give --{'/--'.join(filled)} to "
            f"choose)"] if filled else []
    src = Source(result(None), a, warnings=said + list(a.warnings))
    if lo is not None and hi > lo:
        src.lo, src.hi = result(lo), result(hi)
    return src


def for_model(result: PolicyResult, policy, model) -> PolicyResult:
    """A trace's analysis with its decode cost restated for ``model`` (the trace's head size
    is not the planned model's)."""
    return dataclasses.replace(result, cost=policy.decode_cost(result.stats, model))


def choose(cfg, trace_path: Path, n_tokens: int, analyze, model) -> Source:
    """The policy statistics for the replay of ``cfg``, with the decode cost stated for
    ``model``; ``analyze(path, policy, seed)`` runs the policy on a trace when no profile
    applies."""
    policy, name = cfg.policy, cfg.policy.name
    if not policy.needs_attention:
        return Source(for_model(analyze(trace_path, policy, cfg.seed), policy, model))
    prof, named = profile_for(cfg.policy_profile, cfg.trace is not None)
    if prof is not None and prof.has(name):
        # a context or a setting off the profile's grid is an error naming the nearest
        # settings, never a silent fallback to one trace's statistics at another context
        prof.check_context(n_tokens)
        return from_profile(prof, cfg, n_tokens, model)
    if prof is not None and named:
        raise KvsimError(f"policy profile {prof.where} holds no {name} settings")
    fallback = None if prof is None else \
        f"the shipped policy profile holds no {name} settings; statistics of one trace"
    src = Source(for_model(analyze(trace_path, policy, cfg.seed), policy, model))
    if fallback:
        src.warnings.append(fallback)
    return src
