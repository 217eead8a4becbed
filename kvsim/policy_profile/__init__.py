"""Policy profiles: what a policy does to traffic and error, measured across context lengths,
layers and parameters, and applied at the planned context with a 90% interval.

A profile (``kvsim policy-profile``, :mod:`.build`) is a JSON file holding, per policy setting,
capture set (task), length, question, layer and pass (``question``, ``decode``, ``overall``), the
harness's statistics (:data:`STATS`). Applying it (:meth:`Profile.at`, numpy only):

1. settings: an exact match of the policy's options, or, for a value between two grid values of
   one numeric option (eps, compression) with every other option on the grid, each statistic
   and its interval's ends interpolated linearly in the log of that option between the two
   settings at the planned context; anything else (beyond the grid's range, several options
   off the grid) is an error naming the nearest settings and the command that measures it;
2. layers: each captured layer weighted by the share of the model's depth it stands for;
3. context: each statistic's mean per length fitted by the form a back-test chose, a central
   value at the planned length and a 90% interval (:mod:`.fit`). Every statistic is >= 0, and
   a form that reaches 0 within the range shown is not used, so an extrapolated error or
   violation rate stays positive with an interval of non-zero width. Zero width means exact by
   definition: a statistic measured at one value at every length and question (no fetches by a
   policy that keeps a fixed set, StreamingLLM's held tokens = sink + local, Quest's fetch
   share of 1); a dense policy's zero error is not in a profile (it needs no attention).

Extrapolation is shown up to :data:`MAX_EXTRAPOLATION` times the longest measured prompt (and
down to a quarter of the shortest); beyond, the profile refuses with one line.
"""

from __future__ import annotations

import functools
import json
import math
import operator
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvsim.errors import KvsimError
from kvsim.io import atomic_write
from kvsim.policy_profile import fit

FORMAT = "kvsim-policy-profile"
VERSION = 1
PASSES = ("question", "decode", "overall")
STATS = ("kv_read_frac", "decisions_fetch_frac", "kvhead_steps_fetch_frac",
         "tokens_per_fetch_frac", "violation_rate", "denominator_rel_err_mean",
         "output_rel_err_mean", "output_rel_err_max", "resident_frac", "meta_frac", "held_tokens")
COLUMNS = ["setting", "capture", "target", "context_len", "question", "layer", "weight", "pass",
           *STATS]
TRAFFIC = ("kv_read_frac", "decisions_fetch_frac", "kvhead_steps_fetch_frac",
           "tokens_per_fetch_frac")  # charged per decode step: from the decode pass
LAYER_LEVEL = ("resident_frac", "meta_frac", "held_tokens")  # the same in every pass
UNBOUNDED = ("held_tokens", "denominator_rel_err_mean", "output_rel_err_mean",
             "output_rel_err_max")  # counts and relative errors: >= 0, no ceiling (shares <= 1)
MAX_EXTRAPOLATION = 16.0
DEFAULT = Path(__file__).resolve().parents[2] / "traces" / "policy-profile-smollm2.json"


def setting_key(name: str, params: dict) -> str:
    return name + json.dumps(params, sort_keys=True)


def _split(key: str) -> tuple[str, dict]:
    i = key.index("{")
    return key[:i], json.loads(key[i:])


def _with_new_options(name: str, params: dict) -> dict:
    """``params`` plus the policy's options added since the profile was built, at their
    defaults: a new option's default is the behaviour from before it existed (VerKV's
    ``pass_plan`` = rows, ``eps_output`` = off), so the old rows still describe it."""
    import dataclasses

    from kvsim.policies.registry import resolve
    try:
        cls = resolve(name)
    except KvsimError:
        return params
    new = {f.name: f.default for f in dataclasses.fields(cls.Params)
           if f.name not in params and f.default is not dataclasses.MISSING}
    return {**params, **new}


def save(profile: dict, path: str | os.PathLike, force: bool = False) -> Path:
    return atomic_write(path, lambda f: f.write(json.dumps(profile).encode()), force)


@dataclass
class Applied:
    """A policy's statistics at one planned context, from a profile."""
    stats: dict  # in the harness's shape: headline keys, question/decode/overall groups
    intervals: dict  # "pass.stat" -> (lo, hi)
    forms: dict  # "pass.stat" -> (form, back-test error)
    measured: tuple[int, int]  # shortest and longest measured context
    at: int
    per_layer: dict  # layer -> {pass: {context_len: kv_read_frac}}
    provenance: str
    warnings: list = field(default_factory=list)

    @property
    def extrapolated(self) -> bool:
        return not self.measured[0] <= self.at <= self.measured[1]


class Profile:
    def __init__(self, data: dict, where: str):
        self.where = where
        self.data = data
        if data.get("format") != FORMAT:
            raise KvsimError(f"{where}: not a kvsim policy profile (format != {FORMAT!r})")
        if data.get("version") != VERSION:
            raise KvsimError(f"{where}: policy profile version {data.get('version')!r} is not "
                             f"supported (this kvsim reads {VERSION})")
        try:
            cols = data["columns"]
            if cols != COLUMNS:
                raise KvsimError(f"{where}: columns differ from this kvsim's {COLUMNS}")
            names = data["settings"]
            if not isinstance(names, list) or not all(isinstance(s, str) for s in names) \
                    or len(set(names)) != len(names):
                raise KvsimError(f"{where}: settings must be a list of distinct settings")
            self.settings = [(n, _with_new_options(n, p)) for n, p in map(_split, names)]
            self.captures = data["captures"]
            if not isinstance(self.captures, list) or not all(
                    isinstance(c, dict) and isinstance(c.get("task"), str)
                    for c in self.captures):
                raise KvsimError(f"{where}: captures must be a list of objects naming a task")
            rows = data["rows"]
            for r in rows:
                _check_row(r, len(self.settings), len(self.captures), where)
            tasks = sorted({c["task"] for c in self.captures})
            self.tasks = tasks
            targets = sorted({int(r[2]) for r in rows})
            self.targets = targets
            # context length per target: the mean over capture sets
            ctx: dict[int, list[int]] = {}
            for r in rows:
                ctx.setdefault(int(r[2]), []).append(int(r[3]))
            self.n = np.array([np.mean(ctx[t]) for t in targets])
            # per setting: (task, target) -> question unit -> pass -> stat -> [(layer, w, v)]
            self.cells: dict[int, dict] = {}
            for r in rows:
                si, ci, tgt, _, q, layer, w, ps = r[:8]
                cell = self.cells.setdefault(int(si), {}).setdefault(
                    (self.captures[int(ci)]["task"], int(tgt)), {}).setdefault((int(ci), int(q)),
                                                                             {})
                cell.setdefault(ps, []).append((int(layer), float(w), r[8:]))
        except KvsimError:
            raise
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise KvsimError(f"{where}: malformed policy profile ({type(e).__name__}: {e})") \
                from None
        if not self.cells:
            raise KvsimError(f"{where}: the profile holds no rows")
        empty = [s for i, s in enumerate(data["settings"]) if i not in self.cells]
        if empty:
            raise KvsimError(f"{where}: setting {empty[0][:80]} has no rows ({len(empty)} of "
                             f"{len(self.settings)} settings have none)")

    def of_tasks(self, tasks) -> Profile:
        """This profile with the capture sets of ``tasks`` alone (to set it beside another
        measurement of the same prompts)."""
        keep = {old: new for new, old in enumerate(
            i for i, c in enumerate(self.captures) if c["task"] in set(tasks))}
        if not keep:
            raise KvsimError(f"{self.where}: no capture set of task(s) {', '.join(tasks)}")
        rows = [[r[0], keep[int(r[1])], *r[2:]] for r in self.data["rows"] if int(r[1]) in keep]
        return Profile(dict(self.data, captures=[self.captures[i] for i in keep], rows=rows),
                       f"{self.where} ({', '.join(sorted(tasks))} only)")

    # ------------------------------------------------------------------ settings

    def has(self, name: str) -> bool:
        return any(n == name for n, _ in self.settings)

    def describe_grid(self, name: str) -> str:
        vals: dict[str, set] = {}
        for n, p in self.settings:
            if n == name:
                for k, v in p.items():
                    vals.setdefault(k, set()).add(v)
        order = lambda v: (0, v, "") if isinstance(v, (int, float)) else (1, 0, str(v))  # noqa: E731
        varied = {k: sorted(v, key=order) for k, v in vals.items() if len(v) > 1}
        fixed = {k: next(iter(v)) for k, v in vals.items() if len(v) == 1}
        return (", ".join(f"{k} {'/'.join(f'{x:g}' if isinstance(x, float) else str(x) for x in v)}"
                          for k, v in varied.items()) +
                "; " + ", ".join(f"{k}={v}" for k, v in fixed.items() if v is not None))

    def _weights(self, name: str, params: dict) -> dict[int, float]:
        """Setting index -> weight: the exact setting, or the two grid settings around it (see
        :meth:`between`)."""
        return self.between(name, params)[0]

    def between(self, name: str, params: dict) -> tuple[dict[int, float], str | None]:
        """(setting index -> weight, how): the exact setting (how None), or the two nearest grid
        settings that differ from ``params`` only in one numeric option (eps, compression) on
        either side of its value, weighted linearly in the log of the option. A setting that
        differs from every grid setting in more than one option, in a value that is not a
        number, or beyond the grid's range is an error naming the nearest settings and the
        command that measures it."""
        same = [(i, p) for i, (n, p) in enumerate(self.settings) if n == name]
        if not same:
            raise KvsimError(f"{self.where} has no {name} settings")
        params = _with_new_options(name, params)  # a query written before an option existed
        exact = [i for i, p in same if p == params]
        if exact:
            return {exact[0]: 1.0}, None
        diff = {i: [k for k in params if p.get(k) != params[k]] for i, p in same}
        fewest = min(len(d) for d in diff.values())
        keys = {diff[i][0] for i in diff if len(diff[i]) == 1}
        for key in sorted(keys):
            want = params[key]
            line = sorted((p[key], i) for i, p in same if diff[i] == [key] and _number(p[key]))
            if not _number(want) or len(line) < 2 or not line[0][0] < want < line[-1][0]:
                continue
            (lo, i_lo), (hi, i_hi) = max(x for x in line if x[0] < want), \
                min(x for x in line if x[0] > want)
            t = (math.log(want) - math.log(lo)) / (math.log(hi) - math.log(lo)) if lo > 0 \
                else (want - lo) / (hi - lo)
            return {i_lo: 1 - t, i_hi: t}, (f"interpolated between {key} {lo:g} and {hi:g} "
                                            f"(linear in log {key}; weight {t:.2f} on {hi:g})")
        raise KvsimError(self._outside(name, params, same, diff, fewest))

    def _outside(self, name: str, params: dict, same: list, diff: dict, fewest: int) -> str:
        """One line: why ``params`` is off the grid, the nearest settings, how to measure it."""
        from kvsim.policies.spec import flag

        def dist(i: int) -> tuple:
            p = dict(same)[i]
            return (len(diff[i]), sum(abs(math.log(p[k] / params[k])) if _number(p[k])
                                      and _number(params[k]) and p[k] > 0 and params[k] > 0
                                      else 1.0 for k in diff[i]))
        order = sorted(diff, key=dist)
        shown = list(dict.fromkeys(k for i in order[:2] for k in diff[i]))
        near = " or ".join(", ".join(f"{k} {_fmt(dict(same)[i][k])}" for k in shown)
                           for i in order[:2])
        off = ", ".join(f"{k} {_fmt(params[k])}" for k in diff[order[0]])
        varied = [k for k in params if len({p.get(k) for _, p in same}) > 1 or k in shown]
        if fewest > 1:
            why = (f"differs from every setting in the profile in {fewest} options (it "
                   f"interpolates along one option at a time)")
        else:
            key = diff[order[0]][0]
            grid = sorted({dict(same)[i][key] for i in diff if diff[i] == [key]}, key=str)
            nums = sorted(g for g in grid if _number(g))
            rest = ", ".join(f"{k} {_fmt(params[k])}" for k in varied if k != key)
            why = (f"is outside the grid's {key} {_fmt(nums[0])}..{_fmt(nums[-1])}"
                   if _number(params[key]) and len(nums) > 1 else
                   f"is not on the grid ({key} {'/'.join(map(_fmt, grid))})") + \
                (f" at {rest}" if rest else "")
        opts = " ".join(f"{flag(k)} {_fmt(params[k])}" for k in
                        dict.fromkeys([*varied, "sink", "local"])
                        if k in params and params[k] is not None)
        caps = "traces/captures/*.npz" if Path(self.where).resolve() == DEFAULT else \
            "CAPTURE_SETS"  # the shipped profile's capture sets, or the user's
        return (f"{name} {off} {why}; nearest in {Path(self.where).name}: {near}; measure it "
                f"with kvsim policy-profile {caps} --policy {name} {opts} --out "
                f"my-profile.json, then --policy-profile my-profile.json (or --policy-profile "
                f"none for one trace's statistics)")

    # ------------------------------------------------------------------ values

    def _units(self, weights: dict[int, float], ps: str, stat: str) -> list[list[np.ndarray]]:
        """units[task][j]: the layer-weighted statistic of each question at length j."""
        s = STATS.index(stat)
        out = []
        for task in self.tasks:
            per_len = []
            for tgt in self.targets:
                acc = None
                for si, wt in weights.items():
                    cell = self.cells[si].get((task, tgt), {})
                    vals = []
                    for unit in sorted(cell):
                        rows = cell[unit].get(ps, [])
                        got = [(w, r[s]) for _, w, r in rows if r[s] is not None]
                        vals.append(sum(w * v for w, v in got) / sum(w for w, _ in got)
                                    if got else np.nan)
                    v = wt * np.array(vals, dtype=float)
                    acc = v if acc is None else acc + v
                acc = acc[np.isfinite(acc)] if acc is not None else np.array([])
                if not acc.size:
                    break
                per_len.append(acc)
            if len(per_len) == len(self.targets):
                out.append(per_len)
        return out

    def per_layer(self, weights: dict[int, float], stat: str = "kv_read_frac") -> dict:
        """layer -> pass -> context length -> the statistic's mean over questions."""
        s = STATS.index(stat)
        acc: dict[tuple, dict] = {}  # (layer, pass, target) -> unit -> interpolated value
        for si, wt in weights.items():
            for (task, tgt), cell in self.cells[si].items():
                for unit, rows in cell.items():
                    for ps in PASSES:
                        for layer, _, r in rows.get(ps, []):
                            if r[s] is not None:
                                d = acc.setdefault((layer, ps, tgt), {})
                                d[(task, unit)] = d.get((task, unit), 0.0) + wt * r[s]
        n_at = dict(zip(self.targets, self.n))
        out: dict[int, dict] = {}
        for (layer, ps, tgt), units in sorted(acc.items()):
            out.setdefault(layer, {}).setdefault(ps, {})[int(round(n_at[tgt]))] = \
                float(np.mean(list(units.values())))
        return out

    def span(self) -> tuple[float, float]:
        """The context lengths shown: a quarter of the shortest measured prompt to
        :data:`MAX_EXTRAPOLATION` times the longest."""
        return self.targets[0] / 4, self.targets[-1] * MAX_EXTRAPOLATION

    def check_context(self, n_tokens: int) -> None:
        """The range shown: a quarter of the shortest measured prompt to
        :data:`MAX_EXTRAPOLATION` times the longest."""
        lo_ok, hi_ok = self.span()
        if not lo_ok <= n_tokens <= hi_ok:
            raise KvsimError(f"--context {n_tokens}: the policy profile measured prompts of "
                             f"{self.targets[0]}..{self.targets[-1]} tokens and extrapolates to "
                             f"{lo_ok:.0f}..{hi_ok:.0f} at most; give --kv-read-frac, or "
                             f"--policy-profile none for the trace's own statistics")

    def at(self, name: str, params: dict, n_tokens: int, head_dim: int | None = None) -> Applied:
        """``name`` with ``params`` at ``n_tokens`` of context."""
        self.check_context(n_tokens)
        weights, how = self.between(name, params)
        hd = head_dim or int(self.captures[0].get("head_dim") or 64)
        ends = [_at(self, name, json.dumps([[i, 1.0]]), int(n_tokens), hd) for i in weights]
        if how is None:
            return ends[0]
        (lo, hi), t = ends, list(weights.values())[1]
        return Applied(_mix(lo.stats, hi.stats, t), _mix(lo.intervals, hi.intervals, t),
                       {k: (f if f == hi.forms[k][0] else f"{f}|{hi.forms[k][0]}",
                            max((e for e in (e, hi.forms[k][1]) if e is not None), default=None))
                        for k, (f, e) in lo.forms.items() if k in hi.forms},
                       lo.measured, lo.at, _mix(lo.per_layer, hi.per_layer, t),
                       f"{lo.provenance}; {name} {how}: each statistic and its interval's ends",
                       lo.warnings + [f"{name} statistics {how}"])

    def sample_error(self, key: str) -> float:
        """The largest relative error of the capture sets' layer samples against every layer,
        as measured when they were chosen (0 where not measured, or every layer is kept)."""
        return max([float(((c.get("layer_sample") or {}).get("max_rel_error") or {})
                          .get(key, 0.0)) for c in self.captures] + [0.0])

    def summary(self) -> str:
        c = self.captures
        n_layers = sorted({len(x["layers"]) for x in c})
        total = c[0].get("total_layers")
        q = sum(ln["questions"] for x in c for ln in x["lengths"])
        return (f"{len(c)} capture sets ({', '.join(self.tasks)}; {q} questions) of "
                f"{c[0].get('model') or '?'} at {self.n[0]:.0f}..{self.n[-1]:.0f} context tokens, "
                f"{'/'.join(map(str, n_layers))} of {total} layers weighted to the whole depth")


@functools.lru_cache(maxsize=512)
def _at(prof: Profile, name: str, weights_json: str, n: int, head_dim: int) -> Applied:
    weights = {int(k): float(v) for k, v in json.loads(weights_json)}
    parts: dict[str, dict] = {ps: {} for ps in PASSES}
    intervals, forms = {}, {}
    for ps in PASSES:
        for stat in STATS:
            if stat in LAYER_LEVEL and ps != "overall":
                continue
            units = prof._units(weights, ps, stat)
            if not units:
                continue
            bounds = (0.0, math.inf) if stat in UNBOUNDED else (0.0, 1.0)
            e = fit.estimate(prof.n, units, n, bounds, span=prof.span())
            parts[ps][stat] = e.value
            err = prof.sample_error(f"{ps}.{stat}")
            intervals[f"{ps}.{stat}"] = (max(bounds[0], e.lo * (1 - err)),
                                         min(bounds[1], e.hi * (1 + err)))
            forms[f"{ps}.{stat}"] = (e.form, e.backtest_error)
    overall, decode = parts["overall"], parts["decode"] or parts["question"]
    stats = dict(overall) | {k: decode[k] for k in TRAFFIC if k in decode}
    stats |= {"context_tokens": n, "head_dim": head_dim,
              "traffic_basis": "decode steps" if parts["decode"] else "question pass",
              "layers": len({la for x in prof.captures for la in x["layers"]})}
    for ps in PASSES:
        if parts[ps]:
            stats[ps] = {k: v for k, v in parts[ps].items() if k not in LAYER_LEVEL}
    mlo, mhi = int(round(prof.n[0])), int(round(prof.n[-1]))
    where = ("interpolated" if mlo <= n <= mhi else "extrapolated")
    kv = forms.get("decode.kv_read_frac") or forms.get("question.kv_read_frac")
    prov = (f"policy profile {Path(prof.where).name}: {prof.summary()}; measured at "
            f"{mlo}..{mhi} tokens, {where} to {n}"
            + (f" (KV read: form {kv[0]}, chosen by back-test)" if kv else "")
            + "; 90% interval: bootstrap over tasks and questions, widened by close forms"
            + (f" and by the layer sample's measured error against every layer (KV read "
               f"+-{100 * prof.sample_error('decode.kv_read_frac'):.0f}%)"
               if prof.sample_error("decode.kv_read_frac") else ""))
    warnings = []
    if where == "extrapolated":
        warnings.append(f"policy statistics extrapolated from {mlo}..{mhi} measured tokens to "
                        f"{n} ({n / mhi:.1f}x the longest)" if n > mhi else
                        f"policy statistics extrapolated below the shortest measured length "
                        f"({mlo}) to {n}")
    return Applied(stats, intervals, forms, (mlo, mhi), n, prof.per_layer(weights), prov,
                   warnings)


NULLABLE = ("violation_rate",)  # a policy with no certificate has no violations to count


def _check_row(r, n_settings: int, n_captures: int, where: str) -> None:
    """A row's types, and each statistic's range: shares in [0, 1], counts and relative errors
    >= 0 (only :data:`NULLABLE` may be null); lengths and layer weights positive."""
    ok = isinstance(r, list) and len(r) == len(COLUMNS) \
        and all(type(x) is int for x in r[:6]) and 0 <= r[0] < n_settings \
        and 0 <= r[1] < n_captures and type(r[6]) in _NUMBERS and r[7] in PASSES \
        and all(v is None or (type(v) in _NUMBERS and math.isfinite(v)) for v in r[8:])
    if not ok:
        raise KvsimError(f"{where}: a row does not match the profile's columns: {str(r)[:120]}")
    if not (r[2] > 0 and r[3] > 0 and r[4] >= 0 and r[5] >= 0 and 0 < r[6] <= 1e6):
        raise KvsimError(f"{where}: a row's target, context length and layer weight must be "
                         f"positive: {str(r)[:120]}")
    stats = r[8:]  # (a copy) the ranges at C speed; the loop below only words a refusal
    for i in _NULLABLE_AT:
        if stats[i] is None:
            stats[i] = 0.0
    if None not in stats and min(stats) >= 0 and max(_SHARES(stats)) <= 1 and max(stats) <= 1e9:
        return
    for stat, v in zip(STATS, r[8:]):
        if v is None and stat in NULLABLE:
            continue
        if v is None or v < 0 or (stat not in UNBOUNDED and v > 1) or v > 1e9:
            what = "a number >= 0" if stat in UNBOUNDED else "a share in [0, 1]"
            raise KvsimError(f"{where}: {stat} must be {what}, got {v!r} (setting {r[0]}, "
                             f"capture {r[1]}, {r[3]} tokens, layer {r[5]}, {r[7]} pass)")


_NUMBERS = (int, float)  # (by type: not bool)
_NULLABLE_AT = [STATS.index(s) for s in NULLABLE]
_SHARES = operator.itemgetter(*(i for i, s in enumerate(STATS) if s not in UNBOUNDED))


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _fmt(v) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def _mix(a, b, t: float):
    """``a`` and ``b`` (numbers, or dicts and tuples of them) weighted (1 - t, t); what is not a
    number (a form, a basis) is ``a``'s, and numbers equal in both stay as they are."""
    if isinstance(a, dict):
        return {k: _mix(v, b[k], t) if k in b else v for k, v in a.items()}
    if isinstance(a, (tuple, list)):
        return type(a)(_mix(x, y, t) for x, y in zip(a, b))
    if _number(a) and _number(b) and a != b:
        return (1 - t) * a + t * b
    return a


@functools.lru_cache(maxsize=8)
def _load(path: str, mtime: float) -> Profile:
    from kvsim.io import read_json
    return Profile(read_json(path, "kvsim policy profile"), path)


def load(path: str | os.PathLike) -> Profile:
    from kvsim.io import regular_file
    p = regular_file(path, "policy profile")
    return _load(str(p.resolve()), p.stat().st_mtime)
