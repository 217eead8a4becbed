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
              "2 GPUs (the thread reports it grows with the GPU count; no larger group's figure "
              "is used here): https://github.com/NVIDIA/nccl/issues/1259")
LINKS: dict[str, Measured] = {
    "NVLink 4": Measured({2: 6.0}, {2: 370.0, 3: 370.0, 4: 370.0, 5: 420.0, 6: 440.0,
                                    7: 460.0, 8: 480.0},
                         f"busbw: {_NCCL_1455}; latency: {_NCCL_1259}"),
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
NVLINK_SHARE = 370 / 450  # NCCL's effective NVLink bandwidth over the line rate (nccl-tests#212)
FALLBACK_LATENCY_US = LINKS["NVLink 4"].latency_us[2]


def _nearest(table: dict[int, float], n: int) -> tuple[float, int]:
    size = min(table, key=lambda k: (abs(k - n), -k))
    return table[size], size


class AllReduce:
    """All-reduce seconds of ``nbytes`` in a group of ``n`` GPUs over ``link`` (a catalog peer
    link name) whose catalog bandwidth is ``peer_gbps`` per direction."""

    def __init__(self, link: str, peer_gbps: float, n: int):
        self.n = n
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
        return np.where(nbytes > 0, self.latency + share * nbytes / self.busbw, 0.0)
