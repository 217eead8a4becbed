"""The fit: bounded least squares (scipy) on the relative error of every measured value of the
fit rows; which parameters are free follows from what the rows can tell apart, and each point's
leave-one-out error says how well the others predict it.

Parameters (:func:`parameters`): engine fields (``PARAMS``) and the four numbers of the decide
model of each policy that decides per step what to fetch, named after the policy's decide kernel
(``decide.<kernel>.<number>``, for each kernel the rows hold). Free by default when the rows
identify them (:func:`identified`):

* ``step_overhead_ms``: always;
* ``hbm_efficiency``: with resident rows at two or more KV sizes per step (at one size it
  trades one-for-one against the overhead);
* ``link.<path>.gbps``: with rows of a policy that moves KV over that path;
* ``attention_efficiency``: with resident decode rows of two or more models, whose KV cache is
  at most 10% of the bytes a step reads in some and at least 30% in others (decode attention's
  HBM rate as a share of the weight reads');
* ``fp8_efficiency``: with three or more rows whose matmuls' compute shows (as for
  ``flop_efficiency``) with fp8 weights on a GPU with an fp8 rate (W8A8), and three or more
  without (the fp8 matmuls' share of their peak over the bf16 ones'; the start value and the
  default, 0.883, is a measured ratio: ``kvsim.hw.costs.FP8_EFFICIENCY_RATIO``);
* ``prefill_attention_efficiency``: with rows whose prefill is timed (TTFT, or a static batch's
  latency or throughput) at prompts where causal attention is at most 10% of the prefill's FLOPs
  and others where it is at least 30% (its compute rate as a share of the matmuls');
* ``head_reread_share``: with two or more decode rows of a GQA model whose ``attention`` column
  says ``per-query-head`` (the share of its repeat KV reads that reach HBM);
* ``decide.<kernel>`` (e.g. ``decide.verkv``): ``per_ktoken_us`` with rows of that kernel's
  policy; ``per_kfetched_us`` with its rows at two or more fetch fractions and a measured
  ``fetch_ms`` (without one, the fetch and this term both grow with the fetched bytes and only
  their sum is seen); ``serial_share`` at two or more batch sizes; ``per_layer_us`` at two or
  more contexts.

``free``/``fixed`` (``--free``, ``--fix``) change the set.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from kvsim.errors import KvsimError
from kvsim.fit import Point, Predictor
from kvsim.hw import catalog
from kvsim.hw.costs import FLOP_EFFICIENCY, FP8_EFFICIENCY_RATIO, GATHER_EFFICIENCY, HBM_EFFICIENCY
from kvsim.hw.engine import BOUNDS, LAYER_OVERHEAD_CEILING_US, DecideModel, Engine, Value

# No engine streams weights faster than a bandwidth test reads HBM: H100 SXM copies peak at 87%
# of spec at 13 MB, ~70% at 68 MB (Voltage Park's 8x H100 bandwidthTest,
# github.com/ZiyanIshani/vpbenchmarking, results/stream_nvbench), NVIDIA's aiconfigurator
# assumes 80% (systems/h800_sxm.yaml, mem_bw_empirical_scaling_factor), the design note 85%.
# The ceiling leaves a margin above them; at 1.0 the fit paired TensorRT-LLM's 100% of spec with
# a 102 us per-layer overhead
HBM_CEILING = 0.92
# name -> (lower, upper bound)
PARAMS = {
    "step_overhead_ms": (0.0, 1e3),
    "layer_overhead_us": (0.0, LAYER_OVERHEAD_CEILING_US),
    "token_overhead_us": (0.0, 1e3),
    "allreduce_us": (0.0, 1e3),
    "gemm_overlap": (0.0, 1.0),
    "gemm_half_tokens": (0.0, 1e4),
    "moe_efficiency": (0.05, 1.0),
    "head_reread_share": (0.0, 1.0),
    "attention_efficiency": (0.2, 1.0),
    "prefill_attention_efficiency": (0.2, 1.0),
    "fp8_efficiency": (0.3, 1.0),
    "hbm_efficiency": (0.05, HBM_CEILING),
    "flop_efficiency": (0.05, 1.0),
    **{f"link.{p}.gbps": (0.05, 2e3) for p in ("h2d", "d2h", "gather")},
    **{f"link.{p}.launch_us": (0.0, 1e4) for p in ("h2d", "d2h", "gather")},
}
# a decide model's numbers: name -> (lower, upper bound, start value)
DECIDE_PARAMS = {"per_layer_us": (0.0, 1e6, 0.0), "per_ktoken_us": (0.0, 1e6, 20.0),
                 "per_kfetched_us": (0.0, 1e7, 0.0), "serial_share": (0.0, 1.0, 0.5)}


def decide_kernels(points: list[Point], pred: Predictor) -> list[str]:
    """The decide kernels of the points' policies (those that decide per step what to fetch)."""
    return sorted({pred.cost(p).decide_kernel for p in points} - {""})


def parameters(kernels: list[str]) -> list[str]:
    """Every parameter a fit over policies with these decide kernels has."""
    return list(PARAMS) + [f"decide.{k}.{f}" for k in kernels for f in DECIDE_PARAMS]


def bounds(name: str) -> tuple[float, float]:
    """A parameter's (lower, upper) bound."""
    if name.startswith("decide."):
        return DECIDE_PARAMS[name.rsplit(".", 1)[1]][:2]
    return PARAMS[name]


def identified(points: list[Point], pred: Predictor) -> list[str]:
    """The parameters these points can tell apart (see the module docstring)."""
    out = ["step_overhead_ms"]
    costs = {id(p): pred.cost(p) for p in points}
    m = {p.model: catalog.model(p.model) for p in points}
    decodes = [p for p in points if {"tpot_ms", "latency_s", "throughput_tok_s"}
               & set(p.measured)]  # rows whose value holds decode steps
    # resident decode rows: (the KV bytes a step reads, the weights')
    held = [(costs[id(p)].hbm_read_frac * m[p.model].kv_bytes_per_token * p.context * p.batch,
             m[p.model].weight_bytes) for p in decodes if costs[id(p)].host_read_frac == 0]
    if len({round(kv + w) for kv, w in held}) >= 2:
        out.append("hbm_efficiency")
    kv_share = [kv / (kv + w) for kv, w in held]
    if kv_share and min(kv_share) <= 0.1 and max(kv_share) >= 0.3 \
            and len({w for _, w in held}) >= 2:
        # the KV's share of the bytes a step reads varies, and so do the weights (with one
        # model's weights their read time trades one-for-one against the step overhead)
        out.append("attention_efficiency")
    share = [float(m[p.model].attention_flops(p.context) / m[p.model].prefill_flops(p.context))
             for p in points if {"ttft_ms", "latency_s", "throughput_tok_s"} & set(p.measured)]
    if share and min(share) <= 0.1 and max(share) >= 0.3:
        out.append("prefill_attention_efficiency")  # attention's share of prefill FLOPs varies
    if len({m[p.model].layers for p in decodes}) >= 2:  # else it trades with the step overhead
        out.append("layer_overhead_us")
    if len({p.batch for p in decodes if costs[id(p)].host_read_frac == 0
            and not costs[id(p)].decide_kernel}) >= 4:  # dense rows: nothing else grows with B
        out.append("token_overhead_us")
    compute = [p for p in points if "ttft_ms" in p.measured or p.batch * (
        p.output_len if {"latency_s", "throughput_tok_s"} & set(p.measured) else 1) >= 64]
    if len(compute) >= 3:  # prefills or large batches: the matmuls' compute side shows
        out += ["flop_efficiency", "gemm_overlap", "gemm_half_tokens"]
    w8a8 = [p for p in compute if p.weight_dtype == "fp8" and not p.weight_only
            and catalog.gpu(p.gpu).fp8_tflops]
    if len(w8a8) >= 3 and len(compute) - len(w8a8) >= 3:  # fp8 GEMMs beside bf16 ones
        out.append("fp8_efficiency")
    if sum(p.tp > 1 for p in decodes) >= 2:
        out.append("allreduce_us")
    if sum(bool(m[p.model].experts) for p in points) >= 2:
        out.append("moe_efficiency")
    if sum(p.attention == "per-query-head" and m[p.model].q_heads > m[p.model].kv_heads
           for p in decodes) >= 2:  # rows that decode with a kernel that is not GQA-aware
        out.append("head_reread_share")
    paths = {costs[id(p)].path for p in points if costs[id(p)].host_read_frac > 0}
    out += [f"link.{p}.gbps" for p in ("h2d", "gather") if p in paths]
    for kernel in decide_kernels(points, pred):
        rows = [p for p in points if costs[id(p)].decide_kernel == kernel]
        reads = {round(costs[id(p)].host_read_frac, 6) for p in rows}
        name = f"decide.{kernel}."
        out += [name + "per_layer_us"] if len({p.context for p in rows}) >= 2 else []
        out += [name + "per_ktoken_us"]
        timed = any("fetch_ms" in p.measured for p in rows)  # else fetch and c trade one-for-one
        out += [name + "per_kfetched_us"] if len(reads) >= 2 and timed else []
        out += [name + "serial_share"] if len({p.batch for p in rows}) >= 2 else []
    return out


def start_values(gpu: str, kernels: list[str]) -> dict:
    """Where the search starts: the catalog's roofline figures of the fitted GPU."""
    g = catalog.gpu(gpu)
    return {"step_overhead_ms": 0.5, "layer_overhead_us": 5.0, "token_overhead_us": 5.0,
            "allreduce_us": 5.0,
            "gemm_overlap": 0.5, "gemm_half_tokens": 32.0, "moe_efficiency": 0.7,
            "head_reread_share": 0.5, "attention_efficiency": 0.8,
            "prefill_attention_efficiency": 0.8, "fp8_efficiency": FP8_EFFICIENCY_RATIO,
            "hbm_efficiency": HBM_EFFICIENCY, "flop_efficiency": FLOP_EFFICIENCY,
            "link.h2d.gbps": g.h2d_gbps,
            "link.d2h.gbps": g.h2d_gbps, "link.gather.gbps": g.h2d_gbps * GATHER_EFFICIENCY,
            **{f"link.{p}.launch_us": g.copy_alpha_us for p in ("h2d", "d2h", "gather")},
            **{f"decide.{k}.{f}": start for k in kernels
               for f, (_, _, start) in DECIDE_PARAMS.items()}}


def make_engine(base: Engine, values: dict, source: str, note: str, gpu: str,
                model: str) -> Engine:
    """``base`` with ``values`` (names of :func:`parameters`) set, each with ``source`` and
    ``note``."""
    fields = dict(base.fields)
    decide: dict[str, dict] = {}  # kernel -> its decide model's numbers given here
    for k, v in values.items():
        if k.startswith("decide."):
            kernel, number = k[len("decide."):].rsplit(".", 1)
            decide.setdefault(kernel, {})[number] = float(v)
        else:
            fields[k] = Value(float(v), source, note)
    for kernel, numbers in decide.items():
        old = base.decide(kernel) or DecideModel(serial_share=1.0)
        dm = dataclasses.replace(old, **numbers)
        fields[f"decide.{kernel}"] = Value(dataclasses.asdict(dm), source, note)
    # a record of its own: the base's (a module-level engine, say) is never written through
    return dataclasses.replace(base, fields=fields, fitted_on={"gpu": gpu, "model": model},
                               fit={})


@dataclass
class Fit:
    engine: Engine
    free: list[str]
    values: dict
    rows: list[dict]  # per point: measured, fitted and leave-one-out values
    cost: float  # RMS relative error over the fitted values


def _residuals(points, pred, base, free, x, gpu, model):
    eng = make_engine(base, dict(zip(free, x)), "fit", "", gpu, model)
    out = []
    for p in points:
        got = pred.predict(p, eng)
        out += [got[k] / v - 1.0 for k, v in p.measured.items()]
    return np.array(out)


def solve(points: list[Point], pred: Predictor, base: Engine, free: list[str],
          start: dict, gpu: str, model: str, loss: str = "linear") -> tuple[dict, float]:
    """Values of ``free`` minimising the squared relative errors (``loss``: scipy's, e.g.
    ``soft_l1`` to let a few far-off points weigh less), and their RMS."""
    from scipy.optimize import least_squares
    n_values = sum(len(p.measured) for p in points)
    if n_values < len(free):
        raise KvsimError(f"{n_values} measured value(s) cannot fit {len(free)} free parameters "
                         f"({', '.join(free)}); add points or fix some (--fix NAME=VALUE)")
    lo = np.array([bounds(k)[0] for k in free])
    hi = np.array([bounds(k)[1] for k in free])
    x0 = np.clip([start[k] for k in free], lo + 1e-9 * (hi - lo), hi - 1e-9 * (hi - lo))
    res = least_squares(lambda x: _residuals(points, pred, base, free, x, gpu, model), x0,
                        bounds=(lo, hi), x_scale="jac", method="trf", xtol=1e-10, ftol=1e-10,
                        loss=loss, f_scale=0.1)
    r = res.fun
    return dict(zip(free, map(float, res.x))), float(np.sqrt(np.mean(r ** 2))) if len(r) else 0.0


def fit(points: list[Point], pred: Predictor, base: Engine, free: list[str] | None = None,
        fixed: dict | None = None, name: str = "fitted", description: str = "",
        origin: str = "", progress: bool = False, loo: bool = True) -> Fit:
    """Fit ``free`` (default: what the fit rows identify) to the fit rows of ``points``, from
    ``base``; ``loo``: also predict each fit row from a fit of the others."""
    fixed = dict(fixed or {})
    rows = [p for p in points if p.use == "fit"]
    if not rows:
        raise KvsimError("no rows to fit (every row has use=check)")
    kernels = decide_kernels(rows, pred)
    known = parameters(kernels)
    for k in list(fixed) + list(free or []):
        if k not in known:
            raise KvsimError(f"unknown parameter {k!r}; parameters: {', '.join(known)}")
    gpus = [p.gpu for p in rows]
    gpu = max(set(gpus), key=gpus.count)
    model = max({p.model for p in rows}, key=[p.model for p in rows].count)
    base = make_engine(base, fixed, "override", "fixed in kvsim fit (--fix)", gpu, model) \
        if fixed else base
    chosen = free if free is not None else identified(rows, pred)
    chosen = [k for k in chosen if k not in fixed]
    start = start_values(gpu, kernels)
    values, rms = solve(rows, pred, base, chosen, start, gpu, model)
    note = (f"kvsim fit {origin}: {len(rows)} points, {sum(len(p.measured) for p in rows)} "
            f"measured values, RMS relative error {100 * rms:.2f}%").replace("  ", " ")
    engine = make_engine(base, values, "fit", note, gpu, model)
    engine = dataclasses.replace(engine, name=name, description=description)
    table = []
    for p in points:
        got = pred.predict(p, engine)
        row = {"row": p.row, "use": p.use, "gpu": p.gpu, "model": p.model, "policy": p.label,
               "options": p.spec.options, "context": p.context, "batch": p.batch,
               "kv_read_frac": p.kv_read_frac, **p.meta}
        for k, v in p.measured.items():
            row[f"measured_{k}"] = v
            row[f"predicted_{k}"] = got[k]
            row[f"err_{k}_pct"] = 100 * (got[k] / v - 1)
        table.append(row)
    if loo:
        _leave_one_out(rows, pred, base, chosen, free is not None, fixed, start, gpu, model,
                       values, table, progress)
    engine.fit.update({"points": table, "free": chosen, "rms_rel_err": rms,
                       "values": values, "range": fitted_range(rows, pred)})
    return Fit(engine, chosen, values, table, rms)


def fitted_range(rows: list[Point], pred: Predictor) -> dict:
    """The contexts, batches and (for policies that fetch) KV reads the fit rows span, per
    policy: a plan outside them is an extrapolation and replay says so."""
    out: dict = {}
    for p in rows:
        r = out.setdefault(p.spec.name, {"context": [p.context] * 2, "batch": [p.batch] * 2})
        for key, v in (("context", p.context), ("batch", p.batch),
                       ("kv_read_frac", pred.cost(p).host_read_frac)):
            lo, hi = r.get(key, [v, v])
            r[key] = [min(lo, v), max(hi, v)]
    return out


def _leave_one_out(rows, pred, base, chosen, forced, fixed, start, gpu, model, values, table,
                   progress=False):
    """Each fit point predicted by a fit of the others (its TPOT error); n/a where the others
    no longer identify every parameter the point needs, or are too few."""
    from tqdm import tqdm
    for i, p in enumerate(tqdm(rows, desc="leave-one-out", unit="fit", leave=False,
                               disable=None if progress else True)):  # on a terminal
        rest = rows[:i] + rows[i + 1:]
        row = next(t for t in table if t["row"] == p.row)
        free = chosen if forced else [k for k in identified(rest, pred) if k not in fixed]
        if set(free) != set(chosen):
            lost = ", ".join(sorted(set(chosen) - set(free)))
            row["loo_tpot_pct"] = None
            row["loo_note"] = f"the other points do not identify {lost}"
            continue
        try:
            v, _ = solve(rest, pred, base, free, {**start, **values}, gpu, model)
        except KvsimError as e:
            row["loo_tpot_pct"], row["loo_note"] = None, str(e).split(";")[0]
            continue
        got = pred.predict(p, make_engine(base, v, "fit", "", gpu, model))
        k = p.headline
        row["loo_tpot_pct"] = 100 * (got[k] / p.measured[k] - 1)


CV_BY = ("source",)  # row cells a cross-validation can hold out by


def cross_validate(points: list[Point], pred: Predictor, base: Engine,
                   free: list[str] | None = None, fixed: dict | None = None,
                   by: str = "source") -> list[dict]:
    """Leave one group out: for each value of the rows' ``by`` cell (a publication), an engine
    fitted on the fit rows of every other group predicts this group's rows, fit and check rows
    alike (their TPOT; not rows whose value only bounds it, :data:`kvsim.hw.engine.BOUNDS`).
    The parameters the other groups do not identify keep ``base``'s values
    (the roofline's where ``base`` does not set them) and are named. One dict per group, in
    the order the groups first appear."""
    if by not in CV_BY:
        raise KvsimError(f"--cv {by!r}: one of {', '.join(CV_BY)}")
    fixed = dict(fixed or {})
    groups: dict[str, list[Point]] = {}
    for p in points:
        groups.setdefault(p.meta.get(by, f"(no {by})"), []).append(p)
    out = []
    for name, rows in groups.items():
        rest = [p for p in points if p.use == "fit" and p.meta.get(by, f"(no {by})") != name]
        res = {by: name, "rows": [p.row for p in rows], "fitted_on": len(rest),
               "errors_pct": [], "held": [], "note": ""}
        out.append(res)
        if not rest:
            res["note"] = "no other source has fit rows"
            continue
        kernels = decide_kernels(rest, pred)
        need = set(parameters(decide_kernels(rows, pred)))
        chosen = [k for k in (free if free is not None else identified(rest, pred))
                  if k not in fixed and k in parameters(kernels)]
        gpus, models = [p.gpu for p in rest], [p.model for p in rest]
        gpu, model = max(set(gpus), key=gpus.count), max(set(models), key=models.count)
        start = start_values(gpu, kernels)
        eng = make_engine(base, fixed, "override", "", gpu, model) if fixed else base
        try:
            values, _ = solve(rest, pred, eng, chosen, start, gpu, model)
        except KvsimError as e:
            res["note"] = str(e).split(";")[0]
            continue
        eng = make_engine(eng, values, "fit", "", gpu, model)
        res["held"] = sorted(k for k in need & (set(identified(rows, pred)) - set(chosen))
                             if k not in fixed)
        bounds = [p.row for p in rows if p.meta.get("certainty") in BOUNDS]
        for p in rows:
            if p.row not in bounds:
                k = p.headline
                got = pred.predict(p, eng)[k]
                res["errors_pct"].append(100 * (got / p.measured[k] - 1))
        if bounds:
            res["note"] = f"rows {' '.join(map(str, bounds))}: a bound of TPOT, not predicted"
    return out


def cv_summary(groups: list[dict], within: float = 20.0) -> dict:
    """How many held-out predictions fall within ``within`` percent, and the median and largest
    absolute error, over every group."""
    errs = [abs(e) for g in groups for e in g["errors_pct"]]
    return {"predicted": len(errs), "within_pct": within,
            "within": sum(e <= within for e in errs),
            "median_abs_pct": float(np.median(errs)) if errs else None,
            "max_abs_pct": max(errs) if errs else None}
