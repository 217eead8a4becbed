"""What ``kvsim plan`` writes into DIR and how it keeps track: the output names, the manifest of
the files it wrote (no other file of those names is ever replaced without ``--force``) and of the
plan's settings (a plan with other settings is refused there without ``--force``), and the
journal of finished configurations that lets an interrupted plan resume."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import numpy as np

from kvsim.errors import KvsimError
from kvsim.io import atomic_write, loads_json, read_json, regular_file

PLOTS = ("goodput_vs_rate", "throughput_vs_batch", "tpot_vs_context", "max_batch_fit",
         "hbm_breakdown", "link_utilisation", "crossover", "pareto", "cost_vs_latency",
         "capacity_per_gpu")  # plots.draw_all's names
MANIFEST = ".kvsim-plan-manifest.json"  # the files this directory's plans wrote
JOURNAL = ".kvsim-plan-journal.jsonl"  # rows of finished configurations, until results.csv
LOCK = ".kvsim-plan.lock"  # held while a plan runs: a second plan into DIR is refused
LOST = "what finished is journaled: run the same plan again to resume"


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
    if mpath.exists() or mpath.is_symlink():
        manifest = read_json(mpath, "kvsim plan manifest")
        written, settings = manifest.get("files"), manifest.get("plan")
        if not (isinstance(written, list) and all(isinstance(n, str) for n in written)
                and isinstance(settings, (dict, type(None)))):
            raise KvsimError(f"{mpath} is damaged; remove it (and check what DIR holds)")
        written = set(written)
    foreign = [n for n in outputs() if ((out / n).exists() or (out / n).is_symlink())
               and n not in written]
    if foreign and not force:
        raise KvsimError(f"--out {out} holds {', '.join(foreign[:3])}"
                         f"{' and more' if len(foreign) > 3 else ''} that kvsim plan did not "
                         f"write; choose another --out or pass --force")
    return written, settings


@contextlib.contextmanager
def only_plan(out: Path):
    """Hold ``out`` for one plan: a second plan into the same DIR while this one runs (its
    manifest and journal would be mixed with this one's) is refused in one line."""
    import fcntl
    try:
        fd = os.open(out / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise KvsimError(f"--out {out}: cannot write there ({e.strerror})") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise KvsimError(f"--out {out}: another kvsim plan is running there; wait for it "
                             f"or choose another --out") from None
        yield
    finally:
        os.close(fd)


def journal_writer(path: Path):
    """A function appending one group of rows to the journal (flushed, fsynced); a full or
    read-only disk is one line."""
    try:
        journal = open(path, "a")
    except OSError as e:
        raise KvsimError(f"{path}: cannot write the plan journal ({e.strerror})") from None

    def write(rows):
        try:
            journal.write(json.dumps(rows, default=jsonable) + "\n")
            journal.flush()
            os.fsync(journal.fileno())
        except OSError as e:
            raise KvsimError(f"{path}: cannot write the plan journal ({e.strerror}); {LOST}") \
                from None
    return journal, write


def differences(old: dict, new: dict) -> list[str]:
    """The settings in which two plans differ, in words."""
    return [f"{k} {json.dumps(old.get(k))} there, {json.dumps(new.get(k))} here"
            for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]


def record(out: Path, written: set[str], settings: dict, claim: bool = False) -> None:
    """The manifest: the output names this DIR's plans wrote (``claim``: every output name,
    recorded before any is written, so that a plan stopped mid-write, by a full disk or a kill,
    still knows its own files when it runs again) and the plan's settings."""
    present = sorted(n for n in set(written) | set(outputs()) if claim or (out / n).exists())
    atomic_write(out / MANIFEST, lambda f: f.write(json.dumps(
        {"written_by": "kvsim plan", "files": present, "plan": settings}, indent=1).encode()),
        force=True)


def journal_rows(path: Path) -> list[dict]:
    """Rows of an interrupted sweep (a torn last line, from a kill mid-write, is dropped); a
    damaged line before it is one line naming the journal."""
    if not path.exists() and not path.is_symlink():
        return []
    regular_file(path, "kvsim plan journal")
    try:
        lines = path.read_bytes().split(b"\n")
    except OSError as e:
        raise KvsimError(f"{path}: cannot read the plan journal ({e.strerror})") from None
    rows = []
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            group = loads_json(line, f"{path} line {i + 1}", "plan journal line", list,
                               nan=True)
            if not all(isinstance(r, dict) and isinstance(r.get("key"), str) for r in group):
                raise KvsimError(f"{path} line {i + 1}: not a list of finished configurations")
        except KvsimError as e:
            if i == last and not line.endswith(b"]"):  # torn by a kill mid-write
                break
            raise KvsimError(f"{e}; the plan journal is damaged: remove it to run its "
                             f"configurations again") from None
        rows += group
    return rows


def jsonable(v):
    if isinstance(v, np.generic):
        return v.item()
    raise TypeError(f"{type(v).__name__} is not JSON-able")
