"""Per-request metrics accumulated as a run goes, in memory that does not grow with the workload.

A finished request hands over its TTFT, TPOT, end-to-end latency and queue wait and is forgotten.
Each metric keeps its exact values up to :data:`EXACT` requests, so shorter runs report numpy's
own percentiles; beyond that the values fold into a log-bucket sketch (DDSketch, Masson et al.,
VLDB 2019): bucket ``i`` holds ``(g^(i-1), g^i]`` with ``g = (1 + a) / (1 - a)`` and answers
``2 g^i / (g + 1)``, within ``a`` (:data:`REL_ERR`) relative of any value in it. A percentile
interpolates the two order statistics around its rank as numpy does, each within ``a``, so it is
within ``a`` of numpy's figure. Values below :data:`TINY` seconds count as 0 (absolute error
below ``TINY``). Means and counts are exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

EXACT = 1 << 17  # values kept exactly per metric (1 MiB each) before the sketch takes over
REL_ERR = 0.005
TINY, HUGE = 1e-9, 1e12  # seconds: below counts as 0; above, the top bucket (31,700 years)
_G = (1 + REL_ERR) / (1 - REL_ERR)
_LOG_G = math.log(_G)
_LO = math.floor(math.log(TINY) / _LOG_G)
_NB = math.ceil(math.log(HUGE) / _LOG_G) - _LO + 1


class Quantiles:
    """Count, mean and percentiles of a stream of non-negative values (seconds)."""

    def __init__(self):
        self.buf = np.empty(EXACT)
        self.k = 0  # values in ``buf``
        self.buckets: np.ndarray | None = None  # the sketch, once more than EXACT values came
        self.zeros = 0
        self._n = 0
        self._total = 0.0
        self.pending: list[float] = []  # values given one at a time, added in blocks

    @property
    def n(self) -> int:
        self._flush()
        return self._n

    @property
    def total(self) -> float:
        self._flush()
        return self._total

    def __getstate__(self):  # pickled (a piece's result, kvsim.sim.segments): the values held
        self._flush()
        state = self.__dict__.copy()
        state["buf"] = self.buf[:self.k].copy()
        return state

    def __setstate__(self, state):  # the buffer widens to EXACT if values are added
        self.__dict__.update(state)

    def fold(self) -> None:
        """Into the sketch now (a part of a run whose whole will be sketched); the buffer goes
        (it widens again if values are added)."""
        self._flush()
        if self.k:
            self._fold()
        elif self.buckets is None:
            self.buckets = np.zeros(_NB, np.int64)
        self.buf = np.empty(0)

    @property
    def exact(self) -> bool:
        self._flush()
        return self.buckets is None

    def add(self, values: np.ndarray) -> None:
        m = len(values)
        if not m:
            return
        self._n += m
        self._total += float(values.sum())
        if self.k + m > EXACT:
            self._fold()
        if m > EXACT:
            self._fold_values(values)
            return
        if len(self.buf) < EXACT:
            self._widen()
        self.buf[self.k:self.k + m] = values
        self.k += m

    def add_one(self, x: float) -> None:
        self.add_many([x])

    def add_many(self, values: list[float]) -> None:
        """Values given a few at a time: added in blocks of 1024, the same blocks however they
        come."""
        p = self.pending
        p += values
        while len(p) >= 1024:
            self.add(np.array(p[:1024]))
            del p[:1024]

    def _flush(self) -> None:
        if self.pending:
            values, self.pending = np.array(self.pending), []
            self.add(values)

    def _widen(self) -> None:
        buf = np.empty(EXACT)
        buf[:self.k] = self.buf[:self.k]
        self.buf = buf

    def _fold_values(self, v: np.ndarray) -> None:
        if self.buckets is None:
            self.buckets = np.zeros(_NB, np.int64)
        small = v < TINY
        self.zeros += int(small.sum())
        i = np.ceil(np.log(np.minimum(v[~small], HUGE)) / _LOG_G).astype(np.int64) - _LO
        self.buckets += np.bincount(np.clip(i, 0, _NB - 1), minlength=_NB)

    def _fold(self) -> None:
        self._fold_values(self.buf[:self.k])
        self.k = 0

    def merge(self, other: Quantiles) -> None:
        other._flush()
        if other.buckets is not None:
            if self.buckets is None:
                self.buckets = np.zeros(_NB, np.int64)
            self.buckets += other.buckets
            self.zeros += other.zeros
        n, total = self.n + other.n, self.total + other.total
        self.add(other.buf[:other.k])
        self._n, self._total = n, total

    def mean(self) -> float:
        return self.total / self.n if self.n else float("nan")

    def percentile(self, q: float) -> float:
        if not self.n:  # (flushed)
            return float("nan")
        if self.buckets is None:
            return float(np.percentile(self.buf[:self.k], q))
        if self.k:
            self._fold()
        h = q / 100 * (self.n - 1)
        lo, hi = math.floor(h), math.ceil(h)
        return (1 - (h - lo)) * self._rank(lo) + (h - lo) * self._rank(hi)

    def _rank(self, r: int) -> float:
        """The sketch's answer for the ``r``-th smallest value (0-based)."""
        if r < self.zeros:
            return 0.0
        i = int(np.searchsorted(np.cumsum(self.buckets), r - self.zeros, side="right"))
        return 2 * _G ** (i + _LO) / (_G + 1)

    def method(self) -> str:
        return "exact" if self.exact else \
            f"log-bucket sketch, within {REL_ERR:.1%} of the exact percentile"


class Gaps:
    """The gaps between consecutive tokens of every sequence (inter-token latency, ITL), in
    the sketch of :class:`Quantiles` (within :data:`REL_ERR` of each value) with weights: a
    step adds its duration once for each sequence that decodes in it, so a run's percentiles
    are over tokens, not steps. A run of decode steps whose durations grow linearly
    (:meth:`add_linear`) is added in closed form, bucket by bucket. Means and counts are
    exact."""

    def __init__(self):
        self.buckets = np.zeros(_NB, np.float64)  # token counts (floats: exact below 2^53)
        self.n = 0
        self.total = 0.0

    @staticmethod
    def _bucket(x: float) -> int:
        if x < TINY:
            return -1
        i = math.ceil(math.log(x if x < HUGE else HUGE) / _LOG_G) - _LO
        return 0 if i < 0 else _NB - 1 if i >= _NB else i

    def add(self, seconds: float, tokens: int) -> None:
        """``tokens`` gaps of ``seconds`` each."""
        if tokens <= 0:
            return
        i = self._bucket(seconds)
        if i >= 0:
            self.buckets[i] += tokens
        self.n += tokens
        self.total += seconds * tokens

    def add_steps(self, seconds: np.ndarray, tokens) -> None:
        """Steps of ``seconds`` each, ``tokens`` gaps each (an array or one count)."""
        w = np.broadcast_to(np.asarray(tokens, float), seconds.shape)
        keep = (w > 0) & (seconds >= TINY)
        i = np.ceil(np.log(np.minimum(seconds[keep], HUGE)) / _LOG_G).astype(np.int64) - _LO
        self.buckets += np.bincount(np.clip(i, 0, _NB - 1), weights=w[keep], minlength=_NB)
        self.n += int(w.sum())
        self.total += float((seconds * w).sum())

    def add_linear(self, u: float, v: float, k: int, tokens: int) -> None:
        """``k`` steps of ``u + v j`` seconds (j = 0 .. k - 1, ``v`` >= 0), ``tokens`` gaps
        each: the steps counted into each bucket between the first's and the last's."""
        if k <= 0 or tokens <= 0:
            return
        lo, hi = self._bucket(u), self._bucket(u + v * (k - 1))
        if lo == hi or v <= 0:
            self.add(u + v * (k - 1) / 2, k * tokens)  # (the mean, in one bucket)
            return
        done = 0  # steps counted so far: those at or below bucket i's upper edge
        for i in range(max(lo, 0), hi + 1):
            edge = _G ** (i + _LO)
            upto = k if i == hi else min(k, max(done, math.floor((edge - u) / v) + 1))
            if upto > done:
                self.buckets[i] += (upto - done) * tokens
            done = upto
        self.n += k * tokens
        self.total += tokens * (k * u + v * k * (k - 1) / 2)

    def merge(self, other: Gaps) -> None:
        self.buckets += other.buckets
        self.n += other.n
        self.total += other.total

    def mean(self) -> float:
        return self.total / self.n if self.n else float("nan")

    def percentile(self, q: float) -> float:
        """As :meth:`Quantiles.percentile`, over the gaps (gaps below TINY count as 0)."""
        if not self.n:
            return float("nan")
        zeros = self.n - float(self.buckets.sum())
        h = q / 100 * (self.n - 1)
        lo, hi = math.floor(h), math.ceil(h)
        cum = np.cumsum(self.buckets)

        def rank(r):
            if r < zeros:
                return 0.0
            i = int(np.searchsorted(cum, r - zeros, side="right"))
            return 2 * _G ** (min(i, _NB - 1) + _LO) / (_G + 1)
        return (1 - (h - lo)) * rank(lo) + (h - lo) * rank(hi)


SLO_KEYS = {"ttft_ms": ("ttft", 1e3), "tpot_ms": ("tpot", 1e3), "e2e_s": ("e2e", 1.0)}


@dataclass
class Requests:
    """What the report needs of every finished request of a run (or of replicas merged), and
    of every token's gap to the one before (``itl``).

    ``slo``: limits (``ttft_ms``, ``tpot_ms``, ``e2e_s``) a request must meet to count for
    goodput; ``window``: (t0, t1) of the open loop's measured window, in which completions are
    counted (:func:`kvsim.replay.report.keeping_up`)."""
    slo: dict = field(default_factory=dict)
    window: tuple[float, float] | None = None
    ttft: Quantiles = field(default_factory=Quantiles)
    tpot: Quantiles = field(default_factory=Quantiles)  # requests of more than one token
    e2e: Quantiles = field(default_factory=Quantiles)
    wait: Quantiles = field(default_factory=Quantiles)  # arrival to first admission
    itl: Gaps = field(default_factory=Gaps)  # every decode token's gap to the one before
    count: int = 0
    output_tokens: int = 0
    first_arrival: float = math.inf
    last_finish: float = -math.inf
    meet_slo: int = 0
    done_by_t0: int = 0  # completions at or before the window's start
    done_by_t1: int = 0

    def method(self) -> str:
        """How the percentiles were computed: exactly, or by the sketch for any metric."""
        sketched = [q for q in (self.ttft, self.tpot, self.e2e, self.wait) if not q.exact]
        return sketched[0].method() if sketched else "exact"

    def fold(self) -> None:
        """Every metric into its sketch (:meth:`Quantiles.fold`)."""
        for q in (self.ttft, self.tpot, self.e2e, self.wait):
            q.fold()

    def fresh(self) -> Requests:
        return Requests(dict(self.slo), self.window)

    def record(self, arrival: np.ndarray, admitted: np.ndarray, first: np.ndarray,
               now: np.ndarray, output: np.ndarray) -> None:
        """Requests that finished, in the order they did: their arrival, first admission, first
        token and finish times and output lengths (columns of floats; the simulator hands them
        over in blocks, and any blocks give the same figures to the last bit:
        ``tests/test_streaming.py``)."""
        ttft, e2e, multi = first - arrival, now - arrival, output > 1
        tpot = np.where(multi, (now - first) / np.where(multi, output - 1, 1.0), math.nan)
        self.ttft.add_many(ttft.tolist())
        self.e2e.add_many(e2e.tolist())
        self.wait.add_many((admitted - arrival).tolist())
        self.tpot.add_many(tpot[multi].tolist())
        self.count += len(now)
        self.output_tokens += int(output.sum())
        self.first_arrival = min(self.first_arrival, float(arrival.min()))
        self.last_finish = max(self.last_finish, float(now.max()))
        if self.slo:
            got, ok = {"ttft": ttft, "e2e": e2e, "tpot": tpot}, np.ones(len(now), bool)
            for key, limit in self.slo.items():
                v = got[SLO_KEYS[key][0]] * SLO_KEYS[key][1]
                ok &= np.isnan(v) | (v <= limit)  # a one-token request has no TPOT to miss
            self.meet_slo += int(ok.sum())
        if self.window is not None:
            self.done_by_t0 += int((now <= self.window[0]).sum())
            self.done_by_t1 += int((now <= self.window[1]).sum())

    @staticmethod
    def merged(parts: list[Requests]) -> Requests:
        out = parts[0].fresh()
        for p in parts:
            for name in ("ttft", "tpot", "e2e", "wait", "itl"):
                getattr(out, name).merge(getattr(p, name))
            for name in ("count", "output_tokens", "meet_slo", "done_by_t0", "done_by_t1"):
                setattr(out, name, getattr(out, name) + getattr(p, name))
            out.first_arrival = min(out.first_arrival, p.first_arrival)
            out.last_finish = max(out.last_finish, p.last_finish)
        return out


def window_of(arrival: np.ndarray, warmup: float, closed: bool) -> tuple[float, float] | None:
    """The measured window of an open loop: from the arrival of the first ``warmup`` share of
    the requests to the last arrival (None for a closed loop or fewer than 10 requests)."""
    n = len(arrival)
    if closed or n < 10:
        return None
    k = int(warmup * n)
    return float(np.partition(arrival, k)[k]), float(arrival.max())
