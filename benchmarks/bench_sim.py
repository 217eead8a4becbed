"""Simulator speed: 1,000 requests (4K prompt, 256 output tokens) with continuous batching.

Prints wall seconds and simulated decode steps per wall second, for an open-loop (Poisson) and a
closed-loop workload, dense-resident and dense-offload, on the catalog H100-SXM with Qwen3-4B,
under both schedulers, side by side in one run: ``chunked`` (the default: vLLM's token budget,
one scheduler turn per step while prompts prefill) and ``prefill-first`` (whole prompts, decodes
vectorised between batch changes); the last column is chunked's time over prefill-first's.
Each cell's time is the least CPU time (``time.process_time``) of ``--repeats`` whole
``run_replay`` calls, the two schedulers' calls alternating, so that a burst of load on a shared
machine falls on both (the median of wall times moved the ratio by up to 1.5x between runs).
The last two columns are the same for ``Simulator.run`` alone (a replay also reads its trace,
sets up costs and builds its report).

    python benchmarks/bench_sim.py [--requests 1000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import time

from _replay import prepared, run
from _sim_timer import simulator_seconds

from kvsim.policies import load_all


def timed(cfgs: list, repeats: int) -> list[tuple[float, float, dict]]:
    """The least CPU seconds of ``repeats`` runs of each configuration, run in turn: of the
    whole ``run_replay`` and of its ``Simulator.run`` alone."""
    best, sim, out = [float("inf")] * len(cfgs), [float("inf")] * len(cfgs), [None] * len(cfgs)
    with simulator_seconds() as inner:
        for _ in range(repeats):
            for j, cfg in enumerate(cfgs):
                inner.clear()
                t0 = time.process_time()
                out[j] = run(cfg)
                best[j] = min(best[j], time.process_time() - t0)
                sim[j] = min(sim[j], sum(inner))
    return list(zip(best, sim, out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=15, help="runs per cell; the least is shown")
    ap.add_argument("--trace", default=None, help="trace (default: the shipped default)")
    args = ap.parse_args()
    load_all()  # the policy registry (and torch) loads once per process: not the simulator's time
    print(f"{'workload':<30} {'policy':<15} {'scheduler':<13} {'cpu_s':>7} {'steps':>7} "
          f"{'steps/s':>9} {'sim/cpu':>9} {'x pf':>6} {'sim_s':>7} {'sim x pf':>8}")
    for label, extra in (("Poisson 4 req/s, max batch 64", dict(qps=4.0, batch=64)),
                         ("closed loop, concurrency 64", dict(concurrency=64, batch=64))):
        for policy in ("dense-resident", "dense-offload"):
            schedulers = ("prefill-first", "chunked")
            cfgs = [prepared(trace=args.trace, policy=policy, gpu="h100-sxm",
                             model="qwen3-4b", context=4096, output_len=256,
                             requests=args.requests, seed=0, scheduler=scheduler, **extra)
                    for scheduler in schedulers]
            got = timed(cfgs, args.repeats)
            base, sim_base = got[0][0], got[0][1]
            for scheduler, (wall, sim_s, r) in zip(schedulers, got):
                s = r["sim"]
                print(f"{label:<30} {policy:<15} {scheduler:<13} {wall:7.3f} "
                      f"{s['decode_steps']:7d} {s['decode_steps'] / wall:9.0f} "
                      f"{s['makespan_s'] / wall:9.0f} {wall / base:6.2f} {sim_s:7.4f} "
                      f"{sim_s / sim_base:8.2f}")


if __name__ == "__main__":
    main()
