"""All-reduce times from published NCCL measurements: the model gives back the figures it was
built from, says when a group size or a link was not measured, and prices tensor parallelism."""

import pytest

from kvsim.hw import catalog
from kvsim.hw.collectives import LINKS, AllReduce
from kvsim.hw.costs import CostModel

GIB = 2**30


def _busbw(ar: AllReduce, nbytes: float) -> tuple[float, float]:
    """(busbw, algbw) in GB/s as nccl-tests computes them from the modelled time."""
    t = float(ar.time(nbytes))
    alg = nbytes / t / 1e9
    return alg * 2 * (ar.n - 1) / ar.n, alg


@pytest.mark.parametrize("link,n,busbw", [
    ("NVLink 4", 8, 480), ("NVLink 4", 2, 370), ("NVLink 4", 4, 370), ("NVLink 4", 6, 440),
    ("NVLink 3", 8, 240), ("PCIe Gen5 x16", 8, 40)])
def test_large_messages_reach_the_published_bus_bandwidth(link, n, busbw):
    got, _ = _busbw(AllReduce(link, 450, n), 4 * GIB)  # the 2-4 GB sizes the threads ran
    assert got == pytest.approx(busbw, rel=0.01)


def test_eight_h100s_give_the_maintainers_algbw():
    _, alg = _busbw(AllReduce("NVLink 4", 450, 8), 4 * GIB)
    assert alg == pytest.approx(275, rel=0.02)  # "busBw ~480GB/s (algbw ~275GB/s)"


@pytest.mark.parametrize("link,nbytes,us", [("NVLink 4", 128, 6.0), ("NVLink 3", 32, 10.14)])
def test_small_messages_take_the_published_latency(link, nbytes, us):
    assert float(AllReduce(link, 450, 2).time(nbytes)) * 1e6 == pytest.approx(us, rel=0.01)


def test_unmeasured_sizes_and_links_say_so():
    eight = AllReduce("NVLink 4", 450, 8)
    assert "measured at 2 GPUs, not 8" in eight.source and not eight.measured
    assert "busbw 480 GB/s (" in eight.source and "github.com/NVIDIA/nccl" in eight.source
    nv5 = AllReduce("NVLink 5", 900, 8)
    assert "no published all-reduce measurement" in nv5.source
    assert nv5.busbw == pytest.approx(900e9 * 370 / 450)
    assert float(AllReduce("NVLink 4", 450, 1).time(1e6)) == 0.0
    for m in LINKS.values():
        assert "https://" in m.source


def test_tensor_parallel_costs_use_the_measured_collective():
    m = catalog.model("qwen3-4b")
    c = CostModel.from_spec(catalog.gpu("h100-sxm")).set_tp(8)
    tokens = 64
    nbytes = tokens * m.hidden * 2
    want = 2 * (6e-6 + 2 * 7 / 8 * nbytes / 480e9)  # two all-reduces per layer
    assert float(c.allreduce_time(tokens, m)) == pytest.approx(want, rel=1e-12)
    prov = c.provenance["tensor_parallel"]
    assert "assumed" not in prov and "nccl" in prov
    assert float(CostModel.from_spec(catalog.gpu("h100-sxm")).allreduce_time(tokens, m)) == 0
