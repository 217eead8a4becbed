"""Policy options as command-line flags, generated from every policy's ``Params`` dataclass.
What the flags mean for the policies named is decided by :mod:`kvsim.policies.spec`."""

from __future__ import annotations

import argparse
import dataclasses

from kvsim.policies import ALIASES, load_all
from kvsim.policies.spec import convert, kind


def _fields():
    """(field, {policy: its default}) for every option of every registered policy."""
    seen: dict[str, tuple[dataclasses.Field, dict]] = {}
    for name, cls in sorted(load_all().items()):
        for f in dataclasses.fields(cls.Params):
            seen.setdefault(f.name, (f, {}))[1][name] = f.default
    return seen.values()


def _defaults_text(owners: dict) -> str:
    """``[verkv, topk: default 16]`` or ``[varrate: default 5; verkv: default 16]``."""
    by_default: dict[str, list[str]] = {}
    for policy, default in owners.items():
        key = "no default" if default is dataclasses.MISSING else \
            "default: see above" if default is None else f"default {default}"
        by_default.setdefault(key, []).append(policy)
    return "[" + "; ".join(f"{', '.join(ps)}: {d}" for d, ps in by_default.items()) + "]"


def parse_list(kind_, text: str) -> list:
    """``"8,16,32"`` -> [8.0, 16.0, 32.0] for a float option (bools: true/false)."""
    try:
        return [convert(kind_, v) for v in text.split(",") if v.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def policy_help() -> str:
    """What ``--policy`` accepts: the spec syntax and every policy's summary."""
    names = "; ".join(f"{n}: {c.summary}" for n, c in sorted(load_all().items()) if c.summary)
    aliases = ", ".join(f"{a} = {b}" for a, b in ALIASES.items())
    return (f"NAME[:KEY=VALUE...], e.g. verkv:eps=0.05:sketch=perfect (options written here "
            f"override the flags below; {aliases}). {names}")


def add_policy_flags(parser: argparse.ArgumentParser, lists: bool = False) -> None:
    """One flag per policy option; with ``lists`` each takes comma-separated values to sweep."""
    group = parser.add_argument_group(
        "policy options", "each applies to the policies named in its help; defaults are the "
                          "policy's" + ("; give comma-separated values to sweep" if lists else ""))
    for f, owners in _fields():
        k = kind(f)
        helptext = f"{f.metadata.get('help', '')} {_defaults_text(owners)}"
        kw = {"default": None, "dest": f"opt_{f.name}", "help": helptext}
        if lists:
            kw["type"] = lambda text, k=k: parse_list(k, text)
            kw["metavar"] = "V[,V...]"
        elif k is bool:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = k
            if "choices" in f.metadata:
                kw["choices"] = f.metadata["choices"]
            else:
                kw["metavar"] = f.name.upper()
        group.add_argument("--" + f.name.replace("_", "-"), **kw)


def policy_options(args: argparse.Namespace) -> dict:
    """The policy flags the user gave (only those), as Params keyword arguments."""
    return {k[4:]: v for k, v in vars(args).items() if k.startswith("opt_") and v is not None}
