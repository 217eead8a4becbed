"""Simulator speed: 1,000 requests (4K prompt, 256 output tokens) with continuous batching.

Prints wall seconds and simulated decode steps per wall second, for an open-loop (Poisson) and a
closed-loop workload, dense-resident and dense-offload, on the catalog H100-SXM with Qwen3-4B.

    python benchmarks/bench_sim.py [--requests 1000]
"""

from __future__ import annotations

import argparse
import time

from kvsim.policies import load_all
from kvsim.replay import ReplayConfig, run_replay


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--trace", default=None, help="trace (default: the shipped default)")
    args = ap.parse_args()
    load_all()  # the policy registry (and torch) loads once per process: not the simulator's time
    print(f"{'workload':<34} {'policy':<15} {'wall_s':>7} {'steps':>7} {'steps/s':>9} "
          f"{'sim_s':>8} {'sim/wall':>9}")
    for label, extra in (("Poisson 4 req/s, max batch 64", dict(qps=4.0, batch=64)),
                         ("closed loop, concurrency 64", dict(concurrency=64, batch=64))):
        for policy in ("dense-resident", "dense-offload"):
            cfg = ReplayConfig(trace=args.trace, policy=policy, gpu="h100-sxm", model="qwen3-4b",
                               context=4096, output_len=256, requests=args.requests, seed=0,
                               **extra)
            t0 = time.perf_counter()
            r = run_replay(cfg)
            wall = time.perf_counter() - t0
            print(f"{label:<34} {policy:<15} {wall:7.3f} {r['sim']['decode_steps']:7d} "
                  f"{r['sim']['decode_steps'] / wall:9.0f} {r['sim']['makespan_s']:8.1f} "
                  f"{r['sim']['makespan_s'] / wall:9.0f}")


if __name__ == "__main__":
    main()
