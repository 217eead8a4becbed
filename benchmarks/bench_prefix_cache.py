"""Mooncake's conversation trace (12,031 requests, one hour of Kimi's traffic) replayed on a
stated cluster with and without prefix caching, with and without a host tier, behind each
router: the hit share per tier, the prompt tokens prefilled and the latencies, side by side.

    python benchmarks/bench_prefix_cache.py [--replicas 8] [--limit N] [--json]

Cluster: ``--replicas`` x H100-SXM, Qwen3-4B in BF16 (TP 1, dense-resident: the KV cache in
HBM), up to 64 sequences per replica, vLLM's chunked prefill (8,192 tokens per step), engine
trtllm (kvsim's default, fitted to published measurements). Every figure is kvsim's
simulation (``kvsim replay``), not a measurement of a real cluster.
"""

from __future__ import annotations

import argparse
import json
import time

from kvsim.replay import configure, run_replay

TRACE = "data/mooncake/conversation_trace.jsonl"
SETTINGS = [("off", 0.0), ("on", 0.0), ("on", 256.0), ("on", 1024.0)]
ROUTERS = ("round-robin", "least-loaded", "prefix-aware")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--limit", type=int, help="the trace's first N requests [default: all]")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = []
    for mode, host in SETTINGS:
        for router in ROUTERS:
            if mode == "off" and router == "prefix-aware":
                continue  # (without a cache it routes as least-loaded)
            t0 = time.perf_counter()
            cfg = configure(policy="dense-resident", model="qwen3-4b", gpu="h100-sxm",
                            batch=64, workload_csv=TRACE, workload_limit=args.limit,
                            replicas=args.replicas, router=router, prefix_caching=mode,
                            cache_host_gib=host)
            r = run_replay(cfg).to_json()
            pc, s = r.get("prefix_cache") or {}, r["sim"]
            rows.append({
                "caching": mode, "host_gib": host, "router": router,
                "hit": pc.get("prefix_hit_frac", 0.0),
                "hit_gpu": pc.get("prefix_hit_frac_gpu", 0.0),
                "hit_host": pc.get("prefix_hit_frac_host", 0.0),
                "prefilled_mtok": pc.get("prefix_tokens_prefilled",
                                         r["prompt_tokens"]["mean"] * s["requests"]) / 1e6,
                "host_loaded_gib": pc.get("prefix_loaded_gib_host", 0.0),
                "ttft_ms": s["ttft_ms"], "ttft_p50_ms": s["ttft_p50_ms"],
                "ttft_p99_ms": s["ttft_p99_ms"], "tpot_p99_ms": s["tpot_p99_ms"],
                "served": s["served_frac_window"], "seconds": time.perf_counter() - t0})
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"{'caching':8} {'host GiB':>8} {'router':13} {'hit':>6} {'gpu':>6} {'host':>6} "
          f"{'prefilled Mtok':>14} {'loaded GiB':>10} {'TTFT ms':>8} {'p50':>7} {'p99':>8} "
          f"{'TPOT p99':>8} {'served':>6} {'run s':>5}")
    for x in rows:
        print(f"{x['caching']:8} {x['host_gib']:8g} {x['router']:13} {x['hit']:6.3f} "
              f"{x['hit_gpu']:6.3f} {x['hit_host']:6.3f} {x['prefilled_mtok']:14.1f} "
              f"{x['host_loaded_gib']:10.0f} {x['ttft_ms']:8.0f} {x['ttft_p50_ms']:7.0f} "
              f"{x['ttft_p99_ms']:8.0f} {x['tpot_p99_ms']:8.1f} {x['served']:6.3f} "
              f"{x['seconds']:5.1f}")


if __name__ == "__main__":
    main()
