"""Engine families fitted on published measurements, and how well they predict a publication
they never saw.

Rows name their serving engine (``engine``: vllm, sglang, trtllm, ...). A fit has two levels:

1. **shared**: every fit row, whatever its engine, fits the kernel shapes and efficiencies the
   rows identify (:func:`kvsim.fit.solve.identified`: the matmuls' compute efficiency, overlap
   and half-size, HBM efficiency, per-layer and per-step overhead);
2. **family**: one engine's rows refit what an engine's own code sets, its per-step and
   per-layer overheads and its HBM and compute efficiencies (those its rows identify), from
   the shared values; what they do not identify keeps the shared value. A family with fewer
   than :data:`MIN_FAMILY_ROWS` rows is the shared engine.

:func:`cross_validate` leaves one publication (``source``) out at a time: both levels are
refitted on the other publications and predict every measured value of the held-out one
(``tpot_ms``, ``ttft_ms``, ``throughput_tok_s``, ``latency_s``). :func:`summary` groups the
errors by category (:meth:`kvsim.fit.Point.categories`) and checks each value against the
interval the other publications' errors give its regime (:func:`spread`).
"""

from __future__ import annotations

import math

import numpy as np

from kvsim.errors import KvsimError
from kvsim.fit import HEADLINE, Point, Predictor
from kvsim.fit.solve import identified, make_engine, solve, start_values
from kvsim.hw.engine import BOUNDS, Engine

FAMILY_PARAMS = ("step_overhead_ms", "layer_overhead_us", "token_overhead_us", "hbm_efficiency",
                 "flop_efficiency")
MIN_FAMILY_ROWS = 3
COVERAGE = 0.9  # the interval is the 90% quantile of the regime's held-out |log errors|
REGIMES = {"tpot_ms": "decode", "ttft_ms": "prefill", "throughput_tok_s": "throughput",
           "latency_s": "throughput"}
CATEGORIES = ("decode", "prefill", "throughput", "tp", "fp8", "moe", "long-context", "offload")


def _mode(values):
    return max(set(values), key=list(values).count)


def fit_levels(rows: list[Point], pred: Predictor, base: Engine, family: str | None,
               progress=None) -> tuple[Engine, Engine, dict]:
    """(shared engine, family engine, what was free at each level) fitted to ``rows``."""
    gpu, model = _mode([p.gpu for p in rows]), _mode([p.model for p in rows])
    free = identified(rows, pred)
    start = start_values(gpu, [])
    values, rms = solve(rows, pred, base, free, start, gpu, model)
    note = f"shared fit of {len(rows)} published points, RMS relative error {100 * rms:.1f}%"
    shared = make_engine(base, values, "fit", note, gpu, model)
    if progress:
        progress()
    own = [p for p in rows if p.engine == family]
    if family is None or len(own) < MIN_FAMILY_ROWS:
        return shared, shared, {"shared": free, "family": []}
    ffree = [k for k in identified(own, pred) if k in FAMILY_PARAMS]
    if not any({"tpot_ms", "latency_s", "throughput_tok_s"} & set(p.measured) for p in own):
        ffree = [k for k in ffree if not k.endswith("overhead_us") and k != "step_overhead_ms"]
    if not ffree:
        return shared, shared, {"shared": free, "family": []}
    fvalues, frms = solve(own, pred, shared, ffree, {**start, **values},
                          _mode([p.gpu for p in own]), _mode([p.model for p in own]))
    fnote = (f"{family}'s {len(own)} published points, from the shared fit; RMS relative "
             f"error {100 * frms:.1f}%")
    fam = make_engine(shared, fvalues, "fit", fnote, gpu, model)
    if progress:
        progress()
    return shared, fam, {"shared": free, "family": ffree}


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


def cross_validate(points: list[Point], pred: Predictor, base: Engine,
                   progress: bool = False) -> list[dict]:
    """Leave one source out (see the module docstring): one record per held-out measured value
    (:func:`held_values`), with the family the prediction came from (its own, or the shared
    engine where the other sources hold too few of its rows)."""
    from tqdm import tqdm
    rows = [p for p in points if p.meta.get("certainty") not in BOUNDS]
    sources = list(dict.fromkeys(p.meta.get("source", "(no source)") for p in rows))
    out = []
    bar = tqdm(sources, desc="leave-one-source-out", unit="source", leave=False,
               disable=None if progress else True)
    for s in bar:
        held = [p for p in rows if p.meta.get("source", "(no source)") == s]
        rest = [p for p in points if p.use == "fit" and p.meta.get("source") != s]
        if not rest:
            continue
        engines = {}
        for fam in sorted({p.engine for p in held}):
            try:
                _, engines[fam], _ = fit_levels(rest, pred, base, fam)
            except KvsimError:
                continue
        for p in held:
            eng = engines.get(p.engine)
            if eng is None:
                continue
            own = sum(q.engine == p.engine for q in rest) >= MIN_FAMILY_ROWS
            for v in held_values(p, pred.predict(p, eng)):
                v["fitted_as"] = p.engine if own else "shared"
                out.append(v)
    return out


def spread(values: list[dict], regime: str | None = None, q: float = COVERAGE) -> float | None:
    """The ``q`` quantile of ``|log(predicted / measured)|`` over ``values`` (of ``regime``):
    a prediction ``P`` puts the measurement in ``[P e^-s, P e^s]``."""
    logs = [abs(v["log_err"]) for v in values if regime is None or v["regime"] == regime]
    return float(np.quantile(logs, q)) if logs else None


def summary(values: list[dict], within: float = 20.0) -> list[dict]:
    """Per category and overall: held-out values, the share within ``within`` percent, the
    median and largest absolute error, and the share inside the interval that the other
    sources' errors of the same regime give (:func:`spread`)."""
    cover = []
    for v in values:
        others = [w for w in values if w["source"] != v["source"]]
        s = spread(others, v["regime"])
        cover.append(s is not None and abs(v["log_err"]) <= s)
    out = []
    for cat in ("all", *CATEGORIES):
        idx = [i for i, v in enumerate(values) if cat == "all" or cat in v["categories"]]
        if not idx:
            out.append({"category": cat, "values": 0})
            continue
        errs = np.array([abs(values[i]["err_pct"]) for i in idx])
        out.append({"category": cat, "values": len(idx),
                    "sources": len({values[i]["source"] for i in idx}),
                    "within_pct": within, "within_share": float(np.mean(errs <= within)),
                    "median_abs_pct": float(np.median(errs)), "max_abs_pct": float(errs.max()),
                    "covered_share": float(np.mean([cover[i] for i in idx]))})
    return out
