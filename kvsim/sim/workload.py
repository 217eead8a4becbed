"""Request streams: Poisson arrivals at a QPS, a closed loop with fixed concurrency, or a CSV."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvsim.errors import KvsimError


@dataclass
class Workload:
    arrival: np.ndarray  # seconds (open loop); ignored for a closed loop
    prompt: np.ndarray  # prompt tokens per request
    output: np.ndarray  # output tokens per request (>= 1; the first comes from prefill)
    concurrency: int | None  # closed loop: this many requests in the system at all times
    description: str

    @property
    def n(self) -> int:
        return len(self.prompt)


def _check_sizes(prompt, output, where: str) -> None:
    if (np.asarray(prompt) < 1).any():
        raise KvsimError(f"{where}: prompt lengths must be positive")
    if (np.asarray(output) < 1).any():
        raise KvsimError(f"{where}: output lengths must be positive")


def poisson(qps: float, n: int, prompt: int, output: int, seed: int) -> Workload:
    if qps <= 0:
        raise KvsimError(f"--qps must be positive, got {qps}")
    if n < 1:
        raise KvsimError(f"--requests must be positive, got {n}")
    _check_sizes([prompt], [output], "workload")
    gaps = np.random.default_rng(seed).exponential(1.0 / qps, n)
    return Workload(np.cumsum(gaps) - gaps[0], np.full(n, prompt), np.full(n, output), None,
                    f"Poisson arrivals at {qps:g} req/s, {n} requests of {prompt}+{output} tokens "
                    f"(seed {seed})")


def closed_loop(concurrency: int, n: int, prompt: int, output: int) -> Workload:
    if concurrency < 1:
        raise KvsimError(f"--concurrency must be positive, got {concurrency}")
    if n < 1:
        raise KvsimError(f"--requests must be positive, got {n}")
    _check_sizes([prompt], [output], "workload")
    return Workload(np.zeros(n), np.full(n, prompt), np.full(n, output), concurrency,
                    f"closed loop of {concurrency} concurrent requests, {n} requests of "
                    f"{prompt}+{output} tokens")


def from_csv(path: str | Path) -> Workload:
    """A CSV with columns ``arrival`` (seconds), ``prompt`` and ``output`` (tokens)."""
    import pandas as pd
    path = Path(path)
    try:
        df = pd.read_csv(path)
    except (OSError, ValueError) as e:
        raise KvsimError(f"{path}: cannot read the workload CSV ({e})") from None
    missing = {"arrival", "prompt", "output"} - set(df.columns)
    if missing:
        raise KvsimError(f"{path}: the workload CSV lacks columns {sorted(missing)}")
    if df.empty:
        raise KvsimError(f"{path}: the workload CSV has no rows")
    try:
        arrival = df["arrival"].to_numpy(float)
        prompt, output = df["prompt"].to_numpy(np.int64), df["output"].to_numpy(np.int64)
    except (ValueError, TypeError) as e:
        raise KvsimError(f"{path}: non-numeric workload values ({e})") from None
    if not np.isfinite(arrival).all() or (arrival < 0).any():
        raise KvsimError(f"{path}: arrival times must be finite and >= 0")
    _check_sizes(prompt, output, str(path))
    order = np.argsort(arrival, kind="stable")
    return Workload(arrival[order], prompt[order], output[order], None,
                    f"{len(df)} requests from {path}")


def build(csv: str | Path | None, qps: float | None, concurrency: int | None, batch: int,
          requests: int | None, prompt: int, output: int, seed: int) -> Workload:
    """The workload a replay asks for: a CSV, Poisson arrivals at ``qps`` (64 requests unless
    given), or a closed loop of ``concurrency`` (default ``batch``; 2 x concurrency requests)."""
    if csv is not None:
        return from_csv(csv)
    if qps is not None:
        return poisson(qps, requests or 64, prompt, output, seed)
    conc = concurrency or batch
    return closed_loop(conc, requests or 2 * conc, prompt, output)
