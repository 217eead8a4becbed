"""kvsim policies: the registered KV policies, and each policy's options (what a --policy spec
such as quest:token_budget=2048 may set)."""

from __future__ import annotations

import argparse
import dataclasses
import textwrap

from kvsim.commands._out import print_json, table

HELP = "list the KV policies, or one policy's options (what its --policy spec takes)"
EPILOG = """examples:
  kvsim policies                 every policy: its kind, options and summary
  kvsim policies verkv           VerKV's options: kind, default, choices and meaning
  kvsim policies quest --json

A policy's options are written in its spec, NAME[:KEY=VALUE...], in kvsim replay, plan, eval and
policy-profile (kvsim replay --policy quest:token_budget=2048). The options marked shared mean
the same in every policy that takes them and are also flags (--compression, --eps, --delta,
--scorer, --sink, --local), read by every named policy that takes them; a value written in the
spec overrides the flag. mask: keeps a set in GPU memory and never fetches; fetch: fetches from
host memory per decision.
"""


def add_parser(sub) -> None:
    p = sub.add_parser("policies", help=HELP, description=__doc__, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", nargs="?", metavar="NAME",
                   help="a policy (or alias): list its options; left out: every policy")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(run=run)


def describe(cls) -> dict:
    """A policy as ``kvsim policies --json`` gives it: name, kind, summary and options (each
    with its kind, default, choices, help, and whether it is a shared option)."""
    from kvsim.policies import ALIASES
    from kvsim.policies.options import SHARED
    from kvsim.policies.spec import kind
    options = []
    for f in dataclasses.fields(cls.Params):
        missing = f.default is dataclasses.MISSING
        options.append({"name": f.name, "kind": kind(f).__name__,
                        "default": None if missing else f.default, "required": missing,
                        "choices": list(f.metadata.get("choices", ())),
                        "shared": f.name in SHARED, "help": f.metadata.get("help", "")})
    return {"name": cls.name, "kind": "fetch" if cls.fetches else "mask",
            "aliases": sorted(a for a, b in ALIASES.items() if b == cls.name),
            "needs_attention": bool(getattr(cls, "needs_attention", False)),
            "summary": cls.summary, "options": options}


def run(args) -> int:
    from kvsim.policies import load_all, resolve
    if args.name:
        d = describe(resolve(args.name))
        if args.json:
            print_json(d)
        else:
            _one(d)
        return 0
    ds = [describe(cls) for _, cls in sorted(load_all().items())]
    if args.json:
        print_json(ds)
        return 0
    width = max(len(_title(d)) for d in ds) + 2
    print(f"{'policy'.ljust(width)}kind   summary and options")
    for d in ds:
        own = [o["name"] for o in d["options"] if not o["shared"]]
        shared = [o["name"] for o in d["options"] if o["shared"]]
        lines = [d["summary"] or "-"]
        lines += [f"shared: {', '.join(shared)}"] if shared else []
        lines += [f"its own: {', '.join(own)}"] if own else []
        lines += [] if own or shared else ["no options"]
        body = [w for line in lines for w in textwrap.wrap(line, 98 - width - 7,
                                                           subsequent_indent="  ")]
        print(f"{_title(d).ljust(width)}{d['kind'].ljust(7)}{body[0]}")
        for line in body[1:]:
            print(" " * (width + 7) + line)
    print("\n" + textwrap.fill(
        "mask: keeps a set in GPU memory, never fetches; fetch: fetches from host memory per "
        "decision. A policy's options go in its spec (--policy quest:token_budget=2048); the "
        "shared ones are also flags (--sink 4). 'kvsim policies NAME' lists a policy's options "
        "with their defaults, choices and meaning.", 98))
    return 0


def _title(d: dict) -> str:
    return d["name"] + "".join(f" (= {a})" for a in d["aliases"])


def _default(o: dict) -> str:
    if o["required"]:
        return "required"
    return "-" if o["default"] is None else repr(o["default"]) if o["default"] == "" \
        else str(o["default"])


def _one(d: dict) -> None:
    print(textwrap.fill(f"{_title(d)}, {d['kind']}: {d['summary']}", 98,
                        subsequent_indent="    "))
    if not d["options"]:
        print(f"\n{d['name']} takes no options.")
        return
    print(f"\noptions: write them in the spec, --policy {d['name']}:KEY=VALUE[:KEY=VALUE...]; "
          f"the shared ones\nalso as flags, --KEY VALUE\n")
    table([{"option": o["name"], "kind": o["kind"], "default": _default(o),
            "choices": ", ".join(map(str, o["choices"])) or "-",
            "shared": "shared" if o["shared"] else ""} for o in d["options"]])
    print()
    for o in d["options"]:
        print(textwrap.fill(f"{o['name']}: {o['help']}", 98, subsequent_indent="    "))
    own = next((o for o in d["options"] if not o["shared"]), None)
    if own is not None:
        value = next((c for c in own["choices"] if c != own["default"]), None) \
            if own["choices"] else 2 * own["default"] if type(own["default"]) in (int, float) \
            else "VALUE"
        edges = "".join(f" --{k} 4" for k in ("sink", "local")
                        if any(o["name"] == k for o in d["options"]))
        print(f"\ne.g. kvsim replay --policy {d['name']}:{own['name']}={value}{edges}")
