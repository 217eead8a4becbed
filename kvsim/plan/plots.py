"""The capacity-planning plots, drawn from a sweep's table (one row per configuration).

Each function draws one figure and returns the series it drew ({label: (x, y)}), so tests can
check the content and the report can say what is shown. Figures are saved as PNG and SVG.

Conventions (issue 15, item 7): tick labels are plain (8K / 32K for contexts, 1 / 4 / 16 for
batches, plain numbers elsewhere, never 10^k); an axis is logarithmic only when its data span at
least ``LOG_SPAN`` times, otherwise linear; bars carry their values; a figure has one legend,
beside its panels; unused grid cells are removed; titles say what is drawn, not a conclusion.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib import ticker

from kvsim.io import atomic_write
from kvsim.plan.axes import LOG_SPAN, plain, tokens  # noqa: F401  (LOG_SPAN: tests)
from kvsim.plan.axes import grid as _grid
from kvsim.plan.axes import legend as _legend
from kvsim.plan.axes import merge_identical as _merge
from kvsim.plan.axes import scale as _scale
from kvsim.plan.axes import single as _single

FIGURE_HOOK = None  # callable(name, figure), called before a figure is saved and closed (tests)


def _save(fig, out: Path, name: str) -> list[str]:
    if FIGURE_HOOK is not None:
        FIGURE_HOOK(name, fig)
    files = []
    for ext in ("png", "svg"):
        path = out / f"{name}.{ext}"
        atomic_write(path, lambda f, ext=ext: fig.savefig(f, format=ext, dpi=120,
                                                          bbox_inches="tight"), force=True)
        files.append(path.name)
    plt.close(fig)
    return files


def _note(fig, text: str, width: int = 150) -> None:
    """A sentence with the figure's legend (its title, wrapped to ``width`` characters): the
    layout sizes the legend with it, so the two never overlap, as a loose text under a legend
    placed by the layout did."""
    import textwrap
    wrapped = "\n".join(textwrap.wrap(text, width))
    if fig.legends:
        fig.legends[0].set_title(wrapped, prop={"size": 8})
    else:
        fig.text(0.5, 0, wrapped, ha="center", va="top", fontsize=8)


def _ok(df: pd.DataFrame) -> pd.DataFrame:
    return df[df["status"] == "ok"] if "status" in df else df


def _truthy(s: pd.Series) -> pd.Series:
    return s.astype(str).str.strip().str.lower().isin(["true", "1", "1.0"])


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
    """One line per label of ``p``: ``y`` against ``x``, recorded in ``series``; where the rows
    carry ``y_lo``/``y_hi`` (the prediction interval), a shaded band. Labels whose lines
    (and bands) are identical are drawn once, as "A = B"."""
    lo, hi = f"{y}_lo", f"{y}_hi"
    drawn = {}
    for lab, g in p.groupby("label"):
        g = g.sort_values(x)
        band = lo in g and hi in g and g[lo].notna().any()
        drawn[lab] = (g[x].tolist(), g[y].tolist()) + \
            ((g[lo].tolist(), g[hi].tolist()) if band else ())
    for lab, (xs, ys, *band) in _merge(drawn).items():
        line, = ax.plot(xs, ys, marker="o", label=lab)
        series[f"{prefix}|{lab}"] = (xs, ys)
        if band:
            ax.fill_between(xs, band[0], band[1], color=line.get_color(), alpha=0.18,
                            linewidth=0)
            ax.fill_between([], [], [], color="grey", alpha=0.3, linewidth=0,
                            label="shaded: prediction interval (engine error, policy profile)")
            series[f"{prefix}|{lab}|band"] = (xs, band[0], band[1])


def _closed_loop(df: pd.DataFrame) -> pd.DataFrame:
    d = _ok(df)
    return d[d["qps"].isna()] if "qps" in d else d


def hbm_limited(df: pd.DataFrame) -> list[str]:
    """The closed-loop configurations whose memory admits fewer requests than their batch
    (the results' ``hbm_limited`` column), as short names."""
    d = _closed_loop(df)
    if "hbm_limited" not in d or d.empty:
        return []
    d = d[_truthy(d["hbm_limited"])].sort_values(["gpu", "model", "context", "label", "batch"])
    return [f"{r.gpu} {r.model} {tokens(r.context)} {r.label} batch {int(r.batch)}"
            + (f" (fits {int(r.max_batch_fit)})" if "max_batch_fit" in d else "")
            for r in d.itertuples()]


def hbm_limited_note(df: pd.DataFrame, most: int = 6) -> str:
    """One sentence naming which configurations are HBM-limited (from the results)."""
    d = _closed_loop(df)
    if "hbm_limited" not in d:
        return "The results have no hbm_limited column."
    names = hbm_limited(df)
    if not names:
        return "No configuration shown is HBM-limited: memory admits every batch."
    more = f", and {len(names) - most} more" if len(names) > most else ""
    return (f"HBM-limited (memory admits fewer requests than the batch; circled): "
            f"{'; '.join(names[:most])}{more}.")


def throughput_vs_batch(df: pd.DataFrame, out: Path) -> dict:
    d = _closed_loop(df)
    series = {}
    fig, panels = _panels(d, ["gpu", "model", "context"])
    if fig is None:
        return series
    for ax, (gpu, model, ctx), p in panels:
        _lines(ax, p, "batch", "decode_tok_s", series, f"{gpu}|{model}|{ctx}")
        if "hbm_limited" in p:
            lim = p[_truthy(p["hbm_limited"])]
            if len(lim):
                ax.scatter(lim.batch, lim.decode_tok_s, s=140, facecolors="none",
                           edgecolors="black", linewidths=1.2, zorder=3,
                           label="HBM-limited (fits fewer than the batch)")
        _scale(ax, "x", p.batch, plain, ticks=True)
        _scale(ax, "y", p.decode_tok_s)
        ax.set(xlabel="max batch", ylabel="decode tokens / s")
        ax.set_title(f"{gpu}, {model}, {tokens(ctx)} context", fontsize=10)
        ax.grid(alpha=0.3)
    _legend(fig, [a for a, _, _ in panels])
    fig.suptitle("Decode throughput vs batch")
    _note(fig, hbm_limited_note(df))
    _save(fig, out, "throughput_vs_batch")
    return series


def tpot_vs_context(df: pd.DataFrame, out: Path) -> dict:
    d = _closed_loop(df)
    d = d[d.batch == d.batch.min()]
    series = {}
    if d.empty or d.context.nunique() < 2:  # one context (a workload): nothing varies on x
        return series
    fig, panels = _panels(d, ["gpu", "model"])
    if fig is None:
        return series
    for ax, (gpu, model), p in panels:
        _lines(ax, p, "context", "tpot_ms", series, f"{gpu}|{model}")
        _scale(ax, "x", p.context, tokens, ticks=True)
        _scale(ax, "y", p.tpot_ms)
        ax.set(xlabel="context (tokens)", ylabel="TPOT (ms)")
        ax.set_title(f"{gpu}, {model}, batch {int(p.batch.iloc[0])}", fontsize=10)
        ax.grid(alpha=0.3)
    _legend(fig, [a for a, _, _ in panels])
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
    cap = 4096
    fig, ax = _single(max(5, 1.3 * len(t) * max(1, len(t.columns) / 2)) + 1.5, 3.8)
    width = 0.8 / len(t.columns)
    x = np.arange(len(t))
    for i, gpu in enumerate(t.columns):
        raw = t[gpu].to_numpy(float)
        vals = np.minimum(raw, cap)
        bars = ax.bar(x + i * width, vals, width, label=gpu)
        ax.bar_label(bars, labels=["" if not np.isfinite(r) else
                                   f"{cap:,}+" if r > cap else f"{r:,.0f}" for r in raw],
                     fontsize=7, padding=2)
        series[gpu] = (t.index.tolist(), vals.tolist())
    ax.set_xticks(x + width * (len(t.columns) - 1) / 2, t.index, rotation=20, ha="right",
                  fontsize=8)
    allv = np.concatenate([s[1] for s in series.values()])
    _scale(ax, "y", allv, span=20)  # bars: linear unless the values span decades
    ax.margins(y=0.15)
    ax.set(ylabel="requests that fit at once")
    ax.set_title(f"Largest batch that fits in memory at {tokens(d.context.max())} context",
                 fontsize=10)
    _legend(fig, [ax])
    _save(fig, out, "max_batch_fit")
    return series


HBM_PARTS = [("hbm_weights_gib", "weights"), ("hbm_kv_gib", "resident KV"),
             ("hbm_staging_gib", "transfer staging"), ("hbm_meta_gib", "sketch / metadata"),
             ("hbm_workspace_gib", "workspace")]


def hbm_breakdown(df: pd.DataFrame, out: Path) -> dict:
    """One panel per GPU: what occupies HBM in the largest-batch run of each policy at the
    longest context. Series: {part: (labels, GiB)} for one GPU, {"gpu|part": ...} for several."""
    d = _ok(df)
    if d.empty:
        return {}
    ctx = d.context.max()
    d = d[d.context == ctx]
    gpus = sorted(d.gpu.unique())
    series = {}
    n_lab = d.label.nunique()
    fig, axes = _grid(len(gpus), width=max(3.6, 1.1 * n_lab + 1.2), height=3.6)
    for ax, gpu in zip(axes, gpus):
        rows = d[d.gpu == gpu].sort_values("batch").groupby("label").tail(1)  # largest batch
        rows = rows.sort_values("label")
        bottom = np.zeros(len(rows))
        for col, name in HBM_PARTS:
            vals = rows[col].fillna(0).to_numpy(float) if col in rows else np.zeros(len(rows))
            bars = ax.bar(rows.label, vals, bottom=bottom, label=name)
            bottom += vals
            big = vals >= 0.08 * max(bottom.max(), 1e-9)
            ax.bar_label(bars, labels=[f"{v:.1f}" if b else "" for v, b in zip(vals, big)],
                         label_type="center", fontsize=7)
            series[name if len(gpus) == 1 else f"{gpu}|{name}"] = (rows.label.tolist(),
                                                                   vals.tolist())
        ax.bar_label(bars, labels=[f"{t:.1f} GiB" for t in bottom], fontsize=7, padding=2,
                     bbox=dict(facecolor="white", edgecolor="none", pad=0.5),
                     zorder=3)  # readable where the total sits on the capacity line
        if "hbm_capacity_gib" in rows and rows.hbm_capacity_gib.notna().any():
            cap = float(rows.hbm_capacity_gib.max())
            ax.axhline(cap, color="black", lw=0.8, ls="--", label="HBM capacity")
        ax.margins(y=0.12)
        ax.tick_params(axis="x", rotation=20, labelsize=8)
        for lab in ax.get_xticklabels():
            lab.set_ha("right")
        ax.set(ylabel="GiB")
        batches = ", ".join(str(int(b)) for b in sorted(rows.batch.unique()))
        ax.set_title(f"{gpu} (batch {batches})", fontsize=10)
    _legend(fig, axes)
    fig.suptitle(f"HBM use at {tokens(ctx)} context, largest batch run of each policy",
                 fontsize=11)
    _save(fig, out, "hbm_breakdown")
    return series


def link_utilisation(df: pd.DataFrame, out: Path) -> dict:
    d = _closed_loop(df)
    d = d[d.context == d.context.max()]
    series = {}
    gpus = sorted(d.gpu.unique())
    if not gpus:
        return series
    fig, axes = _grid(len(gpus))
    panels = [(ax, gpu, d[d.gpu == gpu]) for ax, gpu in zip(axes, gpus)]
    for ax, gpu, p in panels:
        for lab, g in p.groupby("label"):
            g = g.groupby("batch", as_index=False)["link_util"].mean()
            ax.plot(g.batch, g.link_util, marker="o", label=lab)
            series[f"{gpu}|{lab}"] = (g.batch.tolist(), g.link_util.tolist())
        _scale(ax, "x", p.batch, plain, ticks=True)
        ax.set(ylim=(0, 1.05), xlabel="max batch", ylabel="host link busy share")
        ax.set_title(f"{gpu}, {tokens(d.context.max())} context", fontsize=10)
        ax.grid(alpha=0.3)
    _legend(fig, [a for a, _, _ in panels])
    fig.suptitle("Host-link busy share vs batch")
    _save(fig, out, "link_utilisation")
    return series


def crossover(df: pd.DataFrame, out: Path, base: str = "dense-offload") -> dict:
    """TPOT(policy) / TPOT(base) vs context for every other policy that keeps the cache in host
    memory; where a line crosses 1, that policy stops beating ``base``."""
    d = _closed_loop(df)
    fetching = d[(d.policy != base) & (d.host_frac > 0)] if "host_frac" in d else d[:0]
    if base not in set(d.policy) or fetching.empty or d.context.nunique() < 2:
        return {}  # (one context, a workload's: no crossing to draw)
    b = d[d.policy == base].groupby(["gpu", "model", "batch", "context"])["tpot_ms"].min()
    series, crossings = {}, {}
    fig, ax = _single(8, 4)
    if fetching.groupby(["gpu", "model", "batch", "label"]).ngroups > 10:  # no colour twice
        ax.set_prop_cycle(color=plt.cm.tab20.colors)
    for (gpu, model, batch), g in fetching.groupby(["gpu", "model", "batch"]):
        ratios = {}
        for lab, h in g.groupby("label"):
            h = h.sort_values("context")
            ref = np.array([b.get((gpu, model, batch, c), np.nan) for c in h.context])
            ratios[lab] = (h.context.tolist(), (h.tpot_ms.to_numpy() / ref).tolist())
        for lab, (xs, ratio) in _merge(ratios).items():  # identical lines: one, "A = B"
            name = f"{lab} / {base}, {gpu}, {model}, batch {batch}"
            ax.plot(xs, ratio, marker="o", label=name)
            series[name] = (xs, ratio)
            x = np.asarray(xs, float)
            for i in range(len(ratio) - 1):
                if (ratio[i] - 1) * (ratio[i + 1] - 1) < 0:  # log-linear interpolation
                    t = (1 - ratio[i]) / (ratio[i + 1] - ratio[i])
                    cx = float(np.exp(np.log(x[i]) + t * (np.log(x[i + 1]) - np.log(x[i]))))
                    crossings[name] = cx
                    ax.axvline(cx, color="grey", lw=0.6, ls=":")
    ax.axhline(1.0, color="black", lw=0.8)
    xs = [v for s in series.values() for v in s[0]]
    ys = [v for s in series.values() for v in s[1]] + [1.0]
    _scale(ax, "x", xs, tokens, ticks=True)
    _scale(ax, "y", ys)
    ax.set(xlabel="context (tokens)", ylabel=f"TPOT / TPOT {base}")
    ax.set_title(f"TPOT ratio to {base} vs context (below 1: the policy is faster)",
                 fontsize=10)
    ax.grid(alpha=0.3)
    _legend(fig, [ax])
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
    fig, ax = _single(7.5, 4)
    ax.scatter(merged.decode_tok_s, merged.relative_accuracy * 100)
    for _, r in merged.iterrows():
        ax.annotate(r.label, (r.decode_tok_s, r.relative_accuracy * 100), fontsize=7,
                    xytext=(3, 3), textcoords="offset points")
    pts = merged.sort_values("decode_tok_s", ascending=False)
    front, top = [], -np.inf
    for _, r in pts.iterrows():
        if r.relative_accuracy > top:
            front.append((r.decode_tok_s, r.relative_accuracy * 100))
            top = r.relative_accuracy
    fx, fy = zip(*sorted(front))
    ax.plot(fx, fy, color="grey", ls="--", label="Pareto front")
    _scale(ax, "x", merged.decode_tok_s)
    _scale(ax, "y", merged.relative_accuracy * 100)
    ax.set(xlabel="decode tokens / s (best batch)", ylabel="accuracy, % of dense")
    ax.set_title("Accuracy vs decode throughput", fontsize=10)
    ax.grid(alpha=0.3)
    _legend(fig, [ax])
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
        for axis in ("x", "y"):
            f = ticker.ScalarFormatter(useOffset=False)
            f.set_scientific(False)
            (ax.xaxis if axis == "x" else ax.yaxis).set_major_formatter(f)
        ax.set(xlabel="offered rate (requests / s)", ylabel="goodput (requests / s)",
               ylim=(0, None))
        ax.set_title(f"{gpu}, {model}, {tokens(ctx)} context", fontsize=10)
        ax.grid(alpha=0.3)
    _legend(fig, [a for a, _, _ in panels])
    fig.suptitle("Goodput (requests / s meeting every SLO) vs offered rate")
    _save(fig, out, "goodput_vs_rate")
    return series


def frontier(d: pd.DataFrame, x: str, y: str) -> list:
    """The index of the rows of ``d`` that no other row beats: none has both ``x`` and ``y`` at
    most as large and one of them smaller (the Pareto frontier, lower is better on both)."""
    pts = d[[x, y]].to_numpy(float)
    return [i for i, p in zip(d.index, pts)
            if not ((pts <= p).all(axis=1) & (pts < p).any(axis=1)).any()]


def _decision_columns(d: pd.DataFrame) -> dict | None:
    """Where a plan's decision figures are: a deployment search's fleets at the target rate
    (``fleet_*``, ``capacity_per_replica``), or an SLO search's single replica at its sustained
    rate (``slo_at_*``, ``slo_max_qps``); None where there are neither."""
    if "fleet_tpot_p99_ms" in d and d.fleet_tpot_p99_ms.notna().any():
        return {"capacity": "capacity_per_replica", "tpot": "fleet_tpot_p99_ms",
                "ttft": "fleet_ttft_p99_ms", "where": "of its fleet at the target rate",
                "capacity_words": "requests / s per GPU of the fleet that carries the target"}
    if "slo_at_tpot_p99_ms" in d and d.slo_at_tpot_p99_ms.notna().any():
        return {"capacity": "slo_max_qps", "tpot": "slo_at_tpot_p99_ms",
                "ttft": "slo_at_ttft_p99_ms", "where": "at its sustained rate",
                "capacity_words": "sustained requests / s per GPU within the SLO"}
    return None


def _meets(d: pd.DataFrame, cap: str) -> pd.Series:
    """The rows that carry the target within the SLO at a known price (a capacity and a
    cost)."""
    return (pd.to_numeric(d[cap], errors="coerce") > 0) & \
        np.isfinite(pd.to_numeric(d["usd_per_m_tokens"], errors="coerce"))


def _answer(d: pd.DataFrame) -> pd.Series:
    return d["why_lost"].astype(str).eq("the answer") if "why_lost" in d else \
        pd.Series(False, index=d.index)


def _name(r) -> str:
    from kvsim.plan.decide import describe
    return describe(r) + (f", {r['model']} {tokens(r['context'])}" if "context" in r and
                          r["context"] == r["context"] else "")


def cost_vs_latency(df: pd.DataFrame, out: Path) -> dict:
    """Cost per million output tokens against p99 TPOT (and p99 TTFT, where measured) at each
    configuration's sustained rate: the configurations that carry the target within the SLO,
    those that fail the check at the target rate greyed, the Pareto frontier (nothing both
    cheaper and faster) as a line, the answer annotated. Series: {panel: {"points", "frontier",
    "answer"}}."""
    d = _ok(df).copy()
    cols = _decision_columns(d)
    if cols is None or "usd_per_m_tokens" not in d or d.empty:
        return {}
    good, ans = _meets(d, cols["capacity"]), _answer(d)
    if not good.any():
        return {}
    xs = [(cols["tpot"], "p99 TPOT (ms)")]
    if cols["ttft"] in d and d.loc[good, cols["ttft"]].notna().any():
        d = d.assign(ttft_p99_s=d[cols["ttft"]] / 1000)  # seconds: readable ticks
        xs.append(("ttft_p99_s", "p99 TTFT (s)"))
    fig, axes = _grid(len(xs), width=5.2, height=4.0)
    series = {}
    for ax, (x, xlabel) in zip(axes, xs):
        g = d[good & d[x].notna()]
        grey = d[~good & d[x].notna() & np.isfinite(pd.to_numeric(d["usd_per_m_tokens"],
                                                                  errors="coerce"))]
        if len(grey):
            ax.scatter(grey[x], grey.usd_per_m_tokens, color="lightgrey", s=22, zorder=1,
                       label="fails the SLO at the target rate")
        ax.scatter(g[x], g.usd_per_m_tokens, color="tab:blue", s=22, zorder=2,
                   label="meets the SLO at the target rate")
        f = g.loc[frontier(g, x, "usd_per_m_tokens")].sort_values(x)
        ax.plot(f[x], f.usd_per_m_tokens, color="tab:orange", lw=1.2, marker="o", ms=7,
                mfc="none", zorder=3, label="Pareto frontier (nothing cheaper and faster)")
        a = d[ans & d[x].notna()]
        for _, r in a.iterrows():  # named in the legend, marked here
            ax.scatter([r[x]], [r.usd_per_m_tokens], marker="*", s=220, color="tab:red",
                       zorder=4, label=f"the answer: {_name(r)}")
            right = r[x] > g[x].median()
            ax.annotate("the answer", (r[x], r.usd_per_m_tokens), fontsize=8, color="tab:red",
                        xytext=(-9 if right else 9, 9), textcoords="offset points",
                        ha="right" if right else "left")
        _scale(ax, "x", pd.concat([g[x], grey[x]]))
        _scale(ax, "y", pd.concat([g.usd_per_m_tokens, grey.usd_per_m_tokens]))
        ax.set(xlabel=f"{xlabel} {cols['where']}", ylabel="$ per million output tokens")
        ax.set_title(f"cost vs {xlabel.split(' (')[0]}", fontsize=10)
        ax.grid(alpha=0.3)
        series[x] = {"points": (g[x].tolist(), g.usd_per_m_tokens.tolist()),
                     "frontier": (f[x].tolist(), f.usd_per_m_tokens.tolist()),
                     "answer": (a[x].tolist(), a.usd_per_m_tokens.tolist())}
    _legend(fig, axes)
    fig.suptitle("Cost per output token vs latency, configurations that carry the target")
    _save(fig, out, "cost_vs_latency")
    return series


def capacity_per_gpu(df: pd.DataFrame, out: Path) -> dict:
    """Sustained requests / s per GPU (the SLO search's rate of one replica over its TP size)
    of each configuration, sorted, the answer highlighted. Series: {"capacity": (names,
    req/s per GPU)}."""
    d = _ok(df)
    cols = _decision_columns(d)
    if cols is None or "usd_per_hour" not in d:
        return {}
    cap = cols["capacity"]
    d = d[pd.to_numeric(d[cap], errors="coerce").notna()].copy()
    d["per_gpu"] = pd.to_numeric(d[cap]) / d.tp
    none = d[d.per_gpu <= 0]
    d = d[d.per_gpu > 0].sort_values("per_gpu")
    if d.empty:
        return {}
    common = d.model.nunique() == 1 and d.context.nunique() == 1  # said once, in the title
    names = [_name(r).removesuffix(f", {r['model']} {tokens(r['context'])}") if common
             else _name(r) for r in d.to_dict("records")]
    ans = _answer(d).to_numpy()
    fig, ax = _single(8.5, 1.4 + 0.28 * len(d))
    bars = ax.barh(range(len(d)), d.per_gpu, color=np.where(ans, "tab:red", "tab:blue"),
                   height=0.7)
    bars[0].set_label("configuration")
    for i in np.flatnonzero(ans):
        bars[i].set_label("the answer")
    ax.bar_label(bars, labels=[plain(v) for v in d.per_gpu], fontsize=7, padding=2)
    ax.set_yticks(range(len(d)), names, fontsize=7)
    for lab, a in zip(ax.get_yticklabels(), ans):
        lab.set_fontweight("bold" if a else "normal")
    ax.margins(x=0.12)
    ax.set(xlabel=cols["capacity_words"])
    ax.set_title("Capacity per GPU of each configuration" + (
        f", {d.model.iloc[0]} at {tokens(d.context.iloc[0])} context" if common else ""),
        fontsize=10)
    ax.grid(alpha=0.3, axis="x")
    _legend(fig, [ax])
    if len(none):
        from kvsim.plan.decide import describe
        names = sorted(describe(r) for r in none.to_dict("records"))
        more = f"; and {len(names) - 8} more" if len(names) > 8 else ""
        _note(fig, f"{len(names)} configurations sustain no rate within the SLO (not drawn): "
                   + "; ".join(names[:8]) + more + ".")
    _save(fig, out, "capacity_per_gpu")
    return {"capacity": (names, d.per_gpu.tolist())}


def with_tp(df: pd.DataFrame) -> pd.DataFrame:
    """Where a plan sweeps TP sizes, each line's and bar's label names its TP (``verkv TP2``),
    so that no figure mixes TP sizes under one name."""
    if "tp" not in df or df["tp"].nunique() < 2:
        return df
    return df.assign(label=df["label"] + " TP" + df["tp"].astype("Int64").astype(str))


def draw_all(df: pd.DataFrame, out: Path, quality: pd.DataFrame | None = None) -> dict:
    df = with_tp(df)
    return {name: fn(df, out) for name, fn in (
        ("goodput_vs_rate", goodput_vs_rate),
        ("throughput_vs_batch", throughput_vs_batch), ("tpot_vs_context", tpot_vs_context),
        ("max_batch_fit", max_batch_fit), ("hbm_breakdown", hbm_breakdown),
        ("link_utilisation", link_utilisation), ("crossover", crossover),
        ("pareto", lambda d, o: pareto(d, quality, o)), ("cost_vs_latency", cost_vs_latency),
        ("capacity_per_gpu", capacity_per_gpu))}
