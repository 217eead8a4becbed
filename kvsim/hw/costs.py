"""Cost functions of one GPU: host-link transfers, HBM-bound kernels, GEMMs, each fetching policy's
decide step.

Built from a catalog spec (roofline with efficiency factors) or, when a trace carries a measured
hardware section, from its tables: measured points are interpolated (log-log, piecewise linear);
a query outside the measured range falls back to the fitted ``alpha + n / beta`` line (links) or to
proportional scaling from the nearest end (kernels), and is recorded in ``extrapolations`` so the
report can say so. Every figure used is named in ``provenance``.

All functions take numpy arrays or scalars and are vectorised.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvsim.errors import KvsimError
from kvsim.hw import catalog
from kvsim.hw.catalog import GB, GiB, GPUSpec, ModelSpec
from kvsim.hw.collectives import AllReduce
from kvsim.hw.engine import ROOFLINE, DecideModel, Engine, check_runs_on, default_for
from kvsim.hw.engine import load as load_engine
from kvsim.hw.fit import fit_alpha_beta
from kvsim.trace import DECIDE_TABLE, LEGACY_DECIDE_TABLE, decide_tables

DEFAULT_GPU = "h100-sxm"

HBM_EFFICIENCY = 0.85  # achievable / spec HBM bandwidth (design note, public measurements)
FLOP_EFFICIENCY = 0.6  # achieved / peak bf16 tensor-core throughput for decode-size GEMMs
GATHER_EFFICIENCY = 0.72  # scattered-row GPU gather over UVA vs contiguous DMA (design note)

# Weight-only matmuls (W4A16): a Marlin-class kernel reads the narrow weights, dequantises
# them in registers and runs bf16 mma.sync (m16n8k16) on 16-row blocks, at most four a pass: each
# weight is dequantised once per 64 tokens (IST-DASLab/marlin, marlin_cuda_kernel.cu). Published
# figures, each a ratio to the fp16 GEMM on the same GPU and matrix:
# - memory-bound, H100, 8192x8192 channelwise, Marlin over torch fp16 at m = 1, 2, 4 (PR
#   description) and 1, 2, 4, 8, 16 tokens (jinzhen-lin's 2026-03-30 table), inclusionAI/humming
#   PR #2: int4 2.165 2.164 2.144 / 2.168 2.186 2.177 2.184 2.151, mean 2.167 of an ideal 4;
#   int8 1.504 1.484 1.485 / 1.601 1.607 1.620 1.606 1.596, mean 1.563 of 2. The weight reads
#   reach that share of the bf16 GEMM's rate (on every GPU: assumption; the share grows with the
#   matrix: 1.0 on an A10's 72k x 18k, Marlin README peak.png).
# - compute-bound: Marlin's bench.py at 1024, 2048, 4000 tokens runs at 0.66, 0.60, 0.61 of fp16
#   (flat 141 TFLOP/s from 64 tokens on; a comment on vllm-project/vllm PR #2497, Ampere):
#   mean 0.623. The gap, 1/0.623 - 1 = 0.61 of the MMA time of each 64-token pass (dequantising
#   and staging every weight once a pass), is spread over the pass's tokens: a compute-rate
#   share. (A fixed cost per pass would make 1-16 tokens compute-bound on Ampere, against the
#   flat 3.1x the same comment measured there.) No compute-bound figure for Hopper was found:
#   this one is used there (assumption).
WEIGHT_ONLY_READ_SHARE = 0.542  # W4A16: of the bf16 GEMM's weight-read rate (int8's 0.78: unused)
WEIGHT_ONLY_COMPUTE_SHARE = 0.623  # compute-bound throughput over the bf16 GEMM's
WEIGHT_ONLY_ROWS = 16  # tokens a weight-only kernel computes at least (Marlin's m16 blocks)
WEIGHT_ONLY_SOURCE = (
    "Marlin over torch fp16, H100 8192x8192 channelwise, 1-16 tokens: int4 2.14-2.19x (mean "
    "2.167 of 4), int8 1.48-1.62x (mean 1.563 of 2) (https://github.com/inclusionAI/humming/"
    "pull/2 tables); at 1024-4000 tokens 0.66, 0.60, 0.61x (https://github.com/vllm-project/"
    "vllm/pull/2497 comment, Ampere; used on every GPU); 16-row blocks, dequantised once per "
    "64 tokens (https://github.com/IST-DASLab/marlin marlin_cuda_kernel.cu)")
# W8A8: fp8 reaches less of its peak than bf16 does. Maximum achievable matmul FLOP/s on an H100
# SXM, bf16 794.5 of 989 (80.3%), fp8 1402.6 of 1979 (70.9%): stas00/ml-engineering,
# compute/accelerator/README.md, MAMF table (one ratio for every GPU: assumption).
FP8_EFFICIENCY_RATIO = 0.883  # 70.9% / 80.3%
FP8_SOURCE = ("fp8/bf16 achievable-over-peak ratio 70.9%/80.3% (H100 SXM MAMF table, https://"
              "github.com/stas00/ml-engineering compute/accelerator/README.md)")

DECIDE_ESTIMATE = ("estimate: four passes over the policy's per-token decide state (a sketch, "
                   "page bounds) at achievable HBM bandwidth")


@dataclass
class Curve:
    """A measured y(x) > 0, interpolated in log-log space; outside the range ``outside`` decides."""
    name: str
    x: np.ndarray
    y: np.ndarray
    extrapolations: set = field(default_factory=set)

    def __post_init__(self):
        x, y = np.asarray(self.x, float), np.asarray(self.y, float)
        if (x <= 0).any() or (y <= 0).any():
            raise KvsimError(f"measured table {self.name} holds non-positive values")
        ux = np.unique(x)
        self.x = ux
        self.y = np.array([np.median(y[x == v]) for v in ux])  # repeated sizes: take the median

    def __call__(self, q, outside) -> np.ndarray:
        q = np.asarray(q, float)
        out = np.exp(np.interp(np.log(np.maximum(q, 1e-300)), np.log(self.x), np.log(self.y)))
        beyond = (q > self.x[-1]) | ((q < self.x[0]) & (q > 0))
        if beyond.any():
            self.extrapolations.add(
                f"{self.name}: queried {q[beyond].min():.4g}..{q[beyond].max():.4g}, "
                f"measured {self.x[0]:.4g}..{self.x[-1]:.4g}")
            out = np.where(beyond, outside(q), out)
        return np.where(q > 0, out, 0.0)


@dataclass
class LinkPath:
    """Transfer time of one path: ``t(n) = alpha + n / beta``, or a measured curve."""
    alpha: float  # seconds per copy
    beta: float  # bytes per second
    source: str
    curve: Curve | None = None

    def time(self, nbytes, copies=1) -> np.ndarray:
        """Seconds to move ``nbytes`` in ``copies`` copies (each pays alpha)."""
        nbytes = np.asarray(nbytes, float)
        copies = np.maximum(np.asarray(copies, float), 1.0)
        line = lambda n: self.alpha + n / self.beta  # noqa: E731
        per = nbytes / copies
        t = line(per) if self.curve is None else self.curve(per, line)
        return np.where(nbytes > 0, copies * t, 0.0)


class Matmuls:
    """One layer's GEMMs (QKV, O, the gated MLP) for ``n`` tokens, by their shape.

    Compute runs at the layer GEMMs' rate (:meth:`CostModel.gemm_flops`) times a shape
    efficiency ``M / (M + half)``, ``M`` the tokens one matmul sees (``half`` = the engine's
    ``gemm_half_tokens``; 0: flat): every token for the dense matmuls; for a mixture of experts'
    routed experts, grouped by expert, the tokens each expert gets, ``n k / E`` under uniform
    routing (``n`` under shared routing, :attr:`ModelSpec.routing`), at the engine's
    ``moe_efficiency`` of the dense matmuls' efficiency (grouped GEMMs reach less of the peak).
    The weight reads are the bytes the tokens touch (:meth:`ModelSpec.layer_weight_bytes`) at
    achievable HBM bandwidth. The engine's ``gemm_overlap`` says how much of the smaller of the
    two hides under the larger: 1 (the default) is the roofline's max, 0 their sum.
    A step of fewer tokens than the GPU's tensor-core instruction has rows (``tile``,
    :attr:`GPUSpec.mma_rows`: 64 on Hopper) still does ``tile`` tokens' compute, which the
    weight reads hide where the GPU's FLOP/s per byte allow (every GPU here but the H20): the
    time is at least that compute (for a mixture of experts, ``tile`` tokens through the layer).
    Weights dequantised in the kernel (W4A16) come with that kernel's figures
    (:meth:`CostModel.matmuls`): ``rate`` its compute rate, ``hbm_bw`` its weight-read rate,
    ``tile`` its 16 rows.
    ``time`` is vectorised; ``at`` is the same in floats (the simulator's hot path)."""

    def __init__(self, m: ModelSpec, rate: float, hbm_bw: float, overlap: float, half: float,
                 moe_efficiency: float = 1.0, tile: int = 0):
        self.m, self.rate, self.hbm_bw, self.overlap, self.half = m, rate, hbm_bw, overlap, half
        routed = 0.0
        if m.experts:
            share = (m.layers if m.moe_layers is None else m.moe_layers) / m.layers
            routed = 3.0 * m.hidden * m.moe_intermediate * m.experts_per_token * share
        self.dense_flops = 2.0 * (m.active_layer_params - routed)  # per token
        self.routed_flops = 2.0 * routed / moe_efficiency  # per token, at the dense efficiency
        # the share of a step's tokens each routed expert gets (shared routing: every one)
        self.per_expert = (m.experts_per_token / m.experts if m.routing == "uniform" else 1.0) \
            if m.experts else 0.0
        self.dense_bytes = float(m.layer_weight_bytes())
        self.floor = (self.dense_flops + self.routed_flops) * tile / (
            self.rate * self._eff(float(tile))) if tile else 0.0  # tile tokens' compute

    def _eff(self, tokens):
        return tokens / (tokens + self.half) if self.half else 1.0

    def _combine(self, compute, memory):
        if self.overlap == 1.0:
            return np.maximum(compute, memory)
        return compute + memory - self.overlap * np.minimum(compute, memory)

    def time(self, tokens) -> np.ndarray:
        n = np.asarray(tokens, float)
        g = np.maximum(n, 1e-9)
        compute = self.dense_flops * n / (self.rate * self._eff(g))
        if self.routed_flops:
            compute = compute + self.routed_flops * n / (self.rate * self._eff(
                g * self.per_expert))
            memory = self.m.layer_weight_bytes(n) / self.hbm_bw
        else:
            memory = np.where(n > 0, self.dense_bytes / self.hbm_bw, 0.0)
        return np.where(n > 0, np.maximum(self._combine(compute, memory), self.floor), 0.0)

    def at(self, n: float) -> float:
        if n <= 0:
            return 0.0
        if self.routed_flops:
            return float(self.time(n))
        compute = self.dense_flops * n / (self.rate * self._eff(n))
        memory = self.dense_bytes / self.hbm_bw
        if self.overlap == 1.0:
            t = max(compute, memory)
        else:
            t = compute + memory - self.overlap * min(compute, memory)
        return max(t, self.floor)


class CostModel:
    """Costs for one GPU and one model. Build with :meth:`from_spec` or :meth:`from_hardware`,
    then :meth:`apply` an engine profile (:mod:`kvsim.hw.engine`)."""

    def __init__(self, gpu_name: str, hbm_bytes: float, hbm_bw: float, flops: float,
                 links: dict[str, LinkPath], provenance: dict[str, str]):
        self.gpu_name = gpu_name
        self.hbm_bytes = hbm_bytes
        self.hbm_bw = hbm_bw  # achievable bytes/s
        self.flops = flops  # achievable FLOP/s
        self.links = links
        self.provenance = provenance
        self.extrapolations: set[str] = set()
        self.attn_curve: Curve | None = None  # seconds per layer vs KV tokens read (batch total)
        self.gemm_curve: Curve | None = None  # seconds per layer vs batch
        self.head_curve: Curve | None = None  # seconds of the LM head vs batch
        self.spec: GPUSpec | None = None  # the catalog entry the rates came from, if any
        self.engine: Engine = ROOFLINE
        self.step_overhead = 0.0  # seconds per engine step, whatever its batch
        self.launches = "per-sequence"  # a layer's copies: one launch per sequence, or batched
        self.fetch = "policy"  # overlap or serial fetch: as the policy says, or forced
        self.decide_models: dict[str, DecideModel] = {}  # per decide kernel (engine or table)
        # per decide kernel with a measured table: (table, lowest and highest context measured)
        self.decide_ranges: dict[str, tuple[str, float, float]] = {}
        self.decide_override_us: float | None = None  # what-if: every decide step, us per layer
        self.decided: set[str] = set()  # the decide kernels the simulation asked for
        self.tp = 1  # tensor parallelism (set_tp)
        self.allreduce: AllReduce | None = None
        self._gemm_flops: dict[tuple, float] = {}  # per (weight element size, weight-only)
        # engine fields of kernel shape (see :class:`Matmuls`, :meth:`attention_reread`)
        self.layer_overhead = 0.0  # GPU seconds per layer and step (gaps around its kernels)
        self.launch_overhead = 0.0  # host seconds per layer launching it (eager engines only)
        self.token_overhead = 0.0  # seconds per sequence that emits a token in a step
        self.allreduce_extra = 0.0  # seconds the engine adds to each all-reduce
        self.allreduce_kernel = "nccl"  # which all-reduce kernel (collectives.KERNELS)
        self.gemm_overlap = 1.0  # share of min(compute, weight reads) hidden under the max
        self.gemm_half_tokens = 0.0  # tokens per matmul at half its large-shape efficiency
        self.moe_efficiency = 1.0  # grouped expert matmuls' efficiency over the dense ones'
        self.attention = "gqa"  # decode attention reads a KV head once ("gqa") or per query head
        self.head_reread_share = 1.0  # per query head: share of the repeat reads that reach HBM
        self.attention_efficiency = 1.0  # decode attention's share of the weight reads' HBM rate
        self.prefill_attention_efficiency = 1.0  # prefill attention's share of the matmuls' rate
        self.fp8_efficiency = FP8_EFFICIENCY_RATIO  # W8A8's share of peak over bf16's
        self.mma_rows = 0  # tokens a tensor-core matmul computes at least (GPUSpec.mma_rows)

    # ------------------------------------------------------------------------ construction
    @classmethod
    def from_spec(cls, g: GPUSpec) -> CostModel:
        src = f"catalog {g.name}"
        h2d = LinkPath(g.copy_alpha_us * 1e-6, g.h2d_gbps * GB, src)
        links = {
            "h2d": h2d,
            "d2h": LinkPath(h2d.alpha, h2d.beta, src),
            "gather": LinkPath(h2d.alpha, h2d.beta * GATHER_EFFICIENCY,
                               f"{src}; gather at {GATHER_EFFICIENCY:.0%} of the link "
                               "(design note: UVA gathers of sorted 128-byte-aligned rows)"),
        }
        prov = {
            "gpu": f"{src}: {g.source}",
            "hbm_capacity": f"{g.hbm_gib} GiB, {src}",
            "hbm_bandwidth": f"{g.hbm_gbps:.0f} GB/s x {HBM_EFFICIENCY} achievable (design "
                             f"note), {src}",
            "compute": f"{g.bf16_tflops:.0f} TFLOP/s bf16 x {FLOP_EFFICIENCY} (design note), "
                       f"{src}",
            "link_h2d": f"alpha {h2d.alpha * 1e6:.1f} us, beta {h2d.beta / GB:.1f} GB/s, {src}",
            "link_gather": links["gather"].source,
            "decode_attention": "roofline: KV bytes / achievable HBM bandwidth",
            "gemm": "roofline: max(FLOPs / achievable compute, weight bytes / achievable HBM)",
            "decide": f"{DECIDE_ESTIMATE} (no engine decide model, no profiled decide table)",
        }
        cm = cls(g.name, g.hbm_gib * GiB, g.hbm_gbps * GB * HBM_EFFICIENCY,
                 g.bf16_tflops * 1e12 * FLOP_EFFICIENCY, links, prov)
        cm.spec = g
        cm.mma_rows = g.mma_rows
        if g.mma_rows:
            prov["gemm_tile"] = (f"a decode step of fewer than {g.mma_rows} tokens computes "
                                 f"{g.mma_rows} tokens' matmuls: {g.mma_source}")
        return cm

    @classmethod
    def from_hardware(cls, hw, base: GPUSpec | None = None) -> CostModel:
        """Costs from a trace's measured hardware section (``kvsim profile``).

        Tables used when present: ``link_h2d_pinned``, ``link_d2h_pinned``, ``link_gather_gpu``
        (bytes, seconds), ``kernel_decode_attn`` (tokens, seconds), ``kernel_gemm`` (batch,
        seconds), ``kernel_decide_<policy>`` (context, batch (1 if absent), seconds, fetched_frac:
        fitted by :meth:`DecideModel.fit_table`, one decide model per policy; an older profile's
        ``kernel_decide`` is VerKV's). Capacity, HBM bandwidth and compute come from
        ``hw.extra`` (measured) or, failing that, from ``base`` (a catalog spec).
        """
        dev = hw.device.get("name", "measured device")
        where = f"profiled {dev} ({hw.provenance})"
        if base is not None:
            cm = cls.from_spec(base)
        else:
            extra = hw.extra
            missing = [k for k in ("hbm_bytes", "hbm_bw", "flops") if k not in extra]
            if missing:
                raise KvsimError(f"the trace's hardware section lacks {', '.join(missing)} and "
                                 "no catalog GPU was named to fill them (--gpu)")
            cm = cls(dev, float(extra["hbm_bytes"]), float(extra["hbm_bw"]),
                     float(extra["flops"]), {}, {})
            for k, what in (("hbm_bytes", "hbm_capacity"), ("hbm_bw", "hbm_bandwidth"),
                            ("flops", "compute")):
                cm.provenance[what] = f"{float(extra[k]):.4g}, measured: {where}"
        cm.gpu_name = dev
        cm.provenance["gpu"] = where
        for path, table in (("h2d", "link_h2d_pinned"), ("d2h", "link_d2h_pinned"),
                            ("gather", "link_gather_gpu")):
            t = hw.tables.get(table)
            if t is None:
                if path in cm.links:
                    continue
                if path == "h2d":
                    raise KvsimError(f"the trace's hardware section lacks table {table}")
                h2d = cm.links["h2d"]  # derived from the measured H2D path, and said so
                eff = 1.0 if path == "d2h" else GATHER_EFFICIENCY
                cm.links[path] = LinkPath(h2d.alpha, h2d.beta * eff,
                                          f"no {table} measured: H2D x {eff:g}: {where}")
                cm.provenance[f"link_{path}"] = cm.links[path].source
                continue
            alpha, beta = fit_alpha_beta(t["bytes"], t["seconds"])
            curve = Curve(f"{table}", t["bytes"], t["seconds"], cm.extrapolations)
            cm.links[path] = LinkPath(alpha, beta, f"measured table {table}: {where}", curve)
            cm.provenance[f"link_{path}"] = (f"measured {table} (fit alpha {alpha * 1e6:.1f} us, "
                                             f"beta {beta / GB:.2f} GB/s): {where}")
        for attr, table, xcol, what in (("attn_curve", "kernel_decode_attn", "tokens",
                                         "decode_attention"),
                                        ("gemm_curve", "kernel_gemm", "batch", "gemm"),
                                        ("head_curve", "kernel_lm_head", "batch", "lm_head")):
            t = hw.tables.get(table)
            if t is not None:
                setattr(cm, attr, Curve(table, t[xcol], t["seconds"], cm.extrapolations))
                cm.provenance[what] = f"measured table {table}: {where}"
        for kernel, table in decide_tables(hw.tables).items():
            t = hw.tables[table]
            ctx = np.asarray(t["context"], float)
            batch = np.asarray(t["batch"], float) if "batch" in t else np.ones_like(ctx)
            frac = np.asarray(t["fetched_frac"], float) if "fetched_frac" in t else \
                np.zeros_like(ctx)
            dm, worst = DecideModel.fit_table(ctx, batch, t["seconds"], frac)
            cm.decide_models[kernel] = dm
            cm.decide_ranges[kernel] = (table, float(ctx.min()), float(ctx.max()))
            legacy = (f" (the single decide table of an older profile, which timed "
                      f"{kernel}'s decide)" if table == LEGACY_DECIDE_TABLE else "")
            cm.provenance[f"decide.{kernel}"] = (
                f"fit to measured table {table}{legacy} ({len(ctx)} points, contexts "
                f"{ctx.min():.0f}..{ctx.max():.0f}, batches {batch.min():.0f}..{batch.max():.0f};"
                f" worst error {100 * worst:.1f}%): {dm.describe()}: {where}")
        cm.summarize_decide()
        return cm

    def apply(self, engine: Engine) -> CostModel:
        """Take an engine profile's fields over the hardware's (each one said in provenance)."""
        self.engine = engine
        self._gemm_flops.clear()  # the rates may change below
        prov = self.provenance
        prov["engine"] = (f"{engine.name} ({engine.origin})"
                          + (f": {engine.description}" if engine.description else ""))
        fitted = engine.fitted_on.get("gpu")
        for key, val in sorted(engine.fields.items()):
            prov[f"engine.{key}"] = val.describe()
        self._kernel_fields(engine)
        if self.attention_efficiency != 1.0 and self.attn_curve is None:
            prov["decode_attention"] = (f"KV bytes / (achievable HBM bandwidth x "
                                        f"{self.attention_efficiency:.3g}, engine {engine.name}'s "
                                        f"attention_efficiency)")
        self.launches = engine.get("link_launches", self.launches)
        self.fetch = engine.get("fetch", self.fetch)
        measured = self.spec is None  # rates from a profile, not from a catalog entry
        for key, attr, spec_rate, default in (
                ("hbm_efficiency", "hbm_bw", "hbm_gbps", HBM_EFFICIENCY),
                ("flop_efficiency", "flops", "bf16_tflops", FLOP_EFFICIENCY)):
            eff = engine.get(key)
            if eff is None:
                continue
            if measured:
                prov[f"engine.{key}"] += "; not applied: the rates are measured"
                continue
            setattr(self, attr, getattr(self, attr) / default * eff)
            what = "hbm_bandwidth" if attr == "hbm_bw" else "compute"
            unit, scale = ("GB/s", 1e9) if attr == "hbm_bw" else ("TFLOP/s", 1e12)
            prov[what] = (f"{getattr(self.spec, spec_rate):.0f} {unit} x {eff:.3g} (engine "
                          f"{engine.name}) = {getattr(self, attr) / scale:.4g} {unit}, catalog "
                          f"{self.gpu_name}")
        scale = 1.0
        if fitted and self.spec is not None and fitted != self.spec.name:
            from kvsim.hw import catalog
            scale = self.spec.h2d_gbps / catalog.gpu(fitted).h2d_gbps
        for p in ("h2d", "d2h", "gather"):
            gbps, launch = engine.fields.get(f"link.{p}.gbps"), engine.fields.get(
                f"link.{p}.launch_us")
            if gbps is None and launch is None:
                continue
            old = self.links[p]
            beta, note = old.beta, ""
            if gbps is not None:
                s = 1.0 if gbps.source == "override" else scale
                beta = gbps.value * GB * s
                note = f" (x {s:.3g}: the link ratio of {self.gpu_name} to {fitted})" \
                    if s != 1.0 else ""
            alpha = launch.value * 1e-6 if launch is not None else old.alpha
            self.links[p] = LinkPath(alpha, beta, f"engine {engine.name}{note}")
            prov[f"link_{p}"] = (f"alpha {alpha * 1e6:.1f} us, beta {beta / GB:.2f} GB/s: "
                                 f"engine {engine.name}{note}")
        what_if = engine.get("link_gbps")
        if what_if is not None:  # every path at this rate, the gather keeping its ratio to H2D
            ratio = self.links["gather"].beta / self.links["h2d"].beta
            for p, beta in (("h2d", what_if * GB), ("d2h", what_if * GB),
                            ("gather", what_if * GB * ratio)):
                old = self.links[p]
                self.links[p] = LinkPath(old.alpha, beta, f"override (--link-gbps {what_if:g})")
                prov[f"link_{p}"] = (f"alpha {old.alpha * 1e6:.1f} us, beta {beta / GB:.2f} "
                                     f"GB/s: override (--link-gbps {what_if:g}"
                                     + (f" x {ratio:.3g}, the gather/H2D ratio)" if p == "gather"
                                        else ")"))
        for key in engine.fields:
            if key.startswith("decide."):
                self.decide_models[key[7:]] = engine.decide(key[7:])
                prov[key] = f"engine {engine.name}: {engine.fields[key].describe()}"
        self.decide_override_us = engine.get("decide_layer_us")
        self.summarize_decide()
        if fitted and fitted != self.gpu_name:
            prov["engine"] += (f"; fitted on {fitted}: per-step overhead and decide times "
                               f"applied to {self.gpu_name} unscaled")
        return self

    def _kernel_fields(self, engine: Engine) -> None:
        """The engine's overheads and kernel-shape fields (absent: the roofline's)."""
        self.step_overhead = engine.get("step_overhead_ms", 0.0) / 1e3
        self.layer_overhead = engine.get("layer_overhead_us", 0.0) / 1e6
        self.launch_overhead = engine.get("launch_overhead_us", 0.0) / 1e6 \
            if engine.get("launch") == "eager" else 0.0
        self.token_overhead = engine.get("token_overhead_us", 0.0) / 1e6
        self.allreduce_extra = engine.get("allreduce_us", 0.0) / 1e6
        self.allreduce_kernel = engine.get("allreduce_kernel", "nccl")
        self.gemm_overlap = engine.get("gemm_overlap", 1.0)
        self.gemm_half_tokens = engine.get("gemm_half_tokens", 0.0)
        self.moe_efficiency = engine.get("moe_efficiency", 1.0)
        self.attention = engine.get("attention", "gqa")
        self.head_reread_share = engine.get("head_reread_share", 1.0)
        self.attention_efficiency = engine.get("attention_efficiency", 1.0)
        self.prefill_attention_efficiency = engine.get("prefill_attention_efficiency", 1.0)
        self.fp8_efficiency = engine.get("fp8_efficiency", FP8_EFFICIENCY_RATIO)

    # ------------------------------------------------------------------------- cost functions
    def link_time(self, nbytes, path: str = "h2d", copies=1) -> np.ndarray:
        return self.links[path].time(nbytes, copies)

    def attention_time(self, kv_bytes_read, kv_tokens_read=None) -> np.ndarray:
        """One layer's decode attention over the batch: HBM-bound on the KV bytes it reads, at
        the engine's ``attention_efficiency`` of the HBM rate its weight reads reach (paged
        KV, per-head reductions)."""
        roofline = np.asarray(kv_bytes_read, float) / (self.hbm_bw * self.attention_efficiency)
        if self.attn_curve is None or kv_tokens_read is None:
            return roofline
        c = self.attn_curve
        return c(kv_tokens_read, lambda n: c.y[-1] * n / c.x[-1])

    def gemm_time(self, batch, m: ModelSpec) -> np.ndarray:
        """One layer's projections and MLP for ``batch`` decode tokens."""
        batch = np.asarray(batch, float)
        if self.gemm_curve is not None:
            c = self.gemm_curve
            return c(batch, lambda b: np.maximum(c.y[-1] * b / c.x[-1], c.y[0]))
        return self.matmuls(m).time(batch)

    def matmuls(self, m: ModelSpec) -> Matmuls:
        """The layer GEMMs of ``m`` on this GPU under this engine. A weight-only kernel
        (:func:`weight_only_kernel`) reads the weights at its share of the HBM rate
        (``WEIGHT_ONLY_READ_SHARE``) and computes at least its ``WEIGHT_ONLY_ROWS`` tokens, not
        the GPU's tensor-core tile."""
        bw, tile = self.hbm_bw, self.mma_rows
        if weight_only_kernel(m):
            bw, tile = bw * WEIGHT_ONLY_READ_SHARE, min(tile, WEIGHT_ONLY_ROWS)
        return Matmuls(m, self.gemm_flops(m), bw, self.gemm_overlap, self.gemm_half_tokens,
                       self.moe_efficiency, tile)

    def attention_reread(self, m: ModelSpec) -> float:
        """How many times decode attention reads each cached KV head from HBM: once with a
        GQA-aware kernel; with one that is not (engine ``attention``), once per query head of its
        group, of which the repeats after the first cost a read where they miss the L2 cache
        (engine ``head_reread_share`` of them: 1, every one)."""
        if self.attention != "per-query-head":
            return 1.0
        return 1.0 + (m.q_heads / m.kv_heads - 1.0) * self.head_reread_share

    def gemm_flops(self, m: ModelSpec) -> float:
        """Achievable FLOP/s of ``m``'s layer GEMMs, by the type its weights are stored in:
        1-byte (fp8) weights run W8A8 at the GPU's fp8 rate where it has one, times the bf16
        efficiency and the engine's ``fp8_efficiency`` (default ``FP8_EFFICIENCY_RATIO``);
        weights a weight-only kernel dequantises (W4A16: :func:`weight_only_kernel`) at
        ``WEIGHT_ONLY_COMPUTE_SHARE`` of the bf16 rate; any other (bf16, fp8 cast to bf16, fp8
        on a GPU listing no fp8 rate) at the bf16 rate. Said in
        ``provenance["compute_gemm"]``. Attention, the LM head and the policies' work stay at
        the bf16 rate (``flops``)."""
        elem = m.weight_elem
        key = (elem, m.weight_only)
        if key in self._gemm_flops:
            return self._gemm_flops[key]
        g, rate, note = self.spec, self.flops, ""
        if elem == 1 and m.weight_only:
            note = "fp8 weights cast for bf16 GEMMs (W8A16): fp8 bytes, the bf16 rate"
        elif weight_only_kernel(m):
            rate = self.flops * WEIGHT_ONLY_COMPUTE_SHARE
            note = (f"{elem:g}-byte weights dequantised in bf16 matmuls "
                    f"(W4A16): compute at {WEIGHT_ONLY_COMPUTE_SHARE} of the bf16 rate = "
                    f"{rate / 1e12:.4g} TFLOP/s, weight reads at {WEIGHT_ONLY_READ_SHARE} of the "
                    f"achievable HBM rate, at least {WEIGHT_ONLY_ROWS} tokens "
                    f"({WEIGHT_ONLY_SOURCE})")
        elif elem == 1:
            fp8 = g.fp8_tflops if g is not None else 0.0
            if fp8:
                r = self.fp8_efficiency
                rate = self.flops * fp8 / g.bf16_tflops * r
                why = ("the engine's fp8_efficiency, fitted" if r != FP8_EFFICIENCY_RATIO
                       else FP8_SOURCE)
                note = (f"fp8 weights (W8A8): {fp8:.0f} TFLOP/s dense fp8 x the bf16 efficiency "
                        f"x {r:.3g} = {rate / 1e12:.4g} TFLOP/s ({g.rates_source}; {why})")
            else:
                why = (f"{g.name} lists no fp8 rate ({g.rates_source or 'no fp8 tensor cores'})"
                       if g is not None else "the measured rate is the profile's")
                note = f"fp8 weights at the bf16 rate: {why}"
        if note:
            self.provenance["compute_gemm"] = note
        self._gemm_flops[key] = rate
        return rate

    def head_time(self, batch, m: ModelSpec) -> np.ndarray:
        """The LM head (vocab projection) once per step for ``batch`` sequences that emit a
        token, and the engine's work per emitted token (``token_overhead_us``)."""
        if self.head_curve is not None:
            c = self.head_curve
            head = c(batch, lambda b: np.maximum(c.y[-1] * b / c.x[-1], c.y[0]))
        else:
            p = m.vocab * m.hidden  # (a batch below the tensor-core tile: the tile's work)
            head = np.maximum(2.0 * p * np.maximum(np.asarray(batch, float), self.mma_rows)
                              / self.flops, p * m.dtype_bytes / self.hbm_bw)
        return head + self.token_overhead * np.asarray(batch, float) if self.token_overhead \
            else head

    def summarize_decide(self) -> None:
        """``provenance["decide"]`` before a policy asks for its decide model: which policies
        have one of their own (``decide.<policy>``) and what the others get."""
        if self.decide_override_us is not None:
            self.provenance["decide"] = ("every policy's decide step: "
                                         f"{self.provenance['engine.decide_layer_us']}")
        elif self.decide_models:
            self.provenance["decide"] = (
                f"models of their own for {', '.join(sorted(self.decide_models))} "
                f"(decide.<policy>); any other policy: {DECIDE_ESTIMATE}")

    def decide_model(self, kernel: str, m: ModelSpec, work_per_token: float) -> DecideModel:
        """The decide cost of a policy's kernel: a what-if override (``decide_layer_us``, keeping
        the engine's serial share for the kernel), the engine's or the profile's model, else an
        HBM-bound estimate: the decide pass reads ``work_per_token`` bytes per context token and
        KV head (the sketch and the per-token state) about four times (score, select, sort,
        suffix scan), request after request. Says which in ``provenance["decide.<kernel>"]``
        and, for the policy being planned, ``provenance["decide"]``."""
        self.decided.add(kernel)
        key = f"decide.{kernel}"
        dm = self.decide_models.get(kernel)
        if self.decide_override_us is not None:
            engine_dm = self.engine.decide(kernel)
            dm = DecideModel(per_layer_us=self.decide_override_us,
                             serial_share=engine_dm.serial_share if engine_dm else 1.0)
            over = self.engine.fields["decide_layer_us"]
            self.provenance[key] = (f"engine {self.engine.name}: {dm.describe()} ({over.source}"
                                    f"{': ' + over.note if over.note else ''})")
        elif dm is None:
            dm = DecideModel(per_ktoken_us=4e9 * m.kv_heads * work_per_token / self.hbm_bw)
            self.provenance[key] = (f"{DECIDE_ESTIMATE} (no engine decide model and no profiled "
                                    f"{DECIDE_TABLE.format(kernel)} table)")
        self.provenance["decide"] = self.provenance[key]
        return dm

    def check_decide_range(self, context: float) -> None:
        """Record an extrapolation when a plan decides beyond the contexts a profile measured
        (for each decide kernel the simulation asked for)."""
        for kernel in sorted(self.decided & set(self.decide_ranges)):
            table, lo, hi = self.decide_ranges[kernel]
            if not lo <= context <= hi:
                self.extrapolations.add(f"{table}: context {context:.0f}, measured "
                                        f"{lo:.0f}..{hi:.0f} (linear model)")

    def set_tp(self, tp: int, shared_link: bool = False) -> CostModel:
        """One GPU of a tensor-parallel group of ``tp``: the group's all-reduces priced from
        published measurements of the engine's all-reduce kernel (``allreduce_kernel``: NCCL or
        custom) over the catalog's peer link (:mod:`kvsim.hw.collectives`);
        with ``shared_link`` the group's GPUs share one host link."""
        self.tp = tp
        if tp == 1:
            return self
        g = self.spec
        if g is None or not g.peer_gbps:
            raise KvsimError(f"--tp {tp} needs the GPU-to-GPU bandwidth of a catalog GPU (--gpu)")
        self.allreduce = AllReduce(g.peer, g.peer_gbps, tp, self.allreduce_kernel)
        self.provenance["tensor_parallel"] = (
            f"{tp} GPUs: 2 all-reduces per layer, latency + bytes x 2 (N - 1) / N / bus "
            f"bandwidth over {self.allreduce.source}")
        if shared_link:
            for p, path in self.links.items():
                self.links[p] = LinkPath(path.alpha, path.beta / tp, f"{path.source}; shared by "
                                         f"{tp} GPUs")
            self.provenance["tensor_parallel"] += f"; one host link shared by the {tp} GPUs"
        else:
            self.provenance["tensor_parallel"] += "; each GPU on its own host link"
        return self

    def allreduce_time(self, tokens, m: ModelSpec) -> np.ndarray:
        """One layer's all-reduces (after attention and after the MLP) of ``tokens`` hidden
        states in a tensor-parallel group, each with what the engine adds (``allreduce_us``)."""
        t = np.asarray(tokens, float)
        if self.tp == 1:
            return np.zeros_like(t)
        reduce = self.allreduce.time(t * m.hidden * m.dtype_bytes)
        return 2 * (reduce + self.allreduce_extra) if self.allreduce_extra else 2 * reduce

    def overlap_for(self, policy_overlap: bool) -> bool:
        return {"policy": policy_overlap, "serial": False, "overlap": True}[self.fetch]

    def copies(self, per_layer: float, n_seq):
        """Link launches per layer: one per sequence, or one batched launch for all."""
        if self.launches == "per-layer":
            return np.where(np.asarray(n_seq) > 0, per_layer, 0.0)
        return per_layer * np.asarray(n_seq, float)


def weight_only_kernel(m: ModelSpec) -> bool:
    """Whether ``m``'s layer weights are dequantised inside bf16 matmuls by an integer
    weight-only kernel: 4-bit weights (W4A16). 1-byte weights marked ``weight_only`` (fp8
    weights cast to bf16 where an engine has no fp8 kernel for the model, TensorRT-LLM before
    0.10 for Mixtral) read fp8 bytes at the full rate and compute at the bf16 rate: a cast, not
    an integer unpack and scale, and the published rows of that case fit it (the Marlin-style
    W8A16 rates made them 16-17% slow, one prediction pass, 2026-12-07)."""
    return m.weight_elem < 1


def costs_for(gpu: str | None, hardware, engine=None, overrides: dict | None = None,
              layers: int | None = None) -> tuple[CostModel, str]:
    """The costs a plan uses, and where they came from: a trace's measured ``hardware`` section
    when it has one and no other GPU was named, else the catalog entry ``gpu`` (default
    ``DEFAULT_GPU``); then the engine (a name, a file or an :class:`Engine`; default
    ``roofline`` with measured hardware, so a profile's numbers stay as measured, and
    :func:`kvsim.hw.engine.default_for` the GPU's vendor with a catalog GPU: an engine that
    runs there), with what-if ``overrides``
    (:meth:`Engine.with_overrides`; ``layers``: the planned model's, for ``decide_ms``)."""
    if hardware is not None and (gpu is None or gpu == hardware.device.get("catalog_name")):
        base = catalog.gpu(gpu) if gpu else None
        costs = CostModel.from_hardware(hardware, base)
        source = "trace hardware section"
        default = ROOFLINE
    else:
        costs = CostModel.from_spec(catalog.gpu(gpu or DEFAULT_GPU))
        if hardware is not None:
            costs.provenance["trace_hardware"] = (
                f"not used: the trace was profiled on {hardware.device.get('name')!r}, "
                f"the plan is for {costs.gpu_name}")
        source = "catalog" if gpu else "catalog (default GPU)"
        default = default_for(catalog.gpu(gpu or DEFAULT_GPU).vendor)
    eng = load_engine(engine if engine is not None else default)
    if default is not ROOFLINE:
        check_runs_on(eng, costs.gpu_name, catalog.gpu(gpu or DEFAULT_GPU).vendor)
    if overrides:
        eng = eng.with_overrides(**overrides, layers=layers)
    costs.apply(eng)
    if engine is None:
        costs.provenance["engine"] += " [default for " + (
            "measured hardware]" if default is ROOFLINE else "a catalog GPU]")
    return costs, source
