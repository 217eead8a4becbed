"""VerKV's decide step on a synthetic attention layer of a model's head shape: the kernel that
``kvsim profile`` times (table ``kernel_decide``) and that ``kvsim validate`` runs inside real
decode steps.

The layer comes from :mod:`kvsim.model.synthetic` (spiky, with a sink and needles, so the
certificate has work to do), compressed by the VerKV policy with the options given; every call
of :meth:`DecideBench.plan` makes a real decision for the same decode query (sketch scores,
shortlist, shrinkage, certificate, GQA union), so a loop that runs it fetches what the policy's
statistics on the same layer say it fetches.

A batch: :meth:`DecideBench.stack` gives the same step for ``B`` requests decided in one call,
the requests stacked along the head axis (``B x kv_heads`` KV heads, ``B x q_heads`` query heads;
every stage of the pipeline works per KV head or per query row, so one call over the stack is
what a batched decide does). Request 0 is this bench's own layer; the others are synthetic
layers of their own seeds, generated once per bench (in worker processes when they are large)
and sliced for smaller batches.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from kvsim import trace as T
from kvsim.model.synthetic import synthetic_attention_trace
from kvsim.policies.spec import make
from kvsim.policies.verkv.kvfetch import decide, reweighted_log_factor

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


def _request_kwargs(m, n: int, seed: int, kvzip: bool = False) -> dict:
    """One request's synthetic layer; its kvzip stand-in score (most of the generation's time
    and memory) only when the policy scores with it."""
    return {"n_layers": 1, "n_q": m.q_heads, "n_kv": m.kv_heads, "d": m.head_dim, "context": n,
            "question": QUESTION_ROWS, "decode": 1, "seed": seed, "kvzip": kvzip}


def _kvzip(options: dict | None) -> bool:
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
    kws = [_request_kwargs(m, n, s, kvzip) for s in seeds]
    workers = generation_workers(m, n, len(kws)) if workers is None else min(workers, len(kws))
    if workers <= 1:
        return [synthetic_attention_trace(**kw).attention for kw in kws]
    root = str(Path(__file__).resolve().parents[3])  # the directory holding the kvsim package
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


class DecideBench:
    def __init__(self, device, m, n: int, seed: int = 0, options: dict | None = None,
                 attention: T.Attention | None = None):
        """``m``: a model shape (``q_heads``, ``kv_heads``, ``head_dim``); ``n``: context;
        ``attention``: the layer to decide on (default: one request's synthetic layer of
        ``seed``; :meth:`stack` passes a stack of requests)."""
        if attention is None:
            self.trace = synthetic_attention_trace(**_request_kwargs(m, n, seed, _kvzip(options)))
        else:
            self.trace = T.Trace(T.new_meta("kvsim.policies.verkv.bench", model="synthetic",
                                            context=n, notes=attention.provenance),
                                 None, attention)
        la, a = self.trace.attention.layers[0], self.trace.attention
        self.kv_heads, self.q_heads = la.k.shape[0], la.q_question.shape[0]
        self.batch = self.kv_heads // m.kv_heads  # requests in the stack
        self.device, self.seed, self.options = device, seed, options
        self._requests = [a] if self.batch == 1 else None

        def f32(x):  # half-precision values travel as such, and widen on the device
            return torch.from_numpy(np.ascontiguousarray(x)).to(device).to(torch.float32)
        pol = make("verkv", options)
        pol.bind(a.rope, m.head_dim)
        self.cfg = pol.config()
        scores = {k: f32(v[:, :n]) for k, v in la.scores.items()}  # kvzip, when it scores so
        self.layer = pol.compress(f32(la.k[:, :n]), f32(la.v[:, :n]), scores, f32(la.q_question),
                                  torch.as_tensor(a.question_pos, device=device),
                                  torch.Generator().manual_seed(seed), layer=0,
                                  obs_k=f32(la.k[:, n:])).state
        self.q = f32(la.q_decode)
        self.q_pos = torch.tensor([n], device=device)
        self.n, self.m = n, m
        smp = self.layer.sample
        fetched = decide(self.q, self.q_pos, self.layer, self.cfg).exact_kv[:, 0] & ~smp.sampled
        self.resident = smp.resident.sum(-1)  # (n_kv,)
        self.t_max = int((self.resident + fetched.sum(-1)).max())
        self.fetched_frac = float(fetched.float().mean())  # mean over the (stacked) KV heads
        # compact layout per KV head: resident tokens first (filled once), then fetched rows
        res_idx = torch.sort((~smp.resident).to(torch.int8), dim=-1, stable=True).indices
        self.res_cols = res_idx[:, :int(self.resident.max())]

    def stack(self, batch: int, workers: int | None = None) -> DecideBench:
        """The decide step of ``batch`` requests in one call: this bench's layer (request 0)
        and ``batch - 1`` more (seeds :func:`request_seed`), stacked along the head axis and
        compressed together. Requests generated once are kept for later (smaller or larger)
        stacks; ``workers``: see :func:`generate_requests`."""
        if self._requests is None:
            raise ValueError("stack() a single request's bench, not a stack")
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        if batch == 1:
            return self
        have = len(self._requests)
        self._requests += generate_requests(self.m, self.n, [request_seed(self.seed, b)
                                                             for b in range(have, batch)],
                                            workers, _kvzip(self.options))
        return DecideBench(self.device, self.m, self.n, self.seed, self.options,
                           attention=stack_requests(self._requests[:batch]))

    def plan(self):
        """One layer and the whole stack: the fetch set as host row indices (sorted by KV head),
        their slots in the compact layout, VerKV's reweighting as an additive logit bias
        (n_kv, g, t_max) over that layout, and the rows fetched per KV head."""
        lay, n_kv = self.layer, self.kv_heads
        dec = decide(self.q, self.q_pos, lay, self.cfg)
        fetched = dec.exact_kv[:, 0] & ~lay.sample.sampled  # (n_kv, n)
        h, t = fetched.nonzero(as_tuple=True)
        counts = fetched.sum(-1)
        start = torch.cumsum(counts, 0) - counts
        rank = torch.arange(h.numel(), device=h.device) - start[h]
        slot = h * self.t_max + self.resident[h] + rank
        g = self.q_heads // n_kv
        log_w = reweighted_log_factor(lay, dec, self.q_heads).view(n_kv, g, self.n)
        cols = torch.zeros(n_kv, self.t_max, dtype=torch.long, device=h.device)
        valid = torch.zeros(n_kv, self.t_max, dtype=torch.bool, device=h.device)
        r = self.res_cols.shape[1]
        cols[:, :r] = self.res_cols
        valid[:, :r] = torch.arange(r, device=h.device)[None, :] < self.resident[:, None]
        cols.view(-1)[slot] = t
        valid.view(-1)[slot] = True
        bias = log_w.gather(-1, cols[:, None, :].expand(n_kv, g, self.t_max))
        bias = bias.masked_fill(~valid[:, None, :], float("-inf"))
        return h * self.n + t, slot, bias, counts
