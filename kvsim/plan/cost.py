"""What a configuration costs: its GPUs' hourly price (the catalog's example on-demand prices,
or the user's), per hour, per million output tokens and per request.

A configuration of ``replicas`` replicas of ``tp`` GPUs costs ``replicas x tp x price`` per hour
whatever its load, plus the tiers of its prefix cache (:class:`MemoryPrices`: host memory and
disk per GPU, a pool once); per token and per request it is priced at the rate it serves: the
SLO search's sustained rate where there is one (or the target rate, when the replicas were sized
for it), else the rate the run measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from kvsim.errors import KvsimError
from kvsim.hw import catalog

MAX_USD_PER_GPU_HOUR = 1e4  # a thousand times any list price: beyond, a typo (and sums overflow)
MAX_USD_PER_GIB_HOUR = 100.0  # memory or disk: 20,000 times DRAM's cloud price

COLUMNS = ["price_usd_per_gpu_hour", "price_source", "gpus", "cache_usd_per_hour",
           "usd_per_hour", "usd_per_m_tokens", "usd_per_request"]
# example prices of a prefix cache's tiers, each a flag to replace (--memory-price, --disk-price)
MEMORY_GIB_HOUR = 0.004237  # USD per GiB-hour of DRAM: Google Cloud N2 on-demand memory,
# us-central1, as OpenCost's default price sheet holds it ("RAM": "0.004237")
DISK_GIB_HOUR = 0.04 / 730  # USD per GiB-hour of storage: OpenCost's default ($0.04 per
# GiB-month, "storage": "0.00005479452")


@dataclass(frozen=True)
class MemoryPrices:
    """USD per GiB-hour of a prefix cache's tiers: host memory and a pool's DRAM (``memory``),
    local disk (``disk``); where each came from."""
    memory: float = MEMORY_GIB_HOUR
    disk: float = DISK_GIB_HOUR
    source: str = ("example prices: DRAM $0.004237/GiB-h (Google Cloud N2 on-demand memory, "
                   "us-central1, OpenCost's default sheet), disk $0.04/GiB-month (OpenCost's "
                   "default storage)")

    def per_gpu(self, r) -> float:
        """USD per hour of one GPU's host-memory and disk tiers (a row or a mapping)."""
        return _size(r, "cache_host_gib") * self.memory + _size(r, "cache_disk_gib") * self.disk

    def fixed(self, r) -> float:
        """USD per hour of what the replicas share: the pool."""
        return _size(r, "cache_pool_gib") * self.memory


def _size(r, key: str) -> float:
    v = r.get(key) if hasattr(r, "get") else None
    try:
        v = float(v)
    except (TypeError, ValueError):
        return 0.0
    return v if math.isfinite(v) else 0.0


def parse_memory_price(text, flag: str) -> float:
    """A tier's price (``--memory-price``, ``--disk-price``): USD per GiB-hour, >= 0."""
    try:
        v = float(text)
    except (TypeError, ValueError):
        v = math.nan
    if not (math.isfinite(v) and 0 <= v <= MAX_USD_PER_GIB_HOUR):
        raise KvsimError(f"{flag} must be a price >= 0 in US dollars per GiB-hour, at most "
                         f"{MAX_USD_PER_GIB_HOUR:g}, got {text!r}")
    return v


def _usd(text, where: str) -> float:
    try:
        v = float(text)
    except (TypeError, ValueError):
        v = math.nan
    if isinstance(text, bool) or not (math.isfinite(v) and 0 < v <= MAX_USD_PER_GPU_HOUR):
        raise KvsimError(f"{where}: the price must be a positive number of US dollars per "
                         f"GPU-hour, at most {MAX_USD_PER_GPU_HOUR:,.0f}, got {text!r}")
    return v


def parse_price(text: str) -> tuple[str, float]:
    """``h100-sxm=2.49`` (``--price``) as (GPU, USD per GPU-hour)."""
    gpu, sep, usd = str(text).partition("=")
    if not sep or not gpu.strip():
        raise KvsimError(f"--price {text!r}: write GPU=USD_PER_HOUR, e.g. h100-sxm=2.49")
    return gpu.strip(), _usd(usd.strip(), f"--price {text!r}")


def load_prices(path: str | Path) -> dict[str, float]:
    """A JSON object ``{gpu: usd_per_gpu_hour}`` (``--prices FILE``)."""
    from kvsim.io import read_json
    data = read_json(path, "--prices file", top=None)
    if not isinstance(data, dict) or not data:
        raise KvsimError(f"--prices {path}: give a JSON object of GPU names to US dollars per "
                         f"GPU-hour, e.g. {{\"h100-sxm\": 2.49}}")
    return {str(g): _usd(v, f"--prices {path}: {g}") for g, v in data.items()}


def resolve(gpus: list[str], overrides: dict[str, float]) -> dict[str, tuple[float | None, str]]:
    """Each GPU's (price, source): the user's where given, else the catalog's example; a GPU
    priced by the user must be one the plan runs on."""
    unknown = sorted(set(overrides) - set(gpus))
    if unknown:
        raise KvsimError(f"--price/--prices name {', '.join(unknown)}, which --gpu does not "
                         f"list ({', '.join(gpus)})")
    out = {}
    for g in gpus:
        if g in overrides:
            out[g] = (overrides[g], "user override (--price/--prices)")
        elif g in catalog.GPUS:
            p = catalog.GPUS[g]
            out[g] = (p.usd_per_hour, p.price_source if p.usd_per_hour is not None else
                      f"{p.price_source}; give one with --price {g}=USD")
        else:
            out[g] = (None, f"no price for {g}; give one with --price {g}=USD")
    return out


def add_costs(df: pd.DataFrame, prices: dict[str, tuple[float | None, str]],
              target_qps: float | None = None,
              memory: MemoryPrices = MemoryPrices()) -> pd.DataFrame:
    """``df`` with :data:`COLUMNS`. ``target_qps``: each row is priced as the fleet that
    carries the target rate (``replicas_needed``, found by the deployment search:
    :mod:`kvsim.plan.fleet`), at that rate; ``memory``: the prices of its cache's tiers."""
    df = df.copy()
    price = df["gpu"].map(lambda g: prices.get(g, (None, ""))[0]).astype(float)
    df["price_usd_per_gpu_hour"] = price
    df["price_source"] = df["gpu"].map(lambda g: prices.get(g, (None, "no price"))[1])
    tp = _num(df, "tp", 1.0)
    measured = _num(df, "requests_per_s", np.nan)
    tokens_per_request = _num(df, "throughput_tok_s", np.nan) / measured
    sustained = _num(df, "slo_max_qps", np.nan)
    if target_qps is not None:
        needed = _num(df, "replicas_needed", np.nan)
        df["replicas_needed"] = needed
        rate = pd.Series(np.where(needed > 0, target_qps, np.nan), index=df.index)
    else:
        rate = sustained.where(sustained.notna(), measured)
    replicas = df["replicas_needed"] if target_qps is not None else _num(df, "replicas", 1.0)
    df["gpus"] = replicas * tp
    tiers = [(memory.per_gpu(r), memory.fixed(r)) for r in df.to_dict("records")]
    df["cache_usd_per_hour"] = df["gpus"] * [t[0] for t in tiers] + [t[1] for t in tiers]
    df["usd_per_hour"] = df["gpus"] * price + df["cache_usd_per_hour"]
    ok = (df["status"] == "ok") & (rate > 0) if "status" in df else rate > 0
    per_request = df["usd_per_hour"] / 3600 / rate
    df["usd_per_request"] = per_request.where(ok)
    df["usd_per_m_tokens"] = (per_request / tokens_per_request * 1e6).where(ok)
    return df


def _num(df: pd.DataFrame, col: str, default: float) -> pd.Series:
    if col not in df:
        return pd.Series(default, index=df.index, dtype=float)
    return pd.to_numeric(df[col], errors="coerce")
