"""``kvsim validate``: real decode loops on the profiled device vs the simulator's prediction."""

from __future__ import annotations

import argparse

from kvsim.commands._out import fmt, print_json, table
from kvsim.errors import KvsimError

HELP = ("run real decode loops on the profiled device and compare measured with predicted TPOT "
        "(MAPE)")


def _ints(s: str) -> list[int]:
    try:
        out = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") \
            from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {s!r}")
    from kvsim.checks import distinct
    from kvsim.errors import KvsimError
    try:
        return distinct(out, repr(s))
    except KvsimError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


EPILOG = """examples:
  kvsim validate --device cpu --json                       profiles first (--quick); ~25 s here
  kvsim validate --gpu 0 --profile traces/h200-qwen3-4b.npz
  kvsim validate --device cpu --policies dense,topk:compression=8:sink=4:local=4 --contexts 4096

Each configuration runs real decode steps of a model-shaped stack (random weights) built from
the policy's decode cost, and compares their median time with the simulator's prediction from
the same profile.
"""


def add_parser(sub) -> None:
    p = sub.add_parser("validate", help=HELP, description=__doc__, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpu", type=int, default=None, metavar="N", help="CUDA device index")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None)
    p.add_argument("--profile", default=None,
                   help="hardware trace from kvsim profile on this device (default: profile "
                        "first with --quick)")
    p.add_argument("--save-profile", default=None,
                   help="where to keep the profile made when --profile is not given")
    p.add_argument("--contexts", type=_ints, default=None, help="e.g. 1024,4096")
    p.add_argument("--batches", type=_ints, default=None, help="e.g. 1,4")
    p.add_argument("--layers", type=int, default=None,
                   help="layers of the validation stack (default: the model's on a GPU, at "
                        "most 12 on the CPU)")
    p.add_argument("--policies", default=None, metavar="SPEC[,SPEC...]",
                   help="any registered policies, NAME[:KEY=VALUE...] each; those that run on "
                        "attention skip (with a note) contexts their budget does not fit "
                        "[default: dense-resident, dense-offload and every policy with a decide "
                        "kernel]")
    p.add_argument("--steps", type=int, default=None, help="timed decode steps per config")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=None,
                   help="interleaved passes over the configurations (default 3 on the CPU, 1 "
                        "on a GPU); the median step time over all passes is reported")
    p.add_argument("--threads", type=int, default=None, help="CPU: torch threads (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(run=run)


def _check(args) -> None:
    """The options, before torch, the profile or any measuring: counts, the files named."""
    from pathlib import Path
    for flag, v in (("--layers", args.layers), ("--steps", args.steps),
                    ("--rounds", args.rounds), ("--threads", args.threads)):
        if v is not None and v < 1:
            raise KvsimError(f"{flag} must be positive, got {v}")
    if args.profile is not None and not Path(args.profile).is_file():
        raise KvsimError(f"{args.profile}: no such profile (kvsim profile writes one)")
    if args.save_profile is not None and args.profile is None:  # profiled into it, first
        from kvsim.io import check_destination
        if Path(args.save_profile).suffix != ".npz":
            raise KvsimError(f"{args.save_profile}: a trace file must end in .npz")
        check_destination(args.save_profile)


def run(args) -> int:
    _check(args)
    from kvsim.validate import validate
    if args.gpu is None and args.device is None:
        args.gpu = 0
    res = validate(profile=args.profile, gpu=args.gpu, device=args.device,
                   contexts=args.contexts, batches=args.batches, layers=args.layers,
                   policies=tuple(p.strip() for p in args.policies.split(",") if p.strip())
                   if args.policies is not None else None,
                   steps=args.steps, warmup=args.warmup, threads=args.threads,
                   save_profile=args.save_profile, seed=args.seed, rounds=args.rounds,
                   progress=not args.no_progress and not args.json)
    if args.json:
        print_json(res)
        return 0
    print(f"validate on {res['device']} ({res['model']}), profile {res['profile']}")
    cols = ["policy", "context", "batch", "measured_tpot_ms", "predicted_tpot_ms", "error_pct"]
    if "mape_excl_wait" in res:
        cols += ["runqueue_wait_ms", "measured_excl_wait_ms", "error_excl_wait_pct"]
    table([{k: r[k] for k in cols} for r in res["configs"]])
    per = ", ".join(f"{p} {fmt(v)}%" for p, v in res["mape_by_policy"].items())
    print(f"MAPE {fmt(res['mape'])}% over {res['n_configs']} configurations ({per}); "
          f"{fmt(res['wall_s'])} s")
    if "mape_excl_wait" in res:
        print(f"MAPE excluding the main thread's wait for a core: "
              f"{fmt(res['mape_excl_wait'])}% (load average {res['load_avg']})")
    for n in res["notes"]:
        print(f"note: {n}")
    return 0
