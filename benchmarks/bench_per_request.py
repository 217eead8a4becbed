"""What one simulated request costs the simulator: ``Simulator.run`` timed in-process (CPU time,
best and median of ``--repeats``) on the long-workload benchmark's requests (Poisson 2 req/s of
2048+128 tokens, batches up to 16, Qwen3-4B on H100-SXM, dense), fewer than the 100,000 that
would run in pieces, so one process, one piece.

    python benchmarks/bench_per_request.py [--requests 20000] [--repeats 5]
    PYTHONPATH=OTHER_CHECKOUT python benchmarks/bench_per_request.py   # the same on other code
"""

from __future__ import annotations

import argparse
import statistics

from _replay import prepared, run
from _sim_timer import simulator_seconds


def us_per_request(kw: dict, repeats: int) -> list[float]:
    """CPU microseconds ``Simulator.run`` spends per simulated request of the configuration
    ``kw`` names (its ``requests`` of them), per repeat."""
    cfg = prepared(**kw)
    with simulator_seconds() as seconds:
        for _ in range(repeats):
            run(cfg)
    return [s / kw["requests"] * 1e6 for s in seconds]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=20_000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    us = us_per_request(dict(policy="dense", qps=2.0, requests=args.requests, context=2048,
                             output_len=128, batch=16, jobs=1), args.repeats)
    print(f"{args.requests:,} requests: {min(us):.1f} us per request at best, "
          f"{statistics.median(us):.1f} median of {args.repeats}")

if __name__ == "__main__":
    main()
