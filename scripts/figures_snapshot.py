"""The figures a reshaping must not change: fourteen replay configurations, a sweep and a
deployment search, written as JSON and CSV, and compared field by field with an earlier snapshot.

    python scripts/figures_snapshot.py --out /tmp/before          # before the change
    python scripts/figures_snapshot.py --out /tmp/after --compare /tmp/before

Exit 1 and a list of differing fields when two snapshots disagree (numbers to ``--rtol``,
default 1e-9; text fields such as provenance are listed but not failed with ``--text-ok``).
Wall-clock timings of the policy on this machine are skipped: they differ from run to run.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

TRACE = "traces/smollm2-mk-2k.npz"
REPLAYS = {
    "dense-resident": ["--policy", "dense-resident", "--batch", "4"],
    "dense-offload": ["--policy", "dense-offload", "--batch", "4", "--context", "65536"],
    "verkv-profile": ["--policy", "verkv", "--sink", "4", "--local", "4", "--batch", "4"],
    "verkv-trace": [TRACE, "--policy", "verkv", "--compression", "16", "--sink", "4",
                    "--local", "4", "--batch", "2"],
    "topk-trace": [TRACE, "--policy", "topk", "--sink", "4", "--local", "4"],
    "poissoncomp-open": ["--policy", "poissoncomp", "--sink", "4", "--local", "4", "--qps", "2",
                         "--requests", "200", "--batch", "16", "--context", "8192"],
    "varrate-trace": [TRACE, "--policy", "varrate", "--batch", "2", "--context", "8192"],
    "prefill-first-grow": ["--policy", "dense-resident", "--scheduler", "prefill-first",
                           "--admission", "grow", "--preemption", "swap", "--batch", "64",
                           "--context", "16384", "--concurrency", "64", "--requests", "200"],
    "replicas-tp2": ["--policy", "dense-offload", "--tp", "2", "--replicas", "2", "--qps", "4",
                     "--requests", "300", "--batch", "8", "--context", "16384"],
    "workload": ["--policy", "dense-resident", "--workload",
                 "docs/workloads/alternating-16k-512.csv", "--batch", "8"],
    # fetching policies on head-dim-128 and head-dim-64 models, and with an 8-bit KV cache
    "quest-qwen3": ["--policy", "quest", "--sink", "4", "--local", "4", "--batch", "4"],
    "quest-smollm2": ["--policy", "quest", "--sink", "4", "--local", "4", "--batch", "4",
                      "--model", "smollm2-135m", "--context", "8192"],
    "verkv-llama-fp8": ["--policy", "verkv", "--sink", "4", "--local", "4", "--batch", "8",
                        "--model", "llama-3.1-8b", "--context", "65536", "--kv-dtype", "fp8"],
    "verkv-perfect-smollm2": ["--policy", "verkv:sketch=perfect", "--sink", "4", "--local",
                              "4", "--model", "smollm2-135m", "--context", "8192"],
}
WALL_CLOCK = ("policy_timings.", "timings.")  # measured on this machine each run: not figures
PLAN = ["--gpu", "h100-sxm,h200", "--model", "qwen3-4b", "--context", "8192,32768,131072",
        "--policy", "dense-resident,dense-offload,verkv", "--compression", "16", "--eps", "0.05",
        "--sink", "4", "--local", "4", "--batch", "1,16", "--jobs", "1"]
# a deployment search: the SLO search, the replicas and the answer
DEPLOY = ["--gpu", "h100-sxm,l40s", "--model", "qwen3-4b", "--context", "16384",
          "--output-len", "128", "--policy", "dense-resident,quest", "--sink", "4", "--local",
          "4", "--batch", "4,16", "--slo-tpot-ms", "60", "--target-qps", "2", "--slo-requests",
          "100", "--jobs", "2"]


def kvsim(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvsim.cli", *args], capture_output=True,
                          text=True)


def snapshot(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, args in REPLAYS.items():
        r = kvsim(["replay", *args, "--json"])
        if r.returncode:
            sys.exit(f"replay {name} failed: {r.stderr.strip().splitlines()[-1:]}")
        (out / f"replay-{name}.json").write_text(r.stdout)
        print(f"replay {name}: ok", flush=True)
    r = kvsim(["plan", *PLAN, "--out", str(out / "plan"), "--force"])
    if r.returncode:
        sys.exit(f"plan failed: {r.stderr.strip()[-300:]}")
    print("plan: ok")
    r = kvsim(["plan", *DEPLOY, "--out", str(out / "deploy"), "--force"])
    if r.returncode:
        sys.exit(f"deploy plan failed: {r.stderr.strip()[-300:]}")
    print("deploy plan: ok")


def _flat(x, prefix=""):
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _flat(v, f"{prefix}{k}.")
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from _flat(v, f"{prefix}{i}.")
    else:
        yield prefix[:-1], x


def _same(a, b, rtol: float) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and \
            not isinstance(a, bool) and not isinstance(b, bool):
        if math.isnan(a) and math.isnan(b):
            return True
        return a == b or abs(a - b) <= rtol * max(abs(a), abs(b))
    return a == b


def compare(new: Path, old: Path, rtol: float, text_ok: bool) -> int:
    import pandas as pd
    bad = 0
    for f in sorted(old.glob("replay-*.json")):
        a = dict(_flat(json.loads(f.read_text())))
        b = dict(_flat(json.loads((new / f.name).read_text())))
        for key in sorted(set(a) | set(b)):
            if key.startswith(WALL_CLOCK):
                continue
            if key not in b or key not in a:
                print(f"{f.name}: {key} {'only before' if key in a else 'only after'}")
                bad += key in a  # a new key is fine; a lost one is not
            elif not _same(a[key], b[key], rtol):
                text = isinstance(a[key], str)
                print(f"{f.name}: {key}: {a[key]!r} -> {b[key]!r}")
                bad += not (text and text_ok)
    for plan in ("plan", "deploy"):
        if not (old / plan / "results.csv").exists():
            continue  # a snapshot of an older version of this script
        bad += _compare_table(pd.read_csv(old / plan / "results.csv"),
                              pd.read_csv(new / plan / "results.csv"), plan, rtol, text_ok)
    if (old / "deploy/answer.json").exists():
        a = dict(_flat(json.loads((old / "deploy/answer.json").read_text())))
        b = dict(_flat(json.loads((new / "deploy/answer.json").read_text())))
        for key in sorted(set(a) | set(b)):
            if key not in b or key not in a or not _same(a[key], b[key], rtol):
                print(f"answer.json: {key}: {a.get(key, '(none)')!r} -> {b.get(key, '(none)')!r}")
                bad += not (isinstance(a.get(key), str) and text_ok)
    print(f"{bad} differing field(s)")
    return 1 if bad else 0


def _compare_table(pa, pb, name: str, rtol: float, text_ok: bool) -> int:
    bad = 0
    if len(pa) != len(pb):
        print(f"{name}: {len(pa)} rows -> {len(pb)}")
        bad += 1
    for col in pa.columns:
        if col not in pb.columns:
            print(f"{name}: column {col} lost")
            bad += 1
            continue
        for i, (x, y) in enumerate(zip(pa[col], pb[col])):
            if not _same(x, y, rtol) and not (isinstance(x, float) and isinstance(y, float)
                                                and math.isnan(x) and math.isnan(y)):
                print(f"{name} row {i} {col}: {x!r} -> {y!r}")
                bad += not (isinstance(x, str) and text_ok)
    return bad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--compare", type=Path)
    ap.add_argument("--rtol", type=float, default=1e-9)
    ap.add_argument("--text-ok", action="store_true")
    a = ap.parse_args()
    snapshot(a.out)
    if a.compare:
        sys.exit(compare(a.out, a.compare, a.rtol, a.text_ok))


if __name__ == "__main__":
    main()
