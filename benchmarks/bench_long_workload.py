"""Long workloads: wall time and peak memory of ``kvsim replay`` over 1 day and 10 days of Poisson
arrivals at 2 requests/s (172,800 and 1,728,000 requests), each in its own process, side by side.
Batches of up to 16 requests keep up with that rate (the output's ``served_frac_window`` is
printed): an overloaded server's queue, and so its memory, grows with the trace, as a real one's
would.

    python benchmarks/bench_long_workload.py [--days 1,10] [--qps 2] [--jobs N] [--reuse SPEC]

``--reuse SPEC`` (e.g. ``conversations``): the same rate of multi-turn conversations whose
prompts reuse their prefixes (``kvsim replay --reuse``), with prefix caching on and a 64 GiB
host tier; its pieces run one after another in one process, each from the cache the last left
(:func:`kvsim.sim.segments.run_cached`), and the workload's block ids are held packed.

Both runs are simulated in pieces over ``--jobs`` worker processes (default: the CPUs;
:mod:`kvsim.sim.segments`), so memory is reported two ways: the peak RSS of the largest process
(what the kernel reports for the command) and the peak of the PSS summed over the command and
its workers, sampled every 0.2 s (a forked worker's pages shared with the main process count
once, split between them; Linux only).

Issue 16's targets: the 10-day run's peak memory within 1.5x of the 1-day run's, and the 10-day
run in no more than 60 s on the 2-core VM.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time


def _tree(pid: int) -> list[int]:
    out = [pid]
    for p in out:
        try:
            for t in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{t}/children") as f:
                    out += [int(x) for x in f.read().split()]
        except OSError:
            pass
    return out


def _pss_mib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            return next(int(ln.split()[1]) for ln in f if ln.startswith("Pss:")) / 1024
    except (OSError, StopIteration):
        return 0.0


def run(days: float, qps: float, jobs: int | None,
        reuse: str | None = None) -> tuple[float, float, float, dict]:
    """(wall seconds, peak RSS MiB of the largest process, peak summed PSS MiB, the replay's
    JSON) of one run in its own process."""
    n = int(days * 86400 * qps)
    cmd = [sys.executable, "-m", "kvsim.cli", "replay", "--policy", "dense", "--qps", str(qps),
           "--requests", str(n), "--context", "2048", "--output-len", "128", "--batch", "16",
           "--json"] + (["--jobs", str(jobs)] if jobs else []) + (
        ["--reuse", reuse, "--prefix-caching", "on", "--cache-host-gib", "64"] if reuse else [])
    with tempfile.TemporaryFile("w+") as out:
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.DEVNULL)
        peak, running = [0.0], [True]

        def sample():
            while running[0]:
                peak[0] = max(peak[0], sum(_pss_mib(q) for q in _tree(p.pid)))
                time.sleep(0.2)

        watcher = threading.Thread(target=sample, daemon=True)
        watcher.start()
        _, status, usage = os.wait4(p.pid, 0)
        wall = time.perf_counter() - t0
        running[0] = False
        watcher.join()
        if status != 0:
            raise SystemExit(f"{' '.join(cmd)} failed with status {status}")
        out.seek(0)
        report = json.load(out)
    return wall, usage.ru_maxrss / 1024, peak[0], report  # MiB (Linux reports KiB)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--days", default="1,10")
    ap.add_argument("--qps", type=float, default=2.0)
    ap.add_argument("--jobs", type=int, help="worker processes [default: the CPUs]")
    ap.add_argument("--reuse", metavar="SPEC", help="conversations with prefix caching on")
    args = ap.parse_args()
    days = [float(d) for d in args.days.split(",")]
    rows = [(d, *run(d, args.qps, args.jobs, args.reuse)) for d in days]
    base = rows[0]
    print(f"{'days':>5} {'requests':>10} {'pieces':>6} {'wall s':>7} {'RSS MiB':>8} "
          f"{'ratio':>6} {'PSS MiB':>8} {'ratio':>6} {'served':>7} {'TTFT p99 ms':>12}  "
          f"{'hit':>6}  percentiles")
    for d, wall, rss, pss, report in rows:
        sim = report["sim"]
        hit = report.get("prefix_hit_frac")
        print(f"{d:5g} {sim['requests']:10,} {sim['pieces']:6} {wall:7.1f} {rss:8.0f} "
              f"{rss / base[2]:6.2f} {pss:8.0f} {pss / base[3] if base[3] else 0:6.2f} "
              f"{sim['served_frac_window']:7.4f} {sim['ttft_p99_ms']:12.2f}  "
              f"{'-' if hit is None else f'{hit:.3f}':>6}  {sim['percentiles']}")


if __name__ == "__main__":
    main()
