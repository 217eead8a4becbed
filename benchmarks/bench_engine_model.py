"""What the shape-aware engine model costs the simulator: ``Simulator.run`` timed in-process (CPU
time per simulated request, best and median of ``--repeats``) under the roofline-shaped engine
(``vllm-paper``: no shape, overlap or overhead fields) and under the published-measurement
families (``vllm``, ``trtllm``: matmul efficiency by shape, partial overlap, grouped experts,
per-layer and per-token overheads), side by side in one run, on the per-request benchmark's
workload (Poisson 2 req/s of 2048+128 tokens, batches up to 16, Qwen3-4B on H100-SXM, dense)
and on a mixture-of-experts model at TP 2 with chunked prefill. The last column is the time per
request over ``vllm-paper``'s (#25: at most 1.3).

    python benchmarks/bench_engine_model.py [--requests 5000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics

from bench_per_request import us_per_request


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=5_000)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    workloads = {
        "qwen3-4b dense": dict(model="qwen3-4b"),
        "mixtral-8x7b TP2": dict(model="mixtral-8x7b", tp=2),
    }
    print(f"{'workload':18s} {'engine':10s} {'best us/req':>11s} {'median':>8s} "
          f"{'x vllm-paper':>12s}")
    for name, over in workloads.items():
        base = None
        for eng in ("vllm-paper", "vllm", "trtllm"):
            us = us_per_request(dict(policy="dense", qps=2.0, requests=args.requests,
                                     context=2048, output_len=128, batch=16, engine=eng, jobs=1,
                                     **over), args.repeats)
            base = base or min(us)
            print(f"{name:18s} {eng:10s} {min(us):11.1f} {statistics.median(us):8.1f} "
                  f"{min(us) / base:12.2f}")


if __name__ == "__main__":
    main()
