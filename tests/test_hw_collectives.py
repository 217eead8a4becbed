"""All-reduce times from published NCCL and custom-kernel measurements: the model gives back the
figures it was built from, says when a group size or a link was not measured, picks the kernel
the engine runs, and prices tensor parallelism."""

import pytest
from conftest import run_cli

from kvsim.fit.families import as_documented
from kvsim.hw import catalog
from kvsim.hw.collectives import CUSTOM_MAX_BYTES, LINKS, AllReduce
from kvsim.hw.costs import CostModel
from kvsim.hw.engine import FAMILY_ALLREDUCE, load

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


@pytest.mark.parametrize("link,n,nbytes,us", [("NVLink 4", 2, 128, 6.0),
                                              ("NVLink 4", 8, 128, 19.19),
                                              ("NVLink 3", 2, 32, 10.14)])
def test_small_messages_take_the_published_latency(link, n, nbytes, us):
    assert float(AllReduce(link, 450, n).time(nbytes)) * 1e6 == pytest.approx(us, rel=0.01)


@pytest.mark.parametrize("n,us_512,us_1m", [(2, 3.7, 19.9), (4, 4.8, 31.1), (8, 5.9, 33.8)])
def test_a_custom_kernel_gives_back_its_published_times(n, us_512, us_1m):
    """SGLang PR 2904's table (float32 elements), to the rounding of its bus bandwidth."""
    ar = AllReduce("NVLink 4", 450, n, "custom")
    assert float(ar.time(512 * 4)) * 1e6 == pytest.approx(us_512, rel=0.02)
    assert float(ar.time(2**20 * 4)) * 1e6 == pytest.approx(us_1m, rel=0.02)
    nccl = AllReduce("NVLink 4", 450, n)
    big = CUSTOM_MAX_BYTES + 1  # past the registered buffer: NCCL
    assert float(ar.time(big)) == float(nccl.time(big))
    assert "SGLang PR 2904" in ar.source and "NCCL above" in ar.source


def test_a_custom_kernel_beats_nccl_where_decode_reduces():
    """Eight H100s, a decode step's hidden states (64 tokens of 8192 bf16 values, 1 MiB): the
    custom kernel's published time is below NCCL's (32.4 us at 1 MB, Triton-distributed 57)."""
    custom, nccl = AllReduce("NVLink 4", 450, 8, "custom"), AllReduce("NVLink 4", 450, 8)
    for nbytes in (16 * 1024, 64 * 8192 * 2):
        assert float(custom.time(nbytes)) < float(nccl.time(nbytes))


def test_a_custom_kernel_needs_nvlink():
    pcie = AllReduce("PCIe Gen5 x16", 64, 2, "custom")
    assert float(pcie.time(1e6)) == float(AllReduce("PCIe Gen5 x16", 64, 2).time(1e6))
    assert pcie.source.startswith("custom kernel needs NVLink, NCCL over")
    a100 = AllReduce("NVLink 3", 300, 4, "custom")
    assert "measured on NVLink 4, not NVLink 3" in a100.source


def test_each_family_runs_its_documented_kernel():
    shared = load("shared")
    for fam, (kernel, why) in FAMILY_ALLREDUCE.items():
        field = as_documented(shared, fam).fields["allreduce_kernel"]
        assert (field.value, field.source, field.note) == (kernel, "docs", why)
        assert load(fam).get("allreduce_kernel") == kernel, fam  # the shipped file carries it
    h100 = catalog.gpu("h100-sxm")
    trt = CostModel.from_spec(h100).apply(as_documented(shared, "trtllm")).set_tp(8)
    assert "custom kernel" in trt.provenance["tensor_parallel"]
    hf = CostModel.from_spec(h100).apply(as_documented(shared, "hf")).set_tp(8)
    assert "custom" not in hf.provenance["tensor_parallel"]


def test_unmeasured_sizes_and_links_say_so():
    four = AllReduce("NVLink 4", 450, 4)
    assert "measured at 2 GPUs, not 4" in four.source and not four.measured
    assert "busbw 370 GB/s (" in four.source and "github.com/NVIDIA/nccl" in four.source
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
    want = 2 * (19.19e-6 + 2 * 7 / 8 * nbytes / 480e9)  # two all-reduces per layer
    assert float(c.allreduce_time(tokens, m)) == pytest.approx(want, rel=1e-12)
    prov = c.provenance["tensor_parallel"]
    assert "assumed" not in prov and "nccl" in prov
    assert float(CostModel.from_spec(catalog.gpu("h100-sxm")).allreduce_time(tokens, m)) == 0


def test_replay_runs_the_kernel_asked_for():
    """``--allreduce-kernel`` is a what-if on the engine (vLLM with
    --disable-custom-all-reduce runs NCCL): recorded as an override, priced by the other
    kernel's figures; at TP 8 NCCL's 19 us small-message latency makes decode slower."""
    import json
    got = {}
    for k in ("nccl", "custom"):
        code, out, err = run_cli("replay", "--policy", "dense-resident", "--gpu", "h100-sxm",
                                 "--model", "llama-3.1-70b", "--tp", "8", "--context", "1024",
                                 "--output-len", "16", "--batch", "4", "--engine", "vllm",
                                 "--allreduce-kernel", k, "--json")
        assert code == 0, err
        r = json.loads(out)
        prov = r["provenance"]
        assert prov["hw.engine.allreduce_kernel"].startswith(f"{k} (override")
        assert ("custom kernel:" in prov["hw.tensor_parallel"]) == (k == "custom")
        got[k] = r["sim"]["tpot_ms"]
    assert got["nccl"] > got["custom"]
