"""``kvsim fit``: measured serving points in, an engine profile out.

A point is one row of a CSV: a configuration (``gpu, model, policy, context, batch`` and the
policy's options as columns, e.g. ``eps, compression, sketch``) and what was measured there:
``tpot_ms`` (required) and, when known, ``fetch_ms`` and ``decide_ms`` per decode step,
``throughput_tok_s``, and ``kv_read_frac`` (the measured fetch fraction: it replaces the trace's).
``output_len`` (default 128) sets the decode steps the TPOT averages over. ``use`` (``fit`` or
``check``) says whether a row is fitted or only predicted (default ``fit``); ``source``,
``certainty`` and ``note`` travel with a row into the report.

A point's prediction is the simulator's own cost of its decode steps
(:meth:`kvsim.sim.steps.StepCosts.decode`): a full batch of ``batch`` requests of ``context``
tokens decoding ``output_len`` tokens together, TPOT = the mean step. :mod:`kvsim.fit.solve` fits
the engine's free parameters to the fit rows.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvsim.errors import KvsimError
from kvsim.hw import catalog
from kvsim.hw.costs import costs_for
from kvsim.hw.engine import Engine
from kvsim.policies.spec import PolicySpec, parse
from kvsim.sim.steps import StepCosts

REQUIRED = ("gpu", "model", "policy", "context", "batch", "tpot_ms")
MEASURED = ("tpot_ms", "fetch_ms", "decide_ms", "throughput_tok_s")
OPTIONAL = ("kv_read_frac", "fetch_ms", "decide_ms", "throughput_tok_s", "output_len")
METADATA = ("use", "source", "certainty", "note")
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
    meta: dict = field(default_factory=dict)  # source, certainty, note

    @property
    def label(self) -> str:
        return self.spec.label


def _number(row: int, col: str, text: str, kind=float):
    try:
        v = kind(float(text)) if kind is int else float(text)
    except ValueError:
        raise KvsimError(f"row {row}: {col} {text!r} is not a number") from None
    if kind is int and float(text) != int(float(text)):
        raise KvsimError(f"row {row}: {col} {text!r} is not a whole number")
    if not math.isfinite(v) or v <= 0:
        raise KvsimError(f"row {row}: {col} must be positive, got {text}")
    return v


def read_points(path: str | Path) -> list[Point]:
    """The CSV's rows, each checked: every problem is one line naming the row and column."""
    import csv
    path = Path(path)
    if not path.is_file():
        raise KvsimError(f"{path}: no such file")
    try:
        with path.open(newline="") as f:
            rows = list(csv.DictReader(row for row in f if not row.lstrip().startswith("#")))
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise KvsimError(f"{path}: not a readable CSV ({e})") from None
    if not rows:
        raise KvsimError(f"{path}: no measured points")
    cols = [c.strip() for c in rows[0].keys() if c is not None]
    missing = [c for c in REQUIRED if c not in cols]
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
        frac = r.get("kv_read_frac")
        frac = float(frac) if frac else None
        if frac is not None and not 0 <= frac <= 1:
            raise KvsimError(f"row {i}: kv_read_frac must be a share in [0, 1], got {frac}")
        points.append(Point(
            i, r["gpu"], r["model"], specs[0], _number(i, "context", r["context"], int),
            _number(i, "batch", r["batch"], int), measured, frac,
            _number(i, "output_len", r["output_len"], int) if r.get("output_len") else 128,
            use, {k: r[k] for k in ("source", "certainty", "note") if r.get(k)}))
    return points


class Predictor:
    """Predictions of points under an engine; a policy's analysis of the trace runs once."""

    def __init__(self, trace: str | Path | None, seed: int = 0):
        from kvsim.replay import DEFAULT_TRACE
        self.trace = Path(trace) if trace is not None else DEFAULT_TRACE
        self.seed = seed
        self._costs: dict = {}

    def cost(self, p: Point):
        """The point's decode cost: the policy's analysis of the trace, with the point's
        measured fetch fraction in place of the trace's when it has one."""
        key = (p.spec.label, p.kv_read_frac)
        if key not in self._costs:
            from kvsim.replay import analyze, with_kv_read
            try:
                a = analyze(self.trace, p.spec, self.seed)
                if p.kv_read_frac is not None:
                    a = with_kv_read(p.spec, a, p.kv_read_frac)
            except KvsimError as e:
                raise KvsimError(f"row {p.row}: {e}") from None
            self._costs[key] = a.cost
        return self._costs[key]

    def predict(self, p: Point, engine: Engine) -> dict:
        """Predicted ``tpot_ms``, ``fetch_ms`` and ``decide_ms`` (per decode step, all layers)
        and ``throughput_tok_s`` of the point."""
        m = catalog.model(p.model)
        costs, _ = costs_for(p.gpu, None, engine)
        steps = StepCosts(m, costs, self.cost(p))
        ctx = np.full(p.batch, float(p.context))
        step, _, _ = steps.decode(ctx, p.output_len)
        j = np.arange(p.output_len, dtype=float)
        _, decide, link = steps.layer_costs(np.full(p.output_len, p.batch),
                                            float(ctx.sum()) + p.batch * j)
        tpot = float(step.mean())
        return {"tpot_ms": 1e3 * tpot, "fetch_ms": 1e3 * m.layers * float(link.mean()),
                "decide_ms": 1e3 * m.layers * float(decide.mean()),
                "throughput_tok_s": p.batch / tpot}
