"""Fit the built-in engine families on the published points and check them on sources they
never saw (each takes the VerKV paper's fitted decide model, the only measured one); writes
``kvsim/hw/engines/<family>.json`` (every family of ``kvsim.hw.engine.FAMILIES`` and the shared
fit, ``shared.json``) and ``docs/published_check.md``.

The same fits as ``kvsim fit data/published.csv --family NAME --out NAME.json --cv source``
(one leave-one-source-out pass shared by the three files):

    python scripts/build_published_dataset.py     # data/published/*.csv -> data/published.csv
    python scripts/fit_published_engines.py [--refit-cv [--jobs N]]   # N sources at once

Without ``--refit-cv`` the leave-one-source-out errors of the last run
(``data/published-cv.json``) and the leave-one-engine-version-out ones
(``data/published-cv-engine-version.json``) are reused: the engines are refitted, the checks
are not. The serving runs' predictions (``data/published-serving.json``, made by
``python scripts/serving_check.py`` with the engines written here) join the summary as the
"serving" category.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

from kvsim.fit import Predictor, read_points
from kvsim.fit import families as F
from kvsim.hw.engine import (
    ENGINES_DIR,
    FAMILIES,
    HOST_LAUNCH_US,
    LAYER_KERNELS,
    LAYER_OVERHEAD_CEILING_US,
    SHARED,
    load,
)

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data" / "published.csv"
PAGE = ROOT / "docs" / "published_check.md"
REUSE = ROOT / "data" / "published-cv.json"  # the last cross-validation (--refit-cv: redo)
SERVING = ROOT / "data" / "published-serving.json"  # scripts/serving_check.py's predictions
REUSE_EV = ROOT / "data" / "published-cv-engine-version.json"  # leave one engine version out
REGIMES = ("decode", "prefill", "throughput")


def between_families(points, pred, shared, engines) -> dict:
    """Per regime, the 90% quantile over the published points of |ln(a family's prediction /
    the shared fit's)|: how far the choice of engine family moves a prediction, the width an
    engine without points of its own adds to its interval."""
    logs = {r: [] for r in REGIMES}
    for p in points:
        if p.meta.get("certainty") in F.BOUNDS:
            continue
        base = pred.predict(p, shared)
        for eng in engines.values():
            got = pred.predict(p, eng)
            for k in p.measured:
                r = F.REGIMES.get(k)
                if r in logs and got.get(k) and base.get(k):
                    logs[r].append(abs(float(np.log(got[k] / base[k]))))
    return {r: float(np.quantile(v, F.COVERAGE)) for r, v in logs.items() if v}


def md_table(rows: list[dict], first: str, fitted: list[dict] | None = None) -> str:
    """The held-out summary rows; with ``fitted`` (the same groups under the fit of every
    source) its share within 20% and median beside."""
    fit = {r["category"]: r for r in fitted or []}
    extra = " fitted: within 20% | fitted: median |" if fitted else ""
    lines = [f"| {first} | values | sources | within 20% | median abs err | largest | "
             f"in 90% interval |{extra}", "|---|---:|---:|---:|---:|---:|---:|"
             + ("---:|---:|" if fitted else "")]
    for r in rows:
        f = fit.get(r["category"])
        more = (f" {100 * f['within_share']:.0f}% | {f['median_abs_pct']:.1f}% |"
                if f and f["values"] else " | |") if fitted else ""
        if not r["values"]:
            lines.append(f"| {r['category']} | 0 | | | | | |{more}")
            continue
        lines.append(f"| {r['category']} | {r['values']} | {r['sources']} | "
                     f"{100 * r['within_share']:.1f}% ({round(r['within_share'] * r['values'])})"
                     f" | {r['median_abs_pct']:.1f}% | "
                     f"{r['max_abs_pct']:.0f}% | {100 * r['covered_share']:.0f}% |{more}")
    return "\n".join(lines)


def with_paper_decide(eng):
    """The family with the VerKV paper's fitted decide model (no published engine runs a fetching
    policy; the paper's vLLM is the only measured one), said so in each field's note."""
    paper = load("vllm-paper")
    fields = dict(eng.fields)
    for k, v in paper.fields.items():
        if k.startswith("decide."):
            fields[k] = dataclasses.replace(v, note=f"from engine vllm-paper (the VerKV paper's "
                                                    f"vLLM on one H100): {v.note}")
    return dataclasses.replace(eng, fields=fields)


def main() -> None:
    points = read_points(DATA)
    rows = [p for p in points if p.use == "fit"]
    pred, base = Predictor(None), load("roofline")
    print(f"{len(points)} points, {len({p.meta.get('source') for p in points})} sources; "
          f"leave-one-source-out ...", flush=True)
    jobs = int(sys.argv[sys.argv.index("--jobs") + 1]) if "--jobs" in sys.argv else 1
    cv = F.cross_validate(points, pred, base, progress=True, jobs=jobs) \
        if not REUSE.exists() or "--refit-cv" in sys.argv \
        else json.loads(REUSE.read_text())["values"]
    summary = F.summary(cv)
    cv_ev = F.cross_validate(points, pred, base, progress=True, jobs=jobs, by="engine-version") \
        if not REUSE_EV.exists() or "--refit-cv" in sys.argv \
        else json.loads(REUSE_EV.read_text())["values"]
    REUSE_EV.write_text(json.dumps({"values": cv_ev}, indent=0) + "\n")
    shared, engines, free_all = F.fit_joint(rows, pred, base)  # every family in one fit
    fitted = F.fitted_values(points, pred, shared, engines)  # the same values, in-sample
    between = between_families(points, pred, shared, engines)
    for fam in (*FAMILIES, SHARED):
        eng = F.engine_for(fam, shared, engines)
        free = {"shared": free_all["shared"],
                "family": [] if fam == SHARED else free_all.get(fam, [])}
        n = sum(p.engine == fam for p in rows)
        how = (f"its {n} published points set offsets of {', '.join(free['family'])} from the "
               f"shared fit" if free["family"] else
               "the shared fit of every engine's points, which stands in for an engine "
               "without points of its own" if fam == SHARED else
               f"{n} published point(s) of its own: the shared fit of every engine's points")
        record = F.record(points, rows, pred, eng, None if fam == SHARED else fam, free, cv,
                          summary)
        record["versions"] = sorted({F.version_key(p.engine, p.meta.get("engine_version", ""))
                                     .split(" ", 1)[1] for p in rows if p.engine == fam})
        record["between_families"] = between
        eng = dataclasses.replace(
            eng, name=fam, fitted_on={"gpus": sorted({p.gpu for p in rows}),
                                      "models": sorted({p.model for p in rows})},
            description=f"{fam}: kernel shapes and efficiencies shared by {len(rows)} published "
                        f"points of {len({p.engine for p in rows})} engines; {how} "
                        f"(data/published.csv, scripts/fit_published_engines.py)",
            fit=record)
        eng = with_paper_decide(eng)
        path = ENGINES_DIR / f"{fam}.json"
        eng.save(path, force=True)
        print(f"wrote {path.relative_to(ROOT)}: {how}")
    serving = json.loads(SERVING.read_text())["values"] if SERVING.exists() else []
    both = F.summary(cv + serving)  # the static values and the serving runs' (held out too)
    by_run = F.summary(serving, groups=lambda v: [f"{v['source']}: {v['metric']}"]) \
        if serving else []
    by_engine, by_source = (lambda v: [v["engine"]]), (lambda v: [v["source"]])
    per_engine, per_source = F.summary(cv, groups=by_engine), F.summary(cv, groups=by_source)
    fitted_summary = F.summary(fitted)
    worst = sorted(cv, key=lambda v: -abs(v["log_err"]))[:12]
    shares = F.overhead_shares(rows, pred, engines)
    spreads = {r: F.spread(cv, r) for r in REGIMES}
    page = f"""# Published-measurement check

Every value below was predicted by an engine fitted **without** the source it comes from
(leave-one-source-out): the shared kernel shapes and the engine family's own overheads are
refitted on the other sources, then the held-out source's static-batch TPOT, TTFT and
throughput are predicted. "In 90% interval": the value falls inside the prediction interval
that the *other* sources' held-out errors of the same regime give (their 90% quantile of
`|ln(predicted / measured)|`). "Fitted": the same values predicted by the fit of *every*
source, the value's own included: what remains there is the model's misfit; the gap to the
held-out columns is what a publication's own rows teach its engine family and no other
source does.

Data: `data/published.csv` ({len(points)} points from
{len({p.meta.get('source') for p in points})} publications; how each was measured:
`data/published/*.md`). Regenerate: `python scripts/build_published_dataset.py &&
python scripts/fit_published_engines.py` (or `kvsim fit data/published.csv --family vllm
--out E.json --cv source`, which prints the first table). Hardware: none; this is arithmetic
on published figures, run on a 2-vCPU VM.

## By category

A value counts in every category its row belongs to (a TP-4 FP8 decode row is in decode, tp
and fp8).

{md_table(both, "category", fitted_summary)}

The serving row: {len(serving)} values of {len({v['source'] for v in serving})} publications'
serving benchmarks (`data/published/serving.csv`), each run replayed by `kvsim replay` with its
arrivals, request count and length distribution and the family that ran it, fitted without the
publication (`python scripts/serving_check.py`); none of them is fitted. Their intervals use
the static values' spreads of the same regime (median TTFT: prefill, median ITL: decode,
output tokens/s: throughput). The "fitted" columns are of the static values alone. Regenerate
the serving values with `python scripts/serving_check.py` after a refit.

## Serving runs, by publication and metric

{md_table(by_run, "source: metric") if by_run else "(none: run scripts/serving_check.py)"}

## Leave one engine version out

The same values, each predicted by a fit without its engine version (`kvsim fit
data/published.csv --family trtllm --out E.json --cv engine-version`): the engine family and
the major.minor version its row states (`kvsim.fit.families.version_key`). A family with one
version (LMDeploy, gpt-fast, vLLM V1) is then predicted by the shared fit alone: this is what a
user of an engine or version without published points gets.

{md_table([r for r in F.summary(cv_ev) if r["values"]], "category")}

| version held out | values | sources | within 20% | median abs err | largest | in 90% interval |
|---|---:|---:|---:|---:|---:|---:|
""" + "\n".join(md_table(F.summary(cv_ev, groups=lambda v: [v["held_out"]]), "x")
                .splitlines()[2:]) + f"""

## By engine family

{md_table(per_engine, "engine", F.summary(fitted, groups=by_engine))}

## By source

{md_table(per_source, "source", F.summary(fitted, groups=by_source))}

## Overheads: each family's fitted value and its share of the time on its own points

The share of a predicted step (TPOT, batch latency or 1 / throughput; not TTFT) that one
overhead makes, on the fit rows of the family it belongs to: 1 - (the time with it at zero) /
(the time). A share near half means the overhead, not the kernels, explains the measurement.
`host`: the host's overheads (per step, per token, an eager engine's launches) at zero at once.
The stated physical limits (`tests/test_launch_mode.py` holds the shipped engines to them): the
host's overheads at most {100 * F.OVERHEAD_SHARE_CEILING:.0f}% of a step on any point a family
was fitted on (vLLM 0.5.3's
measured host share of a Llama-3-8B step on an H100, the largest published: 33% HTTP server,
29% scheduling, blog.vllm.ai/2024/09/05/perf-update.html), and the per-layer overhead at most
{LAYER_OVERHEAD_CEILING_US:.1f} us (the fit's bound: {max(LAYER_KERNELS.values())} kernels at
the {HOST_LAUNCH_US} us a small kernel takes launch to launch, NVIDIA's CUDA-graphs blog); the
all-reduce's none, it is communication: what an engine adds to its kernel's measured time
(`kvsim/hw/collectives.py`: NCCL, 6 us at 2 H100s and 19.2 us at 8; a custom kernel, 3.7-5.9
us). An
eager family's `launch_overhead_us` is documented, not fitted (`kvsim.hw.engine.FAMILY_LAUNCH`).

| family | overhead | value | points | largest share | median share |
|---|---|---:|---:|---:|---:|
""" + "\n".join(f"| {s['family']} | {s['overhead']} | "
                f"{'all' if s['value'] is None else format(s['value'], '.4g')} | {s['points']} | "
                f"{100 * s['max_share']:.0f}% | {100 * s['median_share']:.0f}% |"
                for s in shares) + """

## Interval half-widths (90% of held-out |log error|)

| regime | factor either way |
|---|---:|
""" + "\n".join(f"| {r} | x{np.exp(s):.3g} |" for r, s in spreads.items() if s) + """

## The largest misses

| source | engine | metric | measured | predicted | error |
|---|---|---|---:|---:|---:|
""" + "\n".join(f"| {v['source']} | {v['engine']} | {v['metric']} | {v['measured']:.4g} | "
                f"{v['predicted']:.4g} | {v['err_pct']:+.0f}% |" for v in worst) + "\n"
    PAGE.write_text(page)
    (ROOT / "data" / "published-cv.json").write_text(json.dumps(
        {"summary": summary, "fitted_summary": fitted_summary, "values": cv}, indent=0) + "\n")
    print(f"wrote {PAGE.relative_to(ROOT)} and data/published-cv.json")
    print(md_table(both, "category", fitted_summary))


if __name__ == "__main__":
    main()
