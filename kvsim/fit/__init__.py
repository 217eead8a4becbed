"""``kvsim fit``: measured serving points in, an engine profile out.

A point is one row of a CSV: a configuration (``gpu, model, policy, context, batch``, the
policy's options as columns, e.g. ``eps, compression, sketch``, and where they apply ``tp``,
``weight_dtype``, ``kv_dtype``, the serving ``engine`` family and its decode ``attention``
kernel) and what was measured there, at least one of:

* ``tpot_ms``: the mean decode step of a full batch of ``batch`` requests whose prompts of
  ``context`` tokens decode ``output_len`` tokens together (default 128);
* ``ttft_ms``: the prefill of that batch's prompts in one step;
* ``latency_s``: the batch end to end, its prefill and ``output_len - 1`` decode steps;
* ``throughput_tok_s``: the generated tokens of that run per second, ``batch x output_len /
  latency``;
* and, where the engine reports them, ``fetch_ms`` and ``decide_ms`` per decode step, and
  ``kv_read_frac`` (the measured fetch fraction: it replaces the trace's).

``use`` (``fit`` or ``check``) says whether a row is fitted or only predicted (default ``fit``);
``source``, ``certainty``, ``where``, ``url``, ``engine_version`` and ``note`` travel with a row
into the report.

A prediction is the simulator's own cost of those steps (:class:`kvsim.sim.steps.StepCosts`).
:mod:`kvsim.fit.solve` fits the engine's free parameters to the fit rows.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvsim import checks
from kvsim.errors import KvsimError
from kvsim.hw import catalog
from kvsim.hw.costs import costs_for
from kvsim.hw.engine import Engine
from kvsim.policies.spec import PolicySpec, parse
from kvsim.sim.steps import StepCosts

REQUIRED = ("gpu", "model", "policy", "context", "batch")
MEASURED = ("tpot_ms", "ttft_ms", "latency_s", "throughput_tok_s", "fetch_ms", "decide_ms")
# what a measured value can be: no step, kernel or request is faster than a microsecond or
# slower than a day, and no GPU serves a billion tokens a second
MEASURED_RANGE = {**dict.fromkeys(("tpot_ms", "ttft_ms", "fetch_ms", "decide_ms"), (1e-3, 8.64e7)),
                  "latency_s": (1e-6, 86400.0), "throughput_tok_s": (1e-3, 1e9)}
HEADLINE = ("tpot_ms", "throughput_tok_s", "latency_s", "ttft_ms")  # what a row is judged by
SETUP = ("tp", "weight_dtype", "kv_dtype", "engine", "attention", "routing", "weight_only")
ROUTING = ("uniform", "shared")  # ModelSpec.routing
OPTIONAL = ("kv_read_frac", "output_len", *MEASURED, *SETUP)
METADATA = ("use", "source", "certainty", "note", "where", "url", "engine_version")
USES = ("fit", "check")


@dataclass
class Point:
    row: int  # line number in the CSV (header = 1)
    gpu: str
    model: str
    spec: PolicySpec
    context: int
    batch: int
    measured: dict  # of MEASURED: value
    kv_read_frac: float | None = None
    output_len: int = 128
    use: str = "fit"
    meta: dict = field(default_factory=dict)  # source, certainty, note, ...
    tp: int = 1
    weight_dtype: str | None = None  # None: the model's own (bf16)
    kv_dtype: str | None = None
    engine: str = ""  # the serving engine's family (vllm, sglang, trtllm, ...)
    attention: str | None = None  # the engine's decode attention kernel, where the row says
    routing: str = "uniform"  # how the batch's tokens pick their experts (ModelSpec.routing)
    weight_only: bool = False  # fp8 weights at the bf16 GEMM rate (ModelSpec.weight_only)

    @property
    def label(self) -> str:
        return self.spec.label

    @property
    def headline(self) -> str | None:
        """The measured value the row is judged by: its TPOT where measured, else its
        throughput, end-to-end latency or TTFT."""
        return next((k for k in HEADLINE if k in self.measured), None)

    def categories(self) -> list[str]:
        """The regimes the row checks: what it measures (decode, prefill, throughput) and what
        its setup has (tp, fp8, moe, long-context, offload)."""
        out = []
        if "tpot_ms" in self.measured:
            out.append("decode")
        if "ttft_ms" in self.measured:
            out.append("prefill")
        if {"throughput_tok_s", "latency_s"} & set(self.measured):
            out.append("throughput")
        m = catalog.model(self.model)
        out += (["tp"] if self.tp > 1 else []) + (["moe"] if m.experts else [])
        out += ["fp8"] if "fp8" in (self.weight_dtype, self.kv_dtype) else []
        out += ["long-context"] if self.context >= 16384 else []
        out += ["offload"] if self.spec.name != "dense-resident" else []
        return out

def _number(row: int, col: str, text: str, kind=float):
    """A cell as a number > 0, checked as the flag of the same name is (a batch or a context
    beyond what kvsim replay simulates is refused before anything is allocated for it)."""
    from kvsim.replay import MAX_BATCH
    from kvsim.sim.workload import MAX_TOKENS
    name = f"row {row}: {col}"
    if kind is not int:
        lo, hi = MEASURED_RANGE.get(col, (None, None))
        if lo is None:
            return checks.positive(checks.parse(text), name)
        return checks.real(checks.parse(text), name, least=lo, most=hi,
                           what=f"a number in [{lo:g}, {hi:g}]")
    return checks.whole(checks.parse(text), name, 1, {"batch": MAX_BATCH}.get(col, MAX_TOKENS))


def read_points(path: str | Path) -> list[Point]:
    """The CSV's rows, each checked: every problem is one line naming the row and column."""
    import csv

    from kvsim.io import regular_file
    path = regular_file(path, "measured points CSV")
    try:
        with path.open(newline="", encoding="utf-8-sig") as f:
            rows = list(csv.DictReader(row for row in f if not row.lstrip().startswith("#")))
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise KvsimError(f"{path}: not a readable CSV ({e})") from None
    if not rows:
        raise KvsimError(f"{path}: no measured points")
    cols = [c.strip() for c in rows[0].keys() if c is not None]
    missing = [c for c in REQUIRED if c not in cols]
    if not any(c in cols for c in HEADLINE):
        missing.append(f"one of {', '.join(HEADLINE)}")
    if missing:
        raise KvsimError(f"{path}: missing column(s) {', '.join(missing)} (required: "
                         f"{', '.join(REQUIRED)})")
    from kvsim.policies import load_all
    option_names = {f.name for cls in load_all().values() for f in dataclasses.fields(cls.Params)}
    unknown = [c for c in cols if c not in (*REQUIRED, *OPTIONAL, *METADATA)
               and c not in option_names]
    if unknown:
        raise KvsimError(f"{path}: unknown column(s) {', '.join(unknown)}; known: "
                         f"{', '.join((*REQUIRED, *OPTIONAL, *METADATA))} and policy options "
                         f"({', '.join(sorted(option_names))})")
    points = []
    for i, raw in enumerate(rows, start=2):
        if None in raw:
            raise KvsimError(f"{path}: row {i} has more cells than the header")
        r = {k.strip(): (v or "").strip() for k, v in raw.items()}
        for c in REQUIRED:
            if not r[c]:
                raise KvsimError(f"row {i}: {c} is empty")
        try:
            catalog.gpu(r["gpu"])
            catalog.model(r["model"])
            opts = {c: r[c] for c in cols if c in option_names and r[c]}
            specs, unused = parse(r["policy"] + "".join(f":{k}={v}" for k, v in opts.items()))
        except KvsimError as e:
            raise KvsimError(f"row {i}: {e}") from None
        if len(specs) != 1:
            raise KvsimError(f"row {i}: one policy per row, got {r['policy']!r}")
        use = r.get("use") or "fit"
        if use not in USES:
            raise KvsimError(f"row {i}: use {use!r} is not one of {', '.join(USES)}")
        measured = {c: _number(i, c, r[c]) for c in MEASURED if r.get(c)}
        if not any(c in measured for c in HEADLINE):
            raise KvsimError(f"row {i}: no measured value (give one of {', '.join(HEADLINE)})")
        setup = _setup(i, r)
        frac = r.get("kv_read_frac")
        frac = checks.share(checks.parse(frac), f"row {i}: kv_read_frac") if frac else None
        points.append(Point(
            i, r["gpu"], r["model"], specs[0], _number(i, "context", r["context"], int),
            _number(i, "batch", r["batch"], int), measured, frac,
            _number(i, "output_len", r["output_len"], int) if r.get("output_len") else 128,
            use, {k: r[k] for k in METADATA[1:] if r.get(k)}, **setup))
    return points


def _setup(i: int, r: dict) -> dict:
    """The row's ``tp``, dtypes, engine family, attention kernel, MoE routing and whether its
    fp8 weights ran at the bf16 GEMM rate, each checked."""
    from kvsim.hw.engine import ATTENTION
    from kvsim.sim.records import KV_DTYPES, WEIGHT_DTYPES
    out = {}
    if r.get("tp"):
        out["tp"] = _number(i, "tp", r["tp"], int)
    for col, table in (("weight_dtype", WEIGHT_DTYPES), ("kv_dtype", KV_DTYPES),
                       ("attention", dict.fromkeys(ATTENTION)),
                       ("routing", dict.fromkeys(ROUTING))):
        if r.get(col):
            if r[col] not in table:
                raise KvsimError(f"row {i}: {col} {r[col]!r} is not one of {', '.join(table)}")
            out[col] = r[col]
    if r.get("engine"):
        out["engine"] = r["engine"]
    if r.get("weight_only"):
        if r["weight_only"] not in ("true", "false"):
            raise KvsimError(f"row {i}: weight_only {r['weight_only']!r} is not true or false")
        out["weight_only"] = r["weight_only"] == "true"
    return out


class Predictor:
    """Predictions of points under an engine; a policy's analysis of the trace runs once."""

    def __init__(self, trace: str | Path | None, seed: int = 0):
        from kvsim.replay import DEFAULT_TRACE
        self.trace = Path(trace) if trace is not None else DEFAULT_TRACE
        self.seed = seed
        self._costs: dict = {}
        self._models: dict = {}  # (model, dtypes, routing, tp) -> sharded model
        self._on: dict = {}  # id(engine) -> (engine, {(gpu, tp, kernel): costs})

    def cost(self, p: Point):
        """The point's decode cost on its model: the policy's analysis of the trace, with the
        point's measured fetch fraction in place of the trace's when it has one."""
        m = self._model(p)
        key = (p.spec.label, p.kv_read_frac, m.head_dim, m.kv_elem)
        if key not in self._costs:
            from kvsim.policies import make
            from kvsim.replay import analyze, with_kv_read
            from kvsim.replay.policy_source import for_model
            try:
                policy = make(p.spec.name, p.spec.options)
                a = for_model(analyze(self.trace, policy, self.seed), policy, m)
                if p.kv_read_frac is not None:
                    a = with_kv_read(policy, a, p.kv_read_frac, m)
            except KvsimError as e:
                raise KvsimError(f"row {p.row}: {e}") from None
            self._costs[key] = a.cost
        return self._costs[key]

    def _model(self, p: Point):
        """The point's model: its dtypes, routing and tensor-parallel shard."""
        key = (p.model, p.kv_dtype, p.weight_dtype, p.routing, p.weight_only, p.tp)
        m = self._models.get(key)
        if m is None:
            from kvsim.replay import with_dtypes
            m = with_dtypes(catalog.model(p.model), p.kv_dtype, p.weight_dtype)
            if (p.routing, p.weight_only) != (m.routing, m.weight_only):
                m = dataclasses.replace(m, routing=p.routing, weight_only=p.weight_only)
            m = self._models[key] = m.shard(p.tp)
        return m

    def _costs_on(self, p: Point, engine: Engine):
        """The point's GPU costs under ``engine`` (its decode attention where the point names
        one), shared by the points of one GPU, TP size and kernel under the same engine object:
        a fit prices every row under each of its trial engines (the last 64 are kept)."""
        held = self._on.get(id(engine))
        if held is None or held[0] is not engine:
            if len(self._on) >= 64:
                self._on.clear()
            held = self._on[id(engine)] = (engine, {})
        key = (p.gpu, p.tp, p.attention)
        costs = held[1].get(key)
        if costs is None:
            eng = engine
            if p.attention is not None and engine.get("attention") != p.attention:
                eng = engine.with_fields(attention=p.attention)
            costs, _ = costs_for(p.gpu, None, eng)
            costs = held[1][key] = costs.set_tp(p.tp)
        return costs

    def predict(self, p: Point, engine: Engine) -> dict:
        """Predicted ``tpot_ms``, ``fetch_ms`` and ``decide_ms`` (per decode step, all layers),
        and, for the values the row measured, ``ttft_ms``, ``latency_s`` and
        ``throughput_tok_s`` (see the module docstring)."""
        m = self._model(p)
        steps = StepCosts(m, self._costs_on(p, engine), self.cost(p), ahead=False)
        ctx = np.full(p.batch, float(p.context))
        step, _, _ = steps.decode(ctx, p.output_len)
        out = {"tpot_ms": 1e3 * float(step.mean()), "fetch_ms": 0.0, "decide_ms": 0.0}
        if steps.fetches or steps.decide is not None:  # else both are 0 (a dense policy)
            j = np.arange(p.output_len, dtype=float)
            _, decide, link = steps.layer_costs(np.full(p.output_len, p.batch),
                                                float(ctx.sum()) + p.batch * j)
            out.update(fetch_ms=1e3 * m.layers * float(link.mean()),
                       decide_ms=1e3 * m.layers * float(decide.mean()))
        if {"ttft_ms", "latency_s", "throughput_tok_s"} & set(p.measured):
            n = p.batch * p.context
            ttft = steps.step(0, 0.0, float(n), p.batch * float(m.attention_flops(p.context)),
                              p.batch, [float(p.context)] * p.batch)[0]
            rest = float(step[1:].sum())  # the decode steps after the first token
            out["ttft_ms"] = 1e3 * ttft
            out["latency_s"] = ttft + rest
            out["throughput_tok_s"] = p.batch * p.output_len / (ttft + rest)
        return out
