"""Long workloads: wall time and peak RSS of ``kvsim replay`` over 1 day and 10 days of Poisson
arrivals at 2 requests/s (172,800 and 1,728,000 requests), each in its own process, side by side.

    python benchmarks/bench_long_workload.py [--days 1,10] [--qps 2]

Issue 16's targets: the 10-day run's peak RSS within 1.5x of the 1-day run's, and the 10-day
run in no more than 60 s on the 2-core VM.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time


def run(days: float, qps: float) -> tuple[float, float]:
    n = int(days * 86400 * qps)
    cmd = [sys.executable, "-m", "kvsim.cli", "replay", "--policy", "dense", "--qps", str(qps),
           "--requests", str(n), "--context", "2048", "--output-len", "128", "--json"]
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    if status != 0:
        raise SystemExit(f"{' '.join(cmd)} failed with status {status}")
    return wall, usage.ru_maxrss / 1024  # MiB (Linux reports KiB)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--days", default="1,10")
    ap.add_argument("--qps", type=float, default=2.0)
    args = ap.parse_args()
    days = [float(d) for d in args.days.split(",")]
    rows = [(d, *run(d, args.qps)) for d in days]
    base = rows[0]
    print(f"{'days':>5} {'requests':>10} {'wall s':>8} {'peak RSS MiB':>13} {'RSS ratio':>10}")
    for d, wall, rss in rows:
        print(f"{d:5g} {int(d * 86400 * args.qps):10,} {wall:8.1f} {rss:13.0f} "
              f"{rss / base[2]:10.2f}")


if __name__ == "__main__":
    main()
