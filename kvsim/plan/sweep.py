"""A sweep: the cross product of GPUs, models, contexts, policies (with their option grids),
deployments (TP sizes, replicas, KV dtypes, host memory), scheduling (tokens per step) and batch
sizes or arrival rates, each simulated by
:func:`kvsim.replay.run_replay`.

A configuration whose weights and workspace alone exceed a GPU's HBM is pruned before it is
simulated: it becomes an infeasible row that says so.

With a workload file each configuration replays the file (its arrivals, prompts and outputs);
the SLO search then runs the file's first requests with their arrival times scaled to each rate
it tries, so the file's burstiness and length mix are kept.

Each configuration is a typed :class:`~kvsim.replay.configuration.Configuration` (its policy
built once); its table row is made at the edge (:func:`columns`, then the replay's figures).
Configurations that share a policy analysis (trace, policy, options, seed) run in one task, so the
policy runs on the trace's tensors once per group. A failed run becomes a row with its error and
the sweep goes on; a re-run skips configurations already in the output table.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from kvsim.errors import Infeasible, KvsimError
from kvsim.hw import catalog
from kvsim.plan import slo
from kvsim.plan.fleet import MAX_REPLICAS, MAX_TARGET_QPS
from kvsim.policies.spec import PolicySpec, parse
from kvsim.replay import Configuration, configure, run_replay
from kvsim.replay.configuration import file_workload
from kvsim.sim.records import ROUTERS

DEPLOYMENT_AXES = ("tp", "replicas", "kv_dtype", "host_gib")  # a plan sweeps lists of these
SCHEDULING_AXES = ("max_batched_tokens",)
CACHING_AXES = ("cache_host_gib", "cache_disk_gib", "cache_pool_gib")
KNOBS = (("scheduling", "max_batched_tokens"), ("deployment", "host_gib"),  # swept settings
         *(("caching", k) for k in CACHING_AXES))
KEYS = "typed configurations"  # how rows are keyed (a plan keyed otherwise is another plan)


@dataclass
class SweepSpec:
    gpus: list[str]
    models: list[str]
    contexts: list[int]
    policies: list[str]  # policy specs, NAME[:KEY=VALUE...]
    batches: list[int] = field(default_factory=lambda: [1])
    qps: list[float] | None = None  # open loop at these rates (batch = max batch)
    option_grid: dict[str, list] = field(default_factory=dict)  # option -> values to sweep
    output_len: int = 128
    requests: int | None = None
    seed: int = 0
    trace: str | None = None
    slo: list[slo.Limit] = field(default_factory=list)  # search the highest sustained rate
    slo_requests: int = 1000
    scheduling: dict = field(default_factory=dict)  # Scheduling's fields (as configure takes
    # them); a list of values sweeps that field (max_batched_tokens)
    engine: dict = field(default_factory=dict)  # the engine and what-if fields (configure's)
    deployment: dict = field(default_factory=dict)  # kv_dtype, weight_dtype, tp, tp_link,
    # host_gib; a list of values sweeps that field
    target_qps: float | None = None  # size each configuration's fleet for this rate
    routers: list[str] | None = None  # the routers a deployment search tries (None: all)
    defaulted: frozenset = frozenset()  # axes the command filled in (not the user's choice)
    workload: str | None = None  # a workload file (kvsim replay --workload) instead of contexts
    caching: dict = field(default_factory=dict)  # PrefixCaching's fields set (configure's
    # names); a list of values sweeps that field (the tiers' sizes)

    def settings(self) -> dict:
        """What makes two plans the same plan, whatever configurations each lists: everything
        but the swept axes (GPUs, models, contexts, policies, batches or rates, TP sizes,
        replicas, KV dtypes, host memory, tokens per step). A plan resumes, or extends its axes,
        only into a DIR holding the same settings."""
        return {"output_len": self.output_len, "requests": self.requests, "seed": self.seed,
                "trace": self.trace, "engine": self.engine,
                "scheduling": {k: v for k, v in self.scheduling.items()
                               if k not in SCHEDULING_AXES},
                "deployment": {k: v for k, v in self.deployment.items()
                               if k not in DEPLOYMENT_AXES},
                "slo": [lim.words() for lim in self.slo], "slo_requests": self.slo_requests,
                "target_qps": self.target_qps, "routers": self.routers,
                "workload": self.workload,
                **({"caching": {k: v for k, v in self.caching.items() if k not in CACHING_AXES}}
                   if self.caching else {}),
                "keys": KEYS}

    def input_files(self) -> dict[str, Path]:
        """The files the plan reads, by the name a resumed plan records them under (model
        configs, profiled GPUs, the trace, the workload, an engine or policy profile, and the
        built-in engine a name or the GPUs' default picks: ``engine trtllm``): a resumed plan
        checks they are what its rows were run on (a refitted built-in engine included)."""
        from kvsim.hw import catalog
        from kvsim.hw.engine import BUILTIN, default_for, resolve
        from kvsim.hw.hfconfig import looks_like_path
        named = self.engine.get("engine")
        names = [n for n in (*self.models, *self.gpus) if looks_like_path(n)] + [
            self.trace, self.workload, named, self.engine.get("policy_profile")]
        paths = [Path(n) / "config.json" if Path(n).is_dir() else Path(n) for n in names if n]
        out = {str(p): p for p in paths if p.is_file()}
        engines = [named] if named else [default_for(catalog.gpu(g).vendor)
                                         for g in self.gpus if g.lower() in catalog.GPUS]
        for family in {resolve(e)[0] for e in engines if not Path(e).is_file()} & set(BUILTIN):
            out[f"engine {family}"] = BUILTIN[family]
        return out

    def file_contexts(self) -> list[int]:
        """The contexts swept: the workload file's mean prompt where there is one."""
        if self.workload is None:
            return self.contexts
        return [int(round(float(file_workload(self.workload).prompt.mean())))]

    def deployments(self) -> list[dict]:
        """One deployment per combination of the listed values; a field at its default is left
        out, as a single value always was (the configuration keys of earlier plans hold)."""
        from kvsim.sim.records import Deployment
        defaults = {f.name: f.default for f in dataclasses.fields(Deployment)}
        names = list(self.deployment)
        axes = [v if isinstance(v, list) else [v] for v in self.deployment.values()]
        return [{k: v for k, v in zip(names, combo) if v != defaults.get(k)}
                for combo in itertools.product(*axes)]

    def schedulings(self) -> list[dict]:
        """One scheduling per combination of the listed values (a single value: the fields as
        given, so the configuration keys of earlier plans hold)."""
        return _combinations(self.scheduling)

    def cachings(self) -> list[dict]:
        """One prefix-caching setting per combination of the listed tier sizes."""
        return _combinations(self.caching)

    def caches(self) -> bool:
        """Whether the plan's runs cache prefixes: a workload that names its prefix blocks,
        unless --prefix-caching off (the policies that cannot are told in their rows)."""
        return self.workload is not None and self.caching.get("prefix_caching") != "off" \
            and file_workload(self.workload).prefix_hashes is not None

    def policy_specs(self) -> list[PolicySpec]:
        """One validated spec per policy and combination of the option grid's values."""
        specs, unused = parse(self.policies, self.option_grid, grid=True)
        if unused:
            raise KvsimError(f"{', '.join(unused)} apply to none of the policies "
                             f"{', '.join(self.policies)}")
        return specs

    def validate(self) -> None:
        named: dict = {}  # what each item resolves to: two items naming one is a duplicate
        for flag, items, resolve in (
                ("--gpu", self.gpus, lambda g: g if Path(g).suffix == ".npz" else
                 catalog.gpu(g).name),
                ("--model", self.models, lambda m: str(Path(m).resolve()) if Path(m).is_file()
                 else catalog.model(m).name)):
            for item in items:
                same = named.setdefault((flag, resolve(item)), item)
                if same != item:
                    raise KvsimError(f"{flag} lists {same} and {item}, which are the same; "
                                     f"each once")
        self.policy_specs()
        if self.workload is not None:
            work = file_workload(self.workload)
            if self.qps:
                raise KvsimError("--workload sets the arrivals (the SLO search scales them); "
                                 "leave out --qps")
            if self.slo and work.n < 2 * self.slo_requests:
                raise KvsimError(f"--workload {self.workload}: the SLO search runs "
                                 f"2 x --slo-requests = {2 * self.slo_requests} of its requests; "
                                 f"it has {work.n}: lower --slo-requests")
        for name, values in (("--context", self.file_contexts()), ("--batch", self.batches),
                             ("--qps", self.qps or [1])):
            if not values or min(values) <= 0:
                raise KvsimError(f"{name} needs positive values")
        from kvsim.replay.configuration import MAX_REQUESTS
        if not 10 <= self.slo_requests <= MAX_REQUESTS // 2:
            raise KvsimError(f"--slo-requests must be at least 10 (the first fifth warms the "
                             f"system up) and at most {MAX_REQUESTS // 2:,} (a rate that "
                             f"passes runs again twice as long; a replay simulates at most "
                             f"{MAX_REQUESTS:,} requests); got {self.slo_requests:,}")
        for c in self.cachings():  # (a list flag holds a value at least: parse_list)
            configure(policy="dense-resident", **c)
        for sched in self.schedulings():
            configure(policy="dense-resident", **sched, **self.engine)
        deployments = self.deployments()
        for d in deployments:
            for m in self.models:  # element types and the TP split, for every model
                configure(policy="dense-resident", model=m, **d)
        if self.target_qps is not None:
            if not (math.isfinite(self.target_qps) and 0 < self.target_qps <= MAX_TARGET_QPS):
                raise KvsimError(f"--target-qps must be a positive rate of at most "
                                 f"{MAX_TARGET_QPS:,.0f} req/s (beyond what a fleet of "
                                 f"{MAX_REPLICAS:,} replicas can be simulated to carry), got "
                                 f"{self.target_qps:g}")
            if not self.slo:
                raise KvsimError("--target-qps needs an SLO to size replicas by: give "
                                 "--slo-tpot-ms, --slo-ttft-ms or --slo-e2e-s")
            if self.qps:
                raise KvsimError("--target-qps sizes replicas from each configuration's "
                                 "sustained rate; leave out --qps")
            if any(d.get("replicas", 1) != 1 for d in deployments):
                raise KvsimError("--target-qps computes the replicas each configuration needs; "
                                 "leave out --replicas")
            if len(self.models) > 1 or len(self.file_contexts()) > 1:
                raise KvsimError(
                    f"--target-qps decides one deployment for one model and one prompt "
                    f"length; this plan lists {len(self.models)} model(s) and "
                    f"{len(self.file_contexts())} context(s): run one plan per (model, "
                    f"context), or leave out --target-qps to compare them")
        unknown = [r for r in self.routers or [] if r not in ROUTERS]
        if unknown:
            raise KvsimError(f"--router {unknown[0]!r}: one of {', '.join(ROUTERS)}")
        if self.routers and len(self.routers) > 1 and self.target_qps is None:
            raise KvsimError("--router takes several routers only with --target-qps (the "
                             "deployment search tries each); give one")
        if self.engine.get("engine") is not None:
            from kvsim.hw.engine import load
            load(self.engine["engine"])  # an unreadable engine file fails before the sweep


def _combinations(fields_: dict) -> list[dict]:
    names = list(fields_)
    axes = [v if isinstance(v, list) else [v] for v in fields_.values()]
    return [dict(zip(names, combo)) for combo in itertools.product(*axes)]


def expand(spec: SweepSpec) -> list[Configuration]:
    """Every configuration of the sweep, each checked and with its policy built once."""
    spec.validate()
    configs = []
    loads = [("batch", b) for b in spec.batches] if not spec.qps else \
        [("qps", q) for q in spec.qps]
    goodput = slo.goodput_limits(spec.slo)
    for gpu, model, ctx, pol, dep, sched, caching in itertools.product(
            spec.gpus, spec.models, spec.file_contexts(), spec.policy_specs(),
            spec.deployments(), spec.schedulings(), spec.cachings()):
        hardware = str(gpu).endswith(".npz")  # a profiled trace stands for its GPU
        for kind, value in loads:
            configs.append(configure(
                policy=pol, model=model, gpu=None if hardware else gpu,
                trace=gpu if hardware else spec.trace, context=int(ctx),
                batch=int(value) if kind == "batch" else int(max(spec.batches)),
                qps=float(value) if kind == "qps" else None, output_len=spec.output_len,
                requests=spec.requests, seed=spec.seed, workload_csv=spec.workload,
                slo=goodput, kv_read_everywhere=False,  # --kv-read-frac: the fetching ones
                **sched, **spec.engine, **dep, **caching))
    return configs


def columns(cfg: Configuration) -> dict:
    """A configuration as a table row's first columns (what a reader filters on; the options
    as JSON text), before the replay's figures."""
    d, s = cfg.deployment, cfg.scheduling
    set_scheduling = {f.name: getattr(s, f.name) for f in dataclasses.fields(s)
                      if getattr(s, f.name) != f.default}
    set_deployment = {f.name: getattr(d, f.name) for f in dataclasses.fields(d)
                      if getattr(d, f.name) != f.default}
    engine = {k: v for k, v in dataclasses.asdict(cfg.engine).items() if v is not None}
    engine = ({"engine": engine.pop("name")} if "name" in engine else {}) | engine | {
        k: getattr(cfg, k) for k in ("policy_profile", "kv_read_frac")
        if getattr(cfg, k) is not None}
    output_len = cfg.traffic.output_len
    if cfg.traffic.workload:  # the file's (mean) lengths, not the flags'
        output_len = int(round(float(file_workload(cfg.traffic.workload).output.mean())))
    return {**({"workload": cfg.traffic.workload} if cfg.traffic.workload else {}),
            "gpu": gpu_of(cfg), "model": cfg.model_name, "context": cfg.context,
            "policy": cfg.policy.name, "options": json.dumps(cfg.options, sort_keys=True),
            "batch": cfg.batch, "qps": cfg.traffic.qps, "output_len": output_len,
            "requests": cfg.traffic.requests, "seed": cfg.seed,
            "trace": None if gpu_of(cfg) == cfg.trace else cfg.trace,
            "scheduling": json.dumps(set_scheduling, sort_keys=True),
            "engine": json.dumps(engine, sort_keys=True),
            "deployment": json.dumps(set_deployment, sort_keys=True),
            "tp": d.tp, "replicas": d.replicas, "kv_dtype": d.kv_dtype or "bf16",
            **{k: getattr(cfg.caching, k) for k in CACHING_AXES if getattr(cfg.caching, k)},
            "knobs": " ".join(f"{k} {v:g}" for k, v in knobs(cfg).items()),
            "label": label(cfg.policy.name, cfg.options), "key": cfg.key()}


def knobs(cfg: Configuration) -> dict:
    """The scheduling and memory settings a plan sweeps (:data:`KNOBS`) that ``cfg`` sets (a
    cache tier where it has a size)."""
    return {knob: v for group, knob in KNOBS
            if (v := getattr(getattr(cfg, group), knob)) is not None
            and (group != "caching" or v)}


def gpu_of(cfg: Configuration) -> str:
    """The GPU as the plan names it: a catalog name, or the profiled trace standing for it."""
    return cfg.gpu if cfg.gpu is not None else str(cfg.trace)


def label(policy: str, options: str | dict) -> str:
    """Short legend label: ``verkv c16 eps0.05 2bit``."""
    opts = json.loads(options) if isinstance(options, str) else options
    short = {"compression": "c", "eps": "eps", "delta": "delta", "coef_bits": "bits"}
    parts = [f"{short.get(k, k)}{v:g}" if isinstance(v, (int, float)) and not isinstance(v, bool)
             else str(v) if isinstance(v, str) else f"{k}={v}" for k, v in sorted(opts.items())]
    return " ".join([policy, *parts])


def weights_exceed_hbm(cfg: Configuration) -> str | None:
    """Why a configuration cannot run on its GPU whatever its policy and batch (its weights and
    workspace alone exceed HBM), or None; only for catalog GPUs."""
    if cfg.gpu is None:
        return None
    from kvsim.sim.records import DEFAULT_WORKSPACE_GIB
    model = cfg.served_model
    hbm = catalog.gpu(cfg.gpu).hbm_gib * catalog.GiB
    workspace = cfg.deployment.workspace_gib
    need = model.weight_bytes + (DEFAULT_WORKSPACE_GIB if workspace is None else
                                 workspace) * catalog.GiB
    if need <= hbm:
        return None
    return (f"pruned before simulation: HBM: weights and workspace need "
            f"{need / catalog.GiB:.1f} GiB per GPU at TP {cfg.deployment.tp}, "
            f"{cfg.gpu} has {hbm / catalog.GiB:.1f} GiB")


def run_config(cfg: Configuration, limits: list, probe_requests: int, run=None) -> dict:
    """One configuration's table row: its columns, its replay's figures, and with ``limits``
    the highest rate one replica sustains within them (the SLO search,
    :mod:`kvsim.plan.slo`). ``run``: the replay the row is of (default: ``cfg`` as given;
    a deployment search's is one replica at the target rate, :mod:`kvsim.plan.deployment`)."""
    row = columns(cfg)
    try:
        r = run_replay(cfg if run is None else run)
        for k, v in result_columns(r).items():
            row.setdefault(k, v)  # the configuration's own columns come first
        if limits and run is None:
            def search(lims, start):
                return slo.max_qps(lambda q, n: run_replay(cfg.at_rate(q, n)), lims,
                                   probe_requests, start=start)

            found = search(limits, r.serving.requests_per_s)
            spread = r.interval.get("spread")
            if spread:
                row["slo_max_qps_lo"], row["slo_max_qps_hi"] = slo.capacity_interval(
                    search, limits, found.qps, spread)
            row.update({"slo_max_qps": found.qps, "slo_qps_fails": found.fails_at,
                        "slo_fails_because": found.why_fails,
                        "slo_evaluations": found.evaluations,
                        "slo_binding": slo.binding(found.at_qps),
                        **{f"slo_at_{k}": v for k, v in found.at_qps.items()}})
    except Infeasible as e:
        row["status"], row["error"] = "infeasible", str(e)
    except KvsimError as e:
        row["status"], row["error"] = "failed", str(e)
    except Exception as e:  # a bug in one run must not end a long sweep; it is recorded
        row["status"], row["error"] = "failed", f"{type(e).__name__}: {e}"
    return row


def result_columns(r) -> dict:
    """A replay's figures, warnings and provenance as a row's columns after the
    configuration's own (status ok)."""
    out = dict(r.row())
    out["overloaded"] = r.serving.served_frac_window is not None and \
        r.serving.served_frac_window < slo.SERVED_MIN
    out["warnings"] = " | ".join(r.warnings)
    out["provenance"] = json.dumps(r.provenance, sort_keys=True)
    out["status"], out["error"] = "ok", ""
    return out


@dataclass
class GroupTask:
    configs: list[Configuration]
    slo: list  # the limits of the SLO search (none: no search)
    slo_requests: int = 1000


def run_group(task: GroupTask) -> list[dict]:
    return [run_config(c, task.slo, task.slo_requests) for c in task.configs]


def groups(configs: list[Configuration], spec: SweepSpec) -> list[GroupTask]:
    """One task per configuration, so that every worker stays busy to the end (a worker
    analyses a policy on a trace once and keeps it for the configurations it runs next)."""
    return [GroupTask([c], list(spec.slo), spec.slo_requests) for c in configs]


def sweep(spec: SweepSpec, executor, done_keys: set[str] = frozenset(),
          progress: bool = True, on_rows=None, configs: list[Configuration] | None = None,
          status=None, search=None):
    """Run every configuration (``configs``, default :func:`expand`'s) not in ``done_keys``;
    one row per configuration (a DataFrame); ``on_rows(rows)`` as each group of configurations
    finishes; ``status()``: what the progress lines add (the best answer so far).
    ``search(todo, executor, progress, on_rows, status)``: what runs the configurations left
    after pruning instead of one task each (the planner's deployment search,
    :func:`kvsim.plan.deployment.search`)."""
    import pandas as pd

    from kvsim.plan.executors import run_all
    todo, pruned = [], []
    for c in expand(spec) if configs is None else configs:
        if c.key() in done_keys:
            continue
        why = weights_exceed_hbm(c)
        if why is None:
            todo.append(c)
        else:
            pruned.append({**columns(c), "status": "infeasible", "error": why})
    if pruned and on_rows is not None:
        on_rows(pruned)
    if search is not None:
        rows = search(todo, executor, progress, on_rows, status)
    else:
        results = run_all(executor, run_group, groups(todo, spec), progress, desc="plan",
                          on_result=on_rows, status=status)
        rows = [row for group in results for row in group]
    return pd.DataFrame(pruned + rows)
