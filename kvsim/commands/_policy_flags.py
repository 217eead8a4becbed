"""Policy options as command-line flags, generated from every policy's ``Params`` dataclass.
What the flags mean for the policies named is decided by :mod:`kvsim.policies.spec`.

Building a parser loads no policy module (they import torch): the flags come from
:mod:`kvsim.policies._flag_table`, a torch-free copy of every policy's name, summary and
``Params`` fields, written by ``python scripts/gen_docs.py`` from the real classes
(``tests/test_docs.py`` fails when it is stale)."""

from __future__ import annotations

import argparse
import dataclasses
import textwrap

from kvsim.policies import ALIASES
from kvsim.policies.spec import clashes, convert, flag, kind

KINDS = {"int": int, "float": float, "bool": bool, "str": str}


def flag_table(policies: dict[str, type]) -> dict:
    """The torch-free table of ``policies``: name -> summary, the key of its Params class,
    and per Params class its fields (name, default, metadata with the field's kind)."""
    classes, pols = {}, {}
    for name, cls in sorted(policies.items()):
        key = f"{cls.Params.__module__}.{cls.Params.__qualname__}"
        pols[name] = {"summary": cls.summary, "params": key}
        classes[key] = [
            {"name": f.name,
             "default": "<missing>" if f.default is dataclasses.MISSING else f.default,
             "metadata": {**{k: (list(v) if isinstance(v, tuple) else v)
                             for k, v in f.metadata.items() if k != "kind"},
                          "kind": kind(f).__name__}}
            for f in dataclasses.fields(cls.Params)]
    return {"policies": pols, "params": classes}


def table_policies(table: dict | None = None) -> dict[str, type]:
    """Stand-ins for the registered policies, built from the table: each has ``summary`` and a
    ``Params`` dataclass with the real one's fields (one class per real Params class)."""
    if table is None:
        from kvsim.policies._flag_table import TABLE as table
    params = {}
    for key, fields in table["params"].items():
        specs = []
        for f in fields:
            meta = {**f["metadata"], "kind": KINDS[f["metadata"]["kind"]]}
            if "choices" in meta:
                meta["choices"] = tuple(meta["choices"])
            default = dataclasses.MISSING if f["default"] == "<missing>" else f["default"]
            specs.append((f["name"], meta["kind"], dataclasses.field(default=default,
                                                                      metadata=meta)))
        params[key] = dataclasses.make_dataclass(key.rsplit(".", 1)[-1], specs)
    return {name: type(name, (), {"name": name, "summary": p["summary"],
                                  "Params": params[p["params"]]})
            for name, p in table["policies"].items()}


def _options(policies: dict[str, type]) -> dict[str, tuple[dataclasses.Field, dict]]:
    """name -> (its field, {policy: its default}) for every option of ``policies``; a name that
    means two things among them is a RuntimeError (a policy's bug, caught by the tests)."""
    bad = clashes(policies)
    if bad:
        raise RuntimeError("; ".join(bad))
    seen: dict[str, tuple[dataclasses.Field, dict]] = {}
    for name, cls in sorted(policies.items()):
        for f in dataclasses.fields(cls.Params):
            seen.setdefault(f.name, (f, {}))[1][name] = f.default
    return seen


def _default_text(default) -> str:
    return "no default" if default is dataclasses.MISSING else \
        "default: see above" if default is None else f"default {default!r}" if default == "" \
        else f"default {default}"


def _defaults_text(owners: dict) -> str:
    """``[verkv, topk: default 16]`` or ``[varrate: default 5; verkv: default 16]``."""
    by_default: dict[str, list[str]] = {}
    for policy, default in owners.items():
        by_default.setdefault(_default_text(default), []).append(policy)
    return "[" + "; ".join(f"{', '.join(ps)}: {d}" for d, ps in by_default.items()) + "]"


def parse_list(kind_, text: str) -> list:
    """``"8,16,32"`` -> [8.0, 16.0, 32.0] for a float option (bools: true/false); each number
    checked as a single flag's is (:func:`kvsim.checks.checked_flags`)."""
    from kvsim.checks import flag_type, real, whole
    one = {int: flag_type(whole), float: flag_type(real)}.get(kind_)
    try:
        return [one(v) if one else convert(kind_, v) for v in text.split(",") if v.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def policy_help() -> str:
    """What ``--policy`` accepts: the spec syntax and every policy's summary."""
    names = "; ".join(f"{n}: {c.summary}" for n, c in sorted(table_policies().items())
                      if c.summary)
    aliases = ", ".join(f"{a} = {b}" for a, b in ALIASES.items())
    return (f"NAME[:KEY=VALUE...], e.g. verkv:eps=0.05:sketch=perfect (options written here "
            f"override the flags below; {aliases}). {names}")


def add_policy_flags(parser: argparse.ArgumentParser, lists: bool = False,
                     policies: dict[str, type] | None = None) -> None:
    """One flag per policy option (``policies``: every registered one); with ``lists`` each
    takes comma-separated values to sweep. Options that policies of more than one ``Params``
    take form the shared group, each naming who takes it with their defaults; the others sit
    in one group per ``Params`` class, titled with the policies that use it."""
    policies = table_policies() if policies is None else policies
    options = _options(policies)
    classes: dict[type, list[str]] = {}
    for name, cls in sorted(policies.items()):
        classes.setdefault(cls.Params, []).append(name)
    where = {n: {policies[p].Params for p in owners} for n, (_, owners) in options.items()}
    shared = [n for n in options if len(where[n]) > 1]
    if shared:
        _add(parser.add_argument_group("shared policy options", _wrap(
            "one meaning and one check in every policy that takes one; each names the "
            "policies that take it, with their defaults" +
            ("; give comma-separated values to sweep" if lists else ""))),
             options, shared, True, lists)
    for cls, owners in classes.items():
        own = [n for n in options if where[n] == {cls}]
        also = [flag(n) for n in shared if cls in where[n]]
        if own or also:
            who, takes = ", ".join(owners), "take" if len(owners) > 1 else "takes"
            desc = f"{who} {takes} {'these and' if own else 'only'} the shared " \
                   f"{', '.join(also)}" if also else ""
            _add(parser.add_argument_group(f"{who} options", _wrap(desc)), options, own, False,
                 lists)


def _wrap(text: str) -> str:
    return textwrap.fill(text, 90)


def _add(group, options: dict, names: list[str], shared: bool, lists: bool) -> None:
    for name in names:
        f, owners = options[name]
        k = kind(f)
        defaults = _defaults_text(owners) if shared else \
            f"[{_default_text(next(iter(owners.values())))}]"
        kw = {"default": None, "dest": f"opt_{name}",
              "help": f"{f.metadata.get('help', '')} {defaults}"}
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
                kw["metavar"] = name.upper()
        group.add_argument(flag(name), **kw)


def policy_options(args: argparse.Namespace) -> dict:
    """The policy flags the user gave (only those), as Params keyword arguments."""
    return {k[4:]: v for k, v in vars(args).items() if k.startswith("opt_") and v is not None}
