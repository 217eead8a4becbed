"""Axis conventions of the plan's figures: plain tick labels (8,192 / 32,768, 1 / 4 / 16, never
10^k; thousands are 1,000), a log axis only where the data span ``LOG_SPAN`` times, one legend
per figure beside its panels, no empty grid cells."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib import ticker

LOG_SPAN = 3.0  # an axis whose data span less than this ratio is drawn linear


def plain(v: float) -> str:
    """A tick value as a plain number: 0.05, 2, 30, 1,500."""
    if not np.isfinite(v):
        return ""
    a = abs(v)
    if a == 0:
        return "0"
    if a >= 1000:
        return f"{v:,.0f}"
    if a >= 1:
        return f"{v:.3g}"
    return f"{v:.2g}"


def tokens(v: float) -> str:
    """A token count as written in the table, thousands meaning 1,000: 512, 8,192, 131,072,
    1.05M (a million and more to three figures)."""
    if v >= 1_000_000:
        return f"{v / 1e6:.3g}M"
    return f"{v:,.0f}"


def scale(ax, axis: str, values, fmt=plain, ticks: bool = False,
           span: float = LOG_SPAN) -> None:
    """Log scale when ``values`` span at least ``span`` times, else linear; plain tick labels.
    ``ticks``: put the major ticks at the data values themselves (batches, contexts)."""
    v = np.asarray(pd.to_numeric(pd.Series(list(values)), errors="coerce"), float)
    v = v[np.isfinite(v)]
    log = len(v) > 0 and v.min() > 0 and v.max() / v.min() >= span
    a = ax.xaxis if axis == "x" else ax.yaxis
    (ax.set_xscale if axis == "x" else ax.set_yscale)("log" if log else "linear")
    if ticks and len(v):
        u = np.unique(v)
        if len(u) > 10:  # keep about eight labels
            u = u[np.linspace(0, len(u) - 1, 8).round().astype(int)]
        a.set_major_locator(ticker.FixedLocator(u))
        a.set_major_formatter(ticker.FuncFormatter(lambda x, _: fmt(x)))
    elif log:
        a.set_major_locator(ticker.LogLocator(10, subs=(1, 2, 5) if v.max() / v.min() >= 10 else
                                              (1, 1.5, 2, 3, 4, 5, 6, 7, 8, 9)))
        a.set_major_formatter(ticker.FuncFormatter(lambda x, _: fmt(x)))
    else:
        f = ticker.ScalarFormatter(useOffset=False)
        f.set_scientific(False)
        a.set_major_formatter(f if fmt is plain else ticker.FuncFormatter(lambda x, _: fmt(x)))
    a.set_minor_formatter(ticker.NullFormatter())
    if log:
        a.set_minor_locator(ticker.NullLocator())


def legend(fig, axes) -> None:
    """One legend for the whole figure, under the panels (entries de-duplicated), so that it
    neither covers the title nor squeezes the panels however long its labels."""
    seen: dict[str, object] = {}
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if not lab.startswith("_"):
                seen.setdefault(lab, h)
    if seen:
        fig.legend(list(seen.values()), list(seen), loc="outside lower center", fontsize=8,
                   frameon=False, ncols=1 if len(seen) < 4 else 2)


def grid(n: int, width: float = 4.2, height: float = 3.2):
    cols = min(n, 3)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols + 1.8, height * rows),
                             squeeze=False, layout="constrained")
    for ax in axes.flat[n:]:  # no empty cells: a figure holds only the panels it draws
        fig.delaxes(ax)
    return fig, list(axes.flat[:n])


def single(width: float, height: float):
    fig, ax = plt.subplots(figsize=(width, height), layout="constrained")
    return fig, ax


def merge_identical(series: dict) -> dict:
    """Series ({label: (x, y, ...)}) that are the same at every point, drawn once under their
    labels joined by " = " (in the order given), so that no line hides another of its name."""
    merged: dict[str, tuple] = {}
    for label, s in series.items():
        arrays = [np.asarray(v, float) for v in s]
        same = next((k for k, t in merged.items() if len(t) == len(arrays) and all(
            a.shape == np.shape(b) and np.allclose(a, b, rtol=1e-9, atol=0, equal_nan=True)
            for a, b in zip(arrays, t))), None)
        if same is None:
            merged[label] = s
        else:
            merged[f"{same} = {label}"] = merged.pop(same)
    return merged
