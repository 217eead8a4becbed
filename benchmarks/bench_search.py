"""The deployment search's wall time, and what pruning saves: ``kvsim plan --target-qps`` over
GPUs x TP sizes x policies x batches for a Llama-3.1-70B-shaped model (its published
config.json fields, written to a temporary file), whose 131 GiB of bf16 weights do not fit one
GPU of most of the catalog. The configurations pruned before simulation are then run through
the simulator on their own, to measure the time pruning saved, side by side in one run.

    PYTHONPATH=. python benchmarks/bench_search.py [--jobs N] [--slo-requests N]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

LLAMA_70B = {  # meta-llama/Llama-3.1-70B config.json (the fields kvsim reads)
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
    "intermediate_size": 28672, "max_position_embeddings": 131072, "num_attention_heads": 64,
    "num_hidden_layers": 80, "num_key_value_heads": 8, "rope_theta": 500000.0,
    "tie_word_embeddings": False, "vocab_size": 128256, "torch_dtype": "bfloat16"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--slo-requests", type=int, default=1000)
    args = ap.parse_args()
    from kvsim.plan import slo
    from kvsim.plan.executors import LocalExecutor
    from kvsim.plan.planner import plan
    from kvsim.plan.sweep import SweepSpec, expand, run_config, weights_exceed_hbm
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "llama-3.1-70b" / "config.json"
        config.parent.mkdir()
        config.write_text(json.dumps(LLAMA_70B))
        limits = [slo.Limit("tpot_ms", 100.0)]
        spec = SweepSpec(gpus=["h100-sxm", "a100-80gb", "l40s"], models=[str(config)],
                         contexts=[8192], policies=["dense-resident", "streamingllm"],
                         batches=[4, 16], slo=limits, slo_requests=args.slo_requests,
                         deployment={"tp": [1, 2, 4]}, target_qps=2.0)
        t0 = time.perf_counter()
        summary = plan(spec, Path(tmp) / "out", LocalExecutor(args.jobs), progress=False).summary
        search_s = time.perf_counter() - t0
        pruned = [c for c in expand(spec) if weights_exceed_hbm(c)]
        t0 = time.perf_counter()
        statuses = [run_config(c, limits, args.slo_requests)["status"] for c in pruned]
        pruned_s = time.perf_counter() - t0
    a = summary["answer"]
    print(f"search: {summary['rows']} configurations (3 GPUs x TP 1,2,4 x 2 policies x 2 "
          f"batches), {summary['pruned']} pruned before simulation, {args.jobs} workers: "
          f"{search_s:.1f} s wall")
    print(f"answer: {a['replicas']} x {a['gpu']} TP{a['tp']} {a['label']} batch {a['batch']}: "
          f"${a['usd_per_hour']:.2f}/h, {a['qps_capacity_per_replica']:.3g} req/s per replica")
    print(f"the {len(pruned)} pruned configurations simulated anyway, one process: "
          f"{pruned_s:.2f} s (statuses: {', '.join(sorted(set(statuses)))}); pruning saved "
          f"{len(pruned)} of {summary['rows']} simulations")


if __name__ == "__main__":
    main()
