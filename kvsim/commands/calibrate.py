"""``kvsim calibrate``: per-layer VarRate bases from calibration traces."""

from __future__ import annotations

from kvsim.commands._out import print_json, table

HELP = "build per-layer VarRate bases from calibration traces"


def add_parser(sub) -> None:
    import argparse
    p = sub.add_parser("calibrate", help=HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="example:\n"
                              "  kvsim calibrate --traces cal-*.npz --out basis.npz\n"
                              "  kvsim replay mk-2k.npz --policy varrate:basis=basis.npz",
                       description="Fit each layer's VarRate residual basis (top-R right "
                                   "singular vectors of the anchor residuals) on the contexts of "
                                   "unlabeled calibration traces (`kvsim capture`), and store it "
                                   "for `--policy varrate:basis=FILE` (or flat:basis=FILE).")
    p.add_argument("--traces", nargs="+", required=True, metavar="TRACE",
                   help="calibration traces (.npz with an attention section)")
    p.add_argument("--out", required=True, help="basis file to write (.npz)")
    p.add_argument("--rank", type=int, default=None,
                   help="basis rows R per layer (default: D, every direction, ordered)")
    p.add_argument("--layers", type=int, nargs="+", default=None,
                   help="layers to calibrate (default: every layer all traces hold)")
    p.add_argument("--stride", type=int, default=16, help="anchor stride (as the policy's)")
    p.add_argument("--anchors-c", type=int, default=4, help="nearest anchors (as the policy's)")
    p.add_argument("--window", type=int, default=64, help="exact recent window (as the policy's)")
    p.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    p.add_argument("--json", action="store_true", help="print the basis meta as JSON")
    p.set_defaults(run=run)


def run(args) -> int:
    from pathlib import Path

    from kvsim.errors import KvsimError
    from kvsim.policies.varrate import calibrate
    if args.rank is not None and args.rank < 1:
        raise KvsimError(f"--rank {args.rank} must be >= 1")
    for flag, v, least in (("--window", args.window, 0), ("--anchors-c", args.anchors_c, 1),
                           ("--stride", args.stride, 1)):
        if v is not None and v < least:
            raise KvsimError(f"{flag} must be >= {least}, got {v}")
    out = Path(args.out)
    if out.suffix != ".npz":
        raise KvsimError(f"{out}: a basis file must end in .npz")
    if out.exists() and not args.force:  # before the work, not after
        raise KvsimError(f"{out} exists; pass --force to overwrite it")
    missing = [t for t in args.traces if not Path(t).is_file()]
    if missing:  # before the first trace is read, not after it is calibrated
        raise KvsimError(f"{missing[0]}: no such trace file")
    basis = calibrate.calibrate(args.traces, rank=args.rank, stride=args.stride,
                                c=args.anchors_c, window=args.window, layers=args.layers)
    calibrate.save(basis, out, force=args.force)
    meta = dict(basis.meta, out=str(out))
    if args.json:
        print_json(meta)
        return 0
    rows = []
    D = meta["D"]
    for l, sv in basis.sv.items():
        e = sv.double() ** 2
        tot = meta["residual_energy"][str(l)] or 1.0
        row = {"layer": l, "residual_rows": meta["residual_rows"][str(l)]}
        for name, r in (("D/8", D // 8), ("D/4", D // 4), ("D/2", D // 2)):
            if r <= meta["R"]:
                row[f"energy_top_{name}"] = float(e[:r].sum()) / tot
        rows.append(row)
    print(f"wrote {out}: {len(basis.layers)} layers, D={D}, R={meta['R']}, from "
          f"{len(args.traces)} trace(s); energy_top_X = share of the residual energy that the "
          f"leading X basis rows capture")
    table(rows)
    return 0
