"""``kvsim plan``: run a sweep into DIR (resuming), write the table, the plots and a report."""

from __future__ import annotations

import datetime
import io
import json
import platform
import re
from pathlib import Path

import pandas as pd

from kvsim import __version__
from kvsim.errors import KvsimError
from kvsim.io import atomic_write
from kvsim.plan.sweep import SweepSpec, label, sweep

DONE = ("ok", "infeasible")  # statuses a re-run does not repeat (failed runs are retried)
SUMMARY = ["gpu", "model", "context", "label", "batch", "qps", "tpot_ms", "decode_tok_s",
           "ttft_ms", "hbm_gib", "max_batch_fit", "link_util", "kv_read_frac", "goodput_rps",
           "slo_max_qps",
           "status"]


def load_quality(paths: list[str], df: pd.DataFrame) -> pd.DataFrame | None:
    """Results of ``kvsim eval --json`` (JSON objects, one per file or one per line), labelled
    like the sweep's rows: the options the sweep varies for that policy, taken from the eval."""
    if not paths:
        return None
    records = []
    for p in paths:
        try:
            text = Path(p).read_text()
        except OSError as e:
            raise KvsimError(f"--quality {p}: {e.strerror}") from None
        try:  # one JSON document (object or list), else JSON lines
            whole = json.loads(text)
            objs = whole if isinstance(whole, list) else [whole]
        except json.JSONDecodeError:
            try:
                objs = [json.loads(line) for line in text.splitlines() if line.strip()]
            except json.JSONDecodeError as e:
                raise KvsimError(f"--quality {p}: not JSON ({e})") from None
        for o in objs:
            if not isinstance(o, dict) or "policy" not in o or "relative_accuracy" not in o:
                raise KvsimError(f"--quality {p}: each record needs 'policy' and "
                                 "'relative_accuracy' (the output of kvsim eval --json)")
            records.append(o)
    varied = {pol: set().union(*(json.loads(o).keys() for o in g.options))
              for pol, g in df.groupby("policy")}
    rows = []
    for o in records:
        opts = o.get("policy_options") or o.get("options") or {}
        keep = {k: v for k, v in opts.items() if k in varied.get(o["policy"], set())}
        rows.append({"label": label(o["policy"], keep), "policy": o["policy"],
                     "relative_accuracy": float(o["relative_accuracy"])})
    return pd.DataFrame(rows).groupby("label", as_index=False).agg(
        {"policy": "first", "relative_accuracy": "mean"})


def _write_table(df: pd.DataFrame, out: Path) -> None:
    atomic_write(out / "results.csv", lambda f: f.write(df.to_csv(index=False).encode()),
                 force=True)
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        raise KvsimError("writing results.parquet needs pyarrow: pip install 'kvsim[parquet]'") \
            from None
    buf = io.BytesIO()
    df.to_parquet(buf, index=False)
    atomic_write(out / "results.parquet", lambda f: f.write(buf.getvalue()), force=True)


def plan(spec: SweepSpec, out: str | Path, executor, quality: list[str] | None = None,
         progress: bool = True, command: str = "") -> dict:
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise KvsimError(f"--out {out} exists and is not a directory")
    if not out.parent.is_dir():
        raise KvsimError(f"--out {out}: directory {out.parent} does not exist")
    out.mkdir(exist_ok=True)
    old = pd.DataFrame()
    if (out / "results.csv").exists():
        try:
            old = pd.read_csv(out / "results.csv")
        except (ValueError, OSError) as e:
            raise KvsimError(f"{out / 'results.csv'}: cannot resume from it ({e})") from None
        if "key" not in old or "status" not in old:
            raise KvsimError(f"{out / 'results.csv'} is not a kvsim plan table")
        old = old[old.status.isin(DONE)]
    new = sweep(spec, executor, set(old["key"]) if len(old) else set(), progress)
    df = pd.concat([old, new], ignore_index=True) if len(old) else new
    if df.empty:
        raise KvsimError("the sweep has no configurations")
    df["qps"] = pd.to_numeric(df["qps"], errors="coerce")
    _write_table(df, out)
    quality_df = load_quality(quality or [], df)
    from kvsim.plan import plots  # matplotlib loads here, when there is something to draw
    series = plots.draw_all(df, out, quality_df)
    _write_report(df, series, out, command, spec, quality)
    return {"out": str(out), "rows": len(df), "new_runs": len(new), "skipped": len(old),
            "failed": int((df.status == "failed").sum()),
            "infeasible": int((df.status == "infeasible").sum()),
            "plots": sorted(p.name for p in out.glob("*.png")),
            "crossings": series.get("crossover", {}).get("_crossings", {})}


def _md_table(df: pd.DataFrame) -> str:
    cols = [c for c in SUMMARY if c in df and df[c].notna().any()]
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r[c]) for c in cols) + " |" for _, r in df.iterrows()]
    return "\n".join(lines)


PLOT_TEXT = {
    "throughput_vs_batch": "Decode throughput vs max batch, per policy; a flat tail means memory "
                           "stopped admission.",
    "tpot_vs_context": "Time per output token vs context at the smallest batch.",
    "max_batch_fit": "How many requests fit in HBM and host memory at once, at the longest "
                     "context.",
    "hbm_breakdown": "What occupies HBM in the largest-batch run of each policy.",
    "link_utilisation": "Share of time the host link is busy.",
    "crossover": "TPOT ratio VerKV / dense offload; where a line crosses 1, VerKV stops winning.",
    "pareto": "Task accuracy (kvsim eval, % of dense) vs decode throughput.",
    "goodput_vs_rate": "Requests per second that meet every SLO given, against the offered "
                       "Poisson rate (DistServe's goodput); where a line leaves the diagonal, "
                       "requests start missing their SLO.",
}


def _write_report(df, series, out: Path, command: str, spec: SweepSpec, quality) -> None:
    ok = df[df.status == "ok"]
    lines = ["# kvsim capacity plan", "",
             f"Generated {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC} by "
             f"kvsim {__version__} on {platform.node()} ({platform.machine()}).", "",
             f"Command: `{command}`" if command else "", "",
             f"{len(df)} configurations: {len(ok)} ran, "
             f"{(df.status == 'infeasible').sum()} infeasible, "
             f"{(df.status == 'failed').sum()} failed. Table: `results.csv`, `results.parquet`.",
             "", "## Where the inputs came from", ""]
    prov: dict[str, set] = {}
    for p in ok.get("provenance", pd.Series(dtype=str)).dropna():
        for k, v in json.loads(p).items():
            if k not in ("workload", "trace"):
                prov.setdefault(k, set()).add(v)
    for k in sorted(prov):
        for v in sorted(prov[k]):
            lines.append(f"- **{k}**: {v}")
    if quality:
        lines.append(f"- **quality**: kvsim eval results from {', '.join(quality)}")
    said: dict[str, list[str]] = {}  # one entry per kind of warning (numbers aside)
    for w in ok.get("warnings", pd.Series(dtype=str)).dropna():
        for one in str(w).split(" | "):
            said.setdefault(re.sub(r"\d[\d.]*", "#", one), []).append(one)
    if said:
        lines += ["", "## Warnings", "", "How many configurations each kind applies to (one "
                  "example each):", ""]
        lines += [f"- {len(v)} x {v[0]}" for _, v in sorted(said.items(), key=lambda x: -len(x[1]))]
    lines += ["", "## Plots", ""]
    for name, text in PLOT_TEXT.items():
        if (out / f"{name}.png").exists() and series.get(name):
            lines += [f"### {name.replace('_', ' ')}", "", text, "",
                      f"![{name}]({name}.png)", ""]
    crossings = series.get("crossover", {}).get("_crossings", {})
    if crossings:
        lines += ["## Crossovers", ""]
        lines += [f"- {k}: ratio crosses 1 at about {v:,.0f} tokens" for k, v in crossings.items()]
        lines.append("")
    if spec.slo:
        from kvsim.plan import slo
        lines += ["## SLO", "", f"The highest Poisson rate that is sustained (completions keep "
                  f"pace with arrivals, the queue stays bounded) with {slo.describe(spec.slo)} "
                  f"({spec.slo_requests} requests per probe): column `slo_max_qps`, with the "
                  f"p50/p99 TPOT and TTFT measured at it (`slo_at_*`), what binds there "
                  f"(`slo_binding`) and what failed at the next rate (`slo_fails_because`).", ""]
        for r in ok.itertuples():
            if getattr(r, "slo_max_qps", None) is not None:
                lines.append(f"- {r.gpu}, {r.model}, {r.context}, {r.label}, batch {r.batch}: "
                             f"{r.slo_max_qps:.3g} req/s (TPOT p50/p99 {r.slo_at_tpot_p50_ms:.3g}/"
                             f"{r.slo_at_tpot_p99_ms:.3g} ms, TTFT p50/p99 "
                             f"{r.slo_at_ttft_p50_ms:.4g}/{r.slo_at_ttft_p99_ms:.4g} ms; "
                             f"{r.slo_binding}); at "
                             f"{r.slo_qps_fails:.3g} req/s: {r.slo_fails_because}"
                             if r.slo_max_qps > 0 else
                             f"- {r.gpu}, {r.model}, {r.context}, {r.label}, batch {r.batch}: "
                             f"no rate from {r.slo_qps_fails:g} req/s up: {r.slo_fails_because}")
        lines.append("")
    lines += ["## Runs", "", _md_table(df), ""]
    bad = df[df.status != "ok"]
    if len(bad):
        lines += ["## Not run", ""]
        lines += [f"- {r.gpu}, {r.model}, {r.context}, {r.label}, batch {r.batch}: {r.error}"
                  for r in bad.itertuples()]
    text = "\n".join(lines) + "\n"
    atomic_write(out / "report.md", lambda f: f.write(text.encode()), force=True)
