"""Engine profiles: what a serving engine adds to the hardware it runs on.

A hardware profile (a catalog entry or ``kvsim profile``) says what the machine can do; an engine
profile says what a serving engine makes of it: a batch-independent overhead per step, the share
of spec HBM and compute bandwidth its kernels reach, per-path link bandwidth and launch cost and
whether a layer's copies are one batched launch or one per sequence, whether a policy's fetch is
overlapped or serial, a decide-kernel cost model per policy, and how it launches a step's
kernels (``launch``: one CUDA graph, or eagerly from the host at ``launch_overhead_us`` a layer,
overlapped with the GPU's work; :data:`FAMILY_LAUNCH` says each family's, from its
documentation and published launch costs).

An engine file is JSON (``FORMAT``, ``VERSION``) with one entry per field, each
``{"value": ..., "source": ..., "note": ...}``: ``source`` says where the value came from
(``SOURCES``). A field the file leaves out is the hardware's own (the catalog's roofline
defaults or the profile's measured tables). Built-in engines:

* ``roofline``: no field set: the hardware as it is (the default with a measured profile, so a
  profile's numbers are unchanged);
* ``trtllm``, ``vllm``, ``sglang``: engine families fitted to published measurements of many
  GPUs, models and TP sizes (``data/published.csv``, :mod:`kvsim.fit.families`; ``vllm`` is
  vLLM's V1 engine, 0.8 on: its older releases are families of their own in the fit), each with its
  leave-one-source-out errors (``fit["cv"]``: the intervals) and the configurations its points
  cover (``fit["checked"]``); ``trtllm``, the best-checked, is the default with a catalog GPU;
* ``vllm-paper``: fitted by ``kvsim fit`` to the VerKV paper's vLLM measurements on one H100
  (``data/verkv-paper-h100.csv``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvsim.checks import MAX_GBPS, MIN_GBPS
from kvsim.errors import KvsimError
from kvsim.hw.collectives import KERNELS

FORMAT = "kvsim-engine"
VERSION = 1
SOURCES = ("catalog", "profile", "fit", "paper", "docs", "override", "default")
PATHS = ("h2d", "d2h", "gather")
LAUNCHES = ("per-sequence", "per-layer")
# how an engine launches a decode step's kernels: one CUDA graph per step, or kernel by kernel
# from the host while the GPU runs the ones launched before (``launch_overhead_us``)
LAUNCH_MODES = ("cuda-graph", "eager")
FETCHES = ("policy", "serial", "overlap")
ATTENTION = ("gqa", "per-query-head")  # decode attention reads each KV head once, or per query head
ENGINES_DIR = Path(__file__).resolve().parent / "engines"
# the engine families fitted to data/published.csv (scripts/fit_published_engines.py), and the
# shared fit of every engine's points, which stands in for an engine without points of its own
FAMILIES = ("trtllm", "vllm", "vllm-v0", "vllm-0.3", "sglang", "lmdeploy", "gpt-fast", "hf")
SHARED = "shared"
BUILTIN = {**{f: ENGINES_DIR / f"{f}.json" for f in (*FAMILIES, SHARED)},
           "vllm-paper": ENGINES_DIR / "vllm-paper-h100.json"}
CATALOG_DEFAULT = "trtllm"  # the default engine with a catalog GPU: the best-checked family
# engine families that run on some vendors' GPUs only (TensorRT-LLM's and LMDeploy's TurboMind
# kernels are CUDA), and the default engine where the best-checked one does not run (vLLM and
# SGLang run on AMD's ROCm too)
RUNS_ON = {"trtllm": ("nvidia",), "lmdeploy": ("nvidia",)}
VENDOR_DEFAULT = {"amd": "vllm"}
# What launching a kernel costs, measured (NVIDIA's "Getting Started with CUDA Graphs",
# developer.nvidia.com/blog/cuda-graphs, V100: 20 kernels of 2.9 us each take 3.8 us a kernel
# launched from C++ into a stream, 3.4 us as one CUDA graph): the host issues a kernel every
# 3.8 us; a graph's kernels follow each other 0.5 us apart on the GPU.
HOST_LAUNCH_US = 3.8
# kernels a decode step launches per Llama layer (our count, not a published one): RMSNorm,
# QKV GEMM, attention with RoPE and the KV write, output GEMM, residual add with RMSNorm,
# gate-up GEMM, SwiGLU, down GEMM, residual add: 9 in a fused C++ engine, about 10 with
# TensorRT-LLM's plugins; torch.compile's Inductor splits the RoPE, the KV write and the
# masking into kernels of their own, about 14
LAYER_KERNELS = {"fused": 10, "compiled": 14}
# PyTorch eager, measured: gpt-fast's Llama-2-7B before torch.compile decodes 25.5 tok/s at
# batch 1 on an A100-80GB, "heavily CPU overhead bound" (pytorch.org/blog/accelerating-
# generative-ai-2): 39.2 ms a token over 32 layers is 1,225 us of host time a layer. Not
# applied to the hf family (FAMILY_LAUNCH says why); a what-if for eager PyTorch code
EAGER_PYTORCH_LAYER_US = 1e3 / 25.5 / 32 * 1e3
# A layer's GPU-side fixed time (its per-layer overhead: gaps and the shortest kernels' time
# beyond the bytes they move) is at most its kernels at the blog's 3.8 us each, for the most
# kernels any family launches: the physical ceiling a fit may not exceed (53.2 us)
LAYER_OVERHEAD_CEILING_US = max(LAYER_KERNELS.values()) * HOST_LAUNCH_US
_CPP = LAYER_KERNELS["fused"] * HOST_LAUNCH_US
# how each family's published points launched decode, its host time per layer where it
# launches eagerly (``launch_overhead_us``, :data:`HOST_LAUNCH_US` x its kernels; None: not
# known), and where that is documented
FAMILY_LAUNCH = {
    "trtllm": ("eager", _CPP, "TensorRT-LLM's TensorRT backend (the published points' 0.5-0.9 "
               "and trtllm-bench): the C++ runtime enqueues the engine's kernels each step; "
               "CUDA graphs are opt-in (cuda_graph_mode, off by default); host time "
               f"{LAYER_KERNELS['fused']} kernels x {HOST_LAUNCH_US} us a layer"),
    "lmdeploy": ("eager", _CPP, "LMDeploy 0.1's TurboMind: a C++ runtime launching kernel by "
                 f"kernel, no CUDA graphs; host time {LAYER_KERNELS['fused']} kernels x "
                 f"{HOST_LAUNCH_US} us a layer"),
    "hf": ("eager", None, "Hugging Face transformers' generate in PyTorch eager mode (no "
           "static cache or torch.compile in the published harnesses); host time not applied: "
           "the one published eager PyTorch figure, gpt-fast's 1,225 us a layer, is another "
           "codebase's, and ShadowKV's own points (Yi-9B, 48 layers in 42.8 ms a step) "
           "contradict it"),
    "vllm": ("cuda-graph", 0.0, "vLLM V1 captures decode batches as (piecewise) CUDA graphs by "
             "default (enforce_eager=False)"),
    "vllm-v0": ("cuda-graph", 0.0, "vLLM 0.4-0.7 captures decode batches up to 256 as CUDA graphs "
                "by default (enforce_eager=False)"),
    "vllm-0.3": ("cuda-graph", 0.0, "vLLM 0.2.5 on captures decode batches as CUDA graphs by "
                 "default (enforce_eager=False)"),
    "sglang": ("cuda-graph", 0.0, "SGLang captures decode batches as CUDA graphs by default "
               "(--disable-cuda-graph turns them off)"),
    "gpt-fast": ("cuda-graph", 0.0, "gpt-fast compiles decode with torch.compile(mode="
                 "'reduce-overhead'): CUDA graphs"),
}
# which all-reduce kernel each family's published points ran (kvsim.hw.collectives prices
# each from its own measurements), and where that is documented; a family not named runs NCCL
FAMILY_ALLREDUCE = {
    "trtllm": ("custom", "TensorRT-LLM's AllReduce plugin: use_custom_all_reduce on by default in "
               "its PluginConfig and its benchmarks' build configs ('gives better performance "
               "with NVLink'), 0.7-0.9"),
    "vllm": ("custom", "vLLM's custom all-reduce (vllm/distributed/device_communicators/"
             "custom_all_reduce.py), on by default since PR 2192 (0.3.0) over NVLink"),
    "vllm-v0": ("custom", "vLLM 0.4-0.7: custom all-reduce on by default over NVLink "
                "(disable_custom_all_reduce=False)"),
    "vllm-0.3": ("custom", "vLLM 0.3: custom all-reduce from PR 2192 (0.3.0) on; the 0.2 rows of "
                 "the family (PR 2542's branch) ran NCCL"),
    "sglang": ("custom", "SGLang: vLLM's custom all-reduce, then sgl-kernel's (TensorRT-LLM's "
               "kernel, PR 2904)"),
    "lmdeploy": ("nccl", "LMDeploy 0.1's TurboMind: ftNcclAllReduceSum after attention and the "
                 "MLP (its FasterTransformer custom all-reduce is built but not enabled)"),
    "gpt-fast": ("nccl", "gpt-fast: torch.distributed's functional all_reduce (NCCL) inside the "
                 "compiled graph"),
    "hf": ("nccl", "transformers' tensor parallelism: torch.distributed (NCCL)"),
}
# what a family's code fixes of its overheads, with where, for the shared fit where it stands
# in for the family (a fold that holds the family out; where the family has points, they set
# them): gpt-fast's generate.py decodes in a Python loop around one compiled step that samples
# on the GPU without a host sync (decode_n_tokens, github.com/pytorch-labs/gpt-fast): no
# scheduler and no input preparation, so no per-step host work beyond the graph's launch (its
# own fit agrees: 0.24 ms, an eighth of the shared fit's 1.9 ms)
FAMILY_FIELDS = {"gpt-fast": {"step_overhead_ms": (
    0.0, "gpt-fast's generate.py: a Python loop around one compiled decode step that samples on "
    "the GPU (decode_n_tokens): no scheduler, no per-step input preparation")}}
# other names of the families
ALIASES = {"tensorrt-llm": "trtllm", "trt-llm": "trtllm", "tensorrt_llm": "trtllm",
           "turbomind": "lmdeploy", "transformers": "hf", "hf-transformers": "hf",
           "huggingface": "hf", "vllm-v1": "vllm", "gptfast": "gpt-fast"}
# vLLM's engine generations, each its own family: (first major.minor, family), newest first;
# data/published/README.md says why (scripts/build_published_dataset.py reads it too)
VLLM_GENERATIONS = (((0, 8), "vllm"), ((0, 4), "vllm-v0"), ((0, 0), "vllm-0.3"))
NAME = re.compile(r"[a-z][a-z0-9._+=@-]*")  # an engine's name, with a version (not a file)
# vllm==0.6.3, sglang@0.4, vllm-0.5
NAMED_VERSION = re.compile(r"(.+?)(?:==|@|-v?)(\d+\.\d+(?:\.\d+)?)$")


def resolve(name: str) -> tuple[str, str | None]:
    """(built-in engine, version asked for or None) for an engine named with an optional
    version (``vllm==0.6.3``, ``vllm-0.6``, ``sglang@0.4``, ``tensorrt-llm``): vLLM's version
    picks its generation's family; an engine without published points is the shared fit."""
    text = name.strip().lower()
    base, version = text, None
    if text not in BUILTIN and (m := NAMED_VERSION.fullmatch(text)):
        base, version = m.group(1), m.group(2)
    family = ALIASES.get(base, base)
    if family == "vllm" and version:
        mm = tuple(int(x) for x in version.split(".")[:2])
        family = next(f for first, f in VLLM_GENERATIONS if mm >= first)
    return (family if family in BUILTIN else SHARED), version


def _stand_in(engine: Engine, asked: str, version: str | None) -> Engine:
    """``engine`` standing in for ``asked``, where ``asked`` (or its version) has no published
    points of its own: said in ``fit["stand_in"]``, which widens its intervals by the spread
    between families (``fit["between_families"]``, :func:`kvsim.replay.report.add_intervals`)."""
    versions = engine.fit.get("versions") or []
    if engine.name == SHARED:
        why = (f"engine {asked} has no published points of its own: the shared fit of every "
               f"engine's points stands in (families with points: {', '.join(FAMILIES)})")
    elif version and versions and ".".join(version.split(".")[:2]) not in versions:
        why = (f"engine {asked}: {engine.name} {version} has no published points of its own: "
               f"the {engine.name} family's fit stands in (its points: "
               f"{', '.join(versions)})")
    else:
        return engine
    return dataclasses.replace(engine, name=asked, fit={**engine.fit, "stand_in": why})


def default_for(vendor: str) -> str:
    """The default engine for a catalog GPU of ``vendor``: the best-checked one that runs there."""
    return VENDOR_DEFAULT.get(vendor, CATALOG_DEFAULT)


def check_runs_on(engine: Engine, gpu: str, vendor: str) -> None:
    """Refuse an engine family that does not run on this vendor's GPUs (TensorRT-LLM on an AMD
    GPU), in one line naming the default that does."""
    family = engine.fit.get("family") or engine.name
    vendors = RUNS_ON.get(family)
    if vendors and vendor not in vendors:
        raise KvsimError(f"--engine {engine.name}: {family} runs on {' and '.join(vendors)} "
                         f"GPUs only, not on {gpu} ({vendor}); use --engine "
                         f"{default_for(vendor)}, the default there")
BOUNDS = ("plot-kernel",)  # certainties of measured values that only bound TPOT


@dataclass(frozen=True)
class DecideModel:
    """Seconds of one layer's decide step for a batch of requests.

    Per request: ``a + b * n / 1000 + c * f * n / 1000`` microseconds for a context of ``n``
    tokens of which the policy fetches the share ``f``; a batch of ``B`` requests takes
    ``(s * B + 1 - s) / B`` times the sum of its requests' costs: ``s`` = 1 when the engine
    decides the requests one after another, 0 when a batch costs what one request does."""
    per_layer_us: float = 0.0  # a
    per_ktoken_us: float = 0.0  # b
    per_kfetched_us: float = 0.0  # c
    serial_share: float = 1.0  # s

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not (isinstance(v, (int, float)) and not isinstance(v, bool)
                    and math.isfinite(v) and 0 <= v <= 1e6):
                raise KvsimError(f"decide model: {f.name} must be a number in [0, 1e6] "
                                 f"(microseconds), got {v!r}")
        if self.serial_share > 1:
            raise KvsimError(f"decide model: serial_share must be in [0, 1], got "
                             f"{self.serial_share}")

    def seconds(self, n_seq, tokens, fetch_frac: float) -> np.ndarray:
        """Per-layer seconds for ``n_seq`` requests holding ``tokens`` context tokens in all."""
        B = np.asarray(n_seq, float)
        per = B * self.per_layer_us + (self.per_ktoken_us + self.per_kfetched_us * fetch_frac) \
            * np.asarray(tokens, float) / 1e3
        share = np.where(B > 0, (self.serial_share * B + 1 - self.serial_share)
                         / np.maximum(B, 1), 0.0)
        return per * share * 1e-6

    def describe(self) -> str:
        return (f"{self.per_layer_us:.4g} us + {self.per_ktoken_us:.4g} us/1K ctx + "
                f"{self.per_kfetched_us:.4g} us/1K fetched per request and layer, serial share "
                f"{self.serial_share:.3g}")

    @classmethod
    def fit_table(cls, context, batch, seconds, fetched_frac) -> tuple[DecideModel, float]:
        """Fit to a measured ``kernel_decide`` table (per-layer seconds of a batch); returns the
        model and its largest relative error on the table. Non-negative least squares on relative
        error for (a, b, c) at each serial share of a grid."""
        from scipy.optimize import nnls
        n, B, t = (np.asarray(x, float) for x in (context, batch, seconds))
        f = np.asarray(fetched_frac, float)
        best = None
        for s in np.linspace(0.0, 1.0, 101):
            share = (s * B + 1 - s)  # the batch's sum times (sB + 1 - s) / B, times B requests
            A = np.stack([share, share * n / 1e3, share * f * n / 1e3], 1) / t[:, None]
            coef, _ = nnls(A, np.ones_like(t))
            err = A @ coef - 1.0
            if best is None or (err ** 2).sum() < best[0]:
                best = ((err ** 2).sum(), s, coef, float(np.abs(err).max()))
        _, s, (a, b, c), worst = best
        # us per request and layer; B requests cost B times one (x the share)
        return cls(a * 1e6, b * 1e6, c * 1e6, float(s)), worst


@dataclass(frozen=True)
class Value:
    value: object
    source: str
    note: str = ""

    def describe(self) -> str:
        v = self.value
        shown = DecideModel(**v).describe() if isinstance(v, dict) else f"{v:g}" \
            if isinstance(v, float) else str(v)
        return f"{shown} ({self.source}{': ' + self.note if self.note else ''})"


# field name -> (kind, check); decide.<policy> entries are DecideModel dicts
def _positive(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def _nonneg(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


MIN_EFFICIENCY = 0.01  # below 1% of a spec rate no engine runs: a typo, or times that overflow


def _share_floor(v):
    return _positive(v) and MIN_EFFICIENCY <= v <= 1


def _upto(most: float):  # a time or size >= 0 within what any engine step holds
    return lambda v: _nonneg(v) and v <= most


def _gbps(v):
    return _positive(v) and MIN_GBPS <= v <= MAX_GBPS


FIELDS = {
    "step_overhead_ms": (_upto(1e3), "a number in [0, 1000] (ms per engine step, whatever its "
                         "batch)"),
    "hbm_efficiency": (_share_floor, f"a share in [{MIN_EFFICIENCY:g}, 1] of spec HBM"),
    "flop_efficiency": (_share_floor, f"a share in [{MIN_EFFICIENCY:g}, 1] of spec compute"),
    "layer_overhead_us": (_upto(1e5), "a number in [0, 1e5] (us per layer and step of GPU "
                          "time between and around its kernels, whatever the batch)"),
    "launch": (lambda v: v in LAUNCH_MODES, f"one of {', '.join(LAUNCH_MODES)}"),
    "launch_overhead_us": (_upto(1e5), "a number in [0, 1e5] (us of host time per layer to "
                           "launch its kernels one by one, eager only: overlapped with the "
                           "GPU's work, a step takes at least the launches)"),
    "token_overhead_us": (_upto(1e5), "a number in [0, 1e5] (us per sequence that emits a "
                          "token in a step: sampling, detokenising, the scheduler's bookkeeping)"),
    "allreduce_us": (_upto(1e5), "microseconds in [0, 1e5] an engine's all-reduce adds to the "
                     "measured kernel time per call (its launch, synchronisation, skew between "
                     "the GPUs)"),
    "allreduce_kernel": (lambda v: v in KERNELS, f"one of {', '.join(KERNELS)} (the all-reduce "
                         "kernel: NCCL, or a custom one-kernel all-reduce over NVLink)"),
    "gemm_overlap": (lambda v: _nonneg(v) and v <= 1, "a share in [0, 1] of the smaller of a "
                     "matmul's compute and weight-read times hidden under the larger"),
    "gemm_half_tokens": (_upto(1e7), "tokens in [0, 1e7] per matmul at which it reaches half its "
                         "large-shape compute efficiency (0: flat)"),
    "moe_efficiency": (_share_floor, f"a share in [{MIN_EFFICIENCY:g}, 1] of the dense "
                       "matmuls' compute efficiency that grouped expert matmuls reach"),
    "attention": (lambda v: v in ATTENTION, f"one of {', '.join(ATTENTION)}"),
    "head_reread_share": (lambda v: _nonneg(v) and v <= 1, "a share in [0, 1] of a per-query-"
                          "head kernel's repeat reads of a KV head that reach HBM (the rest hit "
                          "the L2 cache)"),
    "attention_efficiency": (_share_floor, f"a share in [{MIN_EFFICIENCY:g}, 1] of the HBM "
                             "rate of the weight reads that decode attention reaches on the KV"),
    "prefill_attention_efficiency": (_share_floor, f"a share in [{MIN_EFFICIENCY:g}, 1] of "
                                     "the matmuls' compute rate that prefill attention reaches"),
    "fp8_efficiency": (_share_floor, f"a ratio in [{MIN_EFFICIENCY:g}, 1]: the share of the fp8 "
                       "peak W8A8 matmuls reach over the share of the bf16 peak bf16 ones reach"),
    "link_launches": (lambda v: v in LAUNCHES, f"one of {', '.join(LAUNCHES)}"),
    "fetch": (lambda v: v in FETCHES, f"one of {', '.join(FETCHES)}"),
    **{f"link.{p}.gbps": (_gbps, f"GB/s in [{MIN_GBPS:g}, {MAX_GBPS:g}]") for p in PATHS},
    **{f"link.{p}.launch_us": (_upto(1e5), "microseconds in [0, 1e5] per launch") for p in PATHS},
    "link_gbps": (_gbps, f"GB/s in [{MIN_GBPS:g}, {MAX_GBPS:g}] (a what-if: every path, gather "
                         "keeping its ratio)"),
    "decide_layer_us": (_upto(1e6), "microseconds in [0, 1e6] per request and layer (a what-"
                        "if: the decide step of whichever policy is planned)"),
}


@dataclass
class Engine:
    name: str
    fields: dict[str, Value] = field(default_factory=dict)
    description: str = ""
    fitted_on: dict = field(default_factory=dict)  # {"gpu": ..., "model": ...}
    fit: dict = field(default_factory=dict)  # what kvsim fit measured: points, errors
    origin: str = "built-in"  # the file it came from

    def __post_init__(self):
        for key, val in self.fields.items():
            check(key, val)

    def get(self, key: str, default=None):
        v = self.fields.get(key)
        return default if v is None else v.value

    def residuals(self) -> list[dict]:
        """The engine's out-of-sample TPOT errors on measured points (``fit["points"]``): each
        fit row's leave-one-out error where the other rows identify every parameter it needs,
        and each check row's error (never fitted), except rows whose value is only a bound of
        TPOT (``plot-kernel``: a GPU kernel time). Each ``{"row", "use", "err_pct"}``, the
        predicted over the measured TPOT less 1."""
        out = []
        for p in self.fit.get("points", []):
            err = p.get("loo_tpot_pct") if p.get("use") == "fit" else p.get("err_tpot_ms_pct")
            if err is not None and p.get("certainty") not in BOUNDS:
                out.append({"row": p.get("row"), "use": p.get("use"), "err_pct": float(err)})
        return out

    def spread(self, regime: str = "decode") -> tuple[float | None, str]:
        """How far this engine's predictions of ``regime`` (decode, prefill, throughput) have
        been seen off, as a log ratio ``s``: a prediction ``P`` puts the measured value in
        ``[P e^-s, P e^s]``. An engine fitted on published points with a leave-one-source-out
        check (``fit["cv"]``) takes the 90% quantile of that regime's held-out
        ``|ln(predicted / measured)|``; otherwise :meth:`_spread_loo`. With the words to say
        so."""
        cv = [v for v in self.fit.get("cv") or [] if v.get("regime") == regime]
        if not cv:
            return self._spread_loo()
        logs = sorted(abs(float(v["log_err"])) for v in cv)
        s = float(np.quantile(logs, 0.9))
        n_src = len({v.get("source") for v in cv})
        by = self.fit.get("cv_by", "source")
        held = "each source" if by == "source" else f"each {by} held out and"
        return s, (f"engine {self.name}: the 90% quantile of {len(cv)} held-out {regime} errors "
                   f"of published points ({n_src} sources, {held} predicted by a fit of the "
                   f"others): x{math.exp(s):.3g} either way")

    def _spread_loo(self) -> tuple[float | None, str]:
        """How far this engine's TPOT has been seen off, as a log ratio ``s``: a prediction
        ``P`` puts the measured value in ``[P e^-s, P e^s]``. ``s`` is the largest
        ``|ln(1 + err)|`` of :meth:`residuals` (with a handful of points, their largest rather
        than a quantile); None when the engine was checked on no point. With the words to
        say so."""
        res = self.residuals()
        if not res:
            return None, f"engine {self.name} has no out-of-sample check on measured points"
        logs = [abs(math.log1p(r["err_pct"] / 100)) for r in res]
        s = max(logs)
        loo = sum(r["use"] == "fit" for r in res)
        errs = ", ".join(f"{r['err_pct']:+.1f}%" for r in res)
        return s, (f"engine {self.name}: the largest of {len(res)} out-of-sample TPOT errors "
                   f"({loo} leave-one-out, {len(res) - loo} check rows): "
                   f"{errs}; "
                   f"x{math.exp(s):.3g} either way")

    def decide(self, kernel: str) -> DecideModel | None:
        v = self.fields.get(f"decide.{kernel}")
        return None if v is None else DecideModel(**v.value)

    def with_fields(self, source: str = "override", **values) -> Engine:
        """A copy with these fields set (each checked), from ``source``."""
        fields = dict(self.fields)
        for k, v in values.items():
            fields[k] = Value(v, source)
            check(k, fields[k])
        return dataclasses.replace(self, fields=fields)

    def with_overrides(self, **over) -> Engine:
        """A copy with what-if values (source ``override``): ``step_overhead_ms``,
        ``link_gbps`` (every path; the gather path keeps its ratio to H2D), ``decide_ms`` (per
        request and decode step, all layers: the field ``decide_layer_us``, which replaces the
        decide model of the policy being planned, keeping its serial share; needs ``layers``),
        ``allreduce_kernel`` (``nccl`` or ``custom``: the engine's own extra stays)."""
        fields = dict(self.fields)
        layers = over.pop("layers", None)
        if over.get("allreduce_kernel") is not None:
            k = over["allreduce_kernel"]
            fields["allreduce_kernel"] = Value(k, "override", f"--allreduce-kernel {k}")
            try:
                check("allreduce_kernel", fields["allreduce_kernel"])
            except KvsimError as e:
                raise KvsimError(f"--allreduce-kernel: {e}") from None
        if over.get("step_overhead_ms") is not None:
            fields["step_overhead_ms"] = Value(float(over["step_overhead_ms"]), "override")
            try:
                check("step_overhead_ms", fields["step_overhead_ms"])
            except KvsimError as e:
                raise KvsimError(f"--step-overhead-ms: {e}") from None
        if over.get("link_gbps") is not None:
            from kvsim.checks import rate_gbps
            x = rate_gbps(over["link_gbps"], "--link-gbps")
            fields["link_gbps"] = Value(x, "override", f"--link-gbps {x:g}")
        if over.get("decide_ms") is not None:
            d = float(over["decide_ms"])
            if not (_nonneg(d) and d <= 1e3) or not layers:
                raise KvsimError(f"--decide-ms must be in [0, 1000] (ms per request and step), "
                                 f"got {d:g}")
            fields["decide_layer_us"] = Value(d * 1e3 / layers, "override",
                                              f"--decide-ms {d:g} per request and step")
        return dataclasses.replace(self, fields=fields)

    # ------------------------------------------------------------------------------ files
    def to_json(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "name": self.name,
                "description": self.description, "fitted_on": self.fitted_on,
                "fields": {k: dataclasses.asdict(v) for k, v in sorted(self.fields.items())},
                "fit": self.fit}

    def save(self, path, force: bool = False) -> None:
        from kvsim.io import atomic_write
        text = json.dumps(self.to_json(), indent=1) + "\n"
        atomic_write(path, lambda f: f.write(text.encode()), force)


def check(key: str, val: Value) -> None:
    if val.source not in SOURCES:
        raise KvsimError(f"engine field {key}: source {val.source!r} is not one of "
                         f"{', '.join(SOURCES)}")
    if key.startswith("decide."):
        if not isinstance(val.value, dict) or set(val.value) - {
                f.name for f in dataclasses.fields(DecideModel)}:
            raise KvsimError(f"engine field {key}: give per_layer_us, per_ktoken_us, "
                             f"per_kfetched_us and serial_share")
        DecideModel(**val.value)
        return
    if key not in FIELDS:
        known = [k for k in FIELDS if not k.startswith("link.")]
        raise KvsimError(f"unknown engine field {key!r}; known: {', '.join(known)}, "
                         f"link.<{'|'.join(PATHS)}>.<gbps|launch_us>, decide.<policy>")
    ok, what = FIELDS[key]
    if not ok(val.value):
        raise KvsimError(f"engine field {key}: {val.value!r} is not {what}")


MAX_RECORD_NUMBER = 1e12  # no figure of a fit record (errors in %, ms, tokens) comes near


def _record(fit, where: str) -> dict:
    """An engine file's ``fit`` record, checked where kvsim reads it (the points' errors, the
    cross-validation's log errors, the configurations checked, the fitted ranges) and bounded
    everywhere else: it is printed and passed on."""
    def bad(what: str):
        raise KvsimError(f"{where}: fit.{what}")

    def walk(v, at: str):
        if isinstance(v, dict):
            for k, x in v.items():
                walk(x, f"{at}.{k}")
        elif isinstance(v, list):
            for i, x in enumerate(v):
                walk(x, f"{at}[{i}]")
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and \
                abs(v) > MAX_RECORD_NUMBER:
            bad(f"{at.lstrip('.')}: {v:g} is beyond any figure of a fit record")
    if not isinstance(fit, dict):
        bad(f" must be an object, got {type(fit).__name__}")
    walk(fit, "")

    def number(v) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    def items(key: str) -> list:
        got = fit.get(key, [])
        if not isinstance(got, list) or not all(isinstance(x, dict) for x in got):
            bad(f"{key} must be a list of objects")
        return got
    for i, pt in enumerate(items("points")):
        for k in ("loo_tpot_pct", "err_tpot_ms_pct", "err_pct"):
            if pt.get(k) is not None and not (number(pt[k]) and pt[k] > -100):
                bad(f"points[{i}].{k} must be a percentage error > -100, got {pt[k]!r}")
        for k in ("use", "certainty", "source"):
            if pt.get(k) is not None and not isinstance(pt[k], str):
                bad(f"points[{i}].{k} must be text, got {pt[k]!r}")
    for i, v in enumerate(items("cv")):
        if not (number(v.get("log_err")) and abs(v["log_err"]) <= 20):
            bad(f"cv[{i}].log_err must be a log ratio within +-20, got {v.get('log_err')!r}")
        if not isinstance(v.get("regime"), str):
            bad(f"cv[{i}].regime must be text, got {v.get('regime')!r}")
    items("cv_summary")
    versions = fit.get("versions", [])
    if not (isinstance(versions, list) and all(isinstance(v, str) for v in versions)):
        bad("versions must be a list of engine versions (text)")
    if not isinstance(fit.get("stand_in", ""), str):
        bad("stand_in must be text")
    between = fit.get("between_families", {})
    if not (isinstance(between, dict) and all(
            number(v) and 0 <= v <= 20 for v in between.values())):
        bad("between_families must map each regime to a log ratio in [0, 20]")
    for key in ("checked", "checked_family"):
        got = fit.get(key)
        if got is None:
            continue
        if not isinstance(got, dict) or set(got) != {"gpu", "weight_dtype", "kv_dtype", "tp",
                                                     "moe"}:
            bad(f"{key} must name gpu, weight_dtype, kv_dtype, tp and moe")
        if not all(isinstance(got[k], list) and all(isinstance(x, str) for x in got[k])
                   for k in ("gpu", "weight_dtype", "kv_dtype")) or \
                not (isinstance(got["tp"], list) and all(type(x) is int for x in got["tp"])) \
                or not isinstance(got["moe"], bool):
            bad(f"{key}: gpu, weight_dtype and kv_dtype are lists of names, tp a list of whole "
                f"numbers, moe true or false")
    spans = fit.get("range", {})
    if not isinstance(spans, dict) or not all(
            isinstance(s, dict) and all(isinstance(r, list) and len(r) == 2 and all(map(
                number, r)) and r[0] <= r[1] for r in s.values()) for s in spans.values()):
        bad("range must map each policy to {figure: [low, high]}")
    return fit


def from_json(obj: dict, origin: str) -> Engine:
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise KvsimError(f"{origin}: not a kvsim engine profile (no \"format\": \"{FORMAT}\")")
    if obj.get("version") != VERSION:
        raise KvsimError(f"{origin}: engine profile version {obj.get('version')!r}; this kvsim "
                         f"reads version {VERSION}")
    fields = {}
    for key, v in (obj.get("fields") or {}).items():
        if not isinstance(v, dict) or "value" not in v or "source" not in v:
            raise KvsimError(f"{origin}: field {key} needs a value and a source")
        if not isinstance(v.get("note", ""), str) or not isinstance(v["source"], str) or \
                len(v.get("note", "")) > 10_000:
            raise KvsimError(f"{origin}: field {key}: its source and note must be text (a note "
                             f"at most 10,000 characters)")
        fields[key] = Value(v["value"], v["source"], v.get("note", ""))
    for key in ("name", "description"):
        if not isinstance(obj.get(key, ""), str) or len(obj.get(key, "")) > 10_000:
            raise KvsimError(f"{origin}: {key} must be text (at most 10,000 characters)")
    fitted_on = obj.get("fitted_on") or {}
    if not isinstance(fitted_on, dict) or not all(
            isinstance(v, (str, list)) for v in fitted_on.values()):
        raise KvsimError(f"{origin}: fitted_on must map gpu, model ... to names")
    try:
        return Engine(str(obj.get("name") or Path(origin).stem), fields,
                      str(obj.get("description", "")), dict(fitted_on),
                      _record(obj.get("fit") or {}, origin), origin)
    except KvsimError as e:
        raise KvsimError(f"{origin}: {e}") from None


ROOFLINE = Engine("roofline", description="the hardware as it is: no per-step overhead, the "
                  "hardware's own efficiencies, links and decide costs")


_LOADED: dict[tuple, Engine] = {}  # by (origin, content digest): a plan's replays parse it once


def load(name_or_path: str | Path | Engine | None) -> Engine | None:
    """An engine by built-in name or file; None stays None (the hardware's default engine).
    A file's content is parsed once (the built-in engines carry their fit records, ~120 KB,
    whose guarded parse was ~40% of a 200-request replay); each call reads the file and gets
    its own copy of the engine's dictionaries."""
    if name_or_path is None or isinstance(name_or_path, Engine):
        return name_or_path
    text = str(name_or_path)
    if text.lower() == "roofline":
        return ROOFLINE
    if text not in BUILTIN and NAME.fullmatch(text.lower()) and not text.endswith(".json") \
            and not Path(text).exists():
        family, version = resolve(text)
        return _stand_in(load(family), text.lower(), version)
    path = BUILTIN.get(text, Path(text))
    if not path.exists() and not path.is_symlink():
        raise KvsimError(f"engine {text!r}: no such file (built-in engines: roofline, "
                         f"{', '.join(BUILTIN)})")
    from kvsim.io import loads_json, read_bytes
    origin = f"built-in, kvsim/hw/engines/{path.name}" if text in BUILTIN else str(path)
    data = read_bytes(path, "kvsim engine profile")
    key = (origin, hashlib.blake2b(data, digest_size=16).digest())
    engine = _LOADED.get(key)
    if engine is None:
        engine = from_json(loads_json(data, str(path), "kvsim engine profile", None), origin)
        if len(_LOADED) >= 32:
            _LOADED.clear()
        _LOADED[key] = engine
    return dataclasses.replace(engine, fields=dict(engine.fields),
                               fitted_on=dict(engine.fitted_on), fit=dict(engine.fit))
