"""Simulator speed, kvsim vs Vidur, side by side in one run on the same machine.

    python benchmarks/bench_vs_vidur.py [--trace T.npz] [--requests 1000]
           [--vidur-python /path/to/venv/bin/python] [--vidur-cache DIR] [--vidur-native]

Setting up Vidur (nothing of it goes into kvsim's own environment):

    python -m venv /path/to/venv && /path/to/venv/bin/pip install vidur==0.0.26

Without ``--vidur-python`` only kvsim is timed. With it, Vidur (PyPI ``vidur``, tested with
0.0.26, installed in a separate virtual environment: it pins its own numpy/pandas/scikit-learn
and pulls wandb, streamlit, kaleido...) runs in a subprocess on the same workload and both are
printed in one table.

WHAT IS COMPARED
----------------
Workload, both simulators: 1,000 requests, every prompt 4,096 tokens, every output 256 tokens,
one replica / one GPU (TP1, PP1), continuous batching with at most 64 sequences in a batch, KV
cache resident in HBM; two arrival patterns, as in ``bench_sim.py``:

* "Poisson 4 req/s": seeded Poisson arrivals (the two tools draw different arrival sequences
  from their own RNGs: same distribution, different times). How many iterations each tool
  simulates depends on its own step-time model (see below), so compare per-step rates here.
* "closed loop, concurrency 64": kvsim ``concurrency=64``; Vidur: all 1,000 requests arrive at
  t=0 (``static`` interval generator) and the scheduler's batch cap of 64 admits them as others
  finish, which is the same closed loop. Both then simulate ~1,000 prefills and ~4,000 decode
  steps at batch 64 whatever their step-time models say: the like-for-like row.

* kvsim: ``run_replay`` with policy ``dense-resident``, gpu ``h100-sxm``, model ``qwen3-4b``.
  Timed: the first ``run_replay`` of the workload in this process ("cold": its trace and
  policy-analysis caches are cleared first, so it loads the trace and analyses it), the median
  of 5 more calls ("warm"), and a fresh ``python`` process doing the imports and one call
  ("process"). kvsim's process time is mostly torch, which loads when the policy registry
  does (about 1.5-3 s here).
* Both: wall-clock seconds and the process's CPU seconds (``time.process_time``). On a shared,
  loaded machine wall times swing by 2-3x between runs; CPU seconds are steadier, so compare
  ratios of those too.
* Vidur: ``vidur.simulator.Simulator`` (the code behind ``python -m vidur.main``), replica
  scheduler ``vllm`` (batch_size_cap 64, max_tokens_in_batch 4096, block size 16),
  ``random_forrest`` execution-time predictor, device ``h100`` / node ``h100_dgx``, model
  ``meta-llama/Llama-3-8B`` (Vidur's default and closest supported model: its model table has
  no Qwen3, and its configs derive head_dim = hidden / n_heads, which cannot express Qwen3-4B's
  2560 hidden with 32 x 128-dim heads). Disabled because they are output, not simulation:
  plots (``--no-metrics_config_store_plots``; they would also need kaleido's Chrome), the
  Chrome trace (``--no-metrics_config_enable_chrome_trace``), the JSON event trace (off by
  default), wandb (no project given, and ``WANDB_MODE=disabled``). Request/batch metric
  collection and its CSV files stay on (``write_metrics``), as kvsim also computes its summary.
  Vidur's time is split into: process start + imports, setup (config, request generation,
  loading the predictor's prediction tables from its cache), the event loop, and writing metrics.

"steps": kvsim's ``decode_steps`` is the number of simulated decode iterations (sum of the
steps of its decode chunks). Vidur's count is the number of simulated batches (model
iterations) that completed, split into prefill batches (any request with more than one query
token; Vidur's vllm scheduler never mixes prefills and decodes in one batch) and decode
batches. "dec/wall_s" and "dec/cpu_s" use kvsim's decode steps and Vidur's decode batches,
each divided by that simulator's own timed wall or CPU seconds.

HOW THE TWO MODELS DIFFER (why this is a speed comparison, not an accuracy one)
---------------------------------------------------------------------------------
* Time model. Vidur predicts each operator's time (QKV/out projections, MLP up/down/act,
  norms, RoPE, KV-cache save, prefill and decode attention) from GPU profiling CSVs, through
  scikit-learn random forests trained by grid search, tabulated ahead of time over token counts
  and (batch, KV-length) grids; per batch it looks these tables up and sums the operators over
  the layers. kvsim prices a step with a roofline over the catalog GPU's FLOP/s and bandwidth
  (or a trace's measured tables) and advances decode in chunks of steps between events, so its
  event count grows with arrivals/completions/admissions, not with every decode step.
* Vidur's event loop is per batch per pipeline stage: several Python event objects (batch
  stage arrival/end, replica schedule, batch end...) and per-request bookkeeping every
  iteration.
* No profiling data ships with Vidur. ``vidur`` 0.0.26 fetches its compute and network profiles
  at run time from the HuggingFace Hub datasets ``project-vajra/dev-staging-meta-llama-llama-3-
  8b-h100`` and ``project-vajra/dev-staging-h100-dgx`` (files mlp.csv.xz, attention.csv.xz,
  all_reduce.csv.xz, send_recv.csv.xz + config.json), and first tries precomputed predictions
  from ``project-vajra/predictions-...``; none of the PyPI wheels/sdists (0.0.1-0.0.26)
  contain ``data/profiling``. On a machine without the Hub this script therefore WRITES A
  SYNTHETIC PROFILE into Vidur's offline HF cache: per-operator times for Llama-3-8B on an H100
  SXM from a simple roofline (989 TFLOP/s dense BF16 at 70 %, 3.35 TB/s at 80 %, 4 us per
  kernel). Vidur's random forests are trained on that and its simulation then runs unchanged.
  The simulated latencies are therefore NOT Vidur's real predictions and must not be compared
  for accuracy; they only set the timeline. An 8B model costs about twice a 4B one per token
  (a 4,096-token prefill is ~95 ms here vs ~47 ms), so under Poisson arrivals Vidur's queue
  builds larger decode batches (mean ~23 vs kvsim's ~6) and it simulates ~4x fewer decode
  steps (~11,100 vs ~48,000); the closed loop removes that difference. What one simulated
  iteration costs Vidur in wall time depends on the batch's size, not on the profile's values.
* One-off Vidur costs not in its simulation time: the forest training (with the grid cut to
  one point and 2-fold CV here; Vidur's default grid is 27 points x 10 folds) and tabulating
  predictions, cached under ``--vidur-cache`` and done in a priming run the first time. The
  prediction table range is cut from Vidur's default 2M tokens to 8,192 tokens per request
  (the workload needs 4,352).
* Model/GPU differ (Llama-3-8B vs Qwen3-4B; Vidur's h100 80 GB vs kvsim's h100-sxm), KV block
  accounting differs (Vidur: 16-token blocks, watermark, preemption; kvsim: its own memory
  model), and neither tool's scheduling is the other's.
"""

from __future__ import annotations

import argparse
import json
import lzma
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _replay import prepared, run

from kvsim import replay as kvsim_replay
from kvsim.replay import DEFAULT_TRACE

PROMPT, OUTPUT, QPS, BATCH = 4096, 256, 4.0, 64
WORKLOADS = (("Poisson 4 req/s", "poisson"), ("closed loop, concurrency 64", "closed"))

# ---------------------------------------------------------------- synthetic Vidur profile
# Llama-3-8B (Vidur's model table), H100 SXM roofline.
L3 = dict(h=4096, nq=32, nkv=8, hd=128, inter=14336, vocab=128256)
PEAK = 989e12 * 0.70  # FLOP/s
BW = 3.35e12 * 0.80  # B/s
LAUNCH_MS = 0.004
PROFILE_TAG = "roofline-v1"  # part of the dataset name, so Vidur's cache hash follows changes
COMPUTE_DS = f"kvsim-synthetic/llama-3-8b-h100-{PROFILE_TAG}"
NETWORK_DS = f"kvsim-synthetic/h100-dgx-{PROFILE_TAG}"
MAX_TOKENS_PRED = 8192


def _ms(flops: float, nbytes: float) -> float:
    return max(flops / PEAK, nbytes / BW) * 1e3 + LAUNCH_MS


def _linear_ops(t: int) -> dict:
    h, nq, nkv, hd, i = L3["h"], L3["nq"], L3["nkv"], L3["hd"], L3["inter"]
    qkv = (nq + 2 * nkv) * hd
    return {
        "attn_pre_proj": _ms(2 * t * h * qkv, 2 * (h * qkv + t * h + t * qkv)),
        "attn_post_proj": _ms(2 * t * h * h, 2 * (h * h + 2 * t * h)),
        "mlp_up_proj": _ms(2 * t * h * 2 * i, 2 * (h * 2 * i + t * h + t * 2 * i)),
        "mlp_down_proj": _ms(2 * t * i * h, 2 * (i * h + t * i + t * h)),
        "mlp_act": _ms(3 * t * i, 2 * 3 * t * i),
        "input_layernorm": _ms(4 * t * h, 2 * 2 * t * h),
        "post_attention_layernorm": _ms(4 * t * h, 2 * 2 * t * h),
        "attn_rope": _ms(4 * t * (nq + nkv) * hd, 2 * 2 * t * (nq + nkv) * hd),
        "add": _ms(t * h, 2 * 3 * t * h),
    }


def _kv_bytes_per_token() -> int:
    return 2 * 2 * L3["nkv"] * L3["hd"]  # K and V, 2 bytes each


def _write_xz_csv(path: Path, header: list, rows: list) -> None:
    with lzma.open(path, "wt") as f:
        f.write(",".join(header) + "\n")
        for r in rows:
            f.write(",".join(str(x) for x in r) + "\n")


def _hf_snapshot(cache: Path, repo_id: str) -> Path:
    """The folder layout huggingface_hub's snapshot_download finds offline."""
    repo = cache / ("datasets--" + repo_id.replace("/", "--"))
    commit = "0" * 40
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True, exist_ok=True)
    return snap


def write_synthetic_vidur_profile(cache_dir: Path) -> None:
    h, nq, nkv, hd = L3["h"], L3["nq"], L3["nkv"], L3["hd"]
    snap = _hf_snapshot(cache_dir / "profiling_data" / "compute", COMPUTE_DS)
    (snap / "config.json").write_text(json.dumps(
        {"model": "meta-llama/Llama-3-8B", "device_sku": "h100",
         "note": "synthetic roofline profile written by kvsim benchmarks/bench_vs_vidur.py"}))
    ops = list(_linear_ops(1))
    tokens = sorted({1, 2, 4} | set(range(8, 1025, 8)) | set(range(1024, MAX_TOKENS_PRED + 1, 32)))
    mlp_rows = []
    for t in tokens:
        op = _linear_ops(t)
        mlp_rows.append([nq, nkv, h, L3["inter"], "True", L3["vocab"], 1, t]
                        + [f"{op[k]:.6f}" for k in ops])
    _write_xz_csv(snap / "mlp.csv.xz",
                  ["n_head", "n_kv_head", "n_embd", "n_expanded_embd", "use_gated_mlp",
                   "vocab_size", "num_tensor_parallel_workers", "num_tokens"]
                  + [f"time_stats.{k}.median" for k in ops], mlp_rows)
    kvb = _kv_bytes_per_token()
    att_rows = []
    common = [h, nq, nkv, 16, 1]
    for b in (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128):  # decode
        for k in range(256, MAX_TOKENS_PRED + 1, 256):
            dec = _ms(4 * b * k * nq * hd, b * k * kvb)
            save = _ms(0, 2 * b * kvb)
            att_rows.append(common + [b, k, 0, "", f"{dec:.6f}", f"{save:.6f}"])
    for p in [32, 64, 128] + list(range(256, 4097, 256)):  # prefill (chunk p after k cached)
        for k in range(0, MAX_TOKENS_PRED - p + 1, 512):
            pre = _ms(4 * p * (k + p / 2) * nq * hd / 0.7, (k + p) * kvb + 2 * 2 * p * nq * hd)
            save = _ms(0, 2 * p * kvb)
            att_rows.append(common + [1, k, p, f"{pre:.6f}", "", f"{save:.6f}"])
    _write_xz_csv(snap / "attention.csv.xz",
                  ["n_embd", "n_q_head", "n_kv_head", "block_size",
                   "num_tensor_parallel_workers", "batch_size", "kv_cache_size",
                   "prefill_chunk_size", "time_stats.attn_prefill.median",
                   "time_stats.attn_decode.median", "time_stats.attn_kv_cache_save.median"],
                  att_rows)
    net = _hf_snapshot(cache_dir / "profiling_data" / "network", NETWORK_DS)
    (net / "config.json").write_text(json.dumps({"sku": "h100_dgx", "note": "unused at TP1/PP1"}))
    hdr = ["collective", "num_workers", "devices_per_node", "size", "time_stats.%s.median"]
    _write_xz_csv(net / "all_reduce.csv.xz", hdr[:4] + [hdr[4] % "all_reduce"],
                  [["all_reduce", 1, 1, 8192, 0.01]])
    _write_xz_csv(net / "send_recv.csv.xz", hdr[:4] + [hdr[4] % "send_recv"],
                  [["send_recv", 2, 2, 8192, 0.01]])


# ---------------------------------------------------------------- Vidur run (subprocess)
# Runs inside the Vidur venv. Times phases and counts batches; prints one JSON line last.
VIDUR_DRIVER = r"""
import json, sys, time
t0 = time.perf_counter()
from vidur.config import SimulationConfig
from vidur.simulator import Simulator
from vidur.utils.random import set_seeds
from vidur.events.batch_end_event import BatchEndEvent
t_import = time.perf_counter()
counts = {"prefill": 0, "decode": 0, "decode_tokens": 0}
_orig = BatchEndEvent.handle_event
def _counting(self, *a, **k):
    q = self._batch.num_q_tokens
    if any(n > 1 for n in q):
        counts["prefill"] += 1
    else:
        counts["decode"] += 1
        counts["decode_tokens"] += len(q)
    return _orig(self, *a, **k)
BatchEndEvent.handle_event = _counting
config = SimulationConfig.create_from_cli_args()
set_seeds(config.seed)
sim = Simulator(config)
t_setup = time.perf_counter()
c_setup = time.process_time()
out = {}
_write = sim._write_output
def _timed_write():
    t, c = time.perf_counter(), time.process_time()
    _write()
    out["write_s"], out["write_cpu"] = time.perf_counter() - t, time.process_time() - c
sim._write_output = _timed_write
sim.run()
t_end = time.perf_counter()
c_end = time.process_time()
print(json.dumps({"import_s": t_import - t0, "setup_s": t_setup - t_import,
                  "loop_s": t_end - t_setup - out.get("write_s", 0.0),
                  "loop_cpu": c_end - c_setup - out.get("write_cpu", 0.0),
                  "total_cpu": c_end,
                  "write_s": out.get("write_s", 0.0), "sim_s": sim._time,
                  "batches": counts["prefill"] + counts["decode"], **counts}))
"""


def vidur_args(requests: int, cache_dir: Path, out_dir: Path, workload: str,
               native: bool = False, seed: int = 42) -> list:
    p = "random_forrest_execution_time_predictor_config"
    if workload == "poisson":
        arrivals = ["--interval_generator_config_type", "poisson",
                    "--poisson_request_interval_generator_config_qps", str(QPS)]
    else:  # closed loop: everything queued at t=0, the batch cap is the concurrency
        arrivals = ["--interval_generator_config_type", "static"]
    return arrivals + ([f"--{p}_use_native_execution_time_predictor"] if native else []) + [
        "--seed", str(seed), "--log_level", "warning",
        "--cluster_config_num_replicas", "1",
        "--replica_config_model_name", "meta-llama/Llama-3-8B",
        "--replica_config_device", "h100", "--replica_config_network_device", "h100_dgx",
        "--replica_config_tensor_parallel_size", "1", "--replica_config_num_pipeline_stages", "1",
        "--global_scheduler_config_type", "round_robin",
        "--replica_scheduler_config_type", "vllm",
        "--vllm_scheduler_config_batch_size_cap", str(BATCH),
        "--vllm_scheduler_config_max_tokens_in_batch", str(PROMPT),
        "--request_generator_config_type", "synthetic",
        "--synthetic_request_generator_config_num_requests", str(requests),
        "--synthetic_request_generator_config_max_tokens", str(PROMPT + OUTPUT),
        "--length_generator_config_type", "fixed",
        "--fixed_request_length_generator_config_prefill_tokens", str(PROMPT),
        "--fixed_request_length_generator_config_decode_tokens", str(OUTPUT),
        "--fixed_request_length_generator_config_max_tokens", str(PROMPT + OUTPUT),
        "--execution_time_predictor_config_type", "random_forrest",
        f"--{p}_model_profiling_dataset", COMPUTE_DS,
        f"--{p}_network_profiling_dataset", NETWORK_DS,
        f"--{p}_prediction_hf_org", "kvsim-synthetic",
        f"--{p}_cache_dir", str(cache_dir),
        f"--{p}_prediction_max_tokens_per_request", str(MAX_TOKENS_PRED),
        f"--{p}_num_estimators", "100", f"--{p}_max_depth", "16",
        f"--{p}_min_samples_split", "2", f"--{p}_k_fold_cv_splits", "2",
        "--no-metrics_config_store_plots", "--no-metrics_config_enable_chrome_trace",
        "--no-metrics_config_write_json_trace",
        "--metrics_config_output_dir", str(out_dir),
    ]


def run_vidur(python: str, requests: int, cache_dir: Path, workload: str,
              native: bool = False) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="disabled")
    with tempfile.TemporaryDirectory(prefix="vidur_out_") as out:
        cmd = [python, "-c", VIDUR_DRIVER] + vidur_args(requests, cache_dir, Path(out), workload,
                                                        native)
        t0 = time.perf_counter()
        p = subprocess.run(cmd, env=env, cwd=out, capture_output=True, text=True)
        wall = time.perf_counter() - t0
    if p.returncode != 0:
        sys.stderr.write(p.stdout[-4000:] + p.stderr[-8000:])
        raise SystemExit(f"vidur failed (exit {p.returncode}); command: {' '.join(cmd[:2])} "
                         f"<driver> {' '.join(cmd[3:])}")
    res = json.loads(p.stdout.strip().splitlines()[-1])
    res["process_s"] = wall
    return res


# ---------------------------------------------------------------- kvsim run
def kvsim_trace(path: str | None) -> str | None:
    """The trace to use: --trace, else the shipped default, else a small synthetic one."""
    if path is not None or DEFAULT_TRACE.exists():
        return path
    from kvsim import trace as T
    from kvsim.model.synthetic import synthetic_attention_trace
    out = Path(tempfile.gettempdir()) / "kvsim_bench_vs_vidur_synthetic.npz"
    T.save(synthetic_attention_trace(), out, force=True)
    print(f"note: {DEFAULT_TRACE} missing, using a synthetic trace {out}", file=sys.stderr)
    return str(out)


KVSIM_DRIVER = r"""
import json, sys, time
t0 = time.perf_counter()
from kvsim.replay import configure, run_replay
cfg = configure(**json.loads(sys.argv[1]))
t1 = time.perf_counter()
run_replay(cfg)
print(json.dumps({"import_s": t1 - t0, "run_s": time.perf_counter() - t1,
                  "total_cpu": time.process_time()}))
"""


def kvsim_config(trace: str | None, requests: int, workload: str) -> dict:
    extra = dict(qps=QPS) if workload == "poisson" else dict(concurrency=BATCH)
    # prefill-first: Vidur's vllm scheduler never mixes prefills and decodes in one batch
    return dict(trace=trace, policy="dense-resident", gpu="h100-sxm", model="qwen3-4b",
                context=PROMPT, output_len=OUTPUT, requests=requests, seed=0, batch=BATCH,
                scheduler="prefill-first", **extra)


def run_kvsim(trace: str | None, requests: int, workload: str) -> dict:
    kw = kvsim_config(trace, requests, workload)
    cfg = prepared(**kw)
    kvsim_replay._load.cache_clear()  # make the 1st call cold
    getattr(kvsim_replay, "_ANALYSES", {}).clear()
    t0, c0 = time.perf_counter(), time.process_time()
    r = run(cfg)
    cold, cold_cpu = time.perf_counter() - t0, time.process_time() - c0
    warm_runs, warm_cpus = [], []
    for _ in range(5):
        t0, c0 = time.perf_counter(), time.process_time()
        run(cfg)
        warm_runs.append(time.perf_counter() - t0)
        warm_cpus.append(time.process_time() - c0)
    warm, warm_cpu = statistics.median(warm_runs), statistics.median(warm_cpus)
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", KVSIM_DRIVER, json.dumps(kw)],
                       capture_output=True, text=True, check=True)
    process = time.perf_counter() - t0
    return {"cold_s": cold, "warm_s": warm, "process_s": process, "cold_cpu": cold_cpu,
            "warm_cpu": warm_cpu,
            **{"p_" + k: v for k, v in json.loads(p.stdout.strip().splitlines()[-1]).items()},
            "decode_steps": r["sim"]["decode_steps"], "sim_s": r["sim"]["makespan_s"],
            "mean_batch": r["sim"]["mean_batch"], "tpot_ms": r["tpot_ms"], "ttft_ms": r["ttft_ms"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--trace", default=None, help="kvsim trace (default: the shipped default)")
    ap.add_argument("--vidur-python", default=None,
                    help="python of a virtual environment with `vidur` installed")
    ap.add_argument("--vidur-cache", default=str(Path(tempfile.gettempdir()) / "kvsim_vidur_cache"),
                    help="Vidur predictor cache + synthetic profile (reused between runs)")
    ap.add_argument("--vidur-native", action="store_true",
                    help="also time Vidur with its C++ execution-time predictor (off by default "
                         "in Vidur)")
    args = ap.parse_args()

    trace = kvsim_trace(args.trace)
    if args.vidur_python:
        cache = Path(args.vidur_cache).resolve()
        write_synthetic_vidur_profile(cache)
        primed = cache / f"primed-{PROFILE_TAG}"
        if not primed.exists():
            print("vidur: priming run (training forests, tabulating predictions; one-off)...",
                  file=sys.stderr)
            pr = run_vidur(args.vidur_python, 8, cache, "poisson")
            print(f"vidur: priming took {pr['process_s']:.1f} s (setup {pr['setup_s']:.1f} s)",
                  file=sys.stderr)
            primed.write_text(json.dumps(pr))

    print(f"{args.requests} requests, prompt {PROMPT}, output {OUTPUT} tokens, max batch {BATCH}, "
          f"1 GPU.\nwall_s: wall-clock seconds; cpu_s: CPU seconds of the process (steadier "
          f"than wall on a shared machine); dec_steps: simulated decode steps (Vidur: decode "
          f"batches); batches: Vidur's simulated batches incl. prefills; sim_s: simulated "
          f"makespan")
    head = (f"  {'simulator, what is timed':<42} {'wall_s':>7} {'cpu_s':>7} {'dec_steps':>9} "
            f"{'batches':>7} {'dec/wall_s':>10} {'dec/cpu_s':>9} {'sim_s':>6}")
    row = "  {:<42} {:7.3f} {:>7} {:>9} {:>7} {:10.0f} {:>9} {:6.1f}"
    summary = []
    for wl_label, wl in WORKLOADS:
        k = run_kvsim(trace, args.requests, wl)
        vs = []
        if args.vidur_python:
            vs.append(("Vidur", run_vidur(args.vidur_python, args.requests, cache, wl)))
            if args.vidur_native:
                vs.append(("Vidur (C++ predictor)",
                           run_vidur(args.vidur_python, args.requests, cache, wl, True)))
        print(f"\n{wl_label}")
        print(head)
        steps = k["decode_steps"]
        f3 = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
        per = lambda n, x: "-" if x is None else f"{n / x:.0f}"  # noqa: E731
        for label, wall, cpu in (
                ("kvsim run_replay, cold (1st call)", k["cold_s"], k["cold_cpu"]),
                ("kvsim run_replay, warm (median of 5)", k["warm_s"], k["warm_cpu"]),
                ("kvsim whole process (imports + 1 run)", k["process_s"], k["p_total_cpu"])):
            print(row.format(label, wall, f3(cpu), steps, "-", steps / wall, per(steps, cpu),
                             k["sim_s"]))
        for name, v in vs:
            in_proc = v["setup_s"] + v["loop_s"] + v["write_s"]
            for label, wall, cpu in ((f"{name} event loop", v["loop_s"], v["loop_cpu"]),
                                     (f"{name} setup + loop + metrics", in_proc, None),
                                     (f"{name} whole process", v["process_s"], v["total_cpu"])):
                print(row.format(label, wall, f3(cpu), v["decode"], v["batches"],
                                 v["decode"] / wall, per(v["decode"], cpu), v["sim_s"]))
        print(f"  kvsim: mean decode batch {k['mean_batch']:.1f}, TPOT {k['tpot_ms']:.2f} ms, "
              f"TTFT {k['ttft_ms']:.0f} ms; its process: imports {k['p_import_s']:.2f} s, "
              f"run {k['p_run_s']:.2f} s")
        for name, v in vs:
            print(f"  {name}: imports {v['import_s']:.2f} s, setup {v['setup_s']:.2f} s, "
                  f"event loop {v['loop_s']:.2f} s, metrics {v['write_s']:.2f} s; "
                  f"{v['prefill']} prefill + {v['decode']} decode batches, mean decode batch "
                  f"{v['decode_tokens'] / max(v['decode'], 1):.1f}")
            summary.append(
                f"{wl_label}, {name}: Vidur event loop / kvsim cold run_replay = "
                f"{v['loop_s'] / k['cold_s']:.0f}x wall, {v['loop_cpu'] / k['cold_cpu']:.0f}x "
                f"CPU (vs warm: {v['loop_s'] / k['warm_s']:.0f}x wall, "
                f"{v['loop_cpu'] / k['warm_cpu']:.0f}x CPU); whole processes "
                f"{v['process_s'] / k['process_s']:.1f}x wall; decode steps per CPU s: kvsim "
                f"{steps / k['cold_cpu']:.0f} (cold), Vidur {v['decode'] / v['loop_cpu']:.0f}")
    if summary:
        print()
        print("\n".join(summary))


if __name__ == "__main__":
    main()
