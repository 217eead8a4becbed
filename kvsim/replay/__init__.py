"""``kvsim replay``: load trace -> analyse policy -> select costs -> simulate -> report.

Each step is a call into the module that owns it; the report (:mod:`kvsim.replay.report`) says
where every input figure came from. Policy analysis and trace loading are cached, so a sweep runs
a policy on a trace's tensors once. Importing this module loads no tensor code: the harness (and
torch) load when a policy that needs attention is analysed.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path

from kvsim import trace as tracefile
from kvsim.checks import positive, real, share, whole
from kvsim.contract import PolicyResult, PrefillWork
from kvsim.errors import KvsimError
from kvsim.hw import catalog
from kvsim.hw.catalog import GiB, ModelSpec
from kvsim.hw.costs import costs_for
from kvsim.io import atomic_write, check_destination
from kvsim.policies.spec import PolicySpec, parse
from kvsim.replay import policy_source, report
from kvsim.sim import timeline, workload
from kvsim.sim.engine import Memory, Scheduling, Simulator, default_token_budget
from kvsim.sim.metrics import Requests, window_of
from kvsim.sim.records import (
    DEFAULT_HOST_GIB,
    DEFAULT_WORKSPACE_GIB,
    KV_DTYPES,
    WEIGHT_DTYPES,
    ChunkLog,
    Deployment,
)

SLO_KEYS = ("tpot_ms", "ttft_ms", "e2e_s")

DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "traces" / "smollm2-mk-2k.npz"
MAX_BATCH = 1_000_000  # sequences in one batch: far beyond any GPU's memory
MAX_REQUESTS = 100_000_000  # per simulation


@dataclass
class ReplayConfig(Scheduling, Deployment):
    """One replay. Its scheduling fields (scheduler, max_batched_tokens, admission, preemption,
    admission_order; ``max_batched_tokens`` None: vLLM's for the GPU) and deployment fields
    (element types, tp, tp_link, replicas, router, host_gib, workspace_gib) are those of
    :class:`kvsim.sim.rules.Scheduling` and :class:`kvsim.sim.records.Deployment`, written
    once there with their flags' help."""
    trace: str | Path | None = None  # None: the shipped default trace
    policy: str = "dense-offload"  # a policy spec: NAME[:KEY=VALUE...]
    policy_options: dict = field(default_factory=dict)
    gpu: str | None = None  # catalog name; None: the trace's measured hardware, else h100-sxm
    model: str | ModelSpec = "qwen3-4b"
    context: int = 32768  # prompt tokens per request
    batch: int = 1  # max concurrent sequences in the decode batch
    qps: float | None = None  # Poisson arrivals; default is a closed loop
    concurrency: int | None = None  # closed loop (default: = batch)
    requests: int | None = None  # default: 2 x concurrency (closed) or 64 (Poisson)
    output_len: int = 128
    workload_csv: str | Path | None = None  # a workload file: kvsim's CSV or a public trace
    workload_format: str = "auto"  # auto | kvsim | azure | burstgpt | mooncake
    time_scale: float = 1.0  # the file's arrival times multiplied by this (0.5: twice the rate)
    workload_limit: int | None = None  # only the file's first N requests by arrival
    seed: int = 0
    timeline: str | Path | None = None  # write a Chrome/Perfetto trace of the first steps here
    timeline_steps: int = 16
    force: bool = False  # overwrite an existing timeline file
    slo: dict = field(default_factory=dict)  # per-request goodput limits: tpot_ms, ttft_ms, e2e_s
    engine: str | None = None  # an engine profile: built-in name or JSON file (kvsim fit)
    policy_profile: str | None = None  # FILE, "default" or "none"; None: the shipped profile
    # when no trace is named (kvsim.replay.policy_source)
    jobs: int | None = None  # processes for a long open loop (kvsim.sim.segments); None: CPUs
    # what-if overrides, each recorded in provenance as such
    kv_read_frac: float | None = None  # the policy's KV read per step, replacing the trace's
    kv_read_everywhere: bool = True  # False (plan): policies that do not fetch keep their own
    decide_ms: float | None = None  # decide per request and decode step, all layers
    step_overhead_ms: float | None = None
    link_gbps: float | None = None

    def check(self) -> None:
        for name in ("context", "batch", "output_len", "timeline_steps", "requests",
                     "concurrency"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise KvsimError(f"--{name.replace('_', '-')} must be positive, got {v}")
        for name, most in (("batch", MAX_BATCH), ("concurrency", MAX_BATCH),
                           ("requests", MAX_REQUESTS)):
            v = getattr(self, name)
            if v is not None and v > most:
                raise KvsimError(f"--{name} {v:,} is beyond what kvsim simulates ({most:,})")
        if self.qps is not None and not (math.isfinite(self.qps) and self.qps > 0):
            raise KvsimError(f"--qps must be a finite rate > 0, got {self.qps}")
        if self.qps is not None and self.concurrency is not None:
            raise KvsimError("give either --qps (open loop) or --concurrency (closed loop), "
                             "not both")
        if self.gpu is not None and not str(self.gpu).strip():
            raise KvsimError("--gpu is empty: name a catalog GPU (kvsim catalog)")
        for k, v in self.slo.items():
            if k not in SLO_KEYS or not (isinstance(v, (int, float)) and v > 0):
                raise KvsimError(f"SLO {k}={v!r}: give a positive --slo-tpot-ms, --slo-ttft-ms "
                                 f"or --slo-e2e-s")
        Scheduling.check(self)
        Deployment.check(self)
        if self.kv_read_frac is not None:
            share(self.kv_read_frac, "--kv-read-frac")
        whole(self.seed, "--seed")
        for name in ("decide_ms", "step_overhead_ms"):
            if getattr(self, name) is not None:
                real(getattr(self, name), f"--{name.replace('_', '-')}", least=0)
        if self.jobs is not None and (isinstance(self.jobs, bool) or
                                      not isinstance(self.jobs, int) or self.jobs < 1):
            raise KvsimError(f"--jobs must be a whole number >= 1, got {self.jobs!r}")
        if self.link_gbps is not None:
            positive(self.link_gbps, "--link-gbps")
        if self.workload_format != "auto" and self.workload_format not in workload.FORMATS:
            raise KvsimError(f"--workload-format {self.workload_format!r}: one of auto, "
                             f"{', '.join(workload.FORMATS)}")
        workload.check_scale_limit(self.time_scale, self.workload_limit)
        if self.workload_csv is None and (self.workload_format != "auto" or self.time_scale != 1
                                          or self.workload_limit is not None):
            raise KvsimError("--workload-format, --time-scale and --limit apply to a --workload "
                             "file")
        if self.timeline is not None:
            check_destination(self.timeline, self.force)  # fail before the work, write nothing

    def overrides(self) -> dict:
        return {k: getattr(self, k) for k in ("decide_ms", "step_overhead_ms", "link_gbps")
                if getattr(self, k) is not None}

    def scheduling(self, default_budget: int) -> Scheduling:
        """The scheduling options, the token budget given or ``default_budget``."""
        over = {} if self.max_batched_tokens is not None else \
            {"max_batched_tokens": default_budget}
        return Scheduling(**{f.name: getattr(self, f.name) for f in fields(Scheduling)} | over)


def run_replay(cfg: ReplayConfig, progress: bool = False) -> dict:
    """The replay ``cfg`` asks for; ``progress``: a bar over the trace's layers while a policy
    analyses them (on a terminal)."""
    cfg.check()
    spec = one_policy(cfg.policy, cfg.policy_options)
    model = with_dtypes(cfg.model if isinstance(cfg.model, ModelSpec) else
                        catalog.model(cfg.model), cfg.kv_dtype, cfg.weight_dtype).shard(cfg.tp)
    # the workload first: a bad workload file fails before the trace and the policy's analysis
    work = workload.build(cfg.workload_csv, cfg.qps, cfg.concurrency, cfg.batch, cfg.requests,
                          cfg.context, cfg.output_len, cfg.seed, cfg.workload_format,
                          cfg.time_scale, cfg.workload_limit)
    trace_path = Path(cfg.trace) if cfg.trace is not None else DEFAULT_TRACE
    tr = load_trace(trace_path)
    costs, cost_source = costs_for(cfg.gpu, tr.hardware, cfg.engine, cfg.overrides(),
                                   model.layers)
    costs.set_tp(cfg.tp, cfg.tp_link == "shared")
    n_plan = int(round(float(work.prompt.mean())))  # the profile's context: the mean prompt
    source = policy_source.choose(cfg, spec, trace_path, n_plan, analyze, model)
    analysis = source.analysis
    skipped = None
    if cfg.kv_read_frac is not None:
        try:
            analysis = with_kv_read(spec, analysis, cfg.kv_read_frac, model)
            source = policy_source.Source(analysis, None, warnings=source.warnings)
        except KvsimError as e:
            if cfg.kv_read_everywhere:
                raise
            skipped = str(e)
    work_at_prefill = prefill_work(spec, model)
    memory = Memory(costs.hbm_bytes, _gib(cfg.host_gib, DEFAULT_HOST_GIB),
                    model.weight_bytes, _gib(cfg.workspace_gib, DEFAULT_WORKSPACE_GIB))
    scheduling = cfg.scheduling(default_token_budget(costs.gpu_name, costs.hbm_bytes))

    window = window_of(work.arrival, report.WARMUP, work.concurrency is not None)

    def simulate(cost):
        # chunks are kept whole only for the timeline (else only summed)
        sim = Simulator(model, costs, cost, memory, cfg.batch, scheduling, work_at_prefill,
                        jobs=cfg.jobs, chunks=ChunkLog(keep=0 if cfg.timeline is None else
                                                       ChunkLog.keep))
        requests = Requests(dict(cfg.slo), window)
        if cfg.replicas == 1:
            return sim, sim.run(work, requests)
        from kvsim.sim import replicas  # one simulator per replica (the first draws the timeline)
        sims = [sim] + [Simulator(model, costs, cost, memory, cfg.batch, scheduling,
                                  work_at_prefill, jobs=cfg.jobs, chunks=ChunkLog(keep=0))
                        for _ in range(cfg.replicas - 1)]
        if cfg.router == "least-loaded" and work.concurrency is None:
            return sim, replicas.merge(replicas.least_loaded(sims, work, requests))
        return sim, replicas.merge([s.run(w, requests.fresh()) for s, w in
                                    zip(sims, replicas.split(work, cfg.replicas))])

    sim, res = simulate(analysis.cost)
    if analysis.cost.decide_bytes_per_token > 0:
        costs.check_decide_range(float(work.prompt.max() + work.output.max()))
    out = report.build(cfg, trace_path, tr, spec, analysis, model, costs, cost_source, memory,
                       work, res, scheduling, work_at_prefill)
    if source.applied is not None:
        bands = {end: report.simulation(simulate(r.cost)[1], work)
                 for end, r in (("lo", source.lo), ("hi", source.hi)) if r is not None}
        report.add_profile(out, source.applied, bands)
    out["warnings"] += source.warnings
    if cfg.replicas > 1:
        how = cfg.router if work.concurrency is None else "round-robin (a closed loop)"
        out["provenance"]["workload"] += f"; {cfg.replicas} replicas behind a {how} router"
    if skipped:
        out["warnings"].append(skipped)
    report.add_intervals(out, costs, model, cfg.tp)
    if cfg.timeline is not None:
        events = timeline.build(sim, res, cfg.timeline_steps)
        atomic_write(cfg.timeline, lambda f: f.write(json.dumps(events).encode()), cfg.force)
        out["timeline"] = str(cfg.timeline)
    return out


def with_dtypes(model: ModelSpec, kv: str | None, weight: str | None) -> ModelSpec:
    """The model with its KV cache and layer weights stored in other element types: bytes
    change everywhere (HBM, host memory, the link, admission); compute stays as profiled."""
    import dataclasses
    over = {}
    for flag, value, table, field_name in (("--kv-dtype", kv, KV_DTYPES, "kv_dtype_bytes"),
                                           ("--weight-dtype", weight, WEIGHT_DTYPES,
                                            "weight_dtype_bytes")):
        if value is None:
            continue
        if value not in table:
            raise KvsimError(f"{flag} {value!r}: one of {', '.join(table)}")
        over[field_name] = table[value]
    return dataclasses.replace(model, **over) if over else model


def one_policy(text: str, options: dict) -> PolicySpec:
    """The one policy a replay runs; options it does not take are an error here (the command
    line reports flags meant for other policies before it gets this far)."""
    specs, unused = parse(text, options)
    if len(specs) != 1:
        raise KvsimError(f"replay runs one policy; got {len(specs)} ({text})")
    if unused:
        raise KvsimError(f"{', '.join(unused)} does not apply to policy {specs[0].name}")
    return specs[0]


def _gib(value: float | None, default: float) -> float:
    return (default if value is None else value) * GiB


def _mtime(path: Path) -> float:
    return path.stat().st_mtime if path.exists() else 0.0


def load_trace(path: Path) -> tracefile.Trace:
    from kvsim.io import regular_file
    regular_file(path, "trace")  # before resolve(): a symlink loop or a FIFO is one line
    return _load(str(path.resolve()), _mtime(path))


@functools.lru_cache(maxsize=8)
def _load(path: str, mtime: float) -> tracefile.Trace:
    return tracefile.load(path)


def analyze(path: Path, spec: PolicySpec, seed: int, progress: bool = False) -> PolicyResult:
    """A policy's analysis of a trace; it does not depend on GPU, model, context or batch, so a
    sweep computes it once per (trace, policy, options, seed)."""
    return _analyze(str(path.resolve()), _mtime(path), spec.name,
                    json.dumps(spec.options, sort_keys=True), seed, progress)


@functools.lru_cache(maxsize=256)
def _analyze(path: str, mtime: float, name: str, options_json: str, seed: int,
             progress: bool = False) -> PolicyResult:
    from kvsim.contract import by_definition
    from kvsim.policies import make
    policy = make(name, json.loads(options_json))
    if not policy.needs_attention:  # the dense baselines: no trace, no tensor code, no torch
        return by_definition(policy)
    from kvsim.measure import harness  # tensor code loads here, when a policy runs
    tr = _load(path, mtime)
    if policy.needs_attention and tr.attention is None:
        raise KvsimError(f"policy {name} needs a trace with an attention section "
                         f"(kvsim capture); {path} has none")
    return harness.analyze(policy, tr, seed, progress)


def with_kv_read(spec: PolicySpec, analysis: PolicyResult, frac: float,
                 model) -> PolicyResult:
    """The analysis with the policy's KV read per step replaced by ``frac`` (a measured fetch
    fraction, or a what-if); the policy derives its decode cost for ``model`` from it as from
    its own."""
    import dataclasses

    from kvsim.policies import make
    stats = {**analysis.stats, "kv_read_frac": float(frac)}
    cost = make(spec.name, spec.options).decode_cost(stats, model)
    if abs(cost.host_read_frac - min(1.0, frac)) > 1e-12:
        raise KvsimError(f"--kv-read-frac does not apply to {spec.name}: it reads "
                         f"{cost.host_read_frac:g} of the cache per step by definition")
    return dataclasses.replace(analysis, cost=cost, stats=stats, provenance=(
        f"{analysis.provenance}; KV read per step {frac:g}: override (--kv-read-frac), "
        f"replacing the trace's {analysis.stats.get('kv_read_frac', 'none')}"))


def prefill_work(spec: PolicySpec, model: ModelSpec) -> PrefillWork:
    """The policy's own work after a prefill on the planned model (counted by the policy)."""
    from kvsim.policies import make
    return make(spec.name, spec.options).prefill_work(model)
