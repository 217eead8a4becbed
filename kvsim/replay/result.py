"""What a replay returns: :class:`ReplayResult`, typed; its JSON (``kvsim replay --json``) and
its table row (a plan's ``results.csv``) are made here, at the output edge, and nowhere else.

    ReplayResult
      configuration   the Configuration it ran
      serving         Serving: latencies (mean, p50, p99), throughput, utilisation, keeping up
      memory          MemoryUse: peak HBM by part, host memory, the batch that fits
      policy          PolicyResult: the statistics (measured on a trace or from a profile), the
                      decode cost for the planned model, where they came from, timings
      bounds          {figure: (lo, hi)}: prediction intervals (engine error, policy profile)
      prefix_cache    with prefix caching: the hit share per tier, tokens prefilled, bytes moved
      provenance      {input: where it came from}; warnings; the timeline file if one was drawn

The JSON keeps the headline figures at its top level (they repeat values of its groups) and
groups the rest (sim, memory, policy_cost, policy_stats, policy_timings, provenance); a row
joins the groups' scalars and refuses a key met twice with two values (:func:`flatten`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np

from kvsim.contract import PolicyResult
from kvsim.errors import KvsimError

HEADLINE = ("tpot_ms", "throughput_tok_s", "ttft_ms", "e2e_s", "hbm_gib", "host_gib",
            "link_util", "kv_read_frac", "hbm_meta_gib")
# policy statistics earlier versions promised at the top level of the JSON (VerKV's Table 2)
TABLE2 = ("decisions_fetch_frac", "kvhead_steps_fetch_frac", "tokens_per_fetch_frac",
          "violation_rate", "output_rel_err_mean", "violation_rate_max_layer",
          "violation_rate_own", "sketch_bytes_per_token", "output_violation_rate")


@dataclass(frozen=True)
class Serving:
    """What the simulated engine served: latencies in ms (end-to-end in s), rates per second
    over the run's makespan, utilisation per replica, and, of an open loop, whether it kept up
    over its measured window (:func:`kvsim.replay.report.keeping_up`)."""
    tpot_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    ttft_ms: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    e2e_s: float
    e2e_p50_s: float
    e2e_p99_s: float
    queue_wait_p99_ms: float
    itl_ms: float  # inter-token latency: every decode token's gap to its sequence's previous
    itl_p50_ms: float  # token (prefill stalls included), over tokens, not requests
    itl_p90_ms: float
    itl_p99_ms: float
    percentiles: str  # how the percentiles were computed (exact, or a streaming sketch)
    pieces: int  # simulated in pieces cut where the server was empty
    throughput_tok_s: float
    decode_tok_s: float
    requests_per_s: float
    requests: int
    makespan_s: float
    decode_steps: int  # all replicas
    mean_batch: float
    mean_in_system: float  # all replicas
    gpu_util: float
    link_util: float
    preemptions: int
    arrivals_window: int | None
    served_frac_window: float | None
    queue_growth_window: int | None
    scheduler: str
    max_batched_tokens: int | None  # chunked prefill's token budget
    admission: str
    admission_order: str
    preemption: str | None  # grow admission only
    goodput_rps: float | None = None  # with an SLO: requests per second meeting every limit
    slo_attainment: float | None = None  # and their share

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        if self.goodput_rps is None:
            del out["goodput_rps"], out["slo_attainment"]
        return out


@dataclass(frozen=True)
class MemoryUse:
    """Peak HBM per GPU by part and peak host memory (GiB), and how many requests memory
    admits at once."""
    hbm_gib: float
    host_gib: float
    hbm_weights_gib: float
    hbm_kv_gib: float
    hbm_staging_gib: float
    hbm_meta_gib: float
    hbm_workspace_gib: float
    hbm_capacity_gib: float
    host_capacity_gib: float
    max_batch_fit: int
    hbm_limited: bool


@dataclass
class ReplayResult:
    configuration: object  # the kvsim.replay.configuration.Configuration that ran
    gpu: str  # the GPU's name as costed (a catalog name or the profiled device)
    model: str
    engine: str
    serving: Serving
    memory: MemoryUse
    policy: PolicyResult  # its cost is the one charged, for the planned model
    stats: dict  # the policy's statistics as reported (trace_* where not what is charged)
    kv_read_frac: float  # the host read per step charged at the configured context
    bounds: dict = field(default_factory=dict)  # figure -> (lo, hi)
    interval: dict = field(default_factory=dict)  # how the bounds were made
    profile: dict | None = None  # the policy profile's estimate, when one gave the statistics
    provenance: dict = field(default_factory=dict)
    warnings: list = field(default_factory=list)
    timeline: str | None = None
    lengths: dict = field(default_factory=dict)  # context, output_len (a workload's means) and
    # a workload's prompt_tokens and output_tokens: mean, p50, p99, max
    prefix_cache: dict | None = None  # with prefix caching: hit shares per tier, tokens, bytes

    @property
    def context(self) -> int:
        """The prompt tokens served: the configuration's, or a workload's mean."""
        return self.lengths.get("context", self.configuration.context)

    def figure(self, key: str) -> float:
        """A figure by its report name: ``kv_read_frac`` or a field of serving or memory."""
        if key == "kv_read_frac":
            return self.kv_read_frac
        for group in (self.serving, self.memory):
            if hasattr(group, key):
                return getattr(group, key)
        raise KeyError(key)

    def to_json(self) -> dict:
        """The report ``kvsim replay --json`` prints (see the module docstring)."""
        cfg, stats, cost = self.configuration, self.stats, self.policy.cost
        sim, mem = self.serving.to_json(), dataclasses.asdict(self.memory)
        top = {"kv_read_frac": self.kv_read_frac, **sim, **mem}
        out = {
            "policy": cfg.policy.name, "policy_options": self.policy.params, "gpu": self.gpu,
            "model": self.model, "context": self.context, "batch": cfg.batch,
            "output_len": self.lengths.get("output_len", cfg.traffic.output_len),
            "seed": cfg.seed, "engine": self.engine,
            "tp": cfg.deployment.tp, "replicas": cfg.deployment.replicas,
            **{k: top[k] for k in HEADLINE}, **{k: stats[k] for k in TABLE2 if k in stats},
            **{f"{ps}_kv_read_frac": stats[ps]["kv_read_frac"] for ps in ("question", "overall")
               if "kv_read_frac" in (stats.get(ps) or {})},
        }
        for key in ("prompt_tokens", "output_tokens"):  # a workload's
            if key in self.lengths:
                out[key] = self.lengths[key]
        if self.prefix_cache is not None:
            out["prefix_hit_frac"] = self.prefix_cache["prefix_hit_frac"]
        for key, (lo, hi) in self.bounds.items():
            out[f"{key}_lo"], out[f"{key}_hi"] = lo, hi
        out |= {"sim": sim, "memory": mem,
                "policy_cost": dataclasses.asdict(cost) | {"scaling": cost.scaling()},
                "policy_stats": stats, "policy_timings": self.policy.timings,
                "provenance": dict(self.provenance), "warnings": list(self.warnings)}
        if self.prefix_cache is not None:
            out["prefix_cache"] = dict(self.prefix_cache)
        if self.profile is not None:
            out["policy_profile"] = self.profile
        if self.interval:
            out["interval"] = self.interval
        if self.timeline is not None:
            out["timeline"] = self.timeline
        self._check_edges(out)
        return out

    def _check_edges(self, out: dict) -> None:
        """The output edge: with requests served, each headline figure is a finite number >= 0
        (TPOT where a request decoded a token after its first) inside its interval; anything
        else is an input beyond what kvsim models, refused rather than printed as null."""
        if not self.serving.requests:
            return
        decoded = out.get("output_len", 2) > 1 or out.get("output_tokens", 0) > \
            self.serving.requests
        for key in ("tpot_ms", "ttft_ms", "e2e_s", "throughput_tok_s"):
            v = out.get(key)
            if key == "tpot_ms" and not decoded:
                continue
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise KvsimError(f"{key} came out {v!r}: an input (an engine field, a profile "
                                 f"statistic, a size) is beyond what kvsim models; no result "
                                 f"is given")
            lo, hi = self.bounds.get(key, (v, v))
            if lo is not None and hi is not None and not lo * (1 - 1e-9) <= v <= hi * (1 + 1e-9):
                raise KvsimError(f"{key}'s interval [{lo:.6g}, {hi:.6g}] does not hold its value "
                                 f"{v:.6g}: an input (a policy profile, an engine's check) is "
                                 f"inconsistent; no result is given")

    def row(self) -> dict:
        """One row of scalars (a plan's table): :func:`flatten` of the JSON."""
        return flatten(self.to_json())


def flatten(report: dict, skip=("provenance", "warnings", "policy_options")) -> dict:
    """One row of scalars: top-level values, then each group's, nested groups joined with ``_``
    (``policy_stats.question.kv_read_frac`` -> ``question_kv_read_frac``). A key met twice must
    carry the same value; otherwise this raises instead of silently keeping one of them."""
    row: dict = {}

    def put(key, value):
        if key in row and not _same(row[key], value):
            raise ValueError(f"report key {key!r} holds {row[key]!r} and {value!r}")
        row.setdefault(key, value)

    def walk(d: dict, prefix: str):
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}_")
            elif isinstance(v, (int, float, str, bool)) or v is None:
                put(prefix + k, v)

    walk({k: v for k, v in report.items() if k not in skip and not isinstance(v, dict)}, "")
    for group in ("sim", "memory", "policy_cost", "policy_stats", "policy_timings",
                  "prefix_cache"):
        walk(report.get(group) or {}, "")
    return row


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and np.isnan(a) and np.isnan(b):
        return True
    return a == b
