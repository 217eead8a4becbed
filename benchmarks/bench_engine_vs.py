"""The simulator's speed against another checkout of kvsim, side by side in one run.

    git worktree add /tmp/kvsim-old <revision>
    python benchmarks/bench_engine_vs.py --other /tmp/kvsim-old [--pairs 5]

Runs the engine alone (no policy analysis, no report; the bench_sim workloads: 1,000 requests of
4K+256 tokens, Qwen3-4B on H100-SXM, dense-resident, batch up to 64) in a child process per
checkout, alternating them ``--pairs`` times; each child prints its minimum in-process CPU time
over ``--runs`` runs. Prints every pair and the median ratio this / other. This checkout runs its
``--scheduler`` (default prefill-first, the model checkouts before chunked prefill had).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import sys, time
from kvsim.hw import catalog
from kvsim.hw.costs import CostModel
from kvsim.sim import workload as wl
from kvsim.sim.engine import Memory, Simulator
try:
    from kvsim.contract import DecodeCost
    from kvsim.sim.engine import Scheduling
    kw = {"scheduling": Scheduling(sys.argv[2])}
except ImportError:  # a checkout from before the contract module and the schedulers
    from kvsim.policies.base import DecodeCost
    kw = {}
m, costs = catalog.model("qwen3-4b"), CostModel.from_spec(catalog.gpu("h100-sxm"))
mem = Memory(costs.hbm_bytes, 256 * 2**30, m.weight_bytes, 4 * 2**30)
w = wl.poisson(4.0, 1000, 4096, 256, 0) if sys.argv[1] == "poisson" else \
    wl.closed_loop(64, 1000, 4096, 256)
best = float("inf")
for _ in range(int(sys.argv[3])):
    sim = Simulator(m, costs, DecodeCost(1.0, 1.0, 0.0, 0.0, False), mem, 64, **kw)
    t = time.process_time()
    sim.run(w)
    best = min(best, time.process_time() - t)
print(best)
"""


def child(root: Path, workload: str, scheduler: str, runs: int) -> float:
    env = dict(os.environ, PYTHONPATH=str(root))
    out = subprocess.run([sys.executable, "-c", CHILD, workload, scheduler, str(runs)],
                         capture_output=True, text=True, check=True, env=env, cwd=root)
    return float(out.stdout.strip())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--other", required=True, type=Path, help="another kvsim checkout")
    ap.add_argument("--scheduler", default="prefill-first", choices=["prefill-first", "chunked"])
    ap.add_argument("--pairs", type=int, default=5)
    args = ap.parse_args()
    here = Path(__file__).resolve().parents[1]
    for workload, runs in (("poisson", 10), ("closed", 60)):
        ratios = []
        for _ in range(args.pairs):
            a = child(here, workload, args.scheduler, runs)
            b = child(args.other.resolve(), workload, args.scheduler, runs)
            ratios.append(a / b)
            print(f"{workload:<8} this {a * 1e3:7.1f} ms  other {b * 1e3:7.1f} ms  "
                  f"x {a / b:5.2f}")
        print(f"{workload:<8} median this / other: {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
