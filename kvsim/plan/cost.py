"""What a configuration costs: its GPUs' hourly price (the catalog's example on-demand prices,
or the user's), per hour, per million output tokens and per request.

A configuration of ``replicas`` replicas of ``tp`` GPUs costs ``replicas x tp x price`` per hour
whatever its load; per token and per request it is priced at the rate it serves: the SLO
search's sustained rate where there is one (or the target rate, when the replicas were sized
for it), else the rate the run measured.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from kvsim.errors import KvsimError
from kvsim.hw import catalog

COLUMNS = ["price_usd_per_gpu_hour", "price_source", "gpus", "usd_per_hour", "usd_per_m_tokens",
           "usd_per_request"]


def _usd(text, where: str) -> float:
    try:
        v = float(text)
    except (TypeError, ValueError):
        v = math.nan
    if isinstance(text, bool) or not (math.isfinite(v) and v > 0):
        raise KvsimError(f"{where}: the price must be a positive number of US dollars per "
                         f"GPU-hour, got {text!r}")
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
              target_qps: float | None = None) -> pd.DataFrame:
    """``df`` with :data:`COLUMNS`. ``target_qps``: each row is priced as the fleet that
    carries the target rate (``replicas_needed``, found by the deployment search:
    :mod:`kvsim.plan.fleet`), at that rate."""
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
    df["usd_per_hour"] = df["gpus"] * price
    ok = (df["status"] == "ok") & (rate > 0) if "status" in df else rate > 0
    per_request = df["usd_per_hour"] / 3600 / rate
    df["usd_per_request"] = per_request.where(ok)
    df["usd_per_m_tokens"] = (per_request / tokens_per_request * 1e6).where(ok)
    return df


def _num(df: pd.DataFrame, col: str, default: float) -> pd.Series:
    if col not in df:
        return pd.Series(default, index=df.index, dtype=float)
    return pd.to_numeric(df[col], errors="coerce")
