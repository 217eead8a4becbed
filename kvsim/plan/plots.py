"""The capacity-planning plots, drawn from a sweep's table (one row per configuration).

Each function draws one figure and returns the series it drew ({label: (x, y)}), so tests can
check the content and the report can say what is shown. Figures are saved as PNG and SVG.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from kvsim.io import atomic_write  # noqa: E402


def _save(fig, out: Path, name: str) -> list[str]:
    files = []
    for ext in ("png", "svg"):
        path = out / f"{name}.{ext}"
        atomic_write(path, lambda f, ext=ext: fig.savefig(f, format=ext, dpi=120,
                                                          bbox_inches="tight"), force=True)
        files.append(path.name)
    plt.close(fig)
    return files


def _grid(n: int, width: float = 4.6, height: float = 3.4):
    cols = min(n, 3)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height * rows), squeeze=False,
                             layout="constrained")
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    return fig, list(axes.flat[:n])


def _ok(df: pd.DataFrame) -> pd.DataFrame:
    return df[df["status"] == "ok"] if "status" in df else df


def _panels(d: pd.DataFrame, keys: list[str]):
    """A figure with one panel per combination of ``keys`` in ``d``, and (axis, key values,
    rows) for each; (None, []) when ``d`` is empty."""
    groups = d.groupby(keys)
    names = sorted(groups.groups)
    if not names:
        return None, []
    fig, axes = _grid(len(names))
    return fig, [(ax, name, groups.get_group(name)) for ax, name in zip(axes, names)]


def _lines(ax, p: pd.DataFrame, x: str, y: str, series: dict, prefix: str) -> None:
    """One line per label of ``p``: ``y`` against ``x``, recorded in ``series``."""
    for lab, g in p.groupby("label"):
        g = g.sort_values(x)
        ax.plot(g[x], g[y], marker="o", label=lab)
        series[f"{prefix}|{lab}"] = (g[x].tolist(), g[y].tolist())


def throughput_vs_batch(df: pd.DataFrame, out: Path) -> dict:
    d = _ok(df)
    d = d[d["qps"].isna()] if "qps" in d else d
    series = {}
    fig, panels = _panels(d, ["gpu", "model", "context"])
    if fig is None:
        return series
    for ax, (gpu, model, ctx), p in panels:
        _lines(ax, p, "batch", "decode_tok_s", series, f"{gpu}|{model}|{ctx}")
        ax.set(xscale="log", yscale="log", xlabel="max batch", ylabel="decode tokens / s",
               title=f"{gpu}, {model}, {ctx // 1024}K context")
        ax.grid(alpha=0.3, which="both")
    panels[0][0].legend(fontsize=7)
    fig.suptitle("Decode throughput vs batch (memory caps admission where a line flattens)")
    _save(fig, out, "throughput_vs_batch")
    return series


def tpot_vs_context(df: pd.DataFrame, out: Path) -> dict:
    d = _ok(df)
    d = d[d["qps"].isna()] if "qps" in d else d
    d = d[d.batch == d.batch.min()]
    panels = sorted(d.groupby(["gpu", "model"]).groups)
    series = {}
    if not panels:
        return series
    fig, axes = _grid(len(panels))
    for ax, (gpu, model) in zip(axes, panels):
        p = d[(d.gpu == gpu) & (d.model == model)]
        _lines(ax, p, "context", "tpot_ms", series, f"{gpu}|{model}")
        ax.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="TPOT (ms)",
               title=f"{gpu}, {model}, batch {int(p.batch.iloc[0])}")
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3, which="both")
    axes[0].legend(fontsize=7)
    fig.suptitle("Time per output token vs context")
    _save(fig, out, "tpot_vs_context")
    return series


def max_batch_fit(df: pd.DataFrame, out: Path) -> dict:
    d = _ok(df)
    if d.empty:  # every run failed: nothing to draw
        return {}
    d = d[d.context == d.context.max()]
    t = d.groupby(["label", "gpu"])["max_batch_fit"].max().unstack("gpu")
    series = {}
    if t.empty:
        return series
    fig, ax = plt.subplots(figsize=(max(5, 1.2 * len(t)), 3.6))
    width = 0.8 / len(t.columns)
    x = np.arange(len(t))
    for i, gpu in enumerate(t.columns):
        vals = t[gpu].clip(upper=4096).to_numpy()
        ax.bar(x + i * width, vals, width, label=gpu)
        series[gpu] = (t.index.tolist(), vals.tolist())
    ax.set_xticks(x + width * (len(t.columns) - 1) / 2, t.index, rotation=20, ha="right",
                  fontsize=8)
    ax.set(yscale="log", ylabel="requests that fit at once",
           title=f"Largest batch that fits in memory at {int(d.context.max()) // 1024}K context")
    ax.legend(fontsize=8)
    _save(fig, out, "max_batch_fit")
    return series


HBM_PARTS = [("hbm_weights_gib", "weights"), ("hbm_kv_gib", "resident KV"),
             ("hbm_staging_gib", "transfer staging"), ("hbm_meta_gib", "sketch / metadata"),
             ("hbm_workspace_gib", "workspace")]


def hbm_breakdown(df: pd.DataFrame, out: Path) -> dict:
    d = _ok(df)
    d = d[(d.context == d.context.max()) & (d.gpu == d.gpu.iloc[0])] if len(d) else d
    rows = d.sort_values("batch").groupby("label").tail(1)  # largest batch per policy
    series = {}
    if rows.empty:
        return series
    fig, ax = plt.subplots(figsize=(max(5, 1.2 * len(rows)), 3.6))
    bottom = np.zeros(len(rows))
    for col, name in HBM_PARTS:
        vals = rows[col].fillna(0).to_numpy(float) if col in rows else np.zeros(len(rows))
        ax.bar(rows.label, vals, bottom=bottom, label=name)
        bottom += vals
        series[name] = (rows.label.tolist(), vals.tolist())
    ax.tick_params(axis="x", rotation=20, labelsize=8)
    ax.set(ylabel="GiB", title=f"HBM use on {rows.gpu.iloc[0]} at "
                               f"{int(rows.context.iloc[0]) // 1024}K context, largest batch run")
    ax.legend(fontsize=8)
    _save(fig, out, "hbm_breakdown")
    return series


def link_utilisation(df: pd.DataFrame, out: Path) -> dict:
    d = _ok(df)
    d = d[d["qps"].isna()] if "qps" in d else d
    d = d[d.context == d.context.max()]
    panels = sorted(d.groupby("gpu").groups)
    series = {}
    if not panels:
        return series
    fig, axes = _grid(len(panels))
    for ax, gpu in zip(axes, panels):
        p = d[d.gpu == gpu]
        for lab, g in p.groupby("label"):
            g = g.groupby("batch", as_index=False)["link_util"].mean()
            ax.plot(g.batch, g.link_util, marker="o", label=lab)
            series[f"{gpu}|{lab}"] = (g.batch.tolist(), g.link_util.tolist())
        ax.set(xscale="log", ylim=(0, 1.05), xlabel="max batch", ylabel="host link busy share",
               title=f"{gpu}, {int(d.context.max()) // 1024}K context")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("Host-link utilisation")
    _save(fig, out, "link_utilisation")
    return series


def crossover(df: pd.DataFrame, out: Path, fast: str = "verkv",
              base: str = "dense-offload") -> dict:
    """TPOT(fast) / TPOT(base) vs context; where it crosses 1, ``fast`` stops beating ``base``."""
    d = _ok(df)
    d = d[d["qps"].isna()] if "qps" in d else d
    if not {fast, base} <= set(d.policy):
        return {}
    b = d[d.policy == base].groupby(["gpu", "model", "batch", "context"])["tpot_ms"].min()
    series, crossings = {}, {}
    fig, ax = plt.subplots(figsize=(6, 4))
    for lab, g in d[d.policy == fast].groupby("label"):
        for (gpu, model, batch), h in g.groupby(["gpu", "model", "batch"]):
            h = h.sort_values("context")
            ref = np.array([b.get((gpu, model, batch, c), np.nan) for c in h.context])
            ratio = h.tpot_ms.to_numpy() / ref
            name = f"{lab} / {base}, {gpu}, {model}, batch {batch}"
            ax.plot(h.context, ratio, marker="o", label=name)
            series[name] = (h.context.tolist(), ratio.tolist())
            x = h.context.to_numpy(float)
            for i in range(len(ratio) - 1):
                if (ratio[i] - 1) * (ratio[i + 1] - 1) < 0:  # log-linear interpolation
                    t = (1 - ratio[i]) / (ratio[i + 1] - ratio[i])
                    cx = float(np.exp(np.log(x[i]) + t * (np.log(x[i + 1]) - np.log(x[i]))))
                    crossings[name] = cx
                    ax.axvline(cx, color="grey", lw=0.6, ls=":")
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set(xscale="log", yscale="log", xlabel="context (tokens)",
           ylabel=f"TPOT {fast} / TPOT {base}",
           title=f"Below 1: {fast} is faster than {base}")
    ax.set_xscale("log", base=2)
    ax.legend(fontsize=6)
    _save(fig, out, "crossover")
    series["_crossings"] = crossings
    return series


def pareto(df: pd.DataFrame, quality: pd.DataFrame, out: Path) -> dict:
    """Accuracy (% of dense, from kvsim eval) vs decode throughput, like the paper's Figure 6."""
    d = _ok(df)
    if quality is None or quality.empty or d.empty:
        return {}
    best = d.sort_values("decode_tok_s").groupby("label").tail(1)
    merged = best.merge(quality, on="label", how="inner")
    if merged.empty:
        return {}
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.scatter(merged.decode_tok_s, merged.relative_accuracy * 100)
    for _, r in merged.iterrows():
        ax.annotate(r.label, (r.decode_tok_s, r.relative_accuracy * 100), fontsize=7)
    pts = merged.sort_values("decode_tok_s", ascending=False)
    front, top = [], -np.inf
    for _, r in pts.iterrows():
        if r.relative_accuracy > top:
            front.append((r.decode_tok_s, r.relative_accuracy * 100))
            top = r.relative_accuracy
    fx, fy = zip(*sorted(front))
    ax.plot(fx, fy, color="grey", ls="--", label="Pareto front")
    ax.set(xscale="log", xlabel="decode tokens / s (best batch)", ylabel="accuracy, % of dense",
           title="Quality vs throughput")
    ax.legend(fontsize=8)
    _save(fig, out, "pareto")
    return {"points": (merged.decode_tok_s.tolist(), merged.relative_accuracy.tolist()),
            "front": (list(fx), list(fy))}


def goodput_vs_rate(df: pd.DataFrame, out: Path) -> dict:
    """Goodput (requests per second meeting every SLO) against the offered Poisson rate; the
    diagonal is what a system that meets every SLO would serve."""
    d = _ok(df)
    if "goodput_rps" not in d or "qps" not in d:
        return {}
    d = d[d["qps"].notna() & d["goodput_rps"].notna()]
    series = {}
    fig, panels = _panels(d, ["gpu", "model", "context"])
    if fig is None:
        return series
    for ax, (gpu, model, ctx), p in panels:
        _lines(ax, p, "qps", "goodput_rps", series, f"{gpu}|{model}|{ctx}")
        lim = [p.qps.min(), p.qps.max()]
        ax.plot(lim, lim, color="grey", lw=0.8, ls=":", label="every request within SLO")
        ax.set(xlabel="offered rate (requests / s)", ylabel="goodput (requests / s)",
               ylim=(0, None), title=f"{gpu}, {model}, {ctx // 1024}K context")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.suptitle("Goodput vs offered rate: requests per second meeting every SLO")
    _save(fig, out, "goodput_vs_rate")
    return series


def draw_all(df: pd.DataFrame, out: Path, quality: pd.DataFrame | None = None) -> dict:
    return {name: fn(df, out) for name, fn in (
        ("goodput_vs_rate", goodput_vs_rate),
        ("throughput_vs_batch", throughput_vs_batch), ("tpot_vs_context", tpot_vs_context),
        ("max_batch_fit", max_batch_fit), ("hbm_breakdown", hbm_breakdown),
        ("link_utilisation", link_utilisation), ("crossover", crossover),
        ("pareto", lambda d, o: pareto(d, quality, o)))}
