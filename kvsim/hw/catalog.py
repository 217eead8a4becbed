"""Spec catalogs: GPUs (from public datasheets and measurements) and model shapes (the published
``config.json`` fields in ``kvsim/hw/models/``, read like a user's own config).

Every entry carries its public source; reports quote it as the provenance of the figure used.
A profiled trace (``kvsim profile``) replaces these numbers with measured ones.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import numpy as np

from kvsim.errors import KvsimError

GiB = 1024**3
GB = 1e9


@dataclass(frozen=True)
class GPUSpec:
    name: str
    hbm_gib: float  # usable HBM as reported by the driver
    hbm_gbps: float  # spec HBM bandwidth, GB/s
    bf16_tflops: float  # dense bf16 tensor-core TFLOP/s
    link: str  # host link kind
    link_theoretical_gbps: float  # per direction
    h2d_gbps: float  # measured H2D, pinned, large copies
    copy_alpha_us: float  # per-copy submission latency
    source: str
    peer: str = ""  # GPU-to-GPU link for tensor parallelism (NVLink, Infinity Fabric, PCIe)
    peer_gbps: float = 0.0  # its bandwidth per GPU and direction, GB/s
    # dense tensor-core peak rates of the other compute types (0: not published here, or the GPU
    # has no tensor cores for it; ``rates_source`` says which)
    fp8_tflops: float = 0.0
    int8_tops: float = 0.0
    int4_tops: float = 0.0
    rates_source: str = ""
    # the fewest rows (tokens) one tensor-core matrix instruction multiplies: a matmul of fewer
    # tokens does this many rows' work (:class:`kvsim.hw.costs.Matmuls`); 0: not known
    mma_rows: int = 0
    mma_source: str = ""

    def rates(self) -> dict[str, float]:
        """Dense peak rate (TFLOP/s or TOP/s) per compute type this entry lists."""
        return {k: v for k, v in (("bf16", self.bf16_tflops), ("fp8", self.fp8_tflops),
                                  ("int8", self.int8_tops), ("int4", self.int4_tops)) if v}

    def describe(self) -> str:
        rates = ", ".join(f"{v:.0f} {k}" for k, v in self.rates().items())
        return (f"{self.name}: {self.hbm_gib} GiB HBM at {self.hbm_gbps:.0f} GB/s, "
                f"{rates} TFLOP/s, {self.link} (H2D {self.h2d_gbps} GB/s)")


_DESIGN = ("kvsim design note (NVIDIA datasheets; nvbandwidth issue threads; vLLM KV-offloading "
           "blog)")
GPUS: dict[str, GPUSpec] = {g.name: g for g in [
    GPUSpec("a100-40gb", 39.5, 1555, 312, "PCIe Gen4 x16", 31.5, 25.0, 5.0,
            f"NVIDIA A100 datasheet (40GB HBM2, 1,555 GB/s, 312 TFLOP/s bf16); {_DESIGN}",
            "NVLink 3", 300.0),
    GPUSpec("a100-80gb", 79.2, 2039, 312, "PCIe Gen4 x16", 31.5, 25.0, 5.0,
            f"NVIDIA A100 datasheet (80GB HBM2e SXM, 2,039 GB/s, 312 TFLOP/s bf16); {_DESIGN}",
            "NVLink 3", 300.0),
    GPUSpec("h100-pcie", 79.6, 2000, 756, "PCIe Gen5 x16", 63.0, 50.0, 5.0,
            "NVIDIA H100 datasheet (PCIe: 80GB HBM2e, 2.0 TB/s, 756 TFLOP/s bf16 dense); "
            "H2D assumed as H100 SXM (same Gen5 x16 link)", "PCIe Gen5 x16", 52.0),
    GPUSpec("h100-sxm", 79.6, 3350, 989, "PCIe Gen5 x16", 63.0, 52.0, 5.0,
            f"NVIDIA H100 datasheet (SXM: 80GB HBM3, 3.35 TB/s, 989 TFLOP/s bf16 dense); "
            f"H2D ~50-57 GB/s measured, 52 used; {_DESIGN}", "NVLink 4", 450.0),
    GPUSpec("h200", 140.4, 4800, 989, "PCIe Gen5 x16", 63.0, 52.0, 5.0,
            "NVIDIA H200 datasheet (SXM: 141GB HBM3e, 4.8 TB/s, 989 TFLOP/s bf16 dense); "
            "H2D not published, assumed equal to H100 SXM (same Gen5 x16 link)", "NVLink 4", 450.0),
    GPUSpec("gh200", 95.6, 4000, 989, "NVLink-C2C", 450.0, 360.0, 5.0,
            f"NVIDIA GH200 datasheet (96GB HBM3, 4 TB/s, NVLink-C2C 450 GB/s per direction); "
            f"H2D ~346-375 GB/s measured, 360 used; {_DESIGN}", "NVLink 4", 450.0),
    GPUSpec("b200", 179.1, 8000, 2250, "PCIe Gen5 x16 (host CPU)", 63.0, 52.0, 5.0,
            "NVIDIA HGX/DGX B200 specifications as summarised by public pages (180 GB HBM3e per "
            "GPU, nvidia-smi 183359MiB = 179.1 GiB in public logs; 8 TB/s; 2.25 PFLOP/s "
            "dense bf16 at 1,000 W; NVLink 5 1.8 TB/s bidirectional); the GPU's PCIe Gen6 is "
            "limited by Gen5 host CPUs: H2D assumed as H100 SXM", "NVLink 5", 900.0),
    GPUSpec("h20", 95.6, 4000, 148, "PCIe Gen5 x16", 63.0, 52.0, 5.0,
            "NVIDIA H20 as published by resellers and press (96 GB HBM3, 4.0 TB/s, 148 TFLOP/s "
            "dense bf16, NVLink 900 GB/s bidirectional); 96 GB read as GH200's 95.6 GiB; H2D "
            "assumed as H100 SXM", "NVLink 4", 450.0),
    GPUSpec("l40s", 45.0, 864, 362, "PCIe Gen4 x16", 31.5, 25.0, 5.0,
            "NVIDIA L40S datasheet (48 GB GDDR6 with ECC, 864 GB/s, 362 TFLOP/s dense bf16 "
            "(733 with sparsity), PCIe Gen4 x16, no NVLink); nvidia-smi 46068MiB = 45.0 GiB; "
            "H2D as A100 (same Gen4 x16 link)", "PCIe Gen4 x16", 25.0),
    GPUSpec("mi300x", 191.5, 5300, 1307, "PCIe Gen5 x16", 63.0, 52.0, 5.0,
            "AMD Instinct MI300X datasheet (192 GB HBM3, 5.3 TB/s, 1,307.4 TFLOP/s dense bf16, "
            "Infinity Fabric 7 x 128 GB/s = 896 GB/s aggregate per GPU in an 8-GPU mesh); "
            "191.5 GiB usable assumed; H2D assumed as H100 SXM (same Gen5 x16 link)",
            "Infinity Fabric", 448.0),
]}

# Dense peak rates by compute type (sparsity halved out where a sheet quotes it), each with its
# source. A number no source found is left out (0), and the entry says so: such a GPU computes
# that type at its bf16 rate.
_HOPPER = ("NVIDIA H100 specification table (SXM: FP8 and INT8 3,958 with sparsity, PCIe: "
           "3,026; 'specifications 1/2 lower without sparsity'), as reproduced at "
           "https://archive-lib.hpctech.co.jp/gpuproduct/nvidia-h100.html")
_A100 = ("NVIDIA A100 datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf), dense "
         "INT8 624 TOPS, INT4 1,248 TOPS, no FP8 tensor cores, as tabulated at "
         "https://glennklockwood.com/garden/processors/A100")
_RATES: dict[str, dict] = {
    "a100-40gb": {"int8_tops": 624, "int4_tops": 1248, "rates_source": _A100},
    "a100-80gb": {"int8_tops": 624, "int4_tops": 1248, "rates_source": _A100},
    "h100-pcie": {"fp8_tflops": 1513, "int8_tops": 1513, "rates_source": _HOPPER
                  + "; INT4 not listed (no INT4 tensor-core rate on Hopper)"},
    "h100-sxm": {"fp8_tflops": 1979, "int8_tops": 1979, "rates_source": _HOPPER
                 + "; INT4 not listed (no INT4 tensor-core rate on Hopper)"},
    "h200": {"fp8_tflops": 1979, "rates_source":
             "H200 SXM dense FP8 ~1,979 TFLOP/s (the GH100 die of the H100): "
             "https://itkb.uw.cz/2026/06/nvidia-h200-vs-b300-precisions-cores.html; INT8 not "
             "found in a source, left out"},
    "gh200": {"rates_source": "no published FP8/INT8 rate found for GH200's GPU: left out "
                              "(fp8 computes at the bf16 rate)"},
    "b200": {"fp8_tflops": 4500, "int8_tops": 4500, "rates_source":
             "HGX B200 at 1,000 W, dense FP8 4,500 TFLOP/s and INT8 4,500 TOP/s (FP4 9,000), "
             "from NVIDIA's Blackwell specifications as tabulated at "
             "https://glennklockwood.com/garden/processors/B200"},
    "h20": {"fp8_tflops": 296, "int8_tops": 296, "rates_source":
            "H20 INT8 296 TOP/s with FP16 148 TFLOP/s (press, "
            "https://zangshuxian.com/new/674733024499207168); FP8 not stated there: taken "
            "equal to INT8, as on every Hopper part whose sheet lists both (H100 SXM and PCIe "
            "above)"},
    "l40s": {"fp8_tflops": 733, "int8_tops": 733, "int4_tops": 1466, "rates_source":
             "NVIDIA L40S datasheet table (FP8 733, 1,466 with sparsity), as reproduced at "
             "https://www.mullet.se/product.html?product_id=355414; INT8 732.86 and INT4 "
             "1,466 TOP/s dense: https://hmc-tech.com/gpu/nvidia-l40s-vs-nvidia-t40"},
    "mi300x": {"rates_source": "FP8/INT8 rates of the MI300X found only in conflicting "
                               "secondary sources: left out (fp8 computes at the bf16 rate)"},
}
# Tensor-core instruction shapes (PTX ISA, "Warpgroup MMA" and "mma" sections; CUTLASS's WGMMA
# and warp-level MMA guides): Hopper's warpgroup MMA is m64nNk16 (k32 for fp8), Ampere's and Ada's
# warp MMA m16n8k16; Blackwell's tcgen05 MMA takes M 64 or 128; CDNA3's MFMA 16x16 or 32x32.
_WGMMA = ("Hopper (sm_90) tensor-core GEMMs issue wgmma.mma_async, whose only M is 64 "
          "(.m64nNk16, .m64nNk32 for fp8: PTX ISA; CUTLASS Warpgroup MMA guide); SGLang's H20 "
          "deployment swaps A and B in small-batch GEMMs for this reason (LMSYS blog "
          "2025-09-26, DeepGEMM swapAB)")
_MMA = "Ampere/Ada warp MMA mma.sync m16n8k16 (PTX ISA; CUTLASS warp-level MMA guide)"
_MMA_ROWS: dict[str, tuple[int, str]] = {
    **{n: (16, _MMA) for n in ("a100-40gb", "a100-80gb", "l40s")},
    **{n: (64, _WGMMA) for n in ("h100-pcie", "h100-sxm", "h200", "gh200", "h20")},
    "b200": (64, "Blackwell tcgen05.mma, M 64 or 128 per CTA (PTX ISA)"),
    "mi300x": (16, "CDNA3 MFMA 16x16xK or 32x32xK (AMD CDNA3 ISA)"),
}
GPUS = {n: dataclasses.replace(g, **_RATES.get(n, {}), mma_rows=_MMA_ROWS[n][0],
                               mma_source=_MMA_ROWS[n][1]) for n, g in GPUS.items()}



@dataclass(frozen=True)
class GPUPrice:
    """An example on-demand price of one GPU for one hour, in US dollars, with where it was
    listed and when. Prices differ by provider, region and commitment by 2-3x: replace them
    with your own (``kvsim plan --price GPU=USD`` or ``--prices FILE``)."""
    usd_per_hour: float | None  # None: no public on-demand price found
    source: str


_RUNPOD = ("RunPod on-demand list price as tabulated by deploybase.ai, 'Best GPU for LLM "
           "Training' (RunPod API, 2026-03-21)")
PRICES: dict[str, GPUPrice] = {
    "a100-40gb": GPUPrice(None, "no public price found"),
    "a100-80gb": GPUPrice(1.39, f"A100 SXM 80GB: {_RUNPOD}"),
    "h100-pcie": GPUPrice(1.99, f"H100 PCIe: {_RUNPOD}"),
    "h100-sxm": GPUPrice(2.69, f"H100 SXM: {_RUNPOD}"),
    "h200": GPUPrice(3.59, f"H200: {_RUNPOD}"),
    "b200": GPUPrice(5.98, f"B200: {_RUNPOD}"),
    "gh200": GPUPrice(None, "no public price found"),
    "h20": GPUPrice(None, "no public price found"),
    "l40s": GPUPrice(0.86, "RunPod on-demand L40S, as tabulated by Modal, 'How much does it cost "
                           "to run NVIDIA L40S GPUs in 2025?' (2025-08-12)"),
    "mi300x": GPUPrice(1.85, "Vultr on-demand MI300X, as quoted by Cliff Center, 'AMD inference "
                             "economics' research note (2026-05-18)"),
}

@dataclass(frozen=True)
class ModelSpec:
    name: str
    hf_id: str
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int
    tied_embeddings: bool
    rope_theta: float
    max_context: int
    dtype_bytes: int = 2  # bf16 weights and KV cache

    @property
    def kv_bytes_per_token(self) -> float:
        """K and V of every layer and KV head for one token."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.kv_elem

    @property
    def kv_elem(self) -> float:
        """Bytes per KV-cache element (``--kv-dtype``; the compute dtype's by default)."""
        return self.kv_dtype_bytes or self.dtype_bytes

    @property
    def weight_elem(self) -> float:
        """Bytes per layer weight (``--weight-dtype``; embeddings and LM head stay in the
        compute dtype, as quantised checkpoints leave them)."""
        return self.weight_dtype_bytes or self.dtype_bytes

    @property
    def attn_params(self) -> int:
        return self.hidden * self.head_dim * (2 * self.q_heads + 2 * self.kv_heads)

    def _mlp_params(self, experts: float) -> float:
        """A layer's MLP parameters, averaged over the layers, with ``experts`` routed experts
        counted (all for the weights held, the active ones for FLOPs)."""
        dense = 3 * self.hidden * self.intermediate  # gated MLP: gate, up, down
        if not self.experts:
            return dense
        moe = 3 * self.hidden * (experts * self.moe_intermediate + self.shared_intermediate) \
            + self.hidden * self.experts  # the router
        k = self.layers if self.moe_layers is None else self.moe_layers
        return (k * moe + (self.layers - k) * dense) / self.layers

    @property
    def layer_params(self) -> float:
        """Parameters of one layer (averaged over layers), every expert included."""
        return self.attn_params + self._mlp_params(self.experts)

    @property
    def active_layer_params(self) -> float:
        """Parameters one token passes through in a layer (its routed experts only)."""
        return self.attn_params + self._mlp_params(self.experts_per_token)

    def layer_weight_bytes(self, tokens=None):
        """Bytes of one layer's weights a forward pass over ``tokens`` tokens reads: every
        weight of a dense layer; of an MoE layer the experts the tokens route to, in
        expectation over uniform routing, ``E (1 - (1 - k/E)^tokens)`` (all without
        ``tokens``); with ``shared`` routing the ``k`` experts of one token."""
        if not self.experts or tokens is None:
            return self.layer_params * self.weight_elem
        t = np.asarray(tokens, float)
        hit = self.experts * (1.0 - (1.0 - self.experts_per_token / self.experts) ** t) \
            if self.routing == "uniform" else np.full_like(t, float(self.experts_per_token))
        return np.where(t > 0, self.attn_params + self._mlp_params(hit), 0.0) * self.weight_elem

    @property
    def params(self) -> float:
        return self.layers * self.layer_params + self.embed_params

    @property
    def active_params(self) -> float:
        return self.layers * self.active_layer_params + self.embed_params

    @property
    def embed_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    @property
    def weight_bytes(self) -> float:
        return self.layers * self.layer_params * self.weight_elem + \
            self.embed_params * self.dtype_bytes

    def prefill_flops(self, size, prefix=0):
        """FLOPs of the layers for ``size`` prompt tokens that follow ``prefix`` tokens already in
        the cache (a whole prompt: ``prefix`` 0; a chunk of chunked prefill otherwise), counting a
        multiply-add as 2 FLOPs:

        * GEMMs (QKV, O and the gated MLP): ``2 * active_layer_params`` per token and layer;
        * causal attention: each new token attends to the prefix and to itself and the new
          tokens before it, ``size * prefix + size * (size + 1) / 2`` query-key pairs per query
          head; QK^T and PV each cost ``2 * head_dim`` FLOPs per pair:
          ``4 * q_heads * head_dim * pairs`` per layer.

        Embedding lookups are not FLOPs; the LM head runs on the last token of a prompt only and
        is charged apart (``CostModel.head_time``). Numbers or numpy arrays alike."""
        return self.layers * 2.0 * self.active_layer_params * size + \
            self.attention_flops(size, prefix)

    def attention_flops(self, size, prefix=0):
        """The causal-attention part of :meth:`prefill_flops`, all layers."""
        pairs = size * prefix + size * (size + 1) / 2
        return self.layers * 4.0 * self.q_heads * self.head_dim * pairs

    @functools.cached_property  # (read once a simulated step)
    def flops_per_pair(self) -> float:
        """Attention FLOPs of one query-key pair, all layers and query heads: the factor of
        :meth:`attention_flops` (the same product, so ``flops_per_pair * pairs`` is its value
        to the bit)."""
        return self.layers * 4.0 * self.q_heads * self.head_dim

    note: str = ""
    # mixture of experts (0 experts: a dense model)
    experts: int = 0  # routed experts per MoE layer
    experts_per_token: int = 0
    moe_intermediate: int = 0  # per routed expert
    shared_intermediate: int = 0  # the always-active shared experts, in all
    moe_layers: int | None = None  # layers with experts (None: all of them)
    # how a step's tokens pick their experts: "uniform" (independently, uniformly: the
    # expectation over real traffic) or "shared" (every token like the first: a benchmark
    # that repeats one prompt across its batch and decodes greedily)
    routing: str = "uniform"
    # narrow (1-byte) weights dequantised for bf16 GEMMs (W8A16) instead of W8A8 fp8 GEMMs:
    # an engine without an fp8 kernel for the model (TensorRT-LLM before 0.10 for Mixtral)
    weight_only: bool = False
    # element bytes where they differ from dtype_bytes (the compute dtype)
    kv_dtype_bytes: float | None = None
    weight_dtype_bytes: float | None = None

    @property
    def source(self) -> str:
        return f"config.json of {self.hf_id}" + (f" ({self.note})" if self.note else "")

    def shard(self, tp: int) -> ModelSpec:
        """What one GPU of a tensor-parallel group of ``tp`` holds and computes, as vLLM shards:
        query heads, MLP (every expert's) width and vocabulary split ``tp`` ways; KV heads too,
        or replicated where there are fewer than ``tp`` of them (one per GPU)."""
        if tp == 1:
            return self
        for what, n in (("query heads", self.q_heads), ("intermediate size", self.intermediate),
                        ("expert width", self.moe_intermediate or tp)):
            if n % tp:
                raise KvsimError(f"--tp {tp}: {self.name}'s {what} ({n}) do not split {tp} ways")
        kv = max(1, self.kv_heads // tp) if self.kv_heads % tp == 0 or self.kv_heads < tp \
            else None
        if kv is None:
            raise KvsimError(f"--tp {tp}: {self.name}'s {self.kv_heads} KV heads do not split "
                             f"{tp} ways")
        return dataclasses.replace(
            self, q_heads=self.q_heads // tp, kv_heads=kv,
            intermediate=self.intermediate // tp, vocab=-(-self.vocab // tp),
            moe_intermediate=self.moe_intermediate // tp,
            shared_intermediate=self.shared_intermediate // tp)

    def describe(self) -> str:
        moe = (f" ({self.active_params / 1e9:.2f}B active, {self.experts} experts, "
               f"{self.experts_per_token} per token)" if self.experts else "")
        return (f"{self.name}: {self.params / 1e9:.2f}B params{moe}, {self.layers} layers, "
                f"{self.q_heads}q/{self.kv_heads}kv heads x {self.head_dim}, "
                f"{self.kv_bytes_per_token / 1024:.0f} KiB KV per token")


def _models() -> dict[str, ModelSpec]:
    from kvsim.hw import hfconfig
    return hfconfig.builtin()


MODELS: dict[str, ModelSpec] = _models()  # from the configs in kvsim/hw/models/


def _lookup(table: dict, name: str, what: str):
    key = name.strip().lower()
    if key not in table:
        raise KvsimError(f"unknown {what} {name!r}; known: {', '.join(table)}")
    return table[key]


def gpu(name: str) -> GPUSpec:
    return _lookup(GPUS, name, "GPU")


def model(name: str) -> ModelSpec:
    """A catalog shape by name, or the shape of a Hugging Face ``config.json`` at a path."""
    from kvsim.hw import hfconfig
    if name.strip().lower() not in MODELS and hfconfig.looks_like_path(name):
        return hfconfig.load(name)
    try:
        return _lookup(MODELS, name, "model")
    except KvsimError as e:
        raise KvsimError(f"{e}; or give the path of a Hugging Face config.json") from None
