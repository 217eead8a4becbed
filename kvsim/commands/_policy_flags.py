"""Policy options as command-line flags, generated from every policy's ``Params`` dataclass."""

from __future__ import annotations

import argparse
import dataclasses

from kvsim.policies import load_all


def add_policy_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "policy options", "each applies to the policies that name it; defaults are the policy's")
    seen: dict[str, str] = {}
    for name, cls in sorted(load_all().items()):
        for f in dataclasses.fields(cls.Params):
            if f.name in seen:
                seen[f.name] += f", {name}"
                continue
            seen[f.name] = name
            default = f.default if f.default is not dataclasses.MISSING else None
            kind = type(default) if default is not None else str
            kw = {"type": kind, "default": None, "dest": f"opt_{f.name}",
                  "help": f.metadata.get("help", "")}
            if kind is bool:
                kw = {"action": argparse.BooleanOptionalAction, "default": None,
                      "dest": f"opt_{f.name}", "help": f.metadata.get("help", "")}
            if "choices" in f.metadata:
                kw["choices"] = f.metadata["choices"]
            if default is not None:
                kw["help"] += f" (default {default})"
            group.add_argument("--" + f.name.replace("_", "-"), **kw)


def policy_options(args: argparse.Namespace) -> dict:
    """The policy flags the user gave (only those), as Params keyword arguments."""
    return {k[4:]: v for k, v in vars(args).items() if k.startswith("opt_") and v is not None}
