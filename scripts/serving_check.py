"""Predict published serving benchmarks with ``kvsim replay`` and compare (the "serving"
category of ``docs/results/published.md``).

Each row of ``data/published/serving.csv`` is one measured value of a serving run with a
stated setup: the arrivals (Poisson at a rate, every request at once, or a closed loop at a
concurrency), the number of requests, the length distribution of the benchmark's random
dataset, and what was measured (median TTFT, median ITL, output tokens/s). Rows of one run
share one replay: the run's requests are drawn here (seeded) as the benchmark draws them and
given to ``kvsim replay --workload``, with the engine family that ran it.

Held out: no serving row is fitted. Where the run's publication also has static rows in
``data/published.csv`` (the vLLM blog's batch-1 rows), its engine is refitted without them.

    python scripts/serving_check.py [--jobs N]   # writes data/published-serving.json
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import csv
import dataclasses
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from kvsim.fit import read_points
from kvsim.hw.catalog import MODEL_IDS as MODELS  # Hugging Face id -> catalog name

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data" / "published" / "serving.csv"
OUT = ROOT / "data" / "published-serving.json"

# what kvsim replay reports for each measured metric (under "sim" in --json)
METRICS = {"ttft_p50_ms": "ttft_p50_ms", "itl_p50_ms": "itl_p50_ms",
           "output_tok_s": "throughput_tok_s"}
REGIME = {"ttft_p50_ms": "prefill", "itl_p50_ms": "decode", "output_tok_s": "throughput"}
INTERVAL = {"ttft_p50_ms": "ttft_ms", "itl_p50_ms": "tpot_ms", "output_tok_s": "throughput_tok_s"}
# how each engine admits requests (kvsim --admission): TensorRT-LLM's default capacity
# scheduler guarantees no eviction (memory for the whole request); vLLM and SGLang grow
ADMISSION = {"trtllm": "reserve", "vllm": "grow", "sglang": "grow"}
MAX_RUNNING = 2048  # --batch: the engines' own caps are higher or memory-bound; memory binds here
SETUP = ("source", "engine", "gpu", "tp", "model", "weight_dtype", "kv_dtype", "input_len",
         "output_len", "lengths", "arrivals", "rate_qps", "concurrency", "requests", "where")


def lengths(kind: str, n: int, top: int, rng) -> np.ndarray:
    """Token counts as the benchmark draws them: ``fixed``; ``uniform`` in [1, top] (SGLang's
    random dataset, range ratio 0); ``pm15``: uniform within 15% of ``top`` (vLLM's
    ``--random-range-ratio 0.15``)."""
    if kind == "fixed":
        return np.full(n, top)
    if kind == "uniform":
        return rng.integers(1, top + 1, n)
    if kind == "pm15":
        return rng.integers(int(top * 0.85), int(top * 1.15) + 1, n)
    raise SystemExit(f"serving.csv: lengths {kind!r} is not fixed, uniform or pm15")


def workload(run: dict, path: Path, seed: int = 0) -> None:
    """The run's requests as a kvsim workload CSV (arrival s, prompt, output)."""
    rng = np.random.default_rng(seed)
    n = int(run["requests"])
    prompt = lengths(run["lengths"], n, int(run["input_len"]), rng)
    output = lengths(run["lengths"], n, int(run["output_len"]), rng)
    arrival = (np.cumsum(rng.exponential(1 / float(run["rate_qps"]), n))
               if run["arrivals"] == "poisson" else np.zeros(n))
    with open(path, "w") as f:
        f.write("arrival,prompt,output\n")
        f.writelines(f"{a:.6f},{p},{o}\n" for a, p, o in zip(arrival, prompt, output))


def replay_args(run: dict, engine: str, tmp: Path, key: int) -> list[str]:
    model = MODELS[run["model"].lower()]
    args = [sys.executable, "-m", "kvsim.cli", "replay", "--policy", "dense-resident",
            "--gpu", run["gpu"], "--model", model, "--tp", run["tp"], "--weight-dtype",
            run["weight_dtype"], "--kv-dtype", run["kv_dtype"], "--engine", engine,
            "--scheduler", "chunked",
            "--admission", ADMISSION.get(run["engine"], "grow"), "--json"]
    if run["arrivals"] == "closed":  # a closed loop at fixed lengths (the means of the run's)
        return args + ["--concurrency", run["concurrency"], "--batch", run["concurrency"],
                       "--requests", run["requests"], "--context", run["input_len"],
                       "--output-len", run["output_len"]]
    path = tmp / f"run{key}.csv"
    workload(run, path)
    return args + ["--workload", str(path), "--batch", str(MAX_RUNNING)]


def held_out_engine(source: str, family: str, tmp: Path, points: list) -> str:
    """``family`` as shipped, or refitted without ``source`` where ``source`` has fit rows of
    ``points`` (the static dataset)."""
    from kvsim.fit import Predictor
    from kvsim.fit import families as F
    from kvsim.hw.engine import load
    if not any(p.meta.get("source") == source and p.use == "fit" for p in points):
        return family
    rest = [p for p in points if p.use == "fit" and p.meta.get("source") != source]
    pred = Predictor(None)
    shared, engines, _ = F.fit_joint(rest, pred, load("roofline"))
    shipped = load(family)
    eng = dataclasses.replace(F.engine_for(family, shared, engines),
                              name=f"{family}-without-{source}", fit=shipped.fit,
                              fitted_on=shipped.fitted_on)
    path = tmp / f"{family}-without-{source}.json"
    eng.save(path, force=True)
    return str(path)


def run_one(args: list[str]) -> dict:
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(args)}: {done.stderr.strip()}")
    return json.loads(done.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=2, help="replays at once [default: 2]")
    ap.add_argument("--engine", help="predict every run with this engine (default: the family "
                                     "that ran it, held out) and print, not write, the result")
    ap.add_argument("--engines", type=Path, metavar="DIR",
                    help="take each family's engine from DIR/<family>.json (a refit under "
                         "study), and print, not write, the result")
    args = ap.parse_args()
    jobs = args.jobs
    rows = list(csv.DictReader(open(DATA)))
    runs: dict[tuple, list[dict]] = {}
    for i, r in enumerate(rows, start=2):  # line numbers of the CSV
        r["line"] = i
        runs.setdefault(tuple(r[k] for k in SETUP), []).append(r)
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        engines = {}
        points = [] if args.engine or args.engines else read_points(ROOT / "data" /
                                                                     "published.csv")
        for key in runs:
            src, fam = key[0], key[1]
            if (src, fam) not in engines:
                engines[src, fam] = args.engine or (str(args.engines / f"{fam}.json")
                                                    if args.engines else
                                                    held_out_engine(src, fam, tmp, points))
        calls = [replay_args(rs[0], engines[key[0], key[1]], tmp, i)
                 for i, (key, rs) in enumerate(runs.items())]
        with cf.ThreadPoolExecutor(jobs) as pool:
            results = list(pool.map(run_one, calls))
    values = []
    for rs, res in zip(runs.values(), results):
        for r in rs:
            got = res["sim"][METRICS[r["metric"]]]
            k = INTERVAL[r["metric"]]
            lo, hi = res.get(f"{k}_lo"), res.get(f"{k}_hi")
            # the replay's interval is around its mean; the same relative width around the median
            scale = got / res[k] if res.get(k) else 1.0
            measured = float(r["measured"])
            cats = ["serving"] + (["tp"] if int(r["tp"]) > 1 else []) + \
                (["fp8"] if "fp8" in (r["weight_dtype"], r["kv_dtype"]) else []) + \
                (["long-context"] if int(r["input_len"]) >= 16384 else [])
            values.append({
                "row": r["line"], "source": r["source"], "engine": r["engine"],
                "metric": r["metric"], "regime": REGIME[r["metric"]], "categories": cats,
                "gpu": r["gpu"], "model": MODELS[r["model"].lower()], "tp": int(r["tp"]),
                "setup": {k: r[k] for k in SETUP if k not in ("source", "where")},
                "measured": measured, "predicted": got,
                "interval": [lo * scale, hi * scale] if lo and hi else None,
                "err_pct": 100 * (got / measured - 1), "log_err": math.log(got / measured),
                "held_out": r["source"], "fitted_as": r["engine"],
                "running_mean": res["sim"].get("mean_batch")})
    errs = np.array([abs(v["err_pct"]) for v in values])
    print(f"{len(values)} serving values from {len({v['source'] for v in values})} sources"
          f"{' with engine ' + args.engine if args.engine else ''}: "
          f"{np.mean(errs <= 20):.0%} within 20%, median {np.median(errs):.1f}%")
    for (src, metric) in dict.fromkeys((v["source"], v["metric"]) for v in values):
        e = np.array([v["err_pct"] for v in values if (v["source"], v["metric"]) == (src,
                                                                                     metric)])
        print(f"  {src}: {metric}: {len(e)} values, {np.mean(abs(e) <= 20):.0%} within 20%, "
              f"median error {np.median(e):+.1f}%")
    if not (args.engine or args.engines):
        OUT.write_text(json.dumps({"values": values}, indent=0) + "\n")
        print(f"wrote {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
