"""One configuration, typed and frozen: what a replay runs, and what a plan's sweep, a fit or a
validation hands a replay. :func:`configure` builds it from what a user wrote (the names of the
command line's flags), checks every option in one place and builds the policy once; a plan makes
its variants with :meth:`Configuration.replace` and :meth:`Configuration.at_rate`. Its
:meth:`~Configuration.key` is its identity (a plan journals and resumes by it).

Nothing here runs a simulation or loads a trace: building a configuration costs what checking
its options costs.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path

from kvsim.checks import positive, real, share, whole
from kvsim.errors import KvsimError
from kvsim.hw import catalog
from kvsim.hw.catalog import ModelSpec
from kvsim.io import check_destination
from kvsim.policies.spec import PolicySpec, parse
from kvsim.sim import workload
from kvsim.sim.records import KV_DTYPES, WEIGHT_DTYPES, Deployment, PrefixCaching
from kvsim.sim.rules import Scheduling

SLO_KEYS = ("tpot_ms", "ttft_ms", "e2e_s")
MAX_BATCH = 1_000_000  # sequences in one batch: far beyond any GPU's memory
MAX_REQUESTS = 100_000_000  # per simulation
MIN_QPS, MAX_QPS = 1e-6, 1e9  # Poisson arrivals: beyond, times overflow what is simulated


@dataclass(frozen=True)
class Traffic:
    """The requests a replay serves: a closed loop (``concurrency`` in flight, default the
    batch), Poisson arrivals at ``qps``, or a workload file (kvsim's CSV or a public trace), its
    arrival times multiplied by ``time_scale`` and cut to its first ``limit`` requests."""
    context: int = 32768  # prompt tokens per request (not used with a workload file)
    output_len: int = 128  # output tokens per request (idem)
    qps: float | None = None
    concurrency: int | None = None
    requests: int | None = None  # default: 2 x concurrency (closed) or 64 (Poisson)
    workload: str | None = None  # a workload file
    workload_format: str = "auto"  # auto | kvsim | azure | burstgpt | mooncake
    time_scale: float = 1.0
    limit: int | None = None
    reuse: str | None = None  # Poisson arrivals with prefix reuse (kvsim.sim.reuse's spec)
    block_tokens: int = 512  # tokens per prefix block of --reuse

    def check(self) -> None:
        for name in ("context", "output_len", "requests", "concurrency"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise KvsimError(f"--{name.replace('_', '-')} must be positive, got {v}")
        for name, most in (("concurrency", MAX_BATCH), ("requests", MAX_REQUESTS)):
            v = getattr(self, name)
            if v is not None and v > most:
                raise KvsimError(f"--{name} {v:,} is beyond what kvsim simulates ({most:,})")
        if self.qps is not None and not (math.isfinite(self.qps)
                                         and MIN_QPS <= self.qps <= MAX_QPS):
            raise KvsimError(f"--qps must be a rate in [{MIN_QPS:g}, {MAX_QPS:g}] req/s (one "
                             f"request in 11.6 days to one a nanosecond), got {self.qps:g}")
        if self.qps is not None and self.concurrency is not None:
            raise KvsimError("give either --qps (open loop) or --concurrency (closed loop), "
                             "not both")
        if self.workload_format != "auto" and self.workload_format not in workload.FORMATS:
            raise KvsimError(f"--workload-format {self.workload_format!r}: one of auto, "
                             f"{', '.join(workload.FORMATS)}")
        workload.check_scale_limit(self.time_scale, self.limit)
        if self.workload is None and (self.workload_format != "auto" or self.time_scale != 1
                                      or self.limit is not None):
            raise KvsimError("--workload-format, --time-scale and --limit apply to a --workload "
                             "file")
        if self.reuse is not None and (self.qps is None or self.workload is not None):
            raise KvsimError("--reuse generates Poisson arrivals with prefix reuse: give --qps "
                             "(and --requests), not --workload or --concurrency")
        if isinstance(self.block_tokens, bool) or not isinstance(self.block_tokens, int) or \
                self.block_tokens < 1:
            raise KvsimError(f"--block-tokens must be a whole number >= 1, got "
                             f"{self.block_tokens!r}")

    def build(self, batch: int, seed: int) -> workload.Workload:
        """The requests themselves (:func:`kvsim.sim.workload.build`, or
        :func:`kvsim.sim.reuse.parse` for ``reuse``)."""
        if self.reuse is not None:
            from kvsim.sim import reuse
            return reuse.parse(self.reuse, self.qps, self.requests or 64, self.block_tokens,
                               seed)
        return workload.build(self.workload, self.qps, self.concurrency, batch, self.requests,
                              self.context, self.output_len, seed, self.workload_format,
                              self.time_scale, self.limit)

    def at_rate(self, qps: float, requests: int) -> Traffic:
        """``requests`` requests at ``qps``: Poisson arrivals, or the workload file's first
        requests with their arrival times scaled to that rate (its burstiness and length mix
        kept)."""
        if self.workload is None:
            return dataclasses.replace(self, qps=qps, requests=requests, concurrency=None)
        arrival = file_workload(self.workload, self.workload_format).arrival[:requests]
        span = float(arrival[-1] - arrival[0])
        if not span > 0:
            raise KvsimError(f"--workload {self.workload}: its first {requests} requests arrive "
                             f"at once; their rate cannot be scaled")
        return dataclasses.replace(self, limit=requests,
                                   time_scale=(len(arrival) - 1) / span / qps)


def file_workload(path: str, fmt: str = "auto") -> workload.Workload:
    """A workload file as read (once per file, format and modification time)."""
    p = Path(path)
    return _file_workload(str(p), fmt, p.stat().st_mtime if p.exists() else 0.0)


def _file_workload(path: str, fmt: str, mtime: float) -> workload.Workload:
    key = (path, fmt, mtime)
    if key not in _FILES:
        if len(_FILES) >= 4:
            _FILES.pop(next(iter(_FILES)))
        _FILES[key] = workload.from_file(path, fmt)
    return _FILES[key]


_FILES: dict = {}


@dataclass(frozen=True)
class EngineChoice:
    """The engine profile (a built-in name or a file from ``kvsim fit``; None: the default for
    the hardware) and what-if overrides of its figures, each recorded in provenance as such."""
    name: str | None = None
    decide_ms: float | None = None  # decide per request and decode step, all layers
    step_overhead_ms: float | None = None
    link_gbps: float | None = None
    allreduce_kernel: str | None = None  # nccl or custom (kvsim.hw.collectives.KERNELS)

    def check(self) -> None:
        for name in ("decide_ms", "step_overhead_ms"):
            if getattr(self, name) is not None:
                real(getattr(self, name), f"--{name.replace('_', '-')}", least=0)
        if self.link_gbps is not None:
            positive(self.link_gbps, "--link-gbps")
        from kvsim.hw.collectives import KERNELS
        if self.allreduce_kernel is not None and self.allreduce_kernel not in KERNELS:
            raise KvsimError(f"--allreduce-kernel must be one of {', '.join(KERNELS)}, got "
                             f"{self.allreduce_kernel!r}")

    def overrides(self) -> dict:
        return {k: getattr(self, k) for k in ("decide_ms", "step_overhead_ms", "link_gbps",
                                              "allreduce_kernel")
                if getattr(self, k) is not None}


@dataclass(frozen=True, eq=False)
class Configuration:
    """One replay: a policy (built once, its options checked) serving a model on a GPU, with a
    batch, traffic, scheduling, deployment and engine; where the policy's statistics come from
    (a trace, a policy profile, a what-if KV read) and the SLO its goodput counts."""
    policy: object  # a kvsim.policies.base.Policy
    model: ModelSpec  # as named, before --kv-dtype, --weight-dtype and --tp
    gpu: str | None = None  # catalog name; None: the trace's measured hardware, else h100-sxm
    batch: int = 1  # max concurrent sequences in the decode batch
    traffic: Traffic = Traffic()
    scheduling: Scheduling = Scheduling()  # max_batched_tokens None: vLLM's for the GPU
    deployment: Deployment = Deployment()
    engine: EngineChoice = EngineChoice()
    caching: PrefixCaching = PrefixCaching()  # prefix caching and the tiers below the GPU
    trace: str | None = None  # None: the shipped default trace
    policy_profile: str | None = None  # FILE, "default" or "none"; None: the shipped profile
    # when no trace is named (kvsim.replay.policy_source)
    kv_read_frac: float | None = None  # the policy's KV read per step, replacing the trace's
    kv_read_everywhere: bool = True  # False (plan): policies that do not fetch keep their own
    seed: int = 0
    slo: tuple = ()  # ((metric, limit), ...): per-request goodput limits (SLO_KEYS)
    model_name: str = ""  # the model as the user named it (a catalog name or a config path)
    label: str = ""  # the policy as the user wrote it (NAME[:KEY=VALUE...])
    options: dict = field(default_factory=dict)  # the policy options the user gave

    @property
    def spec(self) -> PolicySpec:
        return PolicySpec(self.policy.name, dict(self.options), self.label)

    @property
    def served_model(self) -> ModelSpec:
        """What one GPU holds and computes: the model in its element types, sharded ``tp``
        ways."""
        d = self.deployment
        return with_dtypes(self.model, d.kv_dtype, d.weight_dtype).shard(d.tp)

    @property
    def context(self) -> int:
        return self.traffic.context

    def key(self) -> str:
        """The configuration's identity: every field but the policy object, which is named by
        its registered name and its full options (the caching options only where they differ
        from the defaults: a plan journaled before they existed still resumes)."""
        caching = {f.name: getattr(self.caching, f.name) for f in fields(PrefixCaching)
                   if getattr(self.caching, f.name) != f.default}
        return json.dumps({**({"caching": caching} if caching else {}),
            "gpu": self.gpu, "model": self.model_name or self.model.name,
            "policy": self.policy.name,
            "options": dataclasses.asdict(self.policy.params), "batch": self.batch,
            "traffic": dataclasses.asdict(self.traffic),
            "scheduling": dataclasses.asdict(self.scheduling),
            "deployment": dataclasses.asdict(self.deployment),
            "engine": dataclasses.asdict(self.engine), "trace": self.trace,
            "policy_profile": self.policy_profile, "kv_read_frac": self.kv_read_frac,
            "kv_read_everywhere": self.kv_read_everywhere, "seed": self.seed,
            "slo": [list(x) for x in self.slo]}, sort_keys=True, default=str)

    def replace(self, **changes) -> Configuration:
        """A copy with ``changes``: fields of the configuration, or of its traffic,
        scheduling, deployment or engine by their own names (``replicas=4``, ``qps=2.0``)."""
        groups = {}
        for group in ("traffic", "scheduling", "deployment", "engine", "caching"):
            names = {f.name for f in fields(getattr(self, group))}
            mine = {k: changes.pop(k) for k in list(changes) if k in names}
            if mine:
                groups[group] = dataclasses.replace(getattr(self, group), **mine)
        cfg = dataclasses.replace(self, **changes, **groups)
        if groups:
            cfg.check()
        return cfg

    def at_rate(self, qps: float, requests: int, **changes) -> Configuration:
        """This configuration fed ``requests`` requests at ``qps`` (:meth:`Traffic.at_rate`)."""
        return dataclasses.replace(self.replace(**changes),
                                   traffic=self.traffic.at_rate(qps, requests))

    def check(self) -> None:
        if not 1 <= self.batch <= MAX_BATCH:
            raise KvsimError(f"--batch must be positive, got {self.batch}" if self.batch < 1
                             else f"--batch {self.batch:,} is beyond what kvsim simulates "
                                  f"({MAX_BATCH:,})")
        self.traffic.check()
        self.scheduling.check()
        self.deployment.check()
        self.engine.check()
        self.caching.check()
        if self.gpu is not None and not str(self.gpu).strip():
            raise KvsimError("--gpu is empty: name a catalog GPU (kvsim catalog)")
        for k, v in self.slo:
            if k not in SLO_KEYS or not (isinstance(v, (int, float)) and v > 0):
                raise KvsimError(f"SLO {k}={v!r}: give a positive --slo-tpot-ms, --slo-ttft-ms "
                                 f"or --slo-e2e-s")
        if self.kv_read_frac is not None:
            share(self.kv_read_frac, "--kv-read-frac")
        whole(self.seed, "--seed")
        self.served_model  # noqa: B018  (element types and the TP split are checked here)


def with_dtypes(model: ModelSpec, kv: str | None, weight: str | None) -> ModelSpec:
    """The model with its KV cache and layer weights stored in other element types: bytes
    change everywhere (HBM, host memory, the link, admission); compute stays as profiled."""
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


TRAFFIC = {"context": "context", "output_len": "output_len", "qps": "qps",
           "concurrency": "concurrency", "requests": "requests", "workload_csv": "workload",
           "workload_format": "workload_format", "time_scale": "time_scale",
           "workload_limit": "limit", "reuse": "reuse", "block_tokens": "block_tokens"}
ENGINE = {"engine": "name", "decide_ms": "decide_ms", "step_overhead_ms": "step_overhead_ms",
          "link_gbps": "link_gbps", "allreduce_kernel": "allreduce_kernel"}


def configure(policy: str | PolicySpec = "dense-offload", policy_options: dict | None = None,
              model: str | ModelSpec = "qwen3-4b", slo: dict | None = None,
              trace: str | Path | None = None, **options) -> Configuration:
    """A checked :class:`Configuration` from the names of the command line's flags:
    ``policy`` (a spec, NAME[:KEY=VALUE...], or a parsed :class:`PolicySpec`) with
    ``policy_options``, ``model`` (a catalog name, a config.json path or a ModelSpec), ``gpu``,
    ``batch``, the traffic's (``context``, ``output_len``, ``qps``, ``concurrency``,
    ``requests``, ``workload_csv``, ``workload_format``, ``time_scale``, ``workload_limit``),
    the engine's (``engine``, ``decide_ms``, ``step_overhead_ms``, ``link_gbps``,
    ``allreduce_kernel``), every field
    of :class:`~kvsim.sim.rules.Scheduling`, :class:`~kvsim.sim.records.Deployment` and
    :class:`~kvsim.sim.records.PrefixCaching`,
    ``trace``, ``policy_profile``, ``kv_read_frac``, ``kv_read_everywhere``, ``seed`` and
    ``slo`` ({metric: limit}). An unknown name is a TypeError (a caller's bug); a bad value
    is one KvsimError line."""
    spec = one_policy(policy, policy_options or {})
    from kvsim.policies import make
    groups = {"traffic": (Traffic, TRAFFIC), "engine": (EngineChoice, ENGINE),
              "scheduling": (Scheduling, {f.name: f.name for f in fields(Scheduling)}),
              "deployment": (Deployment, {f.name: f.name for f in fields(Deployment)}),
              "caching": (PrefixCaching, {f.name: f.name for f in fields(PrefixCaching)})}
    built = {}
    for group, (cls, names) in groups.items():
        built[group] = cls(**{names[k]: options.pop(k) for k in list(options) if k in names})
    m = model if isinstance(model, ModelSpec) else catalog.model(model)
    cfg = Configuration(policy=make(spec.name, spec.options), model=m,
                        model_name=model.name if isinstance(model, ModelSpec) else str(model),
                        label=spec.label, options=dict(spec.options),
                        trace=None if trace is None else str(trace),
                        slo=tuple(sorted((slo or {}).items())), **built, **options)
    cfg.check()
    return cfg


def one_policy(text: str | PolicySpec, options: dict) -> PolicySpec:
    """The one policy a replay runs; options it does not take are an error here (the command
    line reports flags meant for other policies before it gets this far)."""
    if isinstance(text, PolicySpec):  # parsed (and checked) already
        from kvsim.policies.registry import resolve
        from kvsim.policies.spec import params
        opts = {**options, **text.options}
        params(resolve(text.name), opts)
        return PolicySpec(text.name, opts, text.label)
    specs, unused = parse(text, options)
    if len(specs) != 1:
        raise KvsimError(f"replay runs one policy; got {len(specs)} ({text})")
    if unused:
        raise KvsimError(f"{', '.join(unused)} does not apply to policy {specs[0].name}")
    return specs[0]


def check_timeline(path, force: bool) -> None:
    """A timeline file is written only where ``--force`` allows (checked before the work)."""
    if path is not None:
        check_destination(path, force)
