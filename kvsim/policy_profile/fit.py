"""A statistic's dependence on context length: candidate forms, the back-test that picks one, and
a bootstrap interval at the planned length.

Each form is a straight line in a transformed space, fitted by least squares to the statistic's
mean at each measured length (``x = ln n``): ``power`` (ln y on x), ``logit`` (logit y on x),
``loglin`` (y on x), ``inverse`` (y on 1/n, for shares of a fixed number of tokens), ``const``.
The back-test fits on the shorter lengths and predicts the longer ones (every split that leaves
at least two lengths to fit); the form with the smallest mean error is chosen, the simpler one on
a tie. The interval resamples tasks, then questions within each task and length (a hierarchical
bootstrap), refits the chosen form and takes the 5th and 95th percentiles of the prediction; it
is widened to the predictions of every other form whose back-test error is within 2x of the
chosen one's (the doubt about the form, which matters as much as the points beyond the data).

Every statistic is bounded below (shares, rates and errors by 0): a form whose prediction falls
to that floor anywhere in the range of lengths a profile shows (``span``) is not chosen and does
not widen the interval (a line crossing zero is an artefact of the form, not a measurement), so
an extrapolation stays above the floor, with an interval of non-zero width, and one form serves
every planned length. A statistic measured at one value at every length and question
(StreamingLLM's held tokens = sink + local, no fetches by a policy that never fetches, an error
of 0 where every token is kept) is set by the policy's parameters: it is reported as that value
with a zero-width interval, exact by definition.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FORMS = ("const", "inverse", "loglin", "power", "logit")  # simplest first (ties go left)
FLOOR = 1e-4  # errors of shares below this are absolute, not relative
CLOSE = 2.0  # forms within this factor of the best back-test error widen the interval
BOOT = 1000


def _transform(form: str, y: np.ndarray) -> np.ndarray | None:
    if form == "power":
        return np.log(y) if (y > 0).all() else None
    if form == "logit":
        return np.log(y / (1 - y)) if ((y > 0) & (y < 1)).all() else None
    return y


def _inverse(form: str, t: np.ndarray) -> np.ndarray:
    if form == "power":
        return np.exp(t)
    if form == "logit":
        return 1 / (1 + np.exp(-t))
    return t


def _design(form: str, n: np.ndarray) -> np.ndarray:
    n = np.asarray(n, dtype=float)
    if form == "const":
        return np.ones((n.size, 1))
    x = 1 / n if form == "inverse" else np.log(n)
    return np.stack([np.ones(n.size), x], 1)


def predict(form: str, n: np.ndarray, y: np.ndarray, at) -> np.ndarray | None:
    """Predictions at ``at`` of ``form`` fitted to means ``y`` (..., J) at lengths ``n`` (J,);
    None where the form cannot take these values (a share of 0 for ``power``)."""
    t = _transform(form, np.asarray(y, dtype=float))
    if t is None:
        return None
    coef = np.linalg.pinv(_design(form, n)) @ np.moveaxis(t, -1, 0).reshape(len(n), -1)
    pred = _design(form, np.atleast_1d(at)) @ coef  # (len(at), batch)
    out = _inverse(form, pred).T.reshape(t.shape[:-1] + (np.atleast_1d(at).size,))
    return out


def error(pred: float, meas: float) -> float:
    return abs(pred - meas) / max(abs(meas), FLOOR)


def backtest(n: np.ndarray, y: np.ndarray) -> dict[str, list[tuple[int, int, float, float]]]:
    """Per form: (lengths fitted, length predicted, predicted, measured) of every split that
    fits on at least two lengths and predicts a longer one."""
    out: dict[str, list] = {f: [] for f in FORMS}
    for k in range(2, len(n)):
        for form in FORMS:
            p = predict(form, n[:k], y[:k], n[k:])
            if p is None:
                out[form] = None
                continue
            if out[form] is not None:
                out[form] += [(k, int(n[k + i]), float(p[i]), float(y[k + i]))
                              for i in range(len(n) - k)]
    return {f: v for f, v in out.items() if v is not None}


def usable(form: str, n: np.ndarray, y: np.ndarray, at=None, floor: float | None = None) -> bool:
    """Whether ``form`` can take every mean ``y`` and, given lengths ``at`` and ``floor``,
    predicts values above the floor at all of them."""
    p = predict(form, n, y, np.atleast_1d(at if at is not None else n[-1]))
    return p is not None and (floor is None or at is None or bool((p > floor).all()))


def choose(n: np.ndarray, y: np.ndarray, at=None,
           floor: float | None = None) -> tuple[str, dict[str, float]]:
    """The form with the smallest mean back-test error (and every form's error) among those
    that take every measured mean and (given lengths ``at`` and ``floor``) stay above the floor
    there; with fewer than three lengths there is no back-test and the form is ``loglin`` (or
    ``const`` for one length), ``power`` or ``const`` where ``loglin`` reaches the floor."""
    if len(n) < 3:
        first = "const" if len(n) == 1 else "loglin"
        return next(f for f in (first, "power", "const") if usable(f, n, y, at, floor)), {}
    bt = backtest(n, y)
    errs = {f: float(np.mean([error(p, m) for _, _, p, m in v])) for f, v in bt.items() if v}
    ok = {f: e for f, e in errs.items() if usable(f, n, y, at, floor)} or {"const": 0.0}
    best = min(ok, key=lambda f: (round(ok[f], 12), FORMS.index(f)))
    return best, errs


def _doublings(n: np.ndarray) -> float:
    """The mean distance, in doublings of length, over which :func:`backtest` predicts (from
    the longest length a split fits to each longer one)."""
    d = [np.log2(n[j] / n[k - 1]) for k in range(2, len(n)) for j in range(k, len(n))]
    return float(np.mean(d)) if d else 1.0


def bootstrap_means(units: list[list[np.ndarray]], n_lengths: int, seed: int = 0) -> np.ndarray:
    """(BOOT, J) means per length of hierarchical resamples: tasks with replacement, then each
    slot's questions with replacement at every length."""
    rng = np.random.default_rng(seed)
    T = len(units)
    pick = rng.integers(0, T, (BOOT, T))  # the task in each slot of each resample
    sums = np.zeros((BOOT, n_lengths))
    counts = np.zeros((BOOT, n_lengths))
    for slot in range(T):
        for t in range(T):
            chosen = pick[:, slot] == t
            for j in range(n_lengths):
                v = np.asarray(units[t][j], dtype=float)
                draw = v[rng.integers(0, v.size, (BOOT, v.size))].sum(1)
                sums[chosen, j] += draw[chosen]
                counts[chosen, j] += v.size
    return sums / counts


@dataclass
class Estimate:
    value: float
    lo: float
    hi: float
    form: str
    backtest_error: float | None  # mean relative error of the chosen form in the back-test
    forms_close: list[str]  # other forms that widened the interval


def estimate(n: np.ndarray, units: list[list[np.ndarray]], at: float, bounds=(0.0, 1.0),
             seed: int = 0, span: tuple[float, float] | None = None) -> Estimate:
    """The statistic at ``at`` tokens from ``units[task][j]`` (values of that task's questions at
    length ``n[j]``), with its 90% interval; the chosen form stays above ``bounds[0]`` over
    ``span`` (the lengths the profile shows) and at ``at``."""
    n = np.asarray(n, dtype=float)
    y = np.array([np.mean(np.concatenate([t[j] for t in units])) for j in range(len(n))])
    every = np.concatenate([np.asarray(v, dtype=float) for t in units for v in t])
    if every.size and np.ptp(every) == 0:  # one value everywhere: set by the parameters, exact
        v = float(every[0])
        return Estimate(v, v, v, "exact", 0.0, [])
    check = [at, *(span or ())]  # where a form must stay above the floor
    form, errs = choose(n, y, check, bounds[0])
    value = float(predict(form, n, y, [at])[0])
    boot = bootstrap_means(units, len(n), seed)
    pb = predict(form, n, boot, [at])
    if pb is None:  # a resample the form cannot take (a zero share): use the values it can
        ok = np.array([predict(form, n, boot[b:b + 1], [at]) is not None for b in range(BOOT)])
        pb = predict(form, n, boot[ok], [at]) if ok.any() else np.array([[value]])
    # with few tasks the bootstrap under-states their spread (variance (T-1)/T of the truth's):
    # stretch the resampled predictions about the central value by sqrt(T/(T-1))
    T = len(units)
    stretch = np.sqrt(T / (T - 1)) if T > 1 else 1.0
    lo, hi = np.percentile(value + (pb[:, 0] - value) * stretch, [5, 95])
    close = [f for f, e in errs.items() if f != form and e <= CLOSE * max(errs.get(form, 0), 1e-12)
             and usable(f, n, y, check, bounds[0])]  # one reaching the floor is no doubt
    for f in close:
        p = float(predict(f, n, y, [at])[0])
        lo, hi = min(lo, p), max(hi, p)
    # beyond the data the form itself may be wrong: widen by its back-test error per doubling
    # of length it predicted over, times the doublings from the longest measured length
    widen = errs.get(form, 0.0) / _doublings(n) * max(np.log2(at / n[-1]), 0.0) if errs else 0.0
    lo, hi = lo * (1 - widen), hi * (1 + widen)
    clip = lambda v: float(np.clip(v, *bounds))  # noqa: E731
    return Estimate(clip(value), clip(min(lo, value)), clip(max(hi, value)), form,
                    errs.get(form), close)
