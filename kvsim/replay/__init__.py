"""``kvsim replay``: load trace -> analyse policy -> select costs -> simulate -> result.

A replay runs one :class:`~kvsim.replay.configuration.Configuration` (built and checked by
:func:`~kvsim.replay.configuration.configure`) and returns a
:class:`~kvsim.replay.result.ReplayResult`; each step is a call into the module that owns it, and
the result says where every input figure came from (:mod:`kvsim.replay.report`). Policy analysis
and trace loading are cached, so a sweep runs a policy on a trace's tensors once. Importing this
module loads no tensor code: the harness (and torch) load when a policy that needs attention is
analysed.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

from kvsim import trace as tracefile
from kvsim.contract import PolicyResult
from kvsim.errors import KvsimError
from kvsim.hw.catalog import GiB
from kvsim.hw.costs import costs_for
from kvsim.io import atomic_write
from kvsim.replay import policy_source, report
from kvsim.replay.configuration import (
    MAX_BATCH,
    MAX_REQUESTS,
    SLO_KEYS,
    Configuration,
    EngineChoice,
    Traffic,
    check_timeline,
    configure,
    with_dtypes,
)
from kvsim.replay.result import ReplayResult
from kvsim.sim import timeline as timelines
from kvsim.sim.engine import Memory, Simulator, default_token_budget
from kvsim.sim.metrics import Requests, window_of
from kvsim.sim.records import DEFAULT_HOST_GIB, DEFAULT_WORKSPACE_GIB, ChunkLog

__all__ = ["DEFAULT_TRACE", "MAX_BATCH", "MAX_REQUESTS", "SLO_KEYS", "Configuration",
           "EngineChoice", "ReplayResult", "Traffic", "analyze", "configure", "run_replay",
           "with_dtypes", "with_kv_read"]

DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "traces" / "smollm2-mk-2k.npz"


def run_replay(cfg: Configuration, progress: bool = False, timeline: str | Path | None = None,
               timeline_steps: int = 16, force: bool = False,
               jobs: int | None = None) -> ReplayResult:
    """The replay of ``cfg``. ``progress``: a bar over the trace's layers while a policy
    analyses them (on a terminal); ``timeline``: write a Chrome/Perfetto trace of the first
    ``timeline_steps`` decode steps there (an existing file only with ``force``); ``jobs``:
    processes for a long open loop (:mod:`kvsim.sim.segments`; None: the CPUs), the serial
    run's result whatever their number."""
    if not (isinstance(timeline_steps, int) and timeline_steps >= 1):
        raise KvsimError(f"--timeline-steps must be positive, got {timeline_steps}")
    if jobs is not None and (isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1):
        raise KvsimError(f"--jobs must be a whole number >= 1, got {jobs!r}")
    check_timeline(timeline, force)  # fail before the work, write nothing
    model = cfg.served_model
    # the workload first: a bad workload file fails before the trace and the policy's analysis
    work = cfg.traffic.build(cfg.batch, cfg.seed)
    trace_path = Path(cfg.trace) if cfg.trace is not None else DEFAULT_TRACE
    tr = load_trace(trace_path)
    costs, cost_source = costs_for(cfg.gpu, tr.hardware, cfg.engine.name,
                                   cfg.engine.overrides(), model.layers)
    costs.set_tp(cfg.deployment.tp, cfg.deployment.tp_link == "shared")
    n_plan = int(round(float(work.prompt.mean())))  # the profile's context: the mean prompt
    source = policy_source.choose(cfg, trace_path, n_plan, analyze, model)
    analysis, skipped = source.analysis, None
    if cfg.kv_read_frac is not None:
        try:
            analysis = with_kv_read(cfg.policy, analysis, cfg.kv_read_frac, model)
            source = policy_source.Source(analysis, None, warnings=source.warnings)
        except KvsimError as e:
            if cfg.kv_read_everywhere:
                raise
            skipped = str(e)
    work_at_prefill = cfg.policy.prefill_work(model)
    d = cfg.deployment
    memory = Memory(costs.hbm_bytes, _gib(d.host_gib, DEFAULT_HOST_GIB), model.weight_bytes,
                    _gib(d.workspace_gib, DEFAULT_WORKSPACE_GIB))
    scheduling = cfg.scheduling
    if scheduling.max_batched_tokens is None:
        scheduling = dataclasses.replace(scheduling, max_batched_tokens=default_token_budget(
            costs.gpu_name, costs.hbm_bytes))
    window = window_of(work.arrival, report.WARMUP, work.concurrency is not None)

    def simulate(cost, draws: bool = False):
        def one(draw: bool) -> Simulator:  # chunks are kept whole only for the timeline
            return Simulator(model, costs, cost, memory, cfg.batch, scheduling,
                             work_at_prefill, jobs=jobs, caching=cfg.caching, chunks=ChunkLog(
                                 keep=ChunkLog.keep if draw and timeline is not None else 0))
        sim = one(draws)  # the first replica draws the timeline
        requests = Requests(dict(cfg.slo), window)
        if d.replicas == 1:
            return sim, sim.run(work, requests)
        from kvsim.sim import replicas  # one simulator per replica
        sims = [sim] + [one(False) for _ in range(d.replicas - 1)]
        if work.concurrency is None and (d.router != "round-robin" or sim.caches(work)):
            return sim, replicas.merge(replicas.routed(sims, work, requests, d.router))
        return sim, replicas.merge([s.run(w, requests.fresh()) for s, w in
                                    zip(sims, replicas.split(work, d.replicas))])

    sim, res = simulate(analysis.cost, draws=True)
    if analysis.cost.decide_bytes_per_token > 0:
        costs.check_decide_range(float(work.prompt.max() + work.output.max()))
    out = report.build(cfg, trace_path, tr, analysis, model, costs, cost_source, memory, work,
                       res, scheduling, work_at_prefill)
    if source.applied is not None:
        bands = {end: report.simulation(simulate(r.cost)[1], work, scheduling)
                 for end, r in (("lo", source.lo), ("hi", source.hi)) if r is not None}
        report.add_profile(out, source.applied, bands)
    out.warnings += source.warnings
    if d.replicas > 1:
        how = d.router if work.concurrency is None else "round-robin (a closed loop)"
        out.provenance["workload"] += f"; {d.replicas} replicas behind a {how} router"
    if skipped:
        out.warnings.append(skipped)
    report.add_intervals(out, costs, model, d.tp)
    if timeline is not None:
        events = timelines.build(sim, res, timeline_steps)
        atomic_write(timeline, lambda f: f.write(json.dumps(events).encode()), force)
        out.timeline = str(timeline)
    return out


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


_ANALYSES: dict = {}  # (trace, mtime, policy, options, seed) -> PolicyResult
MAX_ANALYSES = 256


def analyze(path: Path, policy, seed: int, progress: bool = False) -> PolicyResult:
    """A policy's analysis of a trace (its cost stated for the trace's own head shape); it does
    not depend on GPU, model, context or batch, so a sweep computes it once per (trace, policy,
    options, seed)."""
    path = Path(path)
    key = (str(path.resolve()), _mtime(path), policy.name,
           json.dumps(dataclasses.asdict(policy.params), sort_keys=True, default=str), seed)
    if key not in _ANALYSES:
        if len(_ANALYSES) >= MAX_ANALYSES:
            _ANALYSES.pop(next(iter(_ANALYSES)))
        _ANALYSES[key] = _analyze(policy, key[0], key[1], seed, progress)
    return _ANALYSES[key]


def _analyze(policy, path: str, mtime: float, seed: int, progress: bool) -> PolicyResult:
    from kvsim.contract import by_definition
    if not policy.needs_attention:  # the dense baselines: no trace, no tensor code, no torch
        return by_definition(policy)
    from kvsim.measure import harness  # tensor code loads here, when a policy runs
    tr = _load(path, mtime)
    if tr.attention is None:
        raise KvsimError(f"policy {policy.name} needs a trace with an attention section "
                         f"(kvsim capture); {path} has none")
    return harness.analyze(policy, tr, seed, progress)


def with_kv_read(policy, analysis: PolicyResult, frac: float, model) -> PolicyResult:
    """The analysis with the policy's KV read per step replaced by ``frac`` (a measured fetch
    fraction, or a what-if); the policy derives its decode cost for ``model`` from it as from
    its own."""
    stats = {**analysis.stats, "kv_read_frac": float(frac)}
    cost = policy.decode_cost(stats, model)
    if abs(cost.host_read_frac - min(1.0, frac)) > 1e-12:
        raise KvsimError(f"--kv-read-frac does not apply to {policy.name}: it reads "
                         f"{cost.host_read_frac:g} of the cache per step by definition")
    return dataclasses.replace(analysis, cost=cost, stats=stats, provenance=(
        f"{analysis.provenance}; KV read per step {frac:g}: override (--kv-read-frac), "
        f"replacing the trace's {analysis.stats.get('kv_read_frac', 'none')}"))

