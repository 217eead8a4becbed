"""What ``kvsim plan`` writes into DIR and how it keeps track: the output names, the manifest of
the files it wrote (no other file of those names is ever replaced without ``--force``) and of the
plan's settings (a plan with other settings is refused there without ``--force``), and the
journal of finished configurations that lets an interrupted plan resume."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from kvsim.errors import KvsimError
from kvsim.io import atomic_write

PLOTS = ("goodput_vs_rate", "throughput_vs_batch", "tpot_vs_context", "max_batch_fit",
         "hbm_breakdown", "link_utilisation", "crossover", "pareto", "cost_vs_latency",
         "capacity_per_gpu")  # plots.draw_all's names
MANIFEST = ".kvsim-plan-manifest.json"  # the files this directory's plans wrote
JOURNAL = ".kvsim-plan-journal.jsonl"  # rows of finished configurations, until results.csv


def outputs() -> list[str]:
    return ["results.csv", "results.parquet", "report.md", "report.html", "answer.json"] + \
        [f"{p}.{ext}" for p in PLOTS for ext in ("png", "svg")]


def check_outputs(out: Path, force: bool) -> tuple[set[str], dict | None]:
    """The names plan may overwrite (those its manifest lists; any other file of the same name
    in DIR stops the plan before it runs, unless ``force``) and the settings of the plan DIR
    holds (None: none recorded)."""
    written: set[str] = set()
    settings = None
    mpath = out / MANIFEST
    if mpath.exists():
        try:
            manifest = json.loads(mpath.read_text())
            written = set(manifest["files"])
            settings = manifest.get("plan")
        except (ValueError, KeyError, TypeError, OSError):
            raise KvsimError(f"{mpath} is damaged; remove it (and check what DIR holds)") \
                from None
    foreign = [n for n in outputs() if ((out / n).exists() or (out / n).is_symlink())
               and n not in written]
    if foreign and not force:
        raise KvsimError(f"--out {out} holds {', '.join(foreign[:3])}"
                         f"{' and more' if len(foreign) > 3 else ''} that kvsim plan did not "
                         f"write; choose another --out or pass --force")
    return written, settings


def differences(old: dict, new: dict) -> list[str]:
    """The settings in which two plans differ, in words."""
    return [f"{k} {json.dumps(old.get(k))} there, {json.dumps(new.get(k))} here"
            for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]


def record(out: Path, written: set[str], settings: dict) -> None:
    present = sorted(n for n in set(written) | set(outputs()) if (out / n).exists())
    atomic_write(out / MANIFEST, lambda f: f.write(json.dumps(
        {"written_by": "kvsim plan", "files": present, "plan": settings}, indent=1).encode()),
        force=True)


def journal_rows(path: Path) -> list[dict]:
    """Rows of an interrupted sweep (a torn last line, from a kill mid-write, is dropped)."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows += json.loads(line)
        except json.JSONDecodeError:
            continue
    return rows


def jsonable(v):
    if isinstance(v, np.generic):
        return v.item()
    raise TypeError(f"{type(v).__name__} is not JSON-able")
