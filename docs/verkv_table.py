"""VerKV on the shipped capture sets, from the shipped policy profile's rows: per setting (sketch,
budget, eps), the violation rate over all decisions and in the worst layer, the KV read per
decode step and per forward pass, and the output error, at each measured length.

    python docs/verkv_table.py [traces/policy-profile-smollm2.json] [--length 8192]

Every statistic is a mean over the profile's units (2 tasks x 4 questions per length, one draw
of the sample per layer), layers weighted to the whole depth (the capture's ``--layer-weights``);
the worst layer is the kept layer with the highest violation rate, averaged over the units.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("profile", nargs="?", default="traces/policy-profile-smollm2.json")
    ap.add_argument("--length", type=int, default=None, help="one target length (default all)")
    args = ap.parse_args()
    d = json.load(open(args.profile))
    col = {c: i for i, c in enumerate(d["columns"])}
    settings = [json.loads(s[len("verkv"):]) if s.startswith("verkv") else None
                for s in d["settings"]]
    # (setting, target, pass, stat) -> weighted sums; (setting, target, layer) -> violations
    acc = defaultdict(lambda: [0.0, 0.0])
    by_layer = defaultdict(lambda: [0.0, 0])
    for row in d["rows"]:
        s = row[col["setting"]]
        if settings[s] is None:
            continue
        t, ps, w = row[col["target"]], row[col["pass"]], row[col["weight"]]
        for stat in ("kv_read_frac", "violation_rate", "output_rel_err_mean"):
            v = row[col[stat]]
            if v is not None:
                a = acc[(s, t, ps, stat)]
                a[0] += w * v
                a[1] += w
        v = row[col["violation_rate"]]
        if ps == "overall" and v is not None:
            b = by_layer[(s, t, row[col["layer"]])]
            b[0] += v
            b[1] += 1
    mean = lambda *k: acc[k][0] / acc[k][1] if acc[k][1] else float("nan")  # noqa: E731
    targets = sorted({t for (_, t, _, _) in acc})
    if args.length:
        targets = [t for t in targets if t == args.length]
    print("| sketch | budget | eps | length | violation rate | worst layer | KV read per decode "
          "step | KV read per forward pass | output rel. error |")
    print("|---|---|---|--:|--:|--:|--:|--:|--:|")
    order = sorted((i for i, p in enumerate(settings) if p is not None),
                   key=lambda i: (settings[i]["sketch"], settings[i]["compression"],
                                  settings[i]["eps"]))
    for s in order:
        p = settings[s]
        for t in targets:
            layers = {la: v / n for (ss, tt, la), (v, n) in by_layer.items()
                      if ss == s and tt == t}
            worst = max(layers, key=layers.get)
            print(f"| {p['sketch']} | {p['compression']:g}x | {p['eps']:g} | {t} | "
                  f"{mean(s, t, 'overall', 'violation_rate'):.1%} | "
                  + (f"{layers[worst]:.1%} (layer {worst}) | " if layers[worst] > 0 else
                     "0.0% (none) | ") +
                  f"{mean(s, t, 'decode', 'kv_read_frac'):.1%} | "
                  f"{mean(s, t, 'overall', 'kv_read_frac'):.1%} | "
                  f"{mean(s, t, 'overall', 'output_rel_err_mean'):.1%} |")


if __name__ == "__main__":
    main()
