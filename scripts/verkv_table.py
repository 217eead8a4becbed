"""VerKV on the shipped capture sets, from policy profiles' rows: per setting (sketch, pass plan,
budget, eps), the violation rate over all decisions and in the worst layer, the KV read per
decode step, per question pass and per forward pass, and the output error, at each length.

    python scripts/verkv_table.py [PROFILE ...] [--length 8192] [--sketch bounded]

Default profiles: the shipped one (``traces/policy-profile-smollm2.json``: the 2-bit sketch at
4x-32x, the perfect and the bounded sketch at 16x, six task types) and
``docs/verkv-sketches-profile.json`` (the bounded sketch at 8x and 16x, the perfect sketch at 8x
and 32x, the 2-bit sketch at 16x with ``--pass-plan shared``; measured on the ``mk`` and ``qa``
sets only, which its rows say). A setting in several profiles is shown from the first. Every
statistic is a mean over the profile's units (its tasks' questions per length, one draw of the
sample per layer), layers weighted to the whole depth (the capture's ``--layer-weights``); the
worst layer is the kept layer with the highest violation rate, averaged over the units.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

DEFAULT = ["traces/policy-profile-smollm2.json", "docs/verkv-sketches-profile.json"]


def rows_of(path: str):
    """(label params, stat accumulators, per-layer violations, tasks) of one profile's VerKV
    rows."""
    with open(path) as f:
        d = json.load(f)
    col = {c: i for i, c in enumerate(d["columns"])}
    settings = [json.loads(s[len("verkv"):]) if s.startswith("verkv") else None
                for s in d["settings"]]
    acc = defaultdict(lambda: [0.0, 0.0])  # (setting, target, pass, stat) -> weighted sums
    by_layer = defaultdict(lambda: [0.0, 0])  # (setting, target, layer) -> violations
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
    return settings, acc, by_layer, sorted({c["task"] for c in d["captures"]})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("profiles", nargs="*", default=DEFAULT)
    ap.add_argument("--length", type=int, default=None, help="one target length (default all)")
    ap.add_argument("--sketch", default=None, help="one sketch (default all)")
    args = ap.parse_args()
    print("| sketch | budget | eps | length | violation rate | worst layer | KV read per decode "
          "step | per question pass | per forward pass | output rel. error |")
    print("|---|---|---|--:|--:|--:|--:|--:|--:|--:|")
    lines, shown, first_tasks = [], set(), None
    for path in args.profiles:
        settings, acc, by_layer, tasks = rows_of(path)
        first_tasks = first_tasks or tasks
        # a profile measured on other prompts than the first says which, in the sketch column
        where = "" if tasks == first_tasks else f" ({', '.join(tasks)} only)"
        mean = lambda *k, acc=acc: acc[k][0] / acc[k][1] if acc[k][1] else float("nan")  # noqa: E731
        targets = sorted({t for (_, t, _, _) in acc})
        if args.length:
            targets = [t for t in targets if t == args.length]
        for s, p in enumerate(settings):
            if p is None or (args.sketch and p["sketch"] != args.sketch):
                continue
            plan = p.get("pass_plan") or "rows"
            name = p["sketch"] + ("" if plan == "rows" else f", {plan} plan") + where
            same = (p["sketch"], plan, p["compression"], p["eps"])
            if same in shown:  # a setting in several profiles: the first profile's
                continue
            shown.add(same)
            for t in targets:
                layers = {la: v / n for (ss, tt, la), (v, n) in by_layer.items()
                          if ss == s and tt == t}
                worst = max(layers, key=layers.get)
                key = (p["sketch"], plan != "rows", p["compression"], p["eps"], t)
                lines.append((key, f"| {name} | {p['compression']:g}x | {p['eps']:g} | {t} | "
                              f"{mean(s, t, 'overall', 'violation_rate'):.1%} | "
                              + (f"{layers[worst]:.1%} (layer {worst}) | " if layers[worst] > 0
                                 else "0.0% (none) | ") +
                              f"{mean(s, t, 'decode', 'kv_read_frac'):.1%} | "
                              f"{mean(s, t, 'question', 'kv_read_frac'):.1%} | "
                              f"{mean(s, t, 'overall', 'kv_read_frac'):.1%} | "
                              f"{mean(s, t, 'overall', 'output_rel_err_mean'):.1%} |"))
    for _, line in sorted(lines):
        print(line)


if __name__ == "__main__":
    main()
