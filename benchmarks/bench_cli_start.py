"""How fast the CLI starts: ``kvsim --help`` against a bare ``python -c "import numpy"``, timed
side by side in one run (alternating, whole processes, median of N), and the ratio.

    python benchmarks/bench_cli_start.py [--runs 15]

The target is a ratio of at most 4: building the top-level parser loads no command, no policy,
no torch, pandas or matplotlib (``tests/test_layout.py`` holds what is imported). A command's own
start (``kvsim replay --help``, which documents the options every policy shares) is printed for
reference.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

COMMANDS = {
    "python -c 'import numpy'": [sys.executable, "-c", "import numpy"],
    "kvsim --help": [sys.executable, "-m", "kvsim.cli", "--help"],
    "kvsim replay --help": [sys.executable, "-m", "kvsim.cli", "replay", "--help"],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=15)
    args = ap.parse_args()
    times: dict[str, list[float]] = {k: [] for k in COMMANDS}
    for _ in range(args.runs):
        for name, cmd in COMMANDS.items():
            t0 = time.perf_counter()
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            times[name].append(time.perf_counter() - t0)
    base = statistics.median(times["python -c 'import numpy'"])
    print(f"{'command':<26} {'median s':>9} {'min s':>7} {'x numpy':>8}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:<26} {med:9.3f} {min(ts):7.3f} {med / base:8.2f}")


if __name__ == "__main__":
    main()
