"""The shipped policy profile beside an all-layer measurement of the same setting.

    python scripts/profile_check.py /tmp/full/mk-all.json /tmp/full/qa-all.json \\
        [--profile traces/policy-profile-smollm2.json] [--json data/profile-check.json]

The all-layer profiles come from capture sets of every layer and KV head of the same prompts
(kvsim capture --lengths ... --out /tmp/full/TASK.npz; kvsim policy-profile /tmp/full/TASK.npz
--policy verkv --compression 16 --eps 0.05 --sink 4 --local 4 --out /tmp/full/TASK-all.json).
For each length: the whole depth's mean (every layer, every head, every question), the shipped
profile's fitted value there with its 90% interval (from the capture sets of the same tasks
only), and the relative difference.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import numpy as np

from kvsim import policy_profile as pp
from kvsim.policies import make

CHECKS = [("decode", "kv_read_frac"), ("question", "kv_read_frac"), ("overall", "kv_read_frac"),
          ("overall", "violation_rate"), ("overall", "output_rel_err_mean")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("all_layer", nargs="+", help="all-layer profiles (one setting)")
    ap.add_argument("--profile", default=str(pp.DEFAULT))
    ap.add_argument("--json", help="also write the table here")
    args = ap.parse_args()
    full = [pp.load(p) for p in args.all_layer]
    tasks = sorted({f.captures[0]["task"] for f in full})
    prof = pp.load(args.profile).of_tasks(tasks)  # the same prompts' capture sets only
    name, params = full[0].settings[0]
    pol = make(name, {k: v for k, v in params.items() if v is not None})
    params = dataclasses.asdict(pol.params)
    rows = []
    for j, tgt in enumerate(full[0].targets):
        n_full = float(np.mean([f.n[j] for f in full]))
        a = prof.at(name, params, int(round(n_full)))
        for ps, st in CHECKS:
            vals = np.concatenate([np.concatenate([t[j] for t in f._units({0: 1.0}, ps, st)])
                                   for f in full])
            truth = float(vals.mean())
            got = a.stats[ps][st] if ps in a.stats and st in a.stats[ps] else a.stats.get(st)
            lo, hi = a.intervals[f"{ps}.{st}"]
            rows.append({"length": tgt, "statistic": f"{ps} {st}", "all layers": truth,
                         "profile": got, "90% lo": lo, "90% hi": hi,
                         "difference %": 100 * (got - truth) / max(abs(truth), 1e-4),
                         "inside": bool(lo <= truth <= hi)})
    from kvsim.commands._out import table
    shown = ", ".join(f"{k} {params[k]:g}" for k in ("compression", "eps") if k in params)
    print(f"{name} {shown}: shipped profile vs every layer and head of the same "
          f"prompts ({', '.join(f.captures[0]['task'] for f in full)})")
    table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"setting": [name, params], "all_layer": args.all_layer, "tasks": tasks,
                       "profile": args.profile, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
