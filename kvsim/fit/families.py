"""Engine families fitted on published measurements, and how well they predict a publication
they never saw.

Rows name their serving engine (``engine``: vllm, sglang, trtllm, ...). One bounded
least-squares problem (:func:`fit_joint`) fits two levels at once:

1. **shared**: the kernel shapes and efficiencies every row identifies, whatever its engine
   (:func:`kvsim.fit.solve.identified`: the matmuls' compute efficiency, overlap and half-size,
   grouped experts' efficiency, HBM efficiency, per-step, per-layer, per-token and per-all-reduce
   overheads; links stay the hardware's);
2. **family**: for each engine with at least :data:`MIN_FAMILY_ROWS` rows, offsets from the
   shared values of what an engine's own code sets (:data:`FAMILY_PARAMS`, those its rows
   identify), pulled towards zero by a prior so that the shared engine stays the typical one.
   An engine with fewer rows is the shared engine. Each family launches as it is documented
   to (:func:`as_documented`: CUDA graphs, or eagerly at a measured host cost per layer, and
   the overheads its code fixes), and so does the shared engine where it predicts a family
   held out.

:func:`cross_validate` leaves one publication (``source``) out at a time: the joint fit of the
other publications predicts every measured value of the held-out one (``tpot_ms``,
``ttft_ms``, ``throughput_tok_s``, ``latency_s``); with ``by="engine-version"`` it leaves one
engine version out instead (:func:`version_key`: its family's other versions still teach the
family's offsets). :func:`summary` groups the errors by category
(:meth:`kvsim.fit.Point.categories`) and checks each value against the interval the other
held-out groups' errors give its regime (:func:`spread`).
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

from kvsim.errors import KvsimError
from kvsim.fit import HEADLINE, Point, Predictor
from kvsim.fit.solve import identified, make_engine, start_values
from kvsim.hw.engine import (
    BOUNDS,
    FAMILY_ALLREDUCE,
    FAMILY_FIELDS,
    FAMILY_LAUNCH,
    Engine,
    Value,
)

FAMILY_PARAMS = ("step_overhead_ms", "layer_overhead_us", "token_overhead_us", "hbm_efficiency",
                 "flop_efficiency", "allreduce_us")
LOSS = "soft_l1"  # published points disagree: a far-off source should not drag the rest
MIN_FAMILY_ROWS = 3
COVERAGE = 0.9  # the interval is the 90% quantile of the regime's held-out |log errors|
REGIMES = {"tpot_ms": "decode", "ttft_ms": "prefill", "throughput_tok_s": "throughput",
           "latency_s": "throughput"}
CATEGORIES = ("decode", "prefill", "throughput", "tp", "fp8", "moe", "long-context", "offload",
              "serving")


def _mode(values):
    return max(set(values), key=list(values).count)


def family_free(own: list[Point], pred: Predictor) -> list[str]:
    """The family parameters an engine's own rows identify: overheads only with decode rows;
    the HBM efficiency only with rows on two or more GPUs (at least :data:`MIN_FAMILY_ROWS`
    each): on one GPU, the bandwidth the engine reaches and the bandwidth that GPU delivers are
    one number (SGLang's rows, 24 of 25 on an H20, made its family's HBM efficiency 0.51, which
    predicted SGLang's own H200 and A100 serving runs 20-30% slow; docs/results/published.md)."""
    free = [k for k in identified(own, pred) if k in FAMILY_PARAMS]
    if not any({"tpot_ms", "latency_s", "throughput_tok_s"} & set(p.measured) for p in own):
        free = [k for k in free if not k.endswith("overhead_us") and k != "step_overhead_ms"]
    gpus = [g for g in {p.gpu for p in own} if sum(p.gpu == g for p in own) >= MIN_FAMILY_ROWS]
    if len(gpus) < 2:
        free = [k for k in free if k != "hbm_efficiency"]
    return free


# a family parameter is an offset from the shared value: a log factor for an efficiency, a
# difference for an overhead (clipped to its bounds); the prior pulls each offset to 0 with the
# weight of a 10% error per SCALE of offset, so the shared engine stays the typical one. Each
# SCALE is of the spread engines show: per-sequence host work per step runs from a few us (C++
# runtimes) to ~0.5 ms (vLLM 0.2-0.3's Python sampler: the batch slopes of vllm-pr-2542 and
# vllm-pr-3240 give 0.45-0.6 ms); at 50 us the prior made those rows' slope a compute
# efficiency instead (docs/results/published.md)
SCALE = {"hbm_efficiency": 0.5, "flop_efficiency": 0.5, "step_overhead_ms": 1.0,
         "layer_overhead_us": 50.0, "token_overhead_us": 500.0, "allreduce_us": 20.0}
PRIOR = 0.1


def _offset(k: str, shared: float, x: float) -> float:
    from kvsim.fit.solve import bounds
    lo, hi = bounds(k)
    v = shared * math.exp(x) if k.endswith("efficiency") else shared + x
    return min(max(v, lo), hi)


def free_parameters(rows: list[Point], pred: Predictor) -> dict[str, list[str]]:
    """What a joint fit of ``rows`` moves: ``{"shared": [...], family: [...]}`` (links stay the
    hardware's, catalog or profile: an engine family spans GPUs)."""
    free = {"shared": [k for k in identified(rows, pred) if not k.startswith("link.")]}
    for fam in sorted({p.engine for p in rows}):
        own = [p for p in rows if p.engine == fam]
        if len(own) >= MIN_FAMILY_ROWS and (ff := family_free(own, pred)):
            free[fam] = [k for k in ff if k in free["shared"]]
    return free


def engine_for(family: str, shared: Engine, engines: dict) -> Engine:
    """The engine that predicts ``family``'s points: its own fit where it has one, else the
    shared fit as ``family`` is documented to run (:func:`as_documented`, with the overheads
    its code fixes: where a family has points of its own, they set those)."""
    return engines.get(family) or as_documented(shared, family, fixed=True)


def as_documented(engine: Engine, family: str, fixed: bool = False) -> Engine:
    """``engine`` with ``family``'s documented launch mode (:data:`FAMILY_LAUNCH`) and, with
    ``fixed``, the overheads its code fixes (:data:`FAMILY_FIELDS`), each with source ``docs``."""
    fields = dict(engine.fields)
    if family in FAMILY_LAUNCH:
        mode, host_us, why = FAMILY_LAUNCH[family]
        fields["launch"] = Value(mode, "docs", why)
        if host_us:
            fields["launch_overhead_us"] = Value(host_us, "docs", why)
    if family in FAMILY_ALLREDUCE:
        kernel, why = FAMILY_ALLREDUCE[family]
        fields["allreduce_kernel"] = Value(kernel, "docs", why)
    for k, (v, why) in (FAMILY_FIELDS.get(family, {}) if fixed else {}).items():
        fields[k] = Value(v, "docs", why)
    return dataclasses.replace(engine, fields=fields) if fields != engine.fields else engine


class JointProblem:
    """The least-squares problem of :func:`fit_joint`: parameters ``names`` (level, field),
    residuals (every measured value's relative error, then each family offset's prior term) and
    their Jacobian by forward differences over the rows each parameter moves."""

    def __init__(self, rows: list[Point], pred: Predictor, base: Engine, free: dict):
        from kvsim.fit.solve import bounds
        self.rows, self.pred, self.base, self.free = rows, pred, base, free
        self.gpu, self.model = _mode([p.gpu for p in rows]), _mode([p.model for p in rows])
        self.names = [(lvl, k) for lvl, ks in free.items() for k in ks]
        span = {k: (-3.0, 3.0) if k.endswith("efficiency") else (-bounds(k)[1], bounds(k)[1])
                for k in FAMILY_PARAMS}
        self.lo = np.array([bounds(k)[0] if lvl == "shared" else span[k][0]
                            for lvl, k in self.names])
        self.hi = np.array([bounds(k)[1] if lvl == "shared" else span[k][1]
                            for lvl, k in self.names])
        start = start_values(self.gpu, [])
        x0 = np.array([start[k] if lvl == "shared" else 0.0 for lvl, k in self.names])
        self.x0 = np.clip(x0, self.lo + 1e-9 * (self.hi - self.lo),
                          self.hi - 1e-9 * (self.hi - self.lo))
        self.n_cells = sum(len(p.measured) for p in rows)
        self.fam_cols = [j for j, (lvl, _) in enumerate(self.names) if lvl != "shared"]
        self.rows_of = {lvl: [i for i, p in enumerate(rows) if p.engine == lvl] for lvl in free}
        self.rows_of["shared"] = list(range(len(rows)))
        self.at = np.cumsum([0] + [len(p.measured) for p in rows])  # row i: at[i]:at[i + 1]

    def engines(self, x) -> dict[str, Engine]:
        shared = {k: v for (lvl, k), v in zip(self.names, x) if lvl == "shared"}
        out = {"shared": make_engine(self.base, shared, "fit", "", self.gpu, self.model)}
        for fam in self.free:
            if fam != "shared":
                own = {k: _offset(k, shared[k], v) for (lvl, k), v in zip(self.names, x)
                       if lvl == fam}
                out[fam] = as_documented(make_engine(out["shared"], own, "fit", "", self.gpu,
                                                     self.model), fam)
        return out

    def fit_part(self, x, idx) -> np.ndarray:
        """The relative errors of rows ``idx`` (their measured values, in order)."""
        eng, out = self.engines(x), []
        for i in idx:
            p = self.rows[i]
            got = self.pred.predict(p, eng.get(p.engine, eng["shared"]))
            out += [got[k] / v - 1.0 for k, v in p.measured.items()]
        return np.array(out)

    def residuals(self, x) -> np.ndarray:
        prior = [PRIOR * x[j] / SCALE[self.names[j][1]] for j in self.fam_cols]
        return np.concatenate([self.fit_part(x, self.rows_of["shared"]), prior])

    def jacobian(self, x) -> np.ndarray:
        """Forward differences, each column over the rows it moves: a family's parameters
        move only that family's rows (and their own prior term)."""
        J = np.zeros((self.n_cells + len(self.fam_cols), len(self.names)))
        at_x = {}
        for j, (lvl, _) in enumerate(self.names):
            idx = self.rows_of[lvl]
            if lvl not in at_x:
                at_x[lvl] = self.fit_part(x, idx)
            h = 1e-6 * max(1.0, abs(x[j]))
            step = h if x[j] + h <= self.hi[j] else -h
            xp = x.copy()
            xp[j] += step
            cols = np.concatenate([np.arange(self.at[i], self.at[i + 1]) for i in idx])
            J[cols, j] = (self.fit_part(xp, idx) - at_x[lvl]) / step
        for r, j in enumerate(self.fam_cols):
            J[self.n_cells + r, j] = PRIOR / SCALE[self.names[j][1]]
        return J


def fit_joint(rows: list[Point], pred: Predictor, base: Engine) -> tuple[Engine, dict, dict]:
    """The shared engine and one engine per family with at least :data:`MIN_FAMILY_ROWS` rows,
    fitted together in one bounded least-squares problem (:class:`JointProblem`): each
    family's parameters are offsets from the shared values (:data:`SCALE`, :data:`PRIOR`) that
    move only its rows' predictions. Returns (shared, {family: engine}, what was free:
    ``{"shared": [...], family: [...]}``)."""
    from scipy.optimize import least_squares
    free = free_parameters(rows, pred)
    prob = JointProblem(rows, pred, base, free)
    res = least_squares(prob.residuals, prob.x0, jac=prob.jacobian, bounds=(prob.lo, prob.hi),
                        x_scale="jac", method="trf", loss=LOSS, f_scale=0.1, xtol=1e-5,
                        ftol=1e-5)
    rms = float(np.sqrt(np.mean(res.fun[:prob.n_cells] ** 2)))
    note = (f"fitted with {len(rows)} published points of {len({p.engine for p in rows})} "
            f"engines, RMS relative error {100 * rms:.1f}%")
    out = {fam: dataclasses.replace(e, fields={
        k: dataclasses.replace(v, note=note) if v.source == "fit" else v
        for k, v in e.fields.items()}) for fam, e in prob.engines(res.x).items()}
    return out.pop("shared"), out, free


def fit_levels(rows: list[Point], pred: Predictor, base: Engine,
               family: str | None) -> tuple[Engine, Engine, dict, dict]:
    """(shared engine, ``family``'s engine (the shared one where it has too few rows), what
    was free: ``{"shared": [...], "family": [...]}``, every family's engine), from
    :func:`fit_joint`."""
    shared, fams, free = fit_joint(rows, pred, base)
    return shared, fams.get(family, shared), {"shared": free["shared"],
                                               "family": free.get(family, [])}, fams


def fitted_values(points: list[Point], pred: Predictor, shared: Engine,
                  engines: dict) -> list[dict]:
    """The values :func:`cross_validate` judges, each predicted by the joint fit of *every*
    source (``shared`` and ``engines`` from :func:`fit_joint`) with its own family's engine:
    beside the held-out errors, what is left is the model's misfit, and the difference is
    what a publication's own rows teach its engine family."""
    out = []
    for p in points:
        if p.meta.get("certainty") in BOUNDS:
            continue
        for v in held_values(p, pred.predict(p, engine_for(p.engine, shared, engines))):
            v["fitted_as"] = p.engine if p.engine in engines else "shared"
            out.append(v)
    return out


def held_values(p: Point, got: dict) -> list[dict]:
    """One record per measured value of ``p`` that a prediction is judged on."""
    out = []
    for k in HEADLINE:
        if k in p.measured:
            ratio = got[k] / p.measured[k]
            out.append({"row": p.row, "source": p.meta.get("source", "(no source)"),
                        "engine": p.engine, "metric": k, "regime": REGIMES[k],
                        "categories": p.categories(), "gpu": p.gpu, "model": p.model,
                        "measured": p.measured[k], "predicted": got[k],
                        "err_pct": 100 * (ratio - 1), "log_err": math.log(ratio)})
    return out


CV_BY = ("source", "engine-version")  # what a cross-validation holds out at once


def version_key(engine: str, version: str) -> str:
    """An engine version, from the free-text ``engine_version`` cell: the family and the first
    major.minor in the text (``vllm-0.3``, "~0.2.7 (PR #2542 branch)" -> "vllm-0.3 0.2"), else
    the text's first token ("repo@a21f5a9"), else "unstated"."""
    m = re.search(r"\d+\.\d+", version)
    v = m.group() if m else (version.split() or ["unstated"])[0].rstrip(",;:")
    return f"{engine or '(no engine)'} {v}"


def group_of(p: Point, by: str = "source") -> str:
    """The group of ``p`` a cross-validation ``by`` (:data:`CV_BY`) holds out with it."""
    if by == "engine-version":
        return version_key(p.engine, p.meta.get("engine_version", ""))
    return p.meta.get("source", "(no source)")


def cross_validate(points: list[Point], pred: Predictor, base: Engine,
                   progress: bool = False, jobs: int = 1, by: str = "source") -> list[dict]:
    """Leave one group out (``by``: a ``source``, see the module docstring, or an
    ``engine-version``, :func:`version_key`): one record per held-out measured value
    (:func:`held_values`), with the group held out (``held_out``) and the family the prediction
    came from (its own, or the shared engine where the other groups hold too few of its rows).
    ``jobs``: groups fitted at once in worker processes (the records are the same, in the same
    order)."""
    from tqdm import tqdm
    if by not in CV_BY:
        raise KvsimError(f"--cv {by!r}: one of {', '.join(CV_BY)}")
    rows = [p for p in points if p.meta.get("certainty") not in BOUNDS]
    groups = list(dict.fromkeys(group_of(p, by) for p in rows))
    bar = tqdm(total=len(groups), desc=f"leave-one-{by}-out", unit=by.split("-")[-1],
               leave=False, disable=None if progress else True)
    _FOLD.update(points=points, rows=rows, pred=pred, base=base, by=by)
    try:
        if jobs <= 1 or len(groups) < 2:
            done = []
            for g in groups:
                done.append(_fold(g))
                bar.update()
        else:
            import concurrent.futures as cf
            import multiprocessing as mp
            with cf.ProcessPoolExecutor(min(jobs, len(groups)),
                                        mp_context=mp.get_context("fork")) as pool:
                futures = [pool.submit(_fold, g) for g in groups]
                for _ in cf.as_completed(futures):
                    bar.update()
                done = [f.result() for f in futures]
    finally:
        _FOLD.clear()
        bar.close()
    return [v for part in done for v in part]


_FOLD: dict = {}  # what every fold reads (inherited by forked workers)


def _fold(group: str) -> list[dict]:
    """The held-out records of ``group`` (of ``_FOLD["by"]``) under the joint fit of the other
    groups' fit rows (none where nothing is left to fit, or the fit cannot be made)."""
    pred, by = _FOLD["pred"], _FOLD.get("by", "source")
    held = [p for p in _FOLD["rows"] if group_of(p, by) == group]
    rest = [p for p in _FOLD["points"] if p.use == "fit" and group_of(p, by) != group]
    if not rest:
        return []
    try:
        shared, engines, _ = fit_joint(rest, pred, _FOLD["base"])
    except KvsimError:
        return []
    out = []
    for p in held:
        eng = engine_for(p.engine, shared, engines)
        own = sum(q.engine == p.engine for q in rest) >= MIN_FAMILY_ROWS
        for v in held_values(p, pred.predict(p, eng)):
            v["fitted_as"] = p.engine if own else "shared"
            v["held_out"] = group
            out.append(v)
    return out


# The overheads and what they may take. The host's (per step, per token and an eager engine's
# launches) take together at most the share of a step that vLLM 0.5.3 was measured to spend on
# its host, the largest published: Llama-3-8B on one H100, 33% in the HTTP API server and 29%
# scheduling, 38% on the GPU (blog.vllm.ai/2024/09/05/perf-update.html). The per-layer
# overhead, GPU time, has an absolute ceiling (:data:`kvsim.hw.engine.
# LAYER_OVERHEAD_CEILING_US`, the fit's bound); the all-reduce's, communication on top of
# the kernel's measured time (kvsim.hw.collectives: the engine's NCCL or custom kernel), none
OVERHEADS = ("step_overhead_ms", "layer_overhead_us", "token_overhead_us", "allreduce_us",
             "launch_overhead_us")
HOST_OVERHEADS = ("step_overhead_ms", "token_overhead_us", "launch_overhead_us")
OVERHEAD_SHARE_CEILING = 0.62


def overhead_shares(rows: list[Point], pred: Predictor, engines: dict) -> list[dict]:
    """Per family and overhead (and ``host``: the :data:`HOST_OVERHEADS` at once), its value and
    the share of the predicted time it makes on the family's own fit rows (1 - the time with it at
    zero / the time: TPOT, batch latency, 1 / throughput; not TTFT, a prefill), largest and
    median."""
    out = []
    for fam, eng in engines.items():
        own = [p for p in rows if p.engine == fam]
        full = [pred.predict(p, eng) for p in own]
        for k in (*OVERHEADS, "host"):
            if k != "host" and not eng.get(k):
                continue
            bare = eng.with_fields(**{o: 0.0 for o in (HOST_OVERHEADS if k == "host" else [k])
                                      if o in eng.fields})
            shares = []
            for p, f in zip(own, full):
                z = pred.predict(p, bare)
                for m in p.measured:
                    if m != "ttft_ms" and f.get(m) and z.get(m):
                        shares.append(1 - (f[m] / z[m] if m == "throughput_tok_s"
                                           else z[m] / f[m]))
            if shares:
                out.append({"family": fam, "overhead": k,
                            "value": None if k == "host" else float(eng.get(k)),
                            "points": len(own), "max_share": max(shares),
                            "median_share": float(np.median(shares))})
    return out


def spread(values: list[dict], regime: str | None = None, q: float = COVERAGE) -> float | None:
    """The ``q`` quantile of ``|log(predicted / measured)|`` over ``values`` (of ``regime``):
    a prediction ``P`` puts the measurement in ``[P e^-s, P e^s]``."""
    logs = [abs(v["log_err"]) for v in values if regime is None or v["regime"] == regime]
    return float(np.quantile(logs, q)) if logs else None


def summary(values: list[dict], within: float = 20.0, groups=None) -> list[dict]:
    """Per group: held-out values, the share within ``within`` percent, the median and largest
    absolute error, and the share inside the interval that the other held-out groups' (else
    sources') errors of the same regime give (:func:`spread`, over every value). ``groups(v)``:
    the names of the groups a value counts in (default: ``all`` and its categories, in
    :data:`CATEGORIES` order)."""
    cover = []
    held = [v.get("held_out", v["source"]) for v in values]
    for v, g in zip(values, held):
        s = spread([w for w, h in zip(values, held) if h != g], v["regime"])
        cover.append(s is not None and abs(v["log_err"]) <= s)
    if groups is None:
        names = ("all", *CATEGORIES)
        groups = lambda v: ["all", *v["categories"]]  # noqa: E731
    else:
        names = sorted({g for v in values for g in groups(v)})
    out = []
    for name in names:
        idx = [i for i, v in enumerate(values) if name in groups(v)]
        if not idx:
            out.append({"category": name, "values": 0})
            continue
        errs = np.array([abs(values[i]["err_pct"]) for i in idx])
        out.append({"category": name, "values": len(idx),
                    "sources": len({values[i]["source"] for i in idx}),
                    "within_pct": within, "within_share": float(np.mean(errs <= within)),
                    "median_abs_pct": float(np.median(errs)), "max_abs_pct": float(errs.max()),
                    "covered_share": float(np.mean([cover[i] for i in idx]))})
    return out


def record(points: list[Point], rows: list[Point], pred: Predictor, engine: Engine,
           family: str | None, free: dict, cv: list[dict] | None,
           summary_rows: list[dict] | None, by: str = "source") -> dict:
    """What an engine file keeps of its fit: each fitted row's in-sample errors, what was free,
    the configurations its rows cover (``checked``: a plan outside them is warned and its
    interval widened) and, with a cross-validation, every held-out error (``cv``: the intervals'
    spread per regime) and its summary (``cv_by``: what it held out, where not a source)."""
    own = [p for p in rows if family is None or p.engine == family] or rows
    points_out = []
    for p in own:
        for v in held_values(p, pred.predict(p, engine)):
            points_out.append({k: v[k] for k in ("row", "source", "metric", "measured",
                                                 "predicted", "err_pct")})
    fam = [p for p in rows if family is not None and p.engine == family]
    out = {"family": family, "free": free, "points": points_out,
           "checked": checked(rows), "checked_family": checked(fam) if fam else None}
    if cv is not None:
        out["cv"] = [{k: v[k] for k in ("source", "engine", "metric", "regime", "categories",
                                        "err_pct", "log_err")} for v in cv]
        out["cv_summary"] = summary_rows
        if by != "source":
            out["cv_by"] = by
    return out


def checked(rows: list[Point]) -> dict:
    """The GPUs, weight and KV types, TP sizes and model kinds (dense, MoE) the rows cover."""
    from kvsim.hw import catalog
    return {"gpu": sorted({p.gpu for p in rows}),
            "weight_dtype": sorted({p.weight_dtype or "bf16" for p in rows}),
            "kv_dtype": sorted({p.kv_dtype or p.weight_dtype or "bf16" for p in rows}),
            "tp": sorted({p.tp for p in rows}),
            "moe": any(catalog.model(p.model).experts for p in rows)}
