"""Building a policy profile: every setting of a grid run on every question of every capture set.

One *job* is one policy setting on one (capture set, length, question); it runs the policy on each
captured layer alone (the harness, as ``kvsim replay`` does, with the same per-layer seeds) and
yields one row per (layer, pass). Finished jobs are appended to a journal beside the output
(flushed and fsynced), so an interrupted build resumes where it stopped; the profile is written
atomically at the end and the journal removed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
from pathlib import Path

from kvsim import captureset
from kvsim.errors import KvsimError
from kvsim.io import check_destination, regular_file
from kvsim.policy_profile import COLUMNS, FORMAT, PASSES, STATS, VERSION, save, setting_key
from kvsim.trace import Attention, Trace


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


def _journal_path(out: Path) -> Path:
    return out.with_name(f".{out.name}.journal")


def _read_journal(path: Path, signature: dict) -> dict[str, list]:
    """Finished jobs of an interrupted build with the same signature (a torn last line, from a
    kill mid-write, is dropped)."""
    if not path.exists():
        return {}
    lines = path.read_text().splitlines()
    try:
        head = json.loads(lines[0]) if lines else None
    except json.JSONDecodeError:
        head = None
    if head != {"signature": signature}:
        raise KvsimError(f"{path} is the journal of a different build (other captures, grid "
                         f"or seed); delete it to start over")
    from kvsim.io import loads_json
    done = {}
    for i, line in enumerate(lines[1:], 2):
        try:
            rec = loads_json(line, f"{path} line {i}", "policy-profile build journal line")
        except KvsimError:
            continue  # torn by a kill mid-write: that job runs again
        if not isinstance(rec.get("job"), str) or not isinstance(rec.get("rows"), list):
            raise KvsimError(f"{path} line {i}: not a finished job; delete the journal to start "
                             f"over")
        done[rec["job"]] = rec["rows"]
    return done


def build(captures: list[str], specs, out: str | os.PathLike, seed: int = 0,
          force: bool = False, progress: bool = True, jobs_n: int = 1) -> dict:
    """Run every spec (``PolicySpec``) on every question of ``captures``; write the profile."""
    from tqdm import tqdm

    from kvsim.policies import make
    out = Path(out)
    check_destination(out, force)
    sets, files = [], []
    for p in captures:
        path = regular_file(p, "capture set")
        c = captureset.load(path)
        sets.append(c)
        files.append({"file": path.name, "sha256_16": _digest(path), "task": c.task,
                      "seed": c.meta.get("seed"), "model": c.meta.get("model"),
                      "layers": c.layers, "heads": {str(l): h for l, h in c.heads.items()},
                      "weights": {str(l): w for l, w in c.weights.items()},
                      "total_layers": c.meta.get("model_info", {}).get("layers"),
                      "head_dim": int(c.ctx_k[c.layers[0]].shape[2]),
                      "lengths": [{"target": ln.target, "context_len": ln.context_len,
                                   "questions": len(ln.asked),
                                   "dense_correct": [a.dense_correct for a in ln.asked]}
                                  for ln in c.lengths],
                      "layer_sample": c.meta.get("layer_sample"),
                      "provenance": c.provenance})
    policies = [make(s.name, s.options) for s in specs]
    for pol in policies:
        if not pol.needs_attention:
            raise KvsimError(f"policy {pol.name} needs no attention statistics (its traffic is "
                             f"defined); leave it out of the profile")
    settings = [setting_key(p.name, dataclasses.asdict(p.params)) for p in policies]
    if len(set(settings)) != len(settings):
        raise KvsimError("the grid names the same setting twice")
    signature = {"captures": [f["sha256_16"] for f in files], "settings": settings,
                 "seed": seed}
    jpath = _journal_path(out)
    done = _read_journal(jpath, signature) if jpath.exists() else {}
    jobs = [(si, ci, j, i) for ci, c in enumerate(sets) for j, ln in enumerate(c.lengths)
            for i in range(len(ln.asked)) for si in range(len(policies))]  # one view at a time
    bar = tqdm(total=len(jobs), initial=sum(_job(*jb) in done for jb in jobs),
               desc="policy profile", unit="job", disable=None if progress else True)
    # work units: one view (capture set, length, question) with the settings it still lacks
    units: dict[tuple, list[int]] = {}
    for si, ci, j, i in jobs:
        if _job(si, ci, j, i) not in done:
            units.setdefault((ci, j, i), []).append(si)
    with open(jpath, "a") as journal:
        if not done and journal.tell() == 0:
            journal.write(json.dumps({"signature": signature}) + "\n")
            journal.flush()

        def record(ci, j, i, results):
            for si, rows in results.items():
                key = _job(si, ci, j, i)
                journal.write(json.dumps({"job": key, "rows": rows}) + "\n")
                done[key] = rows
            journal.flush()
            os.fsync(journal.fileno())
            bar.update(len(results))

        if jobs_n > 1 and len(units) > 1:
            import concurrent.futures as cf
            import multiprocessing as mp
            with cf.ProcessPoolExecutor(jobs_n, mp_context=mp.get_context("spawn"),
                                        initializer=_init,
                                        initargs=(list(captures), specs, seed)) as pool:
                futs = {pool.submit(_run_unit, u, sis): u for u, sis in units.items()}
                try:
                    for f in cf.as_completed(futs):
                        record(*futs[f], f.result())
                except BaseException:
                    # fail fast: without this the pool would run every pending unit before the
                    # error surfaced; the journal keeps what finished, for a resume
                    for p in list(getattr(pool, "_processes", {}).values()):
                        p.terminate()
                    pool.shutdown(wait=False, cancel_futures=True)
                    raise
        else:
            _run_here(units, sets, policies, seed, bar, record)
    bar.close()
    profile = {"format": FORMAT, "version": VERSION, "seed": seed, "captures": files,
               "how": "kvsim policy-profile: each captured layer alone through kvsim.measure."
                      "harness (the seeds kvsim replay uses), policies in float32 against a "
                      "float64 dense reference; one row per (setting, capture set, length, "
                      "question, layer, pass)",
               "settings": settings, "columns": COLUMNS,
               "rows": [r for jb in jobs for r in done[_job(*jb)]]}
    save(profile, out, force)
    jpath.unlink(missing_ok=True)
    return profile


_WORKER: dict = {}


def _run_here(units: dict, sets, policies, seed: int, bar, record) -> None:
    """The work units one after another in this process, with one torch thread."""
    _init(None, None, seed, sets, policies)
    with _one_torch_thread():
        for (ci, j, i), sis in units.items():
            bar.set_postfix_str(f"{sets[ci].task} {sets[ci].lengths[j].target}")
            record(ci, j, i, _run_unit((ci, j, i), sis))


@contextlib.contextmanager
def _one_torch_thread():
    """One torch thread in this process, as each worker of a parallel build has (the same bits
    whatever --jobs; torch's threads also wait on each other for every small operation: on a
    2-vCPU VM beside another job, 2 threads made a build 12x slower), then the caller's count."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _init(paths, specs, seed, sets=None, policies=None) -> None:
    """A worker's capture sets and policies (loaded once per process)."""
    import torch

    from kvsim.policies import make
    if sets is None:
        torch.set_num_threads(1)
        sets = [captureset.load(p) for p in paths]
        policies = [make(s.name, s.options) for s in specs]
    _WORKER.update(sets=sets, policies=policies, seed=seed)


def _run_unit(unit: tuple, settings: list[int]) -> dict[int, list]:
    """Rows of each setting on one view, one per (layer, pass): every captured layer runs alone
    through the harness (float32; the dense reference is float64). The reads are checked
    (:mod:`kvsim.measure.traffic`) on the view's first layer, as the harness checks a whole
    trace: the check runs ``attend`` a second time, which on every layer doubled the cost."""
    import torch

    from kvsim.measure import harness
    ci, j, i = unit
    c = _WORKER["sets"][ci]
    view = c.view(j, i, f"capture set {ci}")
    a = view.attention
    out = {}
    for si in settings:
        pol, rows = _WORKER["policies"][si], []
        for la in a.layers:
            one = Trace(view.meta, attention=Attention([la], a.context_len, a.question_pos,
                                                       a.decode_pos, a.rope, a.provenance))
            stats, _ = harness.run(pol, one, _WORKER["seed"], dtype=torch.float32, timed=False,
                                   verify="first" if la is a.layers[0] else "none")
            for ps in PASSES:
                part = stats.get(ps, {})
                rows.append([si, ci, c.lengths[j].target, c.lengths[j].context_len, i,
                             int(la.layer), c.weights[int(la.layer)], ps]
                            + [_num(part.get(s, stats.get(s))) for s in STATS])
        out[si] = rows
    return out


def _job(si, ci, j, i) -> str:
    return f"{si}/{ci}/{j}/{i}"


def _num(v):
    if v is None:
        return None
    v = float(v)
    if v != v or v in (float("inf"), float("-inf")):
        raise KvsimError(f"a statistic came out {v} (the captures hold extreme values?)")
    return float(f"{v:.6g}")
