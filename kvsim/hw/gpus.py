"""The catalog's GPUs: one :class:`GPUSpec` record per GPU, each complete (memory, bandwidth,
compute rates by type, host and peer links, tensor-core rows, an example price) and each figure
with its public source. Reports quote the source as the provenance of the figure used; a
profiled trace (``kvsim profile``) replaces these numbers with measured ones.

A new GPU is one more record in :data:`GPUS` (every field named; a figure no source gives is 0,
or ``usd_per_hour=None``, with its source saying so): nothing else in kvsim is keyed by GPU name.
``docs/howto/add-gpu.md`` walks through one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from kvsim.errors import KvsimError

VENDORS = ("nvidia", "amd")


@dataclass(frozen=True, kw_only=True)
class GPUSpec:
    name: str  # lower case: what --gpu takes
    hbm_gib: float  # usable HBM as reported by the driver
    hbm_gbps: float  # spec HBM bandwidth, GB/s
    bf16_tflops: float  # dense bf16 tensor-core TFLOP/s
    link: str  # host link kind
    link_theoretical_gbps: float  # per direction
    h2d_gbps: float  # measured H2D, pinned, large copies
    copy_alpha_us: float  # per-copy submission latency
    source: str  # of the figures above
    peer: str  # GPU-to-GPU link for tensor parallelism (NVLink, Infinity Fabric, PCIe; "": none)
    peer_gbps: float  # its bandwidth per GPU and direction, GB/s (0: none)
    # dense tensor-core peak rates of the other compute types (0: not published here, or the GPU
    # has no tensor cores for it; ``rates_source`` says which): such a type computes at the bf16
    # rate
    fp8_tflops: float
    int8_tops: float
    int4_tops: float
    rates_source: str
    # the fewest rows (tokens) one tensor-core matrix instruction multiplies: a matmul of fewer
    # tokens does this many rows' work (:class:`kvsim.hw.costs.Matmuls`); 0: not known
    mma_rows: int
    mma_source: str
    # an example on-demand price of one GPU for one hour, in US dollars, with where it was listed
    # and when (None: no public on-demand price found, and ``price_source`` says so). Prices
    # differ by provider, region and commitment by 2-3x: replace them with your own
    # (``kvsim plan --price GPU=USD`` or ``--prices FILE``)
    usd_per_hour: float | None
    price_source: str
    vendor: str  # whose GPU (VENDORS): which engines run on it (kvsim.hw.engine.RUNS_ON)

    def __post_init__(self) -> None:
        def bad(field: str, need: str):
            return KvsimError(f"GPU record {self.name!r}: {field} must be {need}, got "
                              f"{getattr(self, field)!r}")
        if not isinstance(self.name, str) or not self.name or \
                self.name != self.name.strip().lower():
            raise bad("name", "a non-empty lower-case name")
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name.endswith("source") and not (isinstance(v, str) and v.strip()):
                raise bad(f.name, "a non-empty source")
            if f.type == "float" and not (isinstance(v, (int, float)) and not
                                          isinstance(v, bool) and math.isfinite(v) and v >= 0):
                raise bad(f.name, "a finite number >= 0")
        for f in ("hbm_gib", "hbm_gbps", "bf16_tflops", "link_theoretical_gbps", "h2d_gbps"):
            if not getattr(self, f) > 0:
                raise bad(f, "> 0")
        if isinstance(self.mma_rows, bool) or not isinstance(self.mma_rows, int) or \
                self.mma_rows < 0:
            raise bad("mma_rows", "a whole number >= 0")
        if self.vendor not in VENDORS:
            raise bad("vendor", f"one of {', '.join(VENDORS)}")
        p = self.usd_per_hour
        if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float)) or
                              not math.isfinite(p) or p <= 0):
            raise bad("usd_per_hour", "None or a positive number")

    def rates(self) -> dict[str, float]:
        """Dense peak rate (TFLOP/s or TOP/s) per compute type this entry lists."""
        return {k: v for k, v in (("bf16", self.bf16_tflops), ("fp8", self.fp8_tflops),
                                  ("int8", self.int8_tops), ("int4", self.int4_tops)) if v}

    def describe(self) -> str:
        rates = ", ".join(f"{v:.0f} {k}" for k, v in self.rates().items())
        return (f"{self.name}: {self.hbm_gib} GiB HBM at {self.hbm_gbps:.0f} GB/s, "
                f"{rates} TFLOP/s, {self.link} (H2D {self.h2d_gbps} GB/s)")


# Sources several records share.
_DESIGN = ("kvsim design note (NVIDIA datasheets; nvbandwidth issue threads; vLLM KV-offloading "
           "blog)")
# Dense peak rates by compute type (sparsity halved out where a sheet quotes it). A number no
# source found is left out (0), and the record says so.
_HOPPER = ("NVIDIA H100 specification table (SXM: FP8 and INT8 3,958 with sparsity, PCIe: "
           "3,026; 'specifications 1/2 lower without sparsity'), as reproduced at "
           "https://archive-lib.hpctech.co.jp/gpuproduct/nvidia-h100.html"
           "; INT4 not listed (no INT4 tensor-core rate on Hopper)")
_A100 = ("NVIDIA A100 datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf), dense "
         "INT8 624 TOPS, INT4 1,248 TOPS, no FP8 tensor cores, as tabulated at "
         "https://glennklockwood.com/garden/processors/A100")
# Tensor-core instruction shapes (PTX ISA, "Warpgroup MMA" and "mma" sections; CUTLASS's WGMMA
# and warp-level MMA guides): Hopper's warpgroup MMA is m64nNk16 (k32 for fp8), Ampere's and Ada's
# warp MMA m16n8k16; Blackwell's tcgen05 MMA takes M 64 or 128; CDNA3's MFMA 16x16 or 32x32.
_WGMMA = ("Hopper (sm_90) tensor-core GEMMs issue wgmma.mma_async, whose only M is 64 "
          "(.m64nNk16, .m64nNk32 for fp8: PTX ISA; CUTLASS Warpgroup MMA guide); SGLang's H20 "
          "deployment swaps A and B in small-batch GEMMs for this reason (LMSYS blog "
          "2025-09-26, DeepGEMM swapAB)")
_MMA = "Ampere/Ada warp MMA mma.sync m16n8k16 (PTX ISA; CUTLASS warp-level MMA guide)"
_RUNPOD = ("RunPod on-demand list price as tabulated by deploybase.ai, 'Best GPU for LLM "
           "Training' (RunPod API, 2026-03-21)")
_NO_PRICE = "no public price found"

_RECORDS = [
    GPUSpec(
        name="a100-40gb", hbm_gib=39.5, hbm_gbps=1555, bf16_tflops=312,
        link="PCIe Gen4 x16", link_theoretical_gbps=31.5, h2d_gbps=25.0, copy_alpha_us=5.0,
        source=f"NVIDIA A100 datasheet (40GB HBM2, 1,555 GB/s, 312 TFLOP/s bf16); {_DESIGN}",
        peer="NVLink 3", peer_gbps=300.0,
        fp8_tflops=0.0, int8_tops=624, int4_tops=1248, rates_source=_A100,
        mma_rows=16, mma_source=_MMA,
        usd_per_hour=None, price_source=_NO_PRICE,
        vendor="nvidia"),
    GPUSpec(
        name="a100-80gb", hbm_gib=79.2, hbm_gbps=2039, bf16_tflops=312,
        link="PCIe Gen4 x16", link_theoretical_gbps=31.5, h2d_gbps=25.0, copy_alpha_us=5.0,
        source=f"NVIDIA A100 datasheet (80GB HBM2e SXM, 2,039 GB/s, 312 TFLOP/s bf16); "
               f"{_DESIGN}",
        peer="NVLink 3", peer_gbps=300.0,
        fp8_tflops=0.0, int8_tops=624, int4_tops=1248, rates_source=_A100,
        mma_rows=16, mma_source=_MMA,
        usd_per_hour=1.39, price_source=f"A100 SXM 80GB: {_RUNPOD}",
        vendor="nvidia"),
    GPUSpec(
        name="h100-pcie", hbm_gib=79.6, hbm_gbps=2000, bf16_tflops=756,
        link="PCIe Gen5 x16", link_theoretical_gbps=63.0, h2d_gbps=50.0, copy_alpha_us=5.0,
        source="NVIDIA H100 datasheet (PCIe: 80GB HBM2e, 2.0 TB/s, 756 TFLOP/s bf16 dense); "
               "H2D assumed as H100 SXM (same Gen5 x16 link)",
        peer="PCIe Gen5 x16", peer_gbps=52.0,
        fp8_tflops=1513, int8_tops=1513, int4_tops=0.0, rates_source=_HOPPER,
        mma_rows=64, mma_source=_WGMMA,
        usd_per_hour=1.99, price_source=f"H100 PCIe: {_RUNPOD}",
        vendor="nvidia"),
    GPUSpec(
        name="h100-sxm", hbm_gib=79.6, hbm_gbps=3350, bf16_tflops=989,
        link="PCIe Gen5 x16", link_theoretical_gbps=63.0, h2d_gbps=52.0, copy_alpha_us=5.0,
        source=f"NVIDIA H100 datasheet (SXM: 80GB HBM3, 3.35 TB/s, 989 TFLOP/s bf16 dense); "
               f"H2D ~50-57 GB/s measured, 52 used; {_DESIGN}",
        peer="NVLink 4", peer_gbps=450.0,
        fp8_tflops=1979, int8_tops=1979, int4_tops=0.0, rates_source=_HOPPER,
        mma_rows=64, mma_source=_WGMMA,
        usd_per_hour=2.69, price_source=f"H100 SXM: {_RUNPOD}",
        vendor="nvidia"),
    GPUSpec(
        name="h200", hbm_gib=140.4, hbm_gbps=4800, bf16_tflops=989,
        link="PCIe Gen5 x16", link_theoretical_gbps=63.0, h2d_gbps=52.0, copy_alpha_us=5.0,
        source="NVIDIA H200 datasheet (SXM: 141GB HBM3e, 4.8 TB/s, 989 TFLOP/s bf16 dense); "
               "H2D not published, assumed equal to H100 SXM (same Gen5 x16 link)",
        peer="NVLink 4", peer_gbps=450.0,
        fp8_tflops=1979, int8_tops=0.0, int4_tops=0.0,
        rates_source="H200 SXM dense FP8 ~1,979 TFLOP/s (the GH100 die of the H100): "
                     "https://itkb.uw.cz/2026/06/nvidia-h200-vs-b300-precisions-cores.html; "
                     "INT8 not found in a source, left out",
        mma_rows=64, mma_source=_WGMMA,
        usd_per_hour=3.59, price_source=f"H200: {_RUNPOD}",
        vendor="nvidia"),
    GPUSpec(
        name="gh200", hbm_gib=95.6, hbm_gbps=4000, bf16_tflops=989,
        link="NVLink-C2C", link_theoretical_gbps=450.0, h2d_gbps=360.0, copy_alpha_us=5.0,
        source=f"NVIDIA GH200 datasheet (96GB HBM3, 4 TB/s, NVLink-C2C 450 GB/s per "
               f"direction); H2D ~346-375 GB/s measured, 360 used; {_DESIGN}",
        peer="NVLink 4", peer_gbps=450.0,
        fp8_tflops=0.0, int8_tops=0.0, int4_tops=0.0,
        rates_source="no published FP8/INT8 rate found for GH200's GPU: left out (fp8 "
                     "computes at the bf16 rate)",
        mma_rows=64, mma_source=_WGMMA,
        usd_per_hour=None, price_source=_NO_PRICE,
        vendor="nvidia"),
    GPUSpec(
        name="b200", hbm_gib=179.1, hbm_gbps=8000, bf16_tflops=2250,
        link="PCIe Gen5 x16 (host CPU)", link_theoretical_gbps=63.0, h2d_gbps=52.0,
        copy_alpha_us=5.0,
        source="NVIDIA HGX/DGX B200 specifications as summarised by public pages (180 GB HBM3e "
               "per GPU, nvidia-smi 183359MiB = 179.1 GiB in public logs; 8 TB/s; 2.25 PFLOP/s "
               "dense bf16 at 1,000 W; NVLink 5 1.8 TB/s bidirectional); the GPU's PCIe Gen6 "
               "is limited by Gen5 host CPUs: H2D assumed as H100 SXM",
        peer="NVLink 5", peer_gbps=900.0,
        fp8_tflops=4500, int8_tops=4500, int4_tops=0.0,
        rates_source="HGX B200 at 1,000 W, dense FP8 4,500 TFLOP/s and INT8 4,500 TOP/s (FP4 "
                     "9,000), from NVIDIA's Blackwell specifications as tabulated at "
                     "https://glennklockwood.com/garden/processors/B200",
        mma_rows=64, mma_source="Blackwell tcgen05.mma, M 64 or 128 per CTA (PTX ISA)",
        usd_per_hour=5.98, price_source=f"B200: {_RUNPOD}",
        vendor="nvidia"),
    GPUSpec(
        name="h20", hbm_gib=95.6, hbm_gbps=4000, bf16_tflops=148,
        link="PCIe Gen5 x16", link_theoretical_gbps=63.0, h2d_gbps=52.0, copy_alpha_us=5.0,
        source="NVIDIA H20 as published by resellers and press (96 GB HBM3, 4.0 TB/s, 148 "
               "TFLOP/s dense bf16, NVLink 900 GB/s bidirectional); 96 GB read as GH200's "
               "95.6 GiB; H2D assumed as H100 SXM",
        peer="NVLink 4", peer_gbps=450.0,
        fp8_tflops=296, int8_tops=296, int4_tops=0.0,
        rates_source="H20 INT8 296 TOP/s with FP16 148 TFLOP/s (press, "
                     "https://zangshuxian.com/new/674733024499207168); FP8 not stated there: "
                     "taken equal to INT8, as on every Hopper part whose sheet lists both (H100 "
                     "SXM and PCIe above)",
        mma_rows=64, mma_source=_WGMMA,
        usd_per_hour=None, price_source=_NO_PRICE,
        vendor="nvidia"),
    GPUSpec(
        name="l40s", hbm_gib=45.0, hbm_gbps=864, bf16_tflops=362,
        link="PCIe Gen4 x16", link_theoretical_gbps=31.5, h2d_gbps=25.0, copy_alpha_us=5.0,
        source="NVIDIA L40S datasheet (48 GB GDDR6 with ECC, 864 GB/s, 362 TFLOP/s dense bf16 "
               "(733 with sparsity), PCIe Gen4 x16, no NVLink); nvidia-smi 46068MiB = 45.0 "
               "GiB; H2D as A100 (same Gen4 x16 link)",
        peer="PCIe Gen4 x16", peer_gbps=25.0,
        fp8_tflops=733, int8_tops=733, int4_tops=1466,
        rates_source="NVIDIA L40S datasheet table (FP8 733, 1,466 with sparsity), as reproduced "
                     "at https://www.mullet.se/product.html?product_id=355414; INT8 732.86 and "
                     "INT4 1,466 TOP/s dense: https://hmc-tech.com/gpu/nvidia-l40s-vs-nvidia-t40",
        mma_rows=16, mma_source=_MMA,
        usd_per_hour=0.86, price_source="RunPod on-demand L40S, as tabulated by Modal, 'How much "
                                        "does it cost to run NVIDIA L40S GPUs in 2025?' "
                                        "(2025-08-12)",
        vendor="nvidia"),
    GPUSpec(
        name="mi300x", hbm_gib=191.5, hbm_gbps=5300, bf16_tflops=1307,
        link="PCIe Gen5 x16", link_theoretical_gbps=63.0, h2d_gbps=52.0, copy_alpha_us=5.0,
        source="AMD Instinct MI300X datasheet (192 GB HBM3, 5.3 TB/s, 1,307.4 TFLOP/s dense "
               "bf16, Infinity Fabric 7 x 128 GB/s = 896 GB/s aggregate per GPU in an 8-GPU "
               "mesh); 191.5 GiB usable assumed; H2D assumed as H100 SXM (same Gen5 x16 link)",
        peer="Infinity Fabric", peer_gbps=448.0,
        fp8_tflops=2614.9, int8_tops=2614.9, int4_tops=0.0,
        rates_source="AMD's ROCm documentation, MI300 series microarchitecture "
                     "(docs/conceptual/gpu-arch/mi300.md, table 'Peak-performance capabilities "
                     "of the MI300X'): matrix FP16/BF16 1,307.4, FP8 2,614.9, INT8 2,614.9 "
                     "peak TFLOPS; https://github.com/ROCm/ROCm",
        mma_rows=16, mma_source="CDNA3 MFMA 16x16xK or 32x32xK (AMD CDNA3 ISA)",
        usd_per_hour=1.85, price_source="Vultr on-demand MI300X, as quoted by Cliff Center, 'AMD "
                                        "inference economics' research note (2026-05-18)",
        vendor="amd"),
]


def _by_name(records: list[GPUSpec]) -> dict[str, GPUSpec]:
    out: dict[str, GPUSpec] = {}
    for g in records:
        if g.name in out:
            raise KvsimError(f"two GPU records are named {g.name!r}")
        out[g.name] = g
    return out


GPUS: dict[str, GPUSpec] = _by_name(_RECORDS)  # name -> record (``kvsim.hw.catalog.GPUS``)
