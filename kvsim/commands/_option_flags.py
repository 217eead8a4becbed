"""Option dataclasses as command-line flags (the way policy ``Params`` become flags): each field
is one flag, its metadata giving ``help``, ``choices``, ``metavar``, ``kind`` (the type where the
default is None) and ``flag`` (default ``--field-name``); the dataclass's ``check()`` validates.
A new option is one field: ``kvsim replay`` and ``kvsim plan`` both get its flag."""

from __future__ import annotations

import argparse
import dataclasses


def add_option_flags(parser: argparse.ArgumentParser, cls, title: str, about: str) -> None:
    """One flag per field of ``cls``, in a group ``title``, default the field's."""
    group = parser.add_argument_group(title, about)
    for f in dataclasses.fields(cls):
        meta = f.metadata
        kw = {"dest": f.name, "default": f.default, "help": meta.get("help")}
        if "choices" in meta:
            kw["choices"] = meta["choices"]
        else:
            kw["type"] = meta.get("kind") or type(f.default)
        if "metavar" in meta:
            kw["metavar"] = meta["metavar"]
        group.add_argument(meta.get("flag", "--" + f.name.replace("_", "-")), **kw)


def option_values(args: argparse.Namespace, cls) -> dict:
    """Every field of ``cls`` as the flags set it."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)}


def changed_options(args: argparse.Namespace, cls) -> dict:
    """The fields of ``cls`` whose flags differ from their defaults."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
            if getattr(args, f.name) != f.default}


def journal_key(args: argparse.Namespace, cls) -> dict:
    """The fields as a plan journals them: all, but those marked ``"keyed": "when set"`` (added
    after plans were journaled) only when changed, so that an older journal still resumes."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
            if f.metadata.get("keyed") != "when set" or getattr(args, f.name) != f.default}
