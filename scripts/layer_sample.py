"""Choose the shipped captures' layer sample by measuring it against every layer.

Input: policy profiles of all-layer, all-head capture sets (one setting), e.g.

    kvsim capture --task mk --lengths 1024,2048,4096,8192 --questions 4 --out /tmp/full/mk.npz
    kvsim policy-profile /tmp/full/mk.npz --policy verkv --compression 16 --eps 0.05 \\
        --sink 4 --local 4 --out /tmp/full/mk-all.json          (and the same for qa)
    python scripts/layer_sample.py /tmp/full/mk-all.json /tmp/full/qa-all.json --layers 8 \
        --kept /tmp/full/mk-1h.json /tmp/full/qa-1h.json

Strata: layer 0 alone (it reads most of the cache at every length), the rest cut into contiguous
blocks of near-equal size; each block is represented by one layer, weighted by the block's size,
chosen by coordinate descent on the squared relative error of the whole sample's estimates
(every statistic below, both tasks, the --choose-on lengths), starting from the layer closest
to its block's mean (with one KV head kept per layer, the statistics of that head are what is
compared), weighted by the block's size. Prints each candidate's error against the
all-layer mean for every statistic, task and length, and the chosen sample.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

STATS = [("decode", "kv_read_frac"), ("question", "kv_read_frac"), ("overall", "kv_read_frac"),
         ("overall", "violation_rate"), ("overall", "output_rel_err_mean")]


def per_layer(path: str) -> tuple[dict, list[int]]:
    """(stat, target) -> layer -> mean over questions; and the targets."""
    d = json.loads(open(path).read())
    cols = d["columns"]
    out: dict = {}
    for r in d["rows"]:
        rec = dict(zip(cols, r))
        for ps, st in STATS:
            if rec["pass"] == ps and rec[st] is not None:
                out.setdefault((ps, st, rec["target"]), {}).setdefault(rec["layer"], []).append(
                    rec[st])
    targets = sorted({k[2] for k in out})
    return {k: {l: float(np.mean(v)) for l, v in layers.items()} for k, layers in out.items()}, \
        targets


def blocks(n_layers: int, k: int) -> list[list[int]]:
    rest = np.array_split(np.arange(1, n_layers), k - 1)
    return [[0]] + [list(map(int, b)) for b in rest]


def choose(tables: list[dict], kept: list[dict], n_layers: int, k: int) -> dict[int, float]:
    """Per block, the layer whose kept head's statistics (``kept``) are closest to the block's
    mean over every layer and head (``tables``)."""
    sample = {}
    for b in blocks(n_layers, k):
        def dist(layer):
            err = 0.0
            for t, h in zip(tables, kept):
                for key, vals in t.items():
                    mean = np.mean([vals[l] for l in b])
                    err += abs(h[key][layer] - mean) / max(abs(mean), 1e-3)
            return err
        sample[min(b, key=dist)] = float(len(b))
    # then coordinate descent on the error of the whole sample's estimate: per block, the layer
    # that makes the weighted estimate closest to the all-layer mean, until nothing changes
    bl = blocks(n_layers, k)

    def loss(smp):
        w = sum(smp.values())
        tot = 0.0
        for t, h in zip(tables, kept):
            for key, vals in t.items():
                full = np.mean(list(vals.values()))
                est = sum(h[key][l] * wt for l, wt in smp.items()) / w
                tot += ((est - full) / max(abs(full), 1e-3)) ** 2
        return tot

    for _ in range(10):
        changed = False
        for b in bl:
            cur = next(l for l in sample if l in b)
            best = min(b, key=lambda l: loss({**{m: w for m, w in sample.items() if m != cur},
                                               l: float(len(b))}))
            if best != cur:
                sample = {**{m: w for m, w in sample.items() if m != cur}, best: float(len(b))}
                changed = True
        if not changed:
            break
    return sample


def errors(tables: list[dict], kept: list[dict], names: list[str],
           sample: dict[int, float]) -> list[dict]:
    rows = []
    w = sum(sample.values())
    for name, t, h in zip(names, tables, kept):
        for (ps, st, tgt), vals in sorted(t.items()):
            full = float(np.mean(list(vals.values())))
            est = sum(h[(ps, st, tgt)][l] * wt for l, wt in sample.items()) / w
            rows.append({"task": name, "stat": f"{ps} {st}", "target": tgt, "all layers": full,
                         "sample": est, "error %": 100 * abs(est - full) / max(abs(full), 1e-4)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("profiles", nargs="+", help="all-layer, all-head profiles")
    ap.add_argument("--kept", nargs="+", help="profiles of the same captures keeping the one "
                    "head per layer a sample would keep (capture set subset, --kv-heads 1)")
    ap.add_argument("--layers", type=int, default=8, help="layers in the sample")
    ap.add_argument("--choose-on", default="1024,2048,8192",
                    help="target lengths the choice looks at (the others are held out: the "
                         "shipped profile is checked against every layer at 4096)")
    args = ap.parse_args()
    tables, names = [], []
    for p in args.profiles:
        t, _ = per_layer(p)
        tables.append(t)
        names.append(json.loads(open(p).read())["captures"][0]["task"])
    kept = [per_layer(p)[0] for p in args.kept] if args.kept else tables
    on = {int(x) for x in args.choose_on.split(",")}
    seen = [{k: v for k, v in t.items() if k[2] in on} for t in tables]
    n_layers = len(next(iter(tables[0].values())))
    for k in range(max(2, args.layers - 2), args.layers + 3):
        s = choose(seen, kept, n_layers, k)
        e = errors(tables, kept, names, s)
        kv = [r["error %"] for r in e if r["stat"].endswith("kv_read_frac")]
        held = [r["error %"] for r in e if r["stat"].endswith("kv_read_frac")
                and r["target"] not in on]
        print(f"{k:2d} layers {sorted(s)}: KV read error mean {np.mean(kv):.1f}%, "
              f"max {np.max(kv):.1f}% (held-out lengths: max {max(held, default=0):.1f}%); "
              f"all statistics max "
              f"{np.max([r['error %'] for r in e]):.1f}%")
    s = choose(seen, kept, n_layers, args.layers)
    print(f"\nchosen ({args.layers} layers): --layers {','.join(map(str, sorted(s)))} "
          f"--layer-weights {','.join(f'{s[l]:g}' for l in sorted(s))}")
    from kvsim.commands._out import table
    table(errors(tables, kept, names, s))


if __name__ == "__main__":
    main()
