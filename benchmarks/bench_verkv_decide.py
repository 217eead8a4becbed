"""VerKV's decide step (sketch scores, shortlist, shrinkage, certificate, fetch set with the GQA
union) for one layer and one decode step, against dense attention of the same layer, timed side
by side in one run on one device. Prints the ratio decide / dense (goal on CPU: <= 2x).

    python benchmarks/bench_verkv_decide.py [--device cpu|cuda] [--context 32768] [--repeat 10]

Shapes: 32 query heads, 8 KV heads, head dim 128 (Llama-3-8B-like), float32. The layer is a
synthetic one (kvsim.model.synthetic) compressed at 16x with the 2-bit sketch (not timed).
"dense" is
grouped-query attention without copying K/V per query head (matmul + softmax + matmul), which is
faster than kvsim.attention.dense.dense_attention (the float64 reference, which expands K/V).
The decide step is also timed with a full sort of the context instead of the top-4096 head.
On a loaded machine use ``--threads 1``: the decide step is ~60 small parallel ops, and each one
waits for a descheduled worker thread, which inflates it far more than dense attention's few
large matmuls.
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch

from kvsim.model.synthetic import synthetic_attention_trace
from kvsim.policies import make
from kvsim.policies.verkv.certificate import FETCH_HEAD, SHRINK_HEAD
from kvsim.policies.verkv.kvfetch import DecideConfig, decide


def dense_gqa(q, k, v):
    n_q, m, d = q.shape
    n_kv = k.shape[0]
    s = torch.matmul(q.reshape(n_kv, -1, d), k.transpose(1, 2)) / math.sqrt(d)
    return torch.matmul(torch.softmax(s, dim=-1), v).view(n_q, m, d)


def timed(fns, repeat, device):
    """Median seconds of each function, calls interleaved so that load on the machine hits all
    of them alike."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for fn in fns:
        fn()
    sync()
    times = [[] for _ in fns]
    for _ in range(repeat):
        for fn, ts in zip(fns, times):
            t = time.perf_counter()
            fn()
            sync()
            ts.append(time.perf_counter() - t)
    return [sorted(ts)[len(ts) // 2] for ts in times]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--eps", type=float, default=0.05)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    tr = synthetic_attention_trace(n_layers=1, n_q=32, n_kv=8, d=128, context=args.context,
                                   question=64, decode=1, seed=0)
    la, a = tr.attention.layers[0], tr.attention
    n_ctx = a.context_len
    f32 = lambda x: torch.as_tensor(x, dtype=torch.float32, device=device)  # noqa: E731
    k, v = f32(la.k)[:, :n_ctx], f32(la.v)[:, :n_ctx]
    qq = f32(la.q_question)
    q = f32(la.q_decode)
    q_pos = torch.tensor([n_ctx], device=device)  # one decode step right after the context
    pol = make("verkv", {"compression": 16, "eps": args.eps})
    qpos_q = torch.as_tensor(a.question_pos, device=device)
    gen = torch.Generator().manual_seed(0)
    pol.bind(a.rope, a.head_dim)
    state = pol.compress(k, v, {}, qq, qpos_q, gen, layer=la.layer, obs_k=f32(la.k)[:, n_ctx:])
    layer = state.layer
    # eps_hat after the GQA union is a reported statistic, not part of deciding: not timed
    cfg = DecideConfig(eps=args.eps, delta=0.1, report_after=False)
    cfg_full = DecideConfig(eps=args.eps, delta=0.1, fetch_head=None, shrink_head=None,
                            report_after=False)

    cfg_1k = DecideConfig(eps=args.eps, delta=0.1, fetch_head=1024, report_after=False)
    t_dense, t_decide, t_1k, t_full = timed(
        [lambda: dense_gqa(q, k, v), lambda: decide(q, q_pos, layer, cfg),
         lambda: decide(q, q_pos, layer, cfg_1k), lambda: decide(q, q_pos, layer, cfg_full)],
        args.repeat, device)
    dec = decide(q, q_pos, layer, cfg)
    dec_full = decide(q, q_pos, layer, cfg_full)
    same = bool(torch.equal(dec.exact_kv, dec_full.exact_kv))
    threads = torch.get_num_threads()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"device {device} ({threads} threads, load average {load:.1f} on {os.cpu_count()} "
          f"cores), 32 query / 8 KV heads, head dim 128, "
          f"{n_ctx} context tokens, one decode step, float32, eps {args.eps}")
    print(f"resident tokens per KV head {state.held_tokens:.0f}; decisions that fetch "
          f"{float((dec.k_star > 0).double().mean()):.2f}; tokens made exact per decision "
          f"{float(dec.k_star.double().mean()):.0f} (max {int(dec.k_star.max())})")
    print(f"dense GQA attention                        {t_dense * 1e3:8.2f} ms")
    print(f"decide (top-{FETCH_HEAD}/{SHRINK_HEAD} heads + fallback)    "
          f"{t_decide * 1e3:8.2f} ms   ratio {t_decide / t_dense:.2f}x dense")
    print(f"decide (top-1024 head + fallback)          {t_1k * 1e3:8.2f} ms   "
          f"ratio {t_1k / t_dense:.2f}x dense")
    print(f"decide (full sort of the context)          {t_full * 1e3:8.2f} ms   "
          f"ratio {t_full / t_dense:.2f}x dense")
    print(f"same fetch set with head and full sort: {same}")


if __name__ == "__main__":
    main()
