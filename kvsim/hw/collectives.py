"""All-reduce time of a tensor-parallel group, from published NCCL measurements per link type.

nccl-tests reports, for a message of ``S`` bytes all-reduced in ``t`` seconds by ``N`` GPUs, the
bus bandwidth ``busbw = S / t * 2 (N - 1) / N``; a ring moves that share of the message over each
link, and NCCL's NVLink SHARP algorithm is reported on the same scale. So a message costs

    t(S, N) = latency(N) + S * 2 (N - 1) / N / busbw(N)

with ``latency`` the small-message time and ``busbw`` the large-message bus bandwidth, each taken
from a published measurement of the link (``LINKS``) at the nearest group size measured (the
provenance says which, and when the size was not measured). A link with no published measurement
falls back to its catalog bandwidth at NCCL's effective share of the NVLink line rate and the
NVLink 4 latency, and says so.

Which kernel runs is the engine's (``KERNELS``): NCCL, or a custom all-reduce (vLLM's since
0.3, SGLang's, TensorRT-LLM's plugin): one kernel that reads its peers' buffers over NVLink,
priced by the same formula from its own published figures (``CUSTOM``) up to the buffer it
registers (``CUSTOM_MAX_BYTES``), NCCL above it. Custom kernels need peer-to-peer NVLink: on
any other link the engine falls back to NCCL, and so does the price.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

GB = 1e9


@dataclass(frozen=True)
class Measured:
    """A link's published all-reduce figures: small-message latency and large-message bus
    bandwidth, each by group size, with their sources."""
    latency_us: dict[int, float]
    busbw_gbps: dict[int, float]
    source: str


_NCCL_1455 = ("8x H100 SXM, nccl-tests all_reduce_perf at 2-4 GB, NCCL_ALGO=NVLS: busbw about "
              "370 GB/s at 2-4 GPUs, 420, 440, 460, 480 at 5, 6, 7, 8 (Ring: 365-370 at every "
              "size): https://github.com/NVIDIA/nccl/issues/1455; 8 GPUs ~480 GB/s busbw, ~275 "
              "algbw, confirmed by NCCL's maintainer: https://github.com/NVIDIA/nccl-tests/issues/"
              "212")
_NCCL_1259 = ("HGX 8x H100, NCCL 2.20.5, CUDA graphs, NVLSTree: ~6 us for small all-reduces at "
              "2 GPUs (the thread reports it grows with the GPU count): "
              "https://github.com/NVIDIA/nccl/issues/1259")
_NCCL_8 = ("8x H100, torch.distributed (NCCL) all_reduce, no CUDA graph: 19.19 us at 128 B, "
           "22.65 at 32 KB, 32.42 at 1 MB: https://github.com/ByteDance-Seed/Triton-distributed/"
           "issues/57")
LINKS: dict[str, Measured] = {
    "NVLink 4": Measured({2: 6.0, 8: 19.19}, {2: 370.0, 3: 370.0, 4: 370.0, 5: 420.0, 6: 440.0,
                                    7: 460.0, 8: 480.0},
                         f"busbw: {_NCCL_1455}; latency: {_NCCL_1259}; {_NCCL_8}"),
    "NVLink 3": Measured(
        {2: 10.14}, {8: 240.0},
        "busbw: 8x A100 SXM4 NVLink 230-250 GB/s at large sizes (nccl-tests reference table, "
        "https://docs.alayanew.com/en/docs/tech-blog/2026-05-06-nccl-tests; 240 used); "
        "latency: 10.14 us at 32 B on 2 A100-SXM4-40GB (all_reduce_perf, no CUDA graphs): "
        "https://github.com/NVIDIA/nccl/issues/583"),
    "PCIe Gen5 x16": Measured(
        {2: 6.0}, {8: 40.0},
        "busbw: 8x H100 PCIe without NVSwitch 35-45 GB/s (nccl-tests reference table, "
        "https://docs.alayanew.com/en/docs/tech-blog/2026-05-06-nccl-tests; 40 used); "
        f"latency not measured on PCIe: NVLink 4's ({_NCCL_1259})"),
}
# a custom all-reduce kernel on H100 NVLink 4 (SGLang PR 2904's unit test, TensorRT-LLM's kernel
# in sgl-kernel, no CUDA graph): 3.7 / 4.8 / 5.9 us at 512 elements for 2 / 4 / 8 GPUs, 19.9 /
# 31.1 / 33.8 us at 1,048,576 float32 elements (the harness's inputs, sgl-kernel/tests/
# test_custom_allreduce.py): a bus bandwidth of 259 / 239 / 263 GB/s. vLLM's kernel measured
# 9-10 us at small sizes in the same table, for a copy into its buffer that CUDA graphs remove
_PR_2904 = ("custom all-reduce on H100 NVLink 4, SGLang PR 2904 (github.com/sgl-project/sglang/"
            "pull/2904, 'unit test performance in H100'): 3.7/4.8/5.9 us at 512 elements for "
            "2/4/8 GPUs; bus bandwidth from 1,048,576 float32 elements (19.9/31.1/33.8 us; "
            "sgl-kernel/tests/test_custom_allreduce.py's inputs)")
_CUSTOM_US = {2: 3.7, 4: 4.8, 8: 5.9}
_CUSTOM_AT_1M_US = {2: 19.9, 4: 31.1, 8: 33.8}
CUSTOM = Measured(_CUSTOM_US, {n: round(2 ** 22 * 2 * (n - 1) / n / (t - _CUSTOM_US[n]) / 1e3)
                               for n, t in _CUSTOM_AT_1M_US.items()}, _PR_2904)
CUSTOM_LINKS = ("NVLink 3", "NVLink 4", "NVLink 5")  # custom kernels need P2P over NVLink
# the registered buffer a custom kernel reduces in place: vLLM's max_size default, 8 MiB
# (vllm/distributed/device_communicators/custom_all_reduce.py); larger messages go to NCCL
CUSTOM_MAX_BYTES = 8 * 2 ** 20
KERNELS = ("nccl", "custom")
NVLINK_SHARE = 370 / 450  # NCCL's effective NVLink bandwidth over the line rate (nccl-tests#212)
FALLBACK_LATENCY_US = LINKS["NVLink 4"].latency_us[2]


def _nearest(table: dict[int, float], n: int) -> tuple[float, int]:
    size = min(table, key=lambda k: (abs(k - n), -k))
    return table[size], size


class AllReduce:
    """All-reduce seconds of ``nbytes`` in a group of ``n`` GPUs over ``link`` (a catalog peer
    link name) whose catalog bandwidth is ``peer_gbps`` per direction, by ``kernel`` (one of
    :data:`KERNELS`)."""

    def __init__(self, link: str, peer_gbps: float, n: int, kernel: str = "nccl"):
        self.n, self.custom = n, None
        self._nccl(link, peer_gbps, n)
        if kernel == "custom":
            if link in CUSTOM_LINKS:
                self.custom = _Custom(link, n)
                self.source = f"{self.custom.source} up to {CUSTOM_MAX_BYTES // 2 ** 20} MiB, " \
                              f"NCCL above: {self.source}"
            else:
                self.source = f"custom kernel needs NVLink, NCCL over {self.source}"

    def _nccl(self, link: str, peer_gbps: float, n: int) -> None:
        m = LINKS.get(link)
        if m is None:
            self.latency = FALLBACK_LATENCY_US * 1e-6
            self.busbw = peer_gbps * NVLINK_SHARE * GB
            self.source = (f"{link}: no published all-reduce measurement; busbw = catalog "
                           f"{peer_gbps:g} GB/s x {NVLINK_SHARE:.3f} (NCCL's effective NVLink "
                           f"share, https://github.com/NVIDIA/nccl-tests/issues/212) = "
                           f"{self.busbw / GB:.0f} GB/s, latency {FALLBACK_LATENCY_US:g} us "
                           f"(NVLink 4's, measured)")
            self.measured = False
            return
        lat, lat_n = _nearest(m.latency_us, n)
        bw, bw_n = _nearest(m.busbw_gbps, n)
        self.latency, self.busbw = lat * 1e-6, bw * GB
        self.measured = lat_n == n and bw_n == n
        at = lambda k: "" if k == n else f", measured at {k} GPUs, not {n}"  # noqa: E731
        self.source = (f"{link}: latency {lat:g} us{at(lat_n)}, busbw {bw:g} GB/s{at(bw_n)} "
                       f"({m.source})")

    def time(self, nbytes) -> np.ndarray:
        nbytes = np.asarray(nbytes, float)
        if self.n == 1:
            return np.zeros_like(nbytes)
        share = 2 * (self.n - 1) / self.n
        t = self.latency + share * nbytes / self.busbw
        if self.custom is not None:
            c = self.custom
            t = np.where(nbytes <= CUSTOM_MAX_BYTES, c.latency + share * nbytes / c.busbw, t)
        return np.where(nbytes > 0, t, 0.0)


class _Custom:
    """A custom kernel's latency and bus bandwidth in a group of ``n`` (:data:`CUSTOM`,
    measured on NVLink 4: on another NVLink generation the provenance says so)."""

    def __init__(self, link: str, n: int):
        lat, lat_n = _nearest(CUSTOM.latency_us, n)
        bw, _ = _nearest(CUSTOM.busbw_gbps, n)  # (measured at the latencies' group sizes)
        self.latency, self.busbw = lat * 1e-6, bw * GB
        at = "" if lat_n == n else f", measured at {lat_n} GPUs, not {n}"
        on = "" if link == "NVLink 4" else f", measured on NVLink 4, not {link}"
        self.source = (f"custom kernel: latency {lat:g} us, busbw {bw:g} GB/s{at}{on} "
                       f"({CUSTOM.source})")
