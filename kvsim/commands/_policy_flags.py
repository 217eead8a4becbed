"""Policy options as command-line flags, generated from every policy's ``Params`` dataclass."""

from __future__ import annotations

import argparse
import dataclasses

from kvsim.policies import load_all


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
        key = "no default" if default is dataclasses.MISSING else f"default {default}"
        by_default.setdefault(key, []).append(policy)
    return "[" + "; ".join(f"{', '.join(ps)}: {d}" for d, ps in by_default.items()) + "]"


def _kind(f: dataclasses.Field):
    return type(f.default) if f.default not in (dataclasses.MISSING, None) else str


def parse_list(kind, text: str) -> list:
    """``"8,16,32"`` -> [8.0, 16.0, 32.0] for a float option (bools: true/false)."""
    def one(v: str):
        if kind is bool:
            if v.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise argparse.ArgumentTypeError(f"expected true/false, got {v!r}")
            return v.lower() in ("true", "1", "yes")
        try:
            return kind(v)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind.__name__}, got {v!r}") from None
    return [one(v.strip()) for v in text.split(",") if v.strip()]


def add_policy_flags(parser: argparse.ArgumentParser, lists: bool = False) -> None:
    """One flag per policy option; with ``lists`` each takes comma-separated values to sweep."""
    group = parser.add_argument_group(
        "policy options", "each applies to the policies named in its help; defaults are the "
                          "policy's" + ("; give comma-separated values to sweep" if lists else ""))
    for f, owners in _fields():
        kind = _kind(f)
        helptext = f"{f.metadata.get('help', '')} {_defaults_text(owners)}"
        kw = {"default": None, "dest": f"opt_{f.name}", "help": helptext}
        if lists:
            kw["type"] = lambda text, kind=kind: parse_list(kind, text)
            kw["metavar"] = "V[,V...]"
        elif kind is bool:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = kind
            if "choices" in f.metadata:
                kw["choices"] = f.metadata["choices"]
            else:
                kw["metavar"] = f.name.upper()
        group.add_argument("--" + f.name.replace("_", "-"), **kw)


def policy_options(args: argparse.Namespace) -> dict:
    """The policy flags the user gave (only those), as Params keyword arguments."""
    return {k[4:]: v for k, v in vars(args).items() if k.startswith("opt_") and v is not None}


def split_options(policy: str, options: dict) -> tuple[dict, list[str]]:
    """(the options ``policy`` takes, the flags it ignores): one command line can carry every
    policy's flags (e.g. a script looping over policies); the ignored ones are reported."""
    registry = load_all()
    if policy not in registry:
        return options, []
    taken = {f.name for f in dataclasses.fields(registry[policy].Params)}
    ignored = ["--" + k.replace("_", "-") for k in sorted(set(options) - taken)]
    return {k: v for k, v in options.items() if k in taken}, ignored
