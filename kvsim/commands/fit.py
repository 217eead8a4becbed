"""kvsim fit: fit an engine profile to measured serving points (TPOT per configuration)."""

from __future__ import annotations

import argparse

from kvsim.commands._out import print_json, table

HELP = "fit an engine profile (overheads, efficiencies, link, decide cost) to measured points"
EPILOG = """example (the VerKV paper's vLLM measurements on one H100, shipped with kvsim):
  kvsim fit data/verkv-paper-h100.csv --launches per-layer --fetch serial \\
      --out my-engine.json
  kvsim replay --engine my-engine.json --policy verkv --eps 0.05 --batch 4 ...

MEASURED.csv: one row per measured configuration. Required columns: gpu, model, policy,
context, batch, tpot_ms. Optional: policy options (eps, compression, sketch, ...),
kv_read_frac (the measured fetch fraction: replaces the trace's), fetch_ms, decide_ms (per decode
step), throughput_tok_s, output_len (default 128), use (fit | check: predicted, not fitted),
source, certainty, note. Lines starting with # are comments.

Every measured value of the fit rows is fitted (bounded least squares on relative error, scipy).
Parameters: step_overhead_ms, hbm_efficiency, flop_efficiency, link.<h2d|d2h|gather>.gbps and
.launch_us, and for each policy in the rows that decides per step what to fetch
decide.<policy>.per_layer_us, .per_ktoken_us, .per_kfetched_us, .serial_share. Free by default:
what the rows can tell apart (see kvsim.fit.solve); --free and --fix change that. Printed per
row: the fitted error and the leave-one-out error (the row predicted by a fit of the others);
check rows are predicted only.

Published points of several engines (an ``engine`` column: vllm, sglang, trtllm, ...), like
the shipped data/published.csv, fit in two levels (kvsim.fit.families): the kernel shapes and
efficiencies shared by every row, then one engine's overheads and efficiencies from its own rows
(--family NAME; without it the shared level is written):
  kvsim fit data/published.csv --family vllm --out vllm.json --cv source

--cv source: leave one source out. For each value of the source column (one publication), an
engine fitted on the fit rows of every other source predicts that source's rows; printed per
source with the errors, and how many of all the held-out predictions fall within 20%. With
engine families it prints the table per category and beside it the same values under the fit
of every source ("fitted"): the gap between the two is what a publication's own rows teach its
engine family and no other source does.

--cv engine-version (engine families only): leave one engine version out. The version is the
engine family and the first major.minor in the engine_version column ("0.9.0" and "~0.9 (main)"
are trtllm 0.9), else its first word, else "unstated". An engine fitted on every other version's
fit rows, the family's other versions included, predicts that version's rows: how well a fit
carries to an engine version it never saw. A family with one version is predicted by the shared
engine. Printed per category and per held-out version:
  kvsim fit data/published.csv --family trtllm --out trtllm.json --cv engine-version --jobs 2
"""


def add_parser(sub) -> None:
    p = sub.add_parser("fit", help=HELP, description=__doc__, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("measured", metavar="MEASURED.csv", help="measured serving points")
    p.add_argument("--out", required=True, metavar="ENGINE.json", help="engine profile to write")
    p.add_argument("--base", default="roofline", metavar="NAME|JSON",
                   help="engine whose fields the fit starts from and keeps where not fitted "
                        "[default: roofline]")
    p.add_argument("--launches", choices=["per-sequence", "per-layer"],
                   help="how the measured engine launches a layer's copies: one per sequence, "
                        "or one batched launch for the whole batch")
    p.add_argument("--fetch", choices=["policy", "serial", "overlap"],
                   help="whether the measured engine overlaps a policy's fetch with compute "
                        "(policy: as the policy says)")
    p.add_argument("--free", metavar="NAME[,NAME...]",
                   help="exactly these parameters are free (default: what the rows identify)")
    p.add_argument("--fix", action="append", default=[], metavar="NAME=VALUE",
                   help="hold a parameter at a value (repeatable)")
    p.add_argument("--trace", help="trace the policies are analysed on [default: shipped]")
    p.add_argument("--name", default=None, help="engine name [default: the output's stem]")
    p.add_argument("--describe", default="", metavar="TEXT", help="engine description")
    p.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    p.add_argument("--cv", choices=["source", "engine-version"],
                   help="also cross-validate, leaving out one source (publication) at a time, "
                        "or with engine families one engine version (see below)")
    p.add_argument("--jobs", type=int, default=1,
                   help="with --cv and engine families: groups left out at once, in worker "
                        "processes (the same results) [default: 1]")
    p.add_argument("--family", metavar="ENGINE",
                   help="with an engine column: the engine family whose profile to write "
                        "(its rows refit its overheads and efficiencies on the shared fit)")
    p.add_argument("--json", action="store_true", help="print the fit as one JSON object")
    p.set_defaults(run=run)


def _fixed(items: list[str]) -> dict:
    from kvsim.checks import parse, real
    from kvsim.errors import KvsimError
    out = {}
    for item in items:
        k, sep, v = item.partition("=")
        if not sep:
            raise KvsimError(f"--fix {item!r}: give NAME=NUMBER")
        out[k.strip()] = real(parse(v), f"--fix {k.strip()}")
    return out


def _short(row: dict, rows: list[dict]) -> str:
    """The policy and the options that differ between its rows: ``verkv eps=0.05``."""
    same = [r["options"] for r in rows if r["policy"].split(":")[0] ==
            row["policy"].split(":")[0]]
    vary = [k for k, v in row["options"].items() if any(o.get(k) != v for o in same)]
    return " ".join([row["policy"].split(":")[0], *(f"{k}={row['options'][k]:g}"
                     if isinstance(row["options"][k], float) else f"{k}={row['options'][k]}"
                     for k in vary)])


def _check(args) -> None:
    """The options, before any point is read or policy analysed: the output, the numbers, the
    base engine and the trace named."""
    from pathlib import Path

    from kvsim.errors import KvsimError
    from kvsim.hw.engine import load
    from kvsim.io import check_destination
    check_destination(args.out, args.force)
    if args.jobs < 1:
        raise KvsimError(f"--jobs must be >= 1, got {args.jobs}")
    _fixed(args.fix)
    load(args.base)
    if args.trace is not None and not Path(args.trace).is_file():
        raise KvsimError(f"{args.trace}: no such trace file")


def run(args) -> int:
    import dataclasses
    from pathlib import Path

    from kvsim.errors import KvsimError
    from kvsim.fit import Predictor, read_points
    from kvsim.fit.solve import fit
    from kvsim.hw.engine import Value, load
    _check(args)  # before the work
    points = _fittable(args, read_points(args.measured))
    if any(p.engine for p in points):
        return _run_families(args, points)
    if args.family:
        raise KvsimError(f"--family {args.family}: {args.measured} has no engine column")
    base = load(args.base)
    fields = dict(base.fields)
    for key, val in (("link_launches", args.launches), ("fetch", args.fetch)):
        if val is not None:
            fields[key] = Value(val, "override", f"given to kvsim fit (--{key.split('_')[-1]})")
    base = dataclasses.replace(base, fields=fields)
    free = [f.strip() for f in args.free.split(",") if f.strip()] if args.free else None
    if not args.json:  # on stdout: a refusal below stays one line on stderr
        print(f"fitting {len(points)} points of {args.measured} (the policies are analysed on "
              f"the trace first)", flush=True)
    res = fit(points, Predictor(args.trace), base, free, _fixed(args.fix),
              args.name or Path(args.out).stem, args.describe, args.measured,
              progress=not args.json)
    res.engine.save(args.out, args.force)
    cv = None
    if args.cv:
        from kvsim.fit.solve import cross_validate, cv_summary
        groups = cross_validate(points, Predictor(args.trace), base, free, _fixed(args.fix),
                                args.cv)
        cv = {"by": args.cv, "groups": groups, "summary": cv_summary(groups)}
    if args.json:
        print_json({"engine": res.engine.to_json(), "out": args.out,
                    **({"cv": cv} if cv else {})})
        return 0
    print(f"fitted {len(res.free)} parameters to {args.measured}: RMS relative error "
          f"{100 * res.cost:.2f}%")
    table([{"parameter": k, "value": v} for k, v in res.values.items()])
    for use, title in (("fit", "fit rows"), ("check", "check rows (predicted, not fitted)")):
        rows = [r for r in res.rows if r["use"] == use]
        if not rows:
            continue
        print(f"\n{title}")
        out = []
        for r in rows:
            d = {"row": r["row"], "policy": _short(r, res.rows), "ctx": r["context"],
                 "B": r["batch"]}
            for k in ("tpot_ms", "fetch_ms", "decide_ms", "throughput_tok_s"):
                if f"measured_{k}" in r:
                    d[f"{k}"] = r[f"measured_{k}"]
                    d[f"pred_{k}"] = r[f"predicted_{k}"]
                    d[f"err%_{k.split('_')[0]}"] = round(r[f"err_{k}_pct"], 2) + 0.0
            if use == "fit":
                d["loo_err%"] = round(r["loo_tpot_pct"], 2) \
                    if r.get("loo_tpot_pct") is not None else "n/a"
            out.append(d)
        cols = list(dict.fromkeys(c for d in out for c in d))
        table([{c: d.get(c, "") for c in cols} for d in out], cols)
        notes = [f"row {r['row']}: {r['loo_note']}" for r in rows if r.get("loo_note")]
        for n in notes:
            print(f"  leave-one-out n/a, {n}")
    if cv:
        _print_cv(cv)
    print(f"\nwrote {args.out}")
    return 0


def _fittable(args, points: list) -> list:
    """``points``, refused where nothing can be fitted, or where ``--cv`` cannot hold a group
    out and still fit on the rest."""
    from kvsim.errors import KvsimError
    if not any(p.use == "fit" for p in points):
        raise KvsimError(f"{args.measured}: no rows to fit (every row has use=check)")
    if args.cv:
        from kvsim.fit.families import group_of
        if args.cv == "engine-version" and not any(p.engine for p in points):
            raise KvsimError(f"--cv engine-version: {args.measured} has no engine column; it "
                             f"holds out engine versions of engine families")
        key = (lambda p: group_of(p, "engine-version")) if args.cv == "engine-version" \
            else (lambda p: p.meta.get("source"))
        noun = args.cv.replace("-", " ")
        groups = {key(p) for p in points}
        fitted = {key(p) for p in points if p.use == "fit"}
        if len(groups) < 2 or not any(fitted - {g} for g in groups):
            shown = ", ".join(sorted(str(g) for g in groups))
            raise KvsimError(f"--cv {args.cv}: {args.measured} holds one {noun} ({shown}) "
                             f"among its fit rows and the rest; leaving it out leaves nothing "
                             f"to fit: give points of two {noun}s or more")
    return points


def _print_cv(cv: dict) -> None:
    by, s = cv["by"], cv["summary"]
    print(f"\nleave-one-{by}-out: each {by}'s rows predicted by a fit of the other {by}s' "
          f"fit rows")
    rows = []
    for g in cv["groups"]:
        errs = g["errors_pct"]
        rows.append({by: g[by], "rows": " ".join(map(str, g["rows"])),
                     "fitted_on": g["fitted_on"],
                     "err%": " ".join(f"{e:+.1f}" for e in errs) or "n/a",
                     "max|err|%": round(max(map(abs, errs)), 1) if errs else "n/a",
                     "not fitted without it": ", ".join(g["held"]) or "-",
                     "note": g["note"] or "-"})
    table(rows)
    if s["predicted"]:
        print(f"within {s['within_pct']:g}%: {s['within']} of {s['predicted']} held-out "
              f"predictions; median |err| {s['median_abs_pct']:.1f}%, largest "
              f"{s['max_abs_pct']:.1f}%")


def _run_families(args, points) -> int:
    """``kvsim fit`` of published points of several engines (:mod:`kvsim.fit.families`)."""
    import dataclasses
    from pathlib import Path

    from kvsim.errors import KvsimError
    from kvsim.fit import Predictor
    from kvsim.fit import families as F
    from kvsim.hw.engine import load
    names = sorted({p.engine for p in points if p.engine})
    if args.family is not None and args.family not in names:
        raise KvsimError(f"--family {args.family}: no such engine in {args.measured} (engines: "
                         f"{', '.join(names)})")
    if args.free or args.fix or args.launches or args.fetch:
        raise KvsimError("--free, --fix, --launches and --fetch apply to one engine's points; "
                         "a fit of engine families chooses its parameters (kvsim.fit.families)")
    pred, base = Predictor(args.trace), load(args.base)
    rows = [p for p in points if p.use == "fit"]
    if not args.json:
        print(f"fitting {len(rows)} points of {args.measured} ({len(names)} engines: "
              f"{', '.join(names)})", flush=True)
    shared, engine, free, engines = F.fit_levels(rows, pred, base, args.family)
    name = args.name or Path(args.out).stem
    cv = summary = fitted = None
    if args.cv:
        cv = F.cross_validate(points, pred, base, progress=not args.json, jobs=args.jobs,
                              by=args.cv)
        summary = F.summary(cv)
        fitted = F.summary(F.fitted_values(points, pred, shared, engines))
    engine = dataclasses.replace(engine, name=name, description=args.describe or (
        f"{args.family or 'every engine'}, fitted by kvsim fit on {args.measured}"),
        fit=F.record(points, rows, pred, engine, args.family, free, cv, summary, args.cv))
    engine.save(args.out, args.force)
    if args.json:
        print_json({"engine": engine.to_json(), "out": args.out,
                    **({"cv": {"by": args.cv, "values": cv, "summary": summary,
                               "fitted_summary": fitted}} if cv else {})})
        return 0
    print(f"shared: {', '.join(free['shared'])}; {args.family or 'shared'}: "
          f"{', '.join(free['family']) or '(the shared values)'}")
    table([{"parameter": k, "shared": shared.get(k), "value": engine.get(k)}
           for k in (*free["shared"], *[f for f in free["family"] if f not in free["shared"]])])
    if summary:
        print_cv_summary(summary, fitted, args.cv)
        if args.cv == "engine-version":
            print("\neach engine version held out in turn")
            print_cv_rows(F.summary(cv, groups=lambda v: [v["held_out"]]), head="held out")
    print(f"\nwrote {args.out}")
    return 0


def print_cv_summary(summary: list[dict], fitted: list[dict] | None = None,
                     by: str = "source") -> None:
    """The leave-one-``by``-out table, per category and overall; with ``fitted`` (the same
    values predicted by the fit of every source) its share within 20% and median beside."""
    noun = by.replace("-", " ")
    print(f"\nleave-one-{by}-out: each {noun}'s values predicted by a fit of the others"
          + ("; 'fitted': by the fit of every source, its own included" if fitted else ""))
    print_cv_rows([r for r in summary if r["values"]], fitted)  # (no serving rows here)


def print_cv_rows(summary: list[dict], fitted: list[dict] | None = None,
                  head: str = "category") -> None:
    """The rows of :func:`kvsim.fit.families.summary` as a table (``fitted`` beside), the
    group's name under ``head``."""
    fit = {r["category"]: r for r in fitted or []}
    pct = lambda r, k, f: f.format(r[k]) if r and r["values"] else "-"  # noqa: E731
    table([{head: r["category"], "values": r["values"], "sources": r.get("sources", 0),
            "within 20%": pct(r, "within_share", "{:.0%}"),
            "median |err|": pct(r, "median_abs_pct", "{:.1f}%"),
            "largest": pct(r, "max_abs_pct", "{:.0f}%"),
            "in interval": pct(r, "covered_share", "{:.0%}"),
            **({"fitted: within 20%": pct(fit.get(r["category"]), "within_share", "{:.0%}"),
                "fitted: median": pct(fit.get(r["category"]), "median_abs_pct", "{:.1f}%")}
               if fitted else {})}
           for r in summary])
