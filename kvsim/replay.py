"""``kvsim replay``: trace -> hardware costs -> policy -> simpy model -> one report.

The report says where every input figure came from (``provenance``): the trace section used, the
catalog entry and its public source, a default, or a command-line override.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvsim import trace as tracefile
from kvsim.errors import KvsimError
from kvsim.hw import catalog
from kvsim.hw.catalog import GiB, ModelSpec
from kvsim.hw.costs import CostModel
from kvsim.policies import REGISTRY, make
from kvsim.sim import workload as wl
from kvsim.io import atomic_write, check_destination
from kvsim.sim import timeline
from kvsim.sim.engine import Memory, SimResult, Simulator

DEFAULT_TRACE = Path(__file__).resolve().parent.parent / "traces" / "smollm2-mk-2k.npz"
DEFAULT_GPU = "h100-sxm"
DEFAULT_HOST_GIB = 256.0  # a 2 TiB host shared by 8 GPUs
DEFAULT_WORKSPACE_GIB = 4.0  # CUDA context, activations, allocator slack


@dataclass
class ReplayConfig:
    trace: str | Path | None = None  # None: the shipped default trace
    policy: str = "dense-offload"
    policy_options: dict = field(default_factory=dict)
    gpu: str | None = None  # catalog name; None: the trace's measured hardware, else h100-sxm
    model: str | ModelSpec = "qwen3-4b"
    context: int = 32768  # prompt tokens per request
    batch: int = 1  # max concurrent sequences in the decode batch
    qps: float | None = None  # Poisson arrivals; default is a closed loop
    concurrency: int | None = None  # closed loop (default: = batch)
    requests: int | None = None  # default: 2 x concurrency (closed) or 64 (Poisson)
    output_len: int = 128
    workload_csv: str | Path | None = None
    seed: int = 0
    host_gib: float | None = None
    workspace_gib: float | None = None
    timeline: str | Path | None = None  # write a Chrome/Perfetto trace of the first steps here
    timeline_steps: int = 16
    force: bool = False  # overwrite an existing timeline file


def _check(cfg: ReplayConfig) -> None:
    for name in ("context", "batch", "output_len"):
        if getattr(cfg, name) < 1:
            raise KvsimError(f"--{name.replace('_', '-')} must be positive, got {getattr(cfg, name)}")
    if cfg.qps is not None and cfg.concurrency is not None:
        raise KvsimError("give either --qps (open loop) or --concurrency (closed loop), not both")
    if cfg.timeline_steps < 1:
        raise KvsimError(f"--timeline-steps must be positive, got {cfg.timeline_steps}")
    for name in ("host_gib", "workspace_gib"):
        v = getattr(cfg, name)
        if v is not None and v < 0:
            raise KvsimError(f"--{name.replace('_', '-')} must be >= 0, got {v}")


def build_costs(cfg: ReplayConfig, tr: tracefile.Trace | None) -> tuple[CostModel, str]:
    """Measured tables when the trace has them (and no other GPU was named), else the catalog."""
    hw = tr.hardware if tr is not None else None
    if hw is not None and (cfg.gpu is None or cfg.gpu == hw.device.get("catalog_name")):
        base = catalog.gpu(cfg.gpu) if cfg.gpu else None
        return CostModel.from_hardware(hw, base), "trace hardware section"
    costs = CostModel.from_spec(catalog.gpu(cfg.gpu or DEFAULT_GPU))
    if hw is not None:
        costs.provenance["trace_hardware"] = (
            f"not used: the trace was profiled on {hw.device.get('name')!r}, "
            f"the plan is for {costs.gpu_name}")
    return costs, "catalog" if cfg.gpu else "catalog (default GPU)"


def build_workload(cfg: ReplayConfig) -> wl.Workload:
    if cfg.workload_csv is not None:
        return wl.from_csv(cfg.workload_csv)
    if cfg.qps is not None:
        return wl.poisson(cfg.qps, cfg.requests or 64, cfg.context, cfg.output_len, cfg.seed)
    conc = cfg.concurrency or cfg.batch
    return wl.closed_loop(conc, cfg.requests or 2 * conc, cfg.context, cfg.output_len)


def run_replay(cfg: ReplayConfig) -> dict:
    _check(cfg)
    if cfg.timeline is not None:
        check_destination(cfg.timeline, cfg.force)  # fail before the work, write nothing
    trace_path = Path(cfg.trace) if cfg.trace is not None else DEFAULT_TRACE
    tr = _load_trace(str(trace_path.resolve()), _mtime(trace_path))
    model = cfg.model if isinstance(cfg.model, ModelSpec) else catalog.model(cfg.model)
    analysis = _analyze(str(trace_path.resolve()), _mtime(trace_path), cfg.policy,
                        json.dumps(cfg.policy_options, sort_keys=True), cfg.seed)
    costs, cost_source = build_costs(cfg, tr)
    host_gib = DEFAULT_HOST_GIB if cfg.host_gib is None else cfg.host_gib
    ws_gib = DEFAULT_WORKSPACE_GIB if cfg.workspace_gib is None else cfg.workspace_gib
    memory = Memory(costs.hbm_bytes, host_gib * GiB, model.weight_bytes, ws_gib * GiB)
    sim = Simulator(model, costs, analysis.cost, memory, cfg.batch)
    work = build_workload(cfg)
    res = sim.run(work)
    report = summarize(res, work)
    report.update({
        "policy": cfg.policy, "policy_options": analysis.params, "gpu": costs.gpu_name,
        "model": model.name, "context": cfg.context, "batch": cfg.batch,
        "output_len": cfg.output_len, "seed": cfg.seed,
        "kv_read_frac": analysis.cost.host_read_frac,
        "resident_frac": analysis.cost.resident_frac,
        "hbm_limited": res.max_batch_fit < cfg.batch,
        "hbm_weights_gib": memory.weights_bytes / GiB,
        "hbm_workspace_gib": memory.workspace_bytes / GiB,
        "policy_stats": analysis.stats,
    })
    for k, v in analysis.stats.items():  # policy statistics also at top level (Table-2 keys)
        report.setdefault(k, v)
    kv_gib = report["hbm_gib"] - report["hbm_weights_gib"] - report["hbm_workspace_gib"]
    meta_share = (analysis.stats.get("sketch_frac", 0.0) / analysis.cost.resident_frac
                  if analysis.cost.resident_frac > 0 else 0.0)
    report["hbm_meta_gib"] = kv_gib * meta_share  # sketch and per-token metadata
    report["hbm_kv_gib"] = kv_gib - report["hbm_meta_gib"]
    warnings = []
    if res.max_batch_fit < cfg.batch:
        warnings.append(f"memory admits at most {res.max_batch_fit} requests at once, "
                        f"below --batch {cfg.batch}")
    if cfg.context + cfg.output_len > model.max_context:
        warnings.append(f"{cfg.context + cfg.output_len} tokens exceed {model.name}'s trained "
                        f"context of {model.max_context}")
    profiled = (tr.hardware.extra.get("model") or {}) if tr.hardware is not None else {}
    if cost_source.startswith("trace") and profiled.get("dtype_bytes", model.dtype_bytes) \
            != model.dtype_bytes:
        warnings.append(f"kernel tables were profiled with {profiled['dtype_bytes']}-byte values; "
                        f"{model.name} is planned with {model.dtype_bytes}-byte values")
    if costs.extrapolations:
        warnings += [f"extrapolated beyond measured table: {e}"
                     for e in sorted(costs.extrapolations)]
    report["warnings"] = warnings
    if cfg.timeline is not None:
        events = timeline.build(sim, res, cfg.timeline_steps)
        atomic_write(cfg.timeline, lambda f: f.write(json.dumps(events).encode()), cfg.force)
        report["timeline"] = str(cfg.timeline)
    report["provenance"] = provenance(cfg, trace_path, tr, model, costs, cost_source, analysis,
                                      host_gib, ws_gib, work)
    if "policy_transfer" in report["provenance"]:
        warnings.append(report["provenance"]["policy_transfer"])
    return report


def _mtime(path: Path) -> float:
    return path.stat().st_mtime if path.exists() else 0.0


@functools.lru_cache(maxsize=8)
def _load_trace(path: str, mtime: float) -> tracefile.Trace:
    return tracefile.load(path)


@functools.lru_cache(maxsize=256)
def _analyze(path: str, mtime: float, policy_name: str, options_json: str, seed: int):
    """A policy's analysis of a trace; it does not depend on GPU, model, context or batch, so a
    sweep computes it once per (trace, policy, options, seed)."""
    tr = _load_trace(path, mtime)
    policy = make(policy_name, json.loads(options_json))
    if policy.needs_attention and tr.attention is None:
        raise KvsimError(f"policy {policy_name} needs a trace with an attention section "
                         f"(kvsim capture); {path} has none")
    return policy.analyze(tr, seed=seed)


def summarize(res: SimResult, work: wl.Workload) -> dict:
    ttft = res.first_token - res.arrival
    e2e = res.finish - res.arrival
    multi = res.output > 1
    tpot = (res.finish - res.first_token)[multi] / (res.output[multi] - 1)
    makespan = float(res.finish.max() - res.arrival.min())
    decode = [c for c in res.chunks if c.kind == "decode"]
    decode_time = sum(c.duration for c in decode)
    gpu_busy = sum(c.gpu_busy for c in res.chunks)
    link_busy = sum(c.link_busy for c in res.chunks)
    pct = lambda a, q: float(np.percentile(a, q)) * 1e3 if len(a) else float("nan")  # noqa: E731
    return {
        "tpot_ms": float(tpot.mean()) * 1e3 if len(tpot) else float("nan"),
        "tpot_p50_ms": pct(tpot, 50), "tpot_p99_ms": pct(tpot, 99),
        "ttft_ms": float(ttft.mean()) * 1e3, "ttft_p50_ms": pct(ttft, 50),
        "ttft_p99_ms": pct(ttft, 99),
        "e2e_s": float(e2e.mean()),
        "throughput_tok_s": float(res.output.sum()) / makespan if makespan > 0 else float("nan"),
        "decode_tok_s": (sum(c.batch * c.steps for c in decode) / decode_time
                         if decode_time else float("nan")),
        "requests_per_s": work.n / makespan if makespan > 0 else float("nan"),
        "requests": work.n,
        "makespan_s": makespan,
        "decode_steps": int(sum(c.steps for c in decode)),
        "mean_batch": (sum(c.batch * c.duration for c in decode) / decode_time
                       if decode_time else 0.0),
        "mean_in_system": res.in_system_area / makespan if makespan > 0 else 0.0,
        "max_batch_fit": res.max_batch_fit,
        "hbm_gib": res.peak_hbm_bytes / GiB,
        "host_gib": res.peak_host_bytes / GiB,
        "gpu_util": gpu_busy / makespan if makespan > 0 else 0.0,
        "link_util": link_busy / makespan if makespan > 0 else 0.0,
    }


def provenance(cfg, trace_path, tr, model, costs, cost_source, analysis, host_gib, ws_gib,
               work) -> dict:
    meta = tr.meta
    p = {
        "trace": f"{trace_path} ({tr.describe()}; recorded by {meta.get('recorded_by')}, "
                 f"{meta.get('created')})",
        "costs": cost_source,
        **{f"hw.{k}": v for k, v in costs.provenance.items()},
        "model": f"catalog {model.name} ({model.source})" if model.name in catalog.MODELS
                 else f"user-supplied shape {model.name}",
        "policy": f"{analysis.name}: {analysis.provenance}",
        "host_memory": f"{host_gib:g} GiB " + ("(override --host-gib)" if cfg.host_gib is not None
                                              else "(default: 2 TiB host / 8 GPUs)"),
        "workspace": f"{ws_gib:g} GiB " + ("(override --workspace-gib)"
                                          if cfg.workspace_gib is not None
                                          else "(default: CUDA context, activations, slack)"),
        "workload": work.description,
    }
    if REGISTRY[cfg.policy].needs_attention:
        src_model, src_ctx = meta.get("model"), tr.attention.context_len
        if src_model != model.name or src_ctx != cfg.context:
            p["policy_transfer"] = (
                f"policy statistics measured on {src_model} at {src_ctx} context tokens are "
                f"applied to {model.name} at {cfg.context} tokens")
    return p
