"""Synthetic requests for a fetching policy's decide bench (``kvsim profile`` times the bench,
``kvsim validate`` runs it inside decode steps): one request's synthetic attention layer of a
model's head shape, more requests generated in worker processes when they are large, requests
stacked along the head axis (a batch decided in one call), :class:`Stacking`, the ``stack(B)``
every bench shares, and :class:`CompactBench`, the compact layout (resident tokens first, then
the fetched rows) that turns a policy's decision into what a decode step gathers: a bench is a
:class:`~kvsim.policies.base.DecideKernel` once it says what it decides (``_decision``)."""

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
from kvsim._torch import torch
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


def on_device(x, device):
    """A trace array as float32 on ``device`` (half-precision values travel as such, and widen
    on the device)."""
    return torch.from_numpy(np.ascontiguousarray(x)).to(device).to(torch.float32)


class CompactBench(Stacking):
    """A decide bench on one (stacked) synthetic layer with the compact layout a decode step
    gathers into: per KV head its resident tokens first (filled once, ``res_cols``), then the
    rows the decision fetches, ``t_max`` slots in all. A subclass calls :meth:`_request` and
    :meth:`_layout` from its constructor and says what it decides (:meth:`_decision`);
    :meth:`plan` is the rest."""

    def _request(self, device, m, n: int, seed: int, attention: T.Attention | None,
                 kvzip: bool = False) -> T.LayerAttention:
        """Take the layer to decide on (default: one request's synthetic layer of ``seed``;
        :meth:`stack` passes a stack of requests) and its head shape; return the layer."""
        if attention is None:
            attention = synthetic_attention_trace(**request_kwargs(m, n, seed, kvzip)).attention
        self.trace = T.Trace(T.new_meta(type(self).__module__, model="synthetic", context=n,
                                        notes=attention.provenance), None, attention)
        la = attention.layers[0]
        self.kv_heads, self.q_heads = la.k.shape[0], la.q_question.shape[0]
        self.batch = self.kv_heads // m.kv_heads  # requests in the stack
        self.device, self.seed, self.m, self.n = device, seed, m, n
        self._requests = [attention] if self.batch == 1 else None
        return la

    def _layout(self, resident: torch.Tensor, fetched: torch.Tensor) -> None:
        """The layout of the resident tokens (n_kv, n) bool and room for the rows ``fetched``
        (n_kv, n) bool by the first decision; its mean share is ``fetched_frac``."""
        self.resident = resident.sum(-1)  # (n_kv,)
        self.t_max = int((self.resident + fetched.sum(-1)).max())
        self.fetched_frac = float(fetched.float().mean())  # mean over the (stacked) KV heads
        res_idx = torch.sort((~resident).to(torch.int8), dim=-1, stable=True).indices
        self.res_cols = res_idx[:, :int(self.resident.max())]

    @abstractmethod
    def _decision(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One real decision for the decode query: the fetched rows (n_kv, n) bool, beyond the
        resident ones, and the policy's reweighting as additive log-weights (n_kv, g, n) on the
        context's logits, or None where it does not reweight."""

    def plan(self):
        """One layer and the whole stack: the fetch set as host row indices (sorted by KV head),
        their slots in the compact layout, the decision's reweighting as an additive logit
        bias (n_kv, g, t_max) over that layout (-inf on unused slots) and the rows fetched per
        KV head."""
        fetched, log_w = self._decision()
        n_kv, t_max = self.kv_heads, self.t_max
        h, t = fetched.nonzero(as_tuple=True)
        counts = fetched.sum(-1)
        start = torch.cumsum(counts, 0) - counts
        rank = torch.arange(h.numel(), device=h.device) - start[h]
        slot = h * t_max + self.resident[h] + rank
        valid = torch.zeros(n_kv, t_max, dtype=torch.bool, device=h.device)
        r = self.res_cols.shape[1]
        valid[:, :r] = torch.arange(r, device=h.device)[None, :] < self.resident[:, None]
        valid.view(-1)[slot] = True
        g = self.q_heads // n_kv
        if log_w is None:
            bias = torch.zeros(n_kv, g, t_max, device=h.device)
        else:  # each slot's token: the resident columns, then the fetched rows
            cols = torch.zeros(n_kv, t_max, dtype=torch.long, device=h.device)
            cols[:, :r] = self.res_cols
            cols.view(-1)[slot] = t
            bias = log_w.gather(-1, cols[:, None, :].expand(n_kv, g, t_max))
        bias = bias.masked_fill(~valid[:, None, :], float("-inf"))
        return h * self.n + t, slot, bias, counts
