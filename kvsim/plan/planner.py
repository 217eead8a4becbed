"""``kvsim plan``: run a sweep into DIR (resuming; with a target rate, the deployment search and
its decision), write the table, the plots and the report (:mod:`kvsim.plan.report`)."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from kvsim.errors import KvsimError
from kvsim.io import atomic_write
from kvsim.plan.decide import decide_plan
from kvsim.plan.outputs import (
    JOURNAL,
    check_outputs,
    differences,
    journal_rows,
    journal_writer,
    only_plan,
    record,
)
from kvsim.plan.report import write_report
from kvsim.plan.sweep import SweepSpec, expand, label, sweep

DONE = ("ok", "infeasible")  # statuses a re-run does not repeat (failed runs are retried)


def load_quality(paths: list[str], df: pd.DataFrame) -> pd.DataFrame | None:
    """Results of ``kvsim eval --json`` (JSON objects, one per file or one per line), labelled
    like the sweep's rows: the options the sweep varies for that policy, taken from the eval."""
    if not paths:
        return None
    records = []
    from kvsim.io import loads_json, read_json
    for p in paths:
        try:  # one JSON document (object or list), else JSON lines
            whole = read_json(p, "kvsim eval result", top=None)
            objs = whole if isinstance(whole, list) else [whole]
        except KvsimError as e:
            if "not JSON" not in str(e):
                raise
            objs = [loads_json(line, f"--quality {p} line {i}", "kvsim eval result", None)
                    for i, line in enumerate(Path(p).read_bytes().splitlines(), 1)
                    if line.strip()]
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


@dataclass
class Outcome:
    """What a plan wrote: the summary ``kvsim plan --json`` prints, and the table of
    ``results.csv`` (one row per configuration, in the sweep's order)."""
    summary: dict
    table: pd.DataFrame


def plan(spec: SweepSpec, out: str | Path, executor, quality: list[str] | None = None,
         progress: bool = True, command: str = "", force: bool = False,
         prices: dict[str, float] | None = None, memory=None) -> Outcome:
    """Run the sweep into ``out``: each finished group of configurations is appended to a
    journal (flushed, fsynced) so a killed plan resumes; results.csv, the plots and the report
    are written at the end, in the sweep's order whatever the order of running. ``prices``:
    USD per GPU-hour replacing the catalog's examples (:mod:`kvsim.plan.cost`); ``memory``:
    the prices of a prefix cache's tiers (:class:`kvsim.plan.cost.MemoryPrices`)."""
    from kvsim.plan import cost
    gpu_prices = cost.resolve(spec.gpus, prices or {})
    memory = memory or cost.MemoryPrices()
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise KvsimError(f"--out {out} exists and is not a directory")
    if not out.parent.is_dir():
        raise KvsimError(f"--out {out}: directory {out.parent} does not exist")
    try:
        out.mkdir(exist_ok=True)
    except OSError as e:
        raise KvsimError(f"--out {out}: cannot make the directory ({e.strerror})") from None
    with only_plan(out):
        return _plan(spec, out, executor, quality, progress, command, force, gpu_prices,
                     memory)


def _plan(spec, out: Path, executor, quality, progress, command, force,
          gpu_prices, memory) -> Outcome:
    from kvsim.plan import cost
    written, settings, old = _previous_rows(out, spec, force)
    configs = {c.key(): c for c in expand(spec)}
    jpath = out / JOURNAL
    journal, journal_rows_ = journal_writer(jpath)
    seen: list[dict] = []

    def on_rows(rows):
        journal_rows_(rows)
        seen.extend(rows)

    with journal:
        new = sweep(spec, executor, set(old["key"]) if len(old) else set(), progress, on_rows,
                    configs=list(configs.values()),
                    status=lambda: best_so_far(seen, gpu_prices, memory) if spec.target_qps
                    else "", search=_fleet_search(spec, gpu_prices, memory))
    df = pd.concat([old, new], ignore_index=True) if len(old) else new
    if df.empty:
        raise KvsimError("the sweep has no configurations")
    df = _in_sweep_order(df, configs)
    df["qps"] = pd.to_numeric(df["qps"], errors="coerce")
    df = cost.add_costs(df.drop(columns=[c for c in cost.COLUMNS if c in df]), gpu_prices,
                        spec.target_qps, memory)
    answer = None
    if spec.target_qps is not None and df.status.isin(DONE).any():
        df, answer = decide_plan(df, spec, configs)
        if answer.get("prefix_cache"):
            answer["prefix_cache"]["price_source"] = memory.source
        from kvsim.io import finite_json  # (numpy scalars as numbers; no infinity)
        text = json.dumps(finite_json(answer), indent=1, allow_nan=False) + "\n"
        atomic_write(out / "answer.json", lambda f: f.write(text.encode()), force=True)
    _write_table(df, out)
    jpath.unlink(missing_ok=True)
    record(out, written, settings, claim=True)  # (the plots and report are still to come)
    any_done = bool(df.status.isin(DONE).any())
    series = {}
    if any_done:
        quality_df = load_quality(quality or [], df)
        from kvsim.plan import plots  # matplotlib loads here, when there is something to draw
        series = plots.draw_all(df, out, quality_df)
    write_report(df, series, out, command, spec, quality, answer)
    record(out, written, settings)
    if not any_done:
        first = df.error.dropna().iloc[0] if df.error.notna().any() else "no reason recorded"
        raise KvsimError(f"every configuration failed ({len(df)}; first: {first}); "
                         f"{out / 'results.csv'} and report.md have each one's error")
    return Outcome({
        "out": str(out), "rows": len(df), "new_runs": len(new), "skipped": len(old),
        "failed": int((df.status == "failed").sum()),
        "infeasible": int((df.status == "infeasible").sum()),
        "plots": sorted(p.name for p in out.glob("*.png")), "answer": answer,
        "pruned": int(df.get("error", pd.Series(dtype=str)).astype(str)
                      .str.startswith("pruned before").sum()),
        "crossings": series.get("crossover", {}).get("_crossings", {})}, df)


def _fleet_search(spec: SweepSpec, prices: dict, memory):
    """With a target rate, the deployment search that runs the sweep's configurations (the
    smallest fleet of each, :mod:`kvsim.plan.deployment`); None without."""
    if spec.target_qps is None:
        return None
    import functools

    from kvsim.plan import deployment
    return functools.partial(deployment.search, spec, prices=prices, memory=memory)


def best_so_far(rows: list[dict], prices: dict, memory=None) -> str:
    """The cheapest fleet among the configurations searched so far, in words."""
    from kvsim.plan.cost import MemoryPrices
    memory, best = memory or MemoryPrices(), None
    for r in rows:
        n, price = r.get("replicas_needed"), prices.get(r.get("gpu"), (None, ""))[0]
        if r.get("status") == "ok" and n == n and n is not None and price is not None:
            usd = n * r.get("tp", 1) * (price + memory.per_gpu(r)) + memory.fixed(r)
            if best is None or usd < best[0]:
                best = (usd, r)
    if best is None:
        return "no fleet found yet"
    usd, r = best
    return (f"best so far: {int(r['replicas_needed'])} x {r['gpu']} TP{r['tp']} {r['label']} "
            f"batch {r['batch']} behind {r['router']}, ${usd:.2f}/h")


def _previous_rows(out: Path, spec: SweepSpec, force: bool) -> tuple[set, dict, pd.DataFrame]:
    """The files this DIR's plans wrote, this plan's settings, and the finished rows of the same
    plan that DIR holds (its table and journal); a different plan there is refused, or with
    ``force`` replaced."""
    written, held = check_outputs(out, force)
    settings = json.loads(json.dumps(spec.settings(), default=str))
    held_inputs = (held or {}).pop("inputs", None) or {}  # older plans recorded none
    inputs = _input_hashes(spec)
    replace = held is not None and held != settings
    if replace and not force:
        raise KvsimError(f"--out {out} holds a different plan "
                         f"({'; '.join(differences(held, settings))}); choose another --out, "
                         f"or pass --force to replace it")
    edited = [p for p, h in inputs.items() if held_inputs.get(p, h) != h]
    if edited and not force:
        raise KvsimError(f"--out {out}: {edited[0]} changed since the plan there ran on it; its "
                         f"rows would not match: choose another --out, or pass --force to run "
                         f"the plan again")
    settings["inputs"] = held_inputs | inputs
    if replace or edited:  # --force: the other plan's rows are dropped, not merged
        for name in ("results.csv", "answer.json", JOURNAL):
            (out / name).unlink(missing_ok=True)
    journaled = pd.DataFrame([r for r in journal_rows(out / JOURNAL) if r.get("status") in DONE])
    record(out, written, settings, claim=True)  # before any output: a plan stopped mid-write
    # (a kill, a full disk) still names its settings and its files when it runs again
    old = pd.DataFrame()
    if (out / "results.csv").exists():
        try:
            old = pd.read_csv(out / "results.csv")
        except (ValueError, OSError) as e:
            raise KvsimError(f"{out / 'results.csv'}: cannot resume from it ({e})") from None
        if "key" not in old or "status" not in old:
            raise KvsimError(f"{out / 'results.csv'} is not a kvsim plan table")
        old = old[old.status.isin(DONE)]
    if len(journaled):
        journaled = journaled[~journaled.key.isin(set(old["key"]) if len(old) else set())]
        old = pd.concat([old, journaled], ignore_index=True) if len(old) else journaled
    return written, settings, old


def _input_hashes(spec: SweepSpec) -> dict[str, str]:
    """SHA-256 of each file the plan reads, by its path."""
    import hashlib
    out = {}
    for name, p in spec.input_files().items():
        try:
            out[name] = hashlib.sha256(p.read_bytes()).hexdigest()[:16]
        except OSError as e:
            raise KvsimError(f"{p}: cannot read ({e.strerror})") from None
    return out


def _in_sweep_order(df: pd.DataFrame, configs: dict) -> pd.DataFrame:
    """Rows in the order the spec lists its configurations (``configs``, by key; rows of
    earlier plans in the same DIR after them, as they were): a resumed plan writes the same
    table as an uninterrupted."""
    rank = {key: i for i, key in enumerate(configs)}
    pos = df["key"].map(rank).fillna(len(rank)).to_numpy()
    return df.iloc[np.lexsort((np.arange(len(df)), pos))].reset_index(drop=True)


