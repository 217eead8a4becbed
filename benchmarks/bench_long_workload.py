"""Long workloads: wall time and peak RSS of ``kvsim replay`` over 1 day and 10 days of Poisson
arrivals at 2 requests/s (172,800 and 1,728,000 requests), each in its own process, side by side.
Batches of up to 16 requests keep up with that rate (the output's ``served_frac_window`` is
printed): an overloaded server's queue, and so its memory, grows with the trace, as a real one's
would.

    python benchmarks/bench_long_workload.py [--days 1,10] [--qps 2]

Issue 16's targets: the 10-day run's peak RSS within 1.5x of the 1-day run's, and the 10-day
run in no more than 60 s on the 2-core VM.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def run(days: float, qps: float) -> tuple[float, float, dict]:
    """(wall seconds, peak RSS MiB, the replay's ``sim`` group) of one run in its own process."""
    n = int(days * 86400 * qps)
    cmd = [sys.executable, "-m", "kvsim.cli", "replay", "--policy", "dense", "--qps", str(qps),
           "--requests", str(n), "--context", "2048", "--output-len", "128", "--batch", "16",
           "--json"]
    with tempfile.TemporaryFile("w+") as out:
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.DEVNULL)
        _, status, usage = os.wait4(p.pid, 0)
        wall = time.perf_counter() - t0
        if status != 0:
            raise SystemExit(f"{' '.join(cmd)} failed with status {status}")
        out.seek(0)
        sim = json.load(out)["sim"]
    return wall, usage.ru_maxrss / 1024, sim  # MiB (Linux reports KiB)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--days", default="1,10")
    ap.add_argument("--qps", type=float, default=2.0)
    args = ap.parse_args()
    days = [float(d) for d in args.days.split(",")]
    rows = [(d, *run(d, args.qps)) for d in days]
    base = rows[0]
    print(f"{'days':>5} {'requests':>10} {'wall s':>8} {'peak RSS MiB':>13} {'RSS ratio':>10} "
          f"{'served':>7} {'TTFT p99 ms':>12}  percentiles")
    for d, wall, rss, sim in rows:
        print(f"{d:5g} {sim['requests']:10,} {wall:8.1f} {rss:13.0f} {rss / base[2]:10.2f} "
              f"{sim['served_frac_window']:7.4f} {sim['ttft_p99_ms']:12.2f}  {sim['percentiles']}")


if __name__ == "__main__":
    main()
