"""``kvsim profile``: measure a GPU (or the CPU) and write a trace's hardware section."""

from __future__ import annotations

HELP = ("measure a GPU (--gpu N) or the CPU (--device cpu): link bandwidth, kernel times, NVML; "
        "writes a trace")


def add_parser(sub) -> None:
    import argparse
    p = sub.add_parser(
        "profile", help=HELP, description=HELP[0].upper() + HELP[1:] + ".",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
               "  kvsim profile --gpu 0 --model qwen3-4b --out traces/h200-qwen3-4b.npz  "
               "(2-4 min)\n"
               "  kvsim profile --device cpu --quick --out cpu.npz\n"
               "  kvsim profile --device cpu --quick --policies verkv --out cpu.npz  "
               "(one decide kernel)\n"
               "  kvsim replay traces/h200-qwen3-4b.npz --policy dense-offload    "
               "(plan on what it measured)")
    p.add_argument("--gpu", type=int, default=None, metavar="N", help="CUDA device index")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="cpu: profile the CPU (memcpy as the link); cuda: same as --gpu 0")
    p.add_argument("--model", default=None,
                   help="model shape for the kernel sweeps (default qwen3-4b on a GPU, "
                        "smollm2-135m on the CPU)")
    p.add_argument("--out", required=True, help="output trace (.npz)")
    p.add_argument("--quick", action="store_true", help="smaller sweeps (CI, a first look)")
    p.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    p.add_argument("--no-nvml", action="store_true", help="profile a GPU without NVML samples")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU: torch threads for the kernels (default 1; the copy thread is extra)")
    p.add_argument("--rounds", type=int, default=None,
                   help="repeat the sweeps and keep each point's median (default 3 on the CPU, "
                        "1 on a GPU)")
    p.add_argument("--policies", default=None, metavar="NAME[,NAME...]",
                   help="time these policies' decide kernels, each into its table "
                        "kernel_decide_<policy> [default: every policy with a decide kernel]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=run)


def _decide_kernels(text: str | None) -> dict:
    """Policy name -> decide kernel to time: those ``text`` names, or every fetching policy."""
    from kvsim.errors import KvsimError
    from kvsim.policies import resolve
    from kvsim.policies.registry import deciding
    from kvsim.validate import decide_kernels
    fetching = deciding()
    if text is None:
        return decide_kernels(fetching)
    names = [resolve(n.strip()).name for n in text.split(",") if n.strip()]
    if not names:
        raise KvsimError("--policies is empty")
    from kvsim.checks import distinct
    distinct(names, "--policies")
    for n in names:
        if n not in fetching:
            raise KvsimError(f"--policies: {n} has no decide kernel to time (policies with one: "
                             f"{', '.join(fetching)})")
    return decide_kernels(names)


def _check(args) -> None:
    """The options, before torch or any measuring: the output file, the model shape."""
    from pathlib import Path

    from kvsim.errors import KvsimError
    from kvsim.io import check_destination
    if Path(args.out).suffix != ".npz":
        raise KvsimError(f"{args.out}: a trace file must end in .npz")
    check_destination(args.out, args.force)
    if args.model is not None:
        from kvsim.hw import catalog
        catalog.model(args.model)
    if args.rounds is not None and args.rounds < 1:
        raise KvsimError(f"--rounds must be positive, got {args.rounds}")


def run(args) -> int:
    _check(args)
    if args.gpu is None and args.device is None:
        args.gpu = 0
    decide = _decide_kernels(args.policies)  # refused before any measuring
    from profiler.run import decide_lines, profile
    tr = profile(args.out, gpu=args.gpu, device=args.device, model=args.model, quick=args.quick,
                 force=args.force, nvml=not args.no_nvml, threads=args.threads, seed=args.seed,
                 progress=not args.no_progress, rounds=args.rounds,
                 decide=decide)
    hw = tr.hardware
    fit = hw.extra.get("fit", {})
    h2d = fit.get("link_h2d_pinned", {})
    print(f"wrote {args.out}: {tr.describe()}")
    print(f"  H2D pinned: alpha {h2d.get('alpha_s', float('nan')) * 1e6:.2f} us, "
          f"beta {h2d.get('beta_Bps', float('nan')) / 1e9:.2f} GB/s; "
          f"memory bw {hw.extra['hbm_bw'] / 1e9:.1f} GB/s; "
          f"matmul {hw.extra['flops'] / 1e12:.3f} TFLOP/s")
    for line in decide_lines(hw):
        print(f"  {line}")
    if hw.missing:
        print(f"  missing ({len(hw.missing)}): " + "; ".join(hw.missing))
    return 0
