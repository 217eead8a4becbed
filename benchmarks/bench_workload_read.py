"""Reading a public trace: a generated file in the Azure LLM inference layout (2023 style:
``TIMESTAMP`` with 7 fractional digits, ``ContextTokens``, ``GeneratedTokens``), timed by
``kvsim.sim.workload.from_file``; prints rows, wall seconds and rows per second.

    python benchmarks/bench_workload_read.py [--rows 1700000]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from kvsim.sim import workload


def write_azure(path: Path, rows: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    t0 = np.datetime64("2023-11-16T18:15:46", "ns")
    t = t0 + np.cumsum(rng.exponential(0.5e9, rows)).astype("timedelta64[ns]")
    ctx, gen = rng.integers(1, 8000, rows), rng.integers(1, 800, rows)
    stamps = np.datetime_as_string(t, unit="ns")
    with path.open("w") as f:
        f.write("TIMESTAMP,ContextTokens,GeneratedTokens\n")
        for s, c, g in zip(stamps, ctx, gen):
            f.write(f"{s[:10]} {s[11:27]},{c},{g}\n")  # 7 fractional digits, as published


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=1_700_000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "azure.csv"
        write_azure(path, args.rows)
        t0 = time.perf_counter()
        w = workload.from_file(path)
        wall = time.perf_counter() - t0
    print(f"{w.n} requests read in {wall:.2f} s ({w.n / wall:,.0f} rows/s): {w.description}")


if __name__ == "__main__":
    main()
