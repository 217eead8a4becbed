"""The policy options on a command line: ``--policy NAME[:KEY=VALUE...]`` carries a policy and its
own options; the options every policy shares (:data:`kvsim.policies.options.SHARED`: compression,
eps, delta, scorer, sink, local) are also flags, read by every named policy that takes them.
What they mean for the policies named is decided by :mod:`kvsim.policies.spec`.

Building a parser loads no policy module (they import torch): the shared options are defined in
a torch-free module. A policy-specific option written as a flag (``--sketch perfect``, which
older versions took) is refused in one line naming the spec form; only then are the policies
loaded, to say whose option it is (:func:`moved_flag`)."""

from __future__ import annotations

import argparse
import textwrap

from kvsim.policies.options import EDGE_DEFAULT, EDGE_NOTE, SHARED
from kvsim.policies.registry import ALIASES
from kvsim.policies.spec import convert, flag

METAVARS = {int: "N", float: "X"}
WHERE = "'kvsim policies [NAME]' lists the policies or one's options"


def parse_list(kind_, text: str) -> list:
    """``"8,16,32"`` -> [8.0, 16.0, 32.0] for a float option (bools: true/false); each number
    checked as a single flag's is (:func:`kvsim.checks.checked_flags`). A list is a set: an
    item given twice (``4,4``, ``64,64.0``) is refused, naming it; so is a list with no item."""
    from kvsim.checks import flag_type, real, whole
    one = {int: flag_type(whole), float: flag_type(real)}.get(kind_)
    try:
        items = [one(v) if one else convert(kind_, v) for v in text.split(",") if v.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if not items:
        raise argparse.ArgumentTypeError(f"{text!r} holds no value (a comma-separated list)")
    from kvsim.checks import distinct
    from kvsim.errors import KvsimError
    try:
        return distinct(items, repr(text))
    except KvsimError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def policy_help() -> str:
    """What ``--policy`` accepts: the spec syntax, and where each policy's options are listed."""
    aliases = ", ".join(f"{a} = {b}" for a, b in ALIASES.items())
    return (f"NAME[:KEY=VALUE...], e.g. quest:token_budget=2048 (over the shared flags; "
            f"{aliases}); {WHERE}")


def add_policy_flags(parser: argparse.ArgumentParser, lists: bool = False) -> None:
    """The shared policy options as flags, in one group; with ``lists`` each takes
    comma-separated values to sweep. Marks ``parser`` so that :func:`moved_flag` refuses a
    policy-specific option given as a flag (``kvsim.cli`` calls it before parsing)."""
    about = ("one meaning in every policy, read by each named policy that takes them (with its "
             "own default: 'kvsim policies NAME'; its other options go in its spec)"
             f"{'; comma-separated values to sweep' if lists else ''}. --sink, --local not "
             f"given: {EDGE_DEFAULT} each, or a quarter of the budget where that does not fit "
             "(warned)")
    group = parser.add_argument_group("shared policy options", textwrap.fill(about, 94))
    for name, s in SHARED.items():
        kw = {"default": None, "dest": f"opt_{name}", "help": s.help.replace(f" {EDGE_NOTE}", "")}
        if lists:
            kw["type"] = lambda text, k=s.kind: parse_list(k, text)
            kw["metavar"] = "V[,V...]"
        else:
            kw["type"], kw["metavar"] = s.kind, METAVARS.get(s.kind, "X")
            if s.choices:
                kw["choices"], kw["metavar"] = s.choices, "NAME"
        group.add_argument(flag(name), **kw)
    parser.policy_spec_flags = True  # kvsim.cli: refuse policy-specific flags before parsing


def policy_options(args: argparse.Namespace) -> dict:
    """The policy flags the user gave (only those), as Params keyword arguments."""
    return {k[4:]: v for k, v in vars(args).items() if k.startswith("opt_") and v is not None}


def _unknown(argv: list[str], known: dict) -> list[tuple[str, str | None]]:
    """(option name, its value or None) of each ``--name`` in ``argv`` that is no option of the
    parser as written (abbreviations included, which argparse would take as another flag)."""
    out = []
    for i, tok in enumerate(argv):
        if tok == "--":
            break
        if not tok.startswith("--") or len(tok) < 3 or tok.split("=", 1)[0] in known:
            continue
        name, eq, value = tok[2:].partition("=")
        if not eq:
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            value = nxt if nxt is not None and not nxt.startswith("--") else None
        out.append((name, value if eq or value is not None else None))
    return out


def _named_items(argv: list[str]) -> list[str]:
    """The items of ``--policy`` as written in ``argv`` (the last one given)."""
    items: list[str] = []
    for i, tok in enumerate(argv):
        text = tok.split("=", 1)[1] if tok.startswith("--policy=") else \
            argv[i + 1] if tok == "--policy" and i + 1 < len(argv) else None
        if text is not None:
            items = [t.strip() for t in text.split(",") if t.strip()]
    return items


def moved_flag(argv: list[str], known: dict) -> str | None:
    """One line refusing the first policy-specific option that ``argv`` gives as a flag, naming
    the spec that says it (``--sketch is an option of verkv: write --policy
    verkv:sketch=perfect; ...``); None where there is none. ``known``: the parser's option
    strings. The policies are loaded only when some flag is not one of them."""
    unknown = _unknown(argv, known)
    if not unknown:
        return None
    from kvsim.policies.registry import load_all
    from kvsim.policies.spec import fields, kind
    registry = load_all()
    for name, value in unknown:
        key, negated = name.replace("-", "_"), False
        owners = sorted(p for p, cls in registry.items() if key in fields(cls))
        if not owners and key.startswith("no_"):
            key, negated = key[3:], True
            owners = sorted(p for p, cls in registry.items() if key in fields(cls))
        if not owners or key in SHARED:
            continue
        items = [item for item in _named_items(argv) if _name(item) in owners] or owners[:1]
        if negated or value is None and kind(fields(registry[owners[0]])[key]) is bool:
            values = ["false" if negated else "true"]
        else:
            values = [v for v in (value or "VALUE").split(",") if v.strip()]
        spec = ",".join(f"{item}:{key}={v}" for item in items for v in values)
        whose = owners[0] if len(owners) == 1 else f"{', '.join(owners[:-1])} and {owners[-1]}"
        return (f"--{name} is an option of {whose}: write --policy {spec}; kvsim policies "
                f"{items[0].split(':')[0]} lists its options")
    return None


def _name(item: str) -> str | None:
    """The registered name of a ``--policy`` item; None for one that names no policy (refused
    later, with the rest of the spec)."""
    from kvsim.errors import KvsimError
    from kvsim.policies.registry import resolve
    try:
        return resolve(item.split(":")[0].strip()).name
    except KvsimError:
        return None
