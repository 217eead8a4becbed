"""``kvsim policy-profile``: measure a grid of policy settings on capture sets (a measured input
of the planner, as ``kvsim profile`` is for hardware); show a profile at a context; back-test its
context fits."""

from __future__ import annotations

import argparse

from kvsim.errors import KvsimError

HELP = "measure policy statistics across lengths, layers and settings; show or back-test them"

EPILOG = """examples:
  kvsim policy-profile traces/captures/*.npz --policy \\
      verkv:sketch=2bit,verkv:sketch=perfect,topk,poissoncomp --compression 8,16,32 \\
      --eps 0.01,0.05,0.1,0.3 --sink 4 --local 4 --out my-profile.json
                                            (resumable: rerun the same command after a stop)
  kvsim policy-profile --show                 (the shipped profile's grid: every policy setting
                                            it holds; or --show FILE for another profile)
  kvsim policy-profile --show traces/policy-profile-smollm2.json --policy verkv --sink 4 \\
      --local 4 --context 32768             (the statistics at 32K, with 90% intervals; a value
                                            between two grid values of one option is interpolated)
  kvsim policy-profile --backtest traces/policy-profile-smollm2.json --policy verkv --sink 4 \\
      --local 4                             (fit on lengths up to 4K, predict 8K)
  kvsim replay --policy verkv --policy-profile my-profile.json --sink 4 --local 4
"""


def add_parser(sub) -> None:
    from kvsim.commands._policy_flags import add_policy_flags, policy_help
    p = sub.add_parser("policy-profile", help=HELP, description=__doc__, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("captures", nargs="*", help="capture sets (kvsim capture --lengths)")
    p.add_argument("--policy", metavar="SPEC[,SPEC...]",
                   help="policies, comma-separated, each " + policy_help() + "; a grid of a "
                        "policy's own option is one item per value: verkv:sketch=2bit,"
                        "verkv:sketch=perfect")
    p.add_argument("--out", help="profile to write (.json)")
    p.add_argument("--show", metavar="PROFILE", nargs="?", const=True,
                   help="print PROFILE's statistics at --context (without --policy: the grid of "
                   "settings it holds); PROFILE left out: the shipped profile, which replay and "
                   "plan use")
    p.add_argument("--backtest", metavar="PROFILE",
                   help="print the back-test of PROFILE's context fits")
    p.add_argument("--fit-up-to", type=int, default=4096,
                   help="--backtest: fit on target lengths up to this [default: 4096]")
    p.add_argument("--context", type=int, default=32768, help="--show: planned context "
                   "[default: 32768]")
    p.add_argument("--jobs", type=int, default=1,
                   help="worker processes when building (one thread each) [default: 1]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="overwrite --out")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--no-progress", action="store_true")
    add_policy_flags(p, lists=True)
    p.set_defaults(run=run)


def run(args) -> int:
    from kvsim.commands._policy_flags import policy_options
    from kvsim.policies.spec import parse
    if sum(bool(x) for x in (args.out, args.show, args.backtest)) != 1:
        raise KvsimError("give one of --out (build from capture sets), --show PROFILE or "
                         "--backtest PROFILE")
    from kvsim import policy_profile as pp
    if args.show is True:  # --show with no file: the shipped profile
        args.show = str(pp.DEFAULT)
    if args.show and not args.policy and not args.captures:
        return _grid(pp.load(args.show), args.json)
    if not args.policy:
        raise KvsimError("--policy is required")
    specs, unused = parse(args.policy, policy_options(args), grid=True)
    if unused:
        raise KvsimError(f"{', '.join(unused)} applies to none of the policies named")
    if args.out:
        if not args.captures:
            raise KvsimError("name the capture sets to measure (kvsim capture --lengths)")
        if not args.out.endswith(".json"):
            raise KvsimError(f"{args.out}: a policy profile file must end in .json")
        from pathlib import Path
        missing = [c for c in args.captures if not Path(c).is_file()]
        if missing:  # before the first capture set is measured
            raise KvsimError(f"{missing[0]}: no such capture set")
        from kvsim.policy_profile.build import build
        if args.jobs < 1:
            raise KvsimError(f"--jobs must be >= 1, got {args.jobs}")
        prof = build(args.captures, specs, args.out, args.seed, args.force,
                     progress=not args.no_progress, jobs_n=args.jobs)
        print(f"wrote {args.out}: {len(prof['settings'])} settings x {len(prof['captures'])} "
              f"capture sets, {len(prof['rows']):,} rows")
        return 0
    if args.captures:
        raise KvsimError("capture sets are read only when building (--out)")
    prof = pp.load(args.show or args.backtest)
    from kvsim.policies import make
    from kvsim.replay.policy_source import unset_from_profile
    settings = []
    for s in specs:  # sink and local left unset: the sizes the profile was measured with
        params = __import__("dataclasses").asdict(make(s.name, s.options).params)
        filled = unset_from_profile(prof, s.name, params) if prof.has(s.name) else {}
        settings.append((s, {**params, **filled}))
    if args.show:
        return _show(prof, settings, args.context, args.json)
    return _backtest(prof, settings, args.fit_up_to, args.json)


def grid_rows(prof) -> list[dict]:
    """One row per setting the profile holds: the policy and the options its grid varies."""
    rows = []
    for name in dict.fromkeys(n for n, _ in prof.settings):
        same = [p for n, p in prof.settings if n == name]
        varied = [k for k in same[0] if len({str(p.get(k)) for p in same}) > 1]
        fixed = ", ".join(f"{k}={v}" for k, v in same[0].items()
                          if k not in varied and v is not None)
        rows += [{"policy": name, "setting": ", ".join(f"{k} {p[k]:g}" if isinstance(p[k], float)
                                                       else f"{k} {p[k]}" for k in varied)
                  or "(one setting)", "fixed": fixed, "options": p} for p in same]
    return rows


def _grid(prof, as_json: bool) -> int:
    from kvsim.commands._out import print_json, table
    rows = grid_rows(prof)
    if as_json:
        print_json({"profile": prof.where, "summary": prof.summary(),
                    "context_tokens": [int(round(x)) for x in prof.n], "settings": rows})
        return 0
    print(f"{prof.where}: {prof.summary()}")
    print(f"grid: {len(rows)} settings; a value between two grid values of one numeric option "
          f"(eps, compression) is interpolated (linear in its log), anything else is measured "
          f"with kvsim policy-profile")
    table([{k: r[k] for k in ("policy", "setting", "fixed")} for r in rows])
    return 0


def _show(prof, settings, context: int, as_json: bool) -> int:
    import numpy as np

    from kvsim.commands._out import print_json, table
    out = []
    for spec, params in settings:
        a = prof.at(spec.name, params, context)
        rows = [{"statistic": f"{k.split('.')[0]} {k.split('.')[1]}",
                 "value": a.stats[k.split(".")[0]].get(k.split(".")[1])
                 if k.split(".")[0] in a.stats else None,
                 "lo": lo, "hi": hi, "form": a.forms[k][0],
                 "back-test err": a.forms[k][1]} for k, (lo, hi) in a.intervals.items()]
        for r in rows:
            if r["value"] is None:
                r["value"] = a.stats.get(r["statistic"].split()[1])
        out.append({"policy": spec.label, "params": params, "context": context,
                    "grid": prof.describe_grid(spec.name),
                    "provenance": a.provenance, "warnings": a.warnings, "statistics": rows,
                    "per_layer_kv_read_frac": a.per_layer})
        if not as_json:
            print(f"{spec.label} at {context:,} tokens: {a.provenance}")
            print(f"grid of {spec.name} in the profile: {prof.describe_grid(spec.name)}")
            for w in a.warnings:
                print(f"warning: {w}")
            table(rows)
            print("\nmeasured means per length (what the fits use; every question, layers "
                  "weighted):")
            w = prof._weights(spec.name, params)
            means = []
            for ps in ("question", "decode", "overall"):
                units = prof._units(w, ps, "kv_read_frac")
                if units:
                    means.append({"KV read": ps, **{
                        f"{n:,.0f}": float(np.mean(np.concatenate([t[j] for t in units])))
                        for j, n in enumerate(prof.n)}})
            table(means)
            layers = sorted(a.per_layer)
            lens = sorted(next(iter(a.per_layer.values()))["decode"])
            print("\nKV read per forward pass, per layer (measured; decode / overall):")
            table([{"layer": l, **{f"{n:,}": f"{a.per_layer[l]['decode'][n]:.3f} / "
                                          f"{a.per_layer[l]['overall'][n]:.3f}" for n in lens}}
                   for l in layers])
            print()
    if as_json:
        print_json(out)
    return 0


def _backtest(prof, settings, up_to: int, as_json: bool) -> int:
    """Fit each statistic's chosen form on the lengths up to ``up_to``, predict the longer ones,
    print the error; the form is the one the whole profile chose (as the planner uses it)."""
    import numpy as np

    from kvsim.commands._out import print_json, table
    from kvsim.policy_profile import PASSES, STATS, fit
    k = sum(t <= up_to for t in prof.targets)
    if k < 2 or k == len(prof.targets):
        raise KvsimError(f"--fit-up-to {up_to}: the profile's lengths are {prof.targets}; "
                         f"leave at least two to fit and one to predict")
    rows = []
    for spec, params in settings:
        w = prof._weights(spec.name, params)
        for ps in PASSES:
            for stat in STATS:
                units = prof._units(w, ps, stat)
                if not units or (stat in ("resident_frac", "meta_frac", "held_tokens")
                                 and ps != "overall"):
                    continue
                y = np.array([np.mean(np.concatenate([t[j] for t in units]))
                              for j in range(len(prof.n))])
                form, _ = fit.choose(prof.n[:k], y[:k]) if k >= 3 else ("loglin", {})
                for j in range(k, len(prof.n)):
                    p = fit.predict(form, prof.n[:k], y[:k], [prof.n[j]])
                    pred = float(p[0]) if p is not None else float("nan")
                    rows.append({"policy": spec.label, "pass": ps, "statistic": stat,
                                 "form": form, "fitted on": f"{prof.n[0]:.0f}..{prof.n[k-1]:.0f}",
                                 "predicted at": int(round(prof.n[j])), "predicted": pred,
                                 "measured": float(y[j]),
                                 "error %": 100 * fit.error(pred, float(y[j]))})
    if as_json:
        print_json(rows)
    else:
        table(rows)
    return 0
