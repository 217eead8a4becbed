"""Synthetic requests for a fetching policy's decide bench (``kvsim profile`` times the bench,
``kvsim validate`` runs it inside decode steps): one request's synthetic attention layer of a
model's head shape, more requests generated in worker processes when they are large, requests
stacked along the head axis (a batch decided in one call), and :class:`Stacking`, the
``stack(B)`` every bench shares."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
from abc import ABC, abstractmethod
from pathlib import Path

import numpy as np

from kvsim import trace as T
from kvsim.model.synthetic import synthetic_attention_trace

QUESTION_ROWS = 4  # observation window for SnapKV scores, replayed by the analysis too
POOL_MIN_ELEMENTS = 1 << 22  # key elements of one request from which generation is parallel


def request_seed(seed: int, b: int) -> int:
    """The synthetic seed of request ``b`` of a stack (request 0: ``seed`` itself)."""
    return seed if b == 0 else int(np.random.SeedSequence([seed, b]).generate_state(1)[0])


def _available_bytes() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 4.0 * 2**30


def generation_workers(m, n: int, count: int) -> int:
    """Worker processes for ``count`` requests of context ``n``: 1 (in this process) for small
    layers, else as many as cores and memory allow (a request's generation holds about
    8 bytes x n x (4 kv_heads x head_dim + q_heads x (head_dim + 100)) at its peak)."""
    if count < 2 or n * m.kv_heads * m.head_dim < POOL_MIN_ELEMENTS:
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    peak = 8.0 * n * (4 * m.kv_heads * m.head_dim + m.q_heads * (m.head_dim + 100))
    return max(1, min(count, cores or 1, int(0.6 * _available_bytes() // peak)))


def request_kwargs(m, n: int, seed: int, kvzip: bool = False) -> dict:
    """One request's synthetic layer; its kvzip stand-in score (most of the generation's time
    and memory) only when the policy scores with it."""
    return {"n_layers": 1, "n_q": m.q_heads, "n_kv": m.kv_heads, "d": m.head_dim, "context": n,
            "question": QUESTION_ROWS, "decode": 1, "seed": seed, "kvzip": kvzip}


def needs_kvzip(options: dict | None) -> bool:
    return (options or {}).get("scorer") == "kvzip"


# a worker: a fresh interpreter that imports only numpy and the generator (no torch, no main
# module to re-run, nothing forked from a process that holds CUDA or threads)
_WORKER = """
import pickle, sys
from kvsim.model.synthetic import synthetic_attention_trace
job = pickle.load(sys.stdin.buffer)
out = [synthetic_attention_trace(**kw).attention for kw in job["requests"]]
with open(job["out"], "wb") as f:
    pickle.dump(out, f, protocol=pickle.HIGHEST_PROTOCOL)
"""


def generate_requests(m, n: int, seeds: list[int], workers: int | None = None,
                      kvzip: bool = False) -> list:
    """The synthetic attention (:class:`kvsim.trace.Attention`, one layer) of each seed; with
    ``workers`` > 1 (default :func:`generation_workers`) in that many worker processes at once.
    The result does not depend on ``workers``. A worker that runs out of memory raises
    MemoryError."""
    kws = [request_kwargs(m, n, s, kvzip) for s in seeds]
    workers = generation_workers(m, n, len(kws)) if workers is None else min(workers, len(kws))
    if workers <= 1:
        return [synthetic_attention_trace(**kw).attention for kw in kws]
    root = str(Path(__file__).resolve().parents[2])  # the directory holding the kvsim package
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    with tempfile.TemporaryDirectory(prefix="kvsim-requests-") as tmp:
        procs = []
        for i in range(workers):
            job = {"requests": kws[i::workers], "out": os.path.join(tmp, f"{i}.pkl")}
            p = subprocess.Popen([sys.executable, "-c", _WORKER], stdin=subprocess.PIPE,
                                 stderr=subprocess.PIPE, env=env)
            p.stdin.write(pickle.dumps(job))
            p.stdin.close()
            procs.append((p, job["out"]))
        parts, failed = [], []
        for p, out in procs:
            err = p.stderr.read().decode(errors="replace")
            if p.wait() != 0:
                failed.append((p.returncode, err.strip().splitlines()[-1:] or [""]))
                continue
            with open(out, "rb") as f:
                parts.append(pickle.load(f))
        if failed:
            rc, last = failed[0]
            what = f"synthetic request generation failed in a worker (exit {rc}): {last[0]}"
            if rc in (-9, 137) or "MemoryError" in last[0]:
                raise MemoryError(what)
            raise RuntimeError(what)
    out = [None] * len(kws)
    for i, part in enumerate(parts):
        out[i::workers] = part
    return out


def stack_requests(requests: list) -> T.Attention:
    """One layer whose heads are the requests' heads, request after request."""
    def cat(xs):
        return np.concatenate(xs, axis=0)
    ls = [a.layers[0] for a in requests]
    scores = {k: cat([la.scores[k] for la in ls]) for k in ls[0].scores}
    layer = T.LayerAttention(0, cat([la.k for la in ls]), cat([la.v for la in ls]),
                             cat([la.q_question for la in ls]), cat([la.q_decode for la in ls]),
                             scores)
    a = requests[0]
    return T.Attention([layer], a.context_len, a.question_pos, a.decode_pos, a.rope,
                       f"{len(requests)} synthetic requests stacked along the head axis "
                       f"(request 0: {a.provenance})")


class Stacking(ABC):
    """``stack(B)`` for a bench of one request that keeps its request's attention in
    ``_requests`` and knows ``m``, ``n``, ``seed``; a subclass builds a bench of a stack with
    :meth:`_of` and says whether its requests need kvzip scores (:meth:`_kvzip`)."""

    @abstractmethod
    def _of(self, attention: T.Attention):
        """A bench of the same kind deciding on ``attention`` (a stack of requests)."""

    def _kvzip(self) -> bool:
        return False

    def stack(self, batch: int, workers: int | None = None):
        """The decide step of ``batch`` requests in one call: this bench's layer (request 0)
        and ``batch - 1`` more (seeds :func:`request_seed`), stacked along the head axis.
        Requests generated once are kept for later (smaller or larger) stacks; ``workers``: see
        :func:`generate_requests`."""
        if self._requests is None:
            raise ValueError("stack() a single request's bench, not a stack")
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        if batch == 1:
            return self
        have = len(self._requests)
        self._requests += generate_requests(self.m, self.n, [request_seed(self.seed, b)
                                                             for b in range(have, batch)],
                                            workers, self._kvzip())
        return self._of(stack_requests(self._requests[:batch]))
