"""The README's quality table from ``kvsim eval --json`` outputs (one file per run).

    python scripts/quality_table.py docs/eval-smollm2/*.json

Rows are policies (with the options that name them), columns budgets; a cell is the accuracy as a
share of dense on the same prompts (right / n) and the KV read per forward pass, question pass
and decode steps alike (decode steps alone in brackets), as measured by the policy's own
statistics. For VarRate the cell gives the measured footprint instead (nothing is read from host
memory). Reads the output of every kvsim version: ``overall_kv_read_frac``
(``kv_read_frac_overall`` before 0.2) and ``stats["footprint_frac"]`` now; ``kv_read_frac``
(then the per-pass mean) and per-key ``{"decode_per_call": ...}`` statistics in the files
shipped in docs/eval-smollm2/.
"""

from __future__ import annotations

import collections
import json
import sys


def row_label(r: dict) -> tuple[str, str]:
    o, name = r["options"], r["name"]
    if name == "dense-resident":
        return "dense", "-"
    if name == "topk":
        lab = f"topk-{o.get('scorer', 'snapkv')}"
    elif name == "verkv":
        lab = f"verkv-{o.get('sketch', '2bit')}"
    else:
        lab = name
    return lab, float(o["compression"])


def main(paths: list[str]) -> None:
    runs = [json.load(open(p)) for p in paths]
    right, dense, n = (collections.defaultdict(float), collections.defaultdict(float),
                       collections.defaultdict(int))
    kv, kv_dec, foot = (collections.defaultdict(list) for _ in range(3))
    tasks = collections.Counter()
    seen = set()
    for run in runs:
        prompts = (run["task"], run["context"], run["seed"], run["n"])
        if prompts not in seen:  # runs of other policies on the same prompts count dense once
            seen.add(prompts)
            tasks[run["task"]] += run["n"]
            right[("dense", "-")] += run["dense_accuracy"] * run["n"]
            dense[("dense", "-")] += run["dense_accuracy"] * run["n"]
            n[("dense", "-")] += run["n"]
        for r in run.get("results") or [run]:
            k = row_label(r)
            if k[0] == "dense":
                continue
            right[k] += r["accuracy"] * r["n"]
            dense[k] += r["dense_accuracy"] * r["n"]  # the same prompts, dense
            n[k] += r["n"]
            stats = r.get("stats", {})
            for old, now in (("kv_read_frac_overall", "overall_kv_read_frac"),
                             ("kv_read_frac_decode", "decode_kv_read_frac")):
                r.setdefault(now, r.get(old))  # the names before kvsim 0.2
            new = r.get("overall_kv_read_frac") is not None
            kv[k].append((r["overall_kv_read_frac"] if new else r.get("kv_read_frac")) or 0.0)
            kv_dec[k].append(r["decode_kv_read_frac"] if new else
                             (stats.get("kv_read_frac") or {}).get("decode_per_call"))
            f = stats.get("footprint_frac")
            foot[k].append(f.get("mean_per_call") if isinstance(f, dict) else f)
    budgets = sorted({b for _, b in n if b != "-"})
    mean = lambda xs: (sum(xs) / len(xs)) if xs else None  # noqa: E731
    print(f"prompts: {dict(tasks)}; dense answered {right[('dense', '-')]:.0f}/{n[('dense', '-')]}")
    print("| policy | " + " | ".join(f"{b:g}x ({100 / b:.3g}% budget)" for b in budgets) + " |")
    print("|---|" + "---|" * len(budgets))
    for lab in dict.fromkeys(lab for lab, _ in n):
        cells = []
        for b in budgets:
            k = (lab, "-") if lab == "dense" else (lab, b)
            if not n.get(k):
                cells.append("")
                continue
            text = f"{100 * right[k] / dense[k]:.0f}% ({right[k]:.0f}/{n[k]})"
            read = mean(kv[k])
            dec = mean([x for x in kv_dec[k] if x is not None])
            f = mean([x for x in foot[k] if x is not None])
            if f is not None:
                text += f"; footprint {100 * f:.1f}%"
            elif lab != "dense":
                text += f"; read {100 * read:.1f}%" + (f" ({100 * dec:.1f}%)" if dec else "")
            cells.append(text)
        print(f"| {lab} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
