"""kvsim profile: a real CPU profile that the loader and the cost model accept, and every refusal
(no CUDA, a missing GPU, no NVML, unsupported NVML fields, out of memory, unwritable output) as
one line with exit status 2 or a recorded shrink. CUDA-only checks are marked ``gpu``."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

import kvsim.io
from kvsim import trace as tracefile
from kvsim.cli import main
from kvsim.errors import KvsimError
from kvsim.hw.costs import CostModel
from kvsim.policies import make
from profiler import kernels
from profiler import run as prun
from profiler.backend import Backend, make_backend
from profiler.link import KiB, MiB
from profiler.nvml import Nvml, Sampler
from profiler.run import Plan, profile

TINY = Plan(link_sizes=[4 * KiB, 64 * KiB, 1 * MiB], bidir_sizes=[64 * KiB, 1 * MiB],
            gather_totals=[64 * KiB, 256 * KiB], gather_pool=4 * MiB, contexts=[128, 256],
            batches=[1, 2], max_tokens=512, gemm_batches=[1, 2, 4], head_batches=[1, 2],
            mem_sizes=[4 * MiB], mm_sizes=[128], decide_contexts=[4096], decide_batches=[1, 2])
CONSUMED = ["link_h2d_pinned", "link_d2h_pinned", "link_gather_gpu", "kernel_decode_attn",
            "kernel_gemm"]


@pytest.fixture(scope="module")
def cpu_trace(tmp_path_factory):
    out = tmp_path_factory.mktemp("prof") / "cpu.npz"
    # the decide kernel is handed in, as kvsim profile does: the profiler imports no policy
    profile(out, device="cpu", plan=TINY, rounds=1, progress=False,
            decide={"verkv": make("verkv").decide_kernel})
    return out


def test_cpu_profile_is_a_valid_trace_the_cost_model_consumes(cpu_trace):
    tr = tracefile.load(cpu_trace)
    hw = tr.hardware
    assert hw is not None and tr.attention is None
    assert hw.device["kind"] == "cpu" and hw.device["name"].startswith("cpu")
    for key in ("torch_version", "dtype", "host"):
        assert key in hw.device
    for t in CONSUMED + ["link_h2d_pageable", "link_d2h_pageable", "link_bidir_pinned",
                         "link_copy_latency", "link_gather_pack", "link_gather_gpu_rows",
                         "kernel_lm_head", "kernel_matmul", "mem_gemv", "mem_copy"]:
        assert t in hw.tables, t
        for col, arr in hw.tables[t].items():
            assert arr.ndim == 1 and len(arr) > 0 and np.isfinite(arr).all(), (t, col)
    assert set(hw.tables["link_h2d_pinned"]) == {"bytes", "seconds"}
    assert (hw.tables["link_h2d_pinned"]["seconds"] > 0).all()
    assert hw.tables["link_h2d_pinned"]["bytes"].tolist() == TINY.link_sizes
    att = hw.tables["kernel_decode_attn"]
    assert (att["tokens"] == att["context"] * att["batch"]).all()
    assert att["tokens"].max() <= TINY.max_tokens
    g = hw.tables["link_gather_gpu"]
    assert (g["row_bytes"] == hw.extra["kv_row_bytes"]).all()  # the model's KV row: 64 x fp32
    assert hw.extra["kv_row_bytes"] == 64 * 4
    assert set(hw.tables["link_gather_gpu_rows"]["row_bytes"]) >= {256, 512, 1024, 2048}
    for k in ("hbm_bytes", "hbm_bw", "flops"):
        assert hw.extra[k] > 0
    assert hw.extra["fit"]["link_h2d_pinned"]["beta_Bps"] > 0
    assert hw.extra["model"]["name"] == "smollm2-135m" and hw.extra["model"]["dtype_bytes"] == 4
    assert any(m.startswith("nvml") for m in hw.missing)
    assert "nvml" not in hw.tables  # nothing to sample on the CPU
    dec = hw.tables["kernel_decide_verkv"]
    assert set(dec) == {"context", "batch", "seconds", "fetched_frac"}
    assert dec["context"].dtype == np.int64 and dec["batch"].dtype == np.int64
    assert dec["seconds"].dtype == np.float64 and dec["fetched_frac"].dtype == np.float64
    assert list(zip(dec["context"].tolist(), dec["batch"].tolist())) == [(4096, 1), (4096, 2)]
    assert (dec["seconds"] > 0).all()
    assert ((0 <= dec["fetched_frac"]) & (dec["fetched_frac"] <= 1)).all()
    # batch 1 is the single-request layer validate runs (same seed, same decision)
    one = make("verkv").decide_kernel(torch.device("cpu"), prun.profile_model(
        make_backend(None, "cpu"), "smollm2-135m"), 4096, 0)
    assert dec["fetched_frac"][0] == pytest.approx(one.fetched_frac)
    # batch 2 is that request and another, decided in one stacked call
    assert dec["fetched_frac"][1] == pytest.approx(one.stack(2).fetched_frac)
    assert dec["fetched_frac"][1] != pytest.approx(dec["fetched_frac"][0])
    assert "whole batch" in hw.units["kernel_decide_verkv"]["seconds"]
    assert hw.units["kernel_decide_verkv"]["batch"].startswith("requests")
    cm = CostModel.from_hardware(hw)
    # the measured table, not an estimate
    assert cm.provenance["decide.verkv"].startswith("fit to measured table kernel_decide_verkv (")
    assert cm.link_time(1 * MiB, "h2d") > 0
    assert cm.link_time(64 * KiB, "gather") > 0
    measured = float(np.median(att["seconds"][att["tokens"] == 256]))  # (128, 2) and (256, 1)
    assert cm.attention_time(1.0, 256) == pytest.approx(measured)
    assert cm.gemm_time(2, None) == pytest.approx(float(hw.tables["kernel_gemm"]["seconds"][1]))
    assert "profiled" in cm.provenance["gemm"] or "measured" in cm.provenance["gemm"]


def test_cli_cpu_quick_profile_and_no_overwrite(tmp_path, capsys):
    out = tmp_path / "q.npz"
    assert main(["profile", "--device", "cpu", "--quick", "--rounds", "1", "--no-progress",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "wrote" in printed
    dec = tracefile.load(out).hardware.tables["kernel_decide_verkv"]
    # the summary shows each decide table: context x batch -> ms per layer
    lines = printed.splitlines()
    head = next(i for i, line in enumerate(lines) if "kernel_decide_verkv:" in line)
    assert lines[head + 1].split() == ["context", "B=1", "B=2"]
    for n, row in zip([4096, 8192], lines[head + 2:head + 4]):
        cells = row.split()
        assert cells[0] == str(n)
        for b, ms in zip([1, 2], cells[1::2]):
            sel = (dec["context"] == n) & (dec["batch"] == b)
            assert float(ms) == pytest.approx(dec["seconds"][sel][0] * 1e3, abs=1e-3)
    before = out.stat().st_mtime_ns
    assert main(["profile", "--device", "cpu", "--quick", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--force" in err
    assert out.stat().st_mtime_ns == before


def _one_line_error(capsys, argv) -> str:
    assert main(argv) == 2
    cap = capsys.readouterr()
    err = cap.err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in cap.err, cap.err
    return err


def test_gpu_without_cuda_is_one_line_with_a_hint(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    err = _one_line_error(capsys, ["profile", "--gpu", "0", "--out", str(tmp_path / "g.npz")])
    assert "CUDA is not available" in err and "--device cpu" in err
    assert not (tmp_path / "g.npz").exists()


def _fake_cuda(monkeypatch, count=1):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: None)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: types.SimpleNamespace(uuid="GPU-fake-0", name="Fake GPU"))


def test_gpu_index_that_does_not_exist(tmp_path, capsys, monkeypatch):
    _fake_cuda(monkeypatch, count=2)
    err = _one_line_error(capsys, ["profile", "--gpu", "5", "--out", str(tmp_path / "g.npz")])
    assert "no such GPU" in err and "0..1" in err


def test_no_nvml_is_one_line_and_names_no_nvml(tmp_path, capsys, monkeypatch):
    import pynvml
    _fake_cuda(monkeypatch)

    def init():
        raise pynvml.NVMLError_LibraryNotFound()  # what a machine without the driver raises
    monkeypatch.setattr(pynvml, "nvmlInit", init)
    err = _one_line_error(capsys, ["profile", "--gpu", "0", "--out", str(tmp_path / "g.npz")])
    assert "NVML is not available" in err and "--no-nvml" in err


class FakeNvml:
    """pynvml's surface as used by the profiler; some fields unsupported, one failing later."""
    NVML_PCIE_UTIL_TX_BYTES, NVML_PCIE_UTIL_RX_BYTES = 0, 1
    NVML_CLOCK_SM, NVML_CLOCK_MEM, NVML_TEMPERATURE_GPU = 1, 2, 0

    class NVMLError(Exception):
        pass

    def __init__(self):
        self.power_calls = 0

    def _unsupported(self, *a):
        raise self.NVMLError("Not Supported")

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetCount(self):
        return 1

    def nvmlDeviceGetHandleByIndex(self, i):
        return f"h{i}"

    def nvmlDeviceGetUUID(self, h):
        return b"GPU-fake-0"

    def nvmlDeviceGetName(self, h):
        return "Fake H200"

    def nvmlSystemGetDriverVersion(self):
        return "999.1"

    def nvmlSystemGetCudaDriverVersion(self):
        return 12080

    def nvmlDeviceGetMemoryInfo(self, h):
        return types.SimpleNamespace(total=141 * 2**30, used=2**30)

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h):
        return 5

    def nvmlDeviceGetCurrPcieLinkWidth(self, h):
        return 16

    def nvmlDeviceGetClockInfo(self, h, which):
        return 1980 if which == self.NVML_CLOCK_SM else 2619

    def nvmlDeviceGetPowerUsage(self, h):
        self.power_calls += 1
        if self.power_calls > 2:  # works at first, then stops
            raise self.NVMLError("Unknown Error")
        return 150000

    # unsupported on this fake machine
    nvmlDeviceGetPcieThroughput = _unsupported
    nvmlDeviceGetMaxPcieLinkGeneration = _unsupported
    nvmlDeviceGetNumaNodeId = _unsupported
    # nvmlDeviceGetMaxPcieLinkWidth, ...: absent altogether (an older pynvml)


def test_nvml_fields_unsupported_are_missing_not_fatal():
    lib = FakeNvml()
    nv = Nvml(0, "fake-0", lib=lib)
    missing: list[str] = []
    ident = nv.identity(missing)
    assert ident["nvml_name"] == "Fake H200" and ident["uuid"] == "GPU-fake-0"
    assert ident["cuda_driver_version"] == "12.8" and ident["hbm_bytes_nvml"] == 141 * 2**30
    assert any(m.startswith("identity.numa_node") for m in missing)
    assert any(m.startswith("identity.pcie_width_max") for m in missing)
    s = Sampler(nv, interval_s=0.005)
    with s.sweep("a"):
        import time
        time.sleep(0.05)
    with s.sweep("b"):
        time.sleep(0.02)
    cols, units, miss = s.table()
    assert {"t", "sweep", "pcie_gen", "pcie_width", "clock_sm_MHz", "clock_mem_MHz",
            "mem_used_bytes"} <= set(cols)
    assert "pcie_tx_kBps" not in cols and "power_mW" not in cols  # the latter failed mid-way
    names = " ".join(miss)
    for f in ("pcie_tx_kBps", "pcie_rx_kBps", "pcie_gen_max", "pcie_width_max", "power_mW",
              "temp_C", "util_gpu_pct"):
        assert f"nvml.{f}" in names
    assert len({len(v) for v in cols.values()}) == 1  # equal-length columns
    assert set(cols["sweep"]) == {0, 1} and s.sweeps == ["a", "b"]
    assert cols["pcie_gen"][0] == 5 and set(units) == set(cols)


def test_out_of_memory_shrinks_and_is_recorded(tmp_path, monkeypatch):
    # device allocations beyond these sizes fail, as on a full GPU: byte buffers (link sweeps)
    # above 1 MiB, value buffers (KV, GEMV matrices) above 256 KiB
    limits = {torch.uint8: 1 * MiB}
    real = Backend.alloc

    def alloc(self, numel, dtype=None):
        dtype = dtype or self.dtype
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if nbytes > limits.get(dtype, 256 * KiB):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate (fake)")
        return real(self, numel, dtype)
    monkeypatch.setattr(Backend, "alloc", alloc)
    out = tmp_path / "oom.npz"
    profile(out, device="cpu", plan=TINY, rounds=1, progress=False)
    hw = tracefile.load(out).hardware
    shrunk = hw.extra["shrunk"]
    assert any(s.startswith("link") for s in shrunk)
    assert any(s.startswith("kernel_decode_attn") for s in shrunk)
    assert any(m.startswith("shrunk:") for m in hw.missing)
    assert hw.tables["link_h2d_pinned"]["bytes"].max() <= 1 * MiB
    att = hw.tables["kernel_decode_attn"]
    per_buffer = att["tokens"] * 3 * 64 * 4  # K (or V) bytes of one point
    assert len(att["tokens"]) > 0 and (per_buffer <= 256 * KiB).all()
    assert att["tokens"].max() < TINY.max_tokens  # the 512-token points were dropped ...
    assert any("measured up to" in s for s in shrunk if s.startswith("kernel_decode_attn"))
    assert any(s.startswith("mem_gemv") for s in shrunk)  # ... and said so
    assert any(m.startswith("kernel_decide_<policy> (no decide kernel") for m in hw.missing)
    CostModel.from_hardware(hw)  # still consumable


@pytest.mark.parametrize("case", ["no_dir", "parent_is_file", "not_writable", "cannot_create",
                                  "not_npz"])
def test_unwritable_output_is_refused_before_measuring(tmp_path, capsys, monkeypatch, case):
    def never(*a, **k):
        raise AssertionError("measured before checking the output path")
    monkeypatch.setattr(prun, "make_backend", never)
    out = tmp_path / "x.npz"
    if case == "no_dir":
        out = tmp_path / "missing" / "x.npz"
    elif case == "parent_is_file":
        (tmp_path / "f").write_text("")
        out = tmp_path / "f" / "x.npz"
    elif case == "not_writable":
        monkeypatch.setattr(kvsim.io.os, "access", lambda p, mode: False)
    elif case == "cannot_create":  # e.g. a read-only mount, where root's access() still says yes
        def ro(*a, **k):
            raise PermissionError(30, "Read-only file system")
        monkeypatch.setattr(kvsim.io.tempfile, "mkstemp", ro)
    else:
        out = tmp_path / "x.txt"
    err = _one_line_error(capsys, ["profile", "--device", "cpu", "--out", str(out)])
    assert str(out) in err


def test_library_refusals_raise_kvsim_error(tmp_path):
    with pytest.raises(KvsimError, match="exclude"):
        profile(tmp_path / "a.npz", gpu=0, device="cpu", plan=TINY)
    with pytest.raises(KvsimError, match="unknown model"):
        profile(tmp_path / "b.npz", device="cpu", model="no-such-model", plan=TINY)


def test_a_stacked_batch_decides_each_request_as_alone():
    """B requests stacked along the head axis: request 0's heads get exactly the decision the
    single-request bench makes (nothing mixes across heads), the others their own layers."""
    from kvsim.hw.catalog import model
    m = model("smollm2-135m")
    one = make("verkv").decide_kernel(torch.device("cpu"), m, 4096, 0)
    two = one.stack(2, workers=1)
    assert one.stack(1) is one
    assert (two.kv_heads, two.q_heads, two.batch) == (2 * m.kv_heads, 2 * m.q_heads, 2)
    idx1, _, bias1, counts1 = one.plan()
    idx2, _, bias2, counts2 = two.plan()
    kv, n = m.kv_heads, 4096
    assert torch.equal(counts2[:kv], counts1)
    first = idx2 < kv * n  # host rows of request 0's heads
    assert torch.equal(idx2[first], idx1)
    assert torch.equal(bias2[:kv, :, :bias1.shape[-1]], bias1)
    assert not torch.equal(counts2[kv:], counts1)  # request 1 is another layer
    assert two.fetched_frac == pytest.approx(
        float(counts2.double().mean()) / n)  # mean share over the stacked KV heads
    # the trace the stacked kernel decides on holds both requests' heads
    assert two.trace.attention.layers[0].k.shape[0] == 2 * kv


def test_request_generation_in_worker_processes_matches_in_process():
    from kvsim.hw.catalog import model
    from kvsim.policies.bench_requests import generate_requests, request_seed
    m = model("smollm2-135m")
    seeds = [request_seed(3, b) for b in (1, 2, 3)]
    assert len(set(seeds + [3])) == 4
    here = generate_requests(m, 512, seeds, workers=1)
    there = generate_requests(m, 512, seeds, workers=2)
    for a, b in zip(here, there, strict=True):
        la, lb = a.layers[0], b.layers[0]
        for f in ("k", "v", "q_question", "q_decode"):
            assert np.array_equal(getattr(la, f), getattr(lb, f)), f


class _Kernel:
    """A decide kernel without stack(): the profiler must call the bench on the stacked shape."""
    fetched_frac = 0.25

    def plan(self):
        return None


def test_sweep_decide_without_stack_uses_the_stacked_head_shape_and_survives_oom():
    from kvsim.hw.catalog import model
    be = make_backend(None, "cpu")
    m = model("smollm2-135m")
    calls = []

    def bench(device, shape, n, seed):
        calls.append((n, shape.q_heads, shape.kv_heads))
        if n == 8192 and shape.kv_heads == 4 * m.kv_heads:
            raise torch.OutOfMemoryError("fake: out of memory")
        return _Kernel()
    ticks = []
    tables, missing = kernels.sweep_decide(be, m, [4096, 8192], [1, 2, 4], lambda: ticks.append(1),
                                           bench, "kernel_decide_x")
    t = tables["kernel_decide_x"]
    got = list(zip(t["context"].tolist(), t["batch"].tolist()))
    assert got == [(4096, 1), (4096, 2), (4096, 4), (8192, 1), (8192, 2)]
    assert (4096, 4 * m.q_heads, 4 * m.kv_heads) in calls and (4096, 2 * m.q_heads,
                                                                2 * m.kv_heads) in calls
    assert (8192, m.q_heads, m.kv_heads) in calls
    assert any("out of memory at context 8192, batch 4" in s for s in be.shrunk)
    assert len(ticks) == 6 and not missing
    assert (t["fetched_frac"] == 0.25).all()


def test_decide_lines_reads_an_older_profiles_table_as_verkvs_and_without_batch_as_batch_1():
    hw = types.SimpleNamespace(tables={"kernel_decide": {
        "context": np.array([4096, 8192]), "seconds": np.array([1e-3, 2.5e-3]),
        "fetched_frac": np.array([0.5, 0.25])}})
    lines = prun.decide_lines(hw)
    assert lines[0].startswith("kernel_decide: verkv's decide")
    assert lines[1].split() == ["context", "B=1"]
    assert lines[2].split() == ["4096", "1.000", "(50.0%)"]
    assert lines[3].split() == ["8192", "2.500", "(25.0%)"]
    assert prun.decide_lines(types.SimpleNamespace(tables={})) == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_quick_profile(tmp_path):
    out = tmp_path / "gpu.npz"
    profile(out, gpu=0, quick=True, progress=False, model="smollm2-135m")
    hw = tracefile.load(out).hardware
    assert hw.device["kind"] == "cuda" and hw.device["hbm_bytes_torch"] > 0
    for t in CONSUMED:
        assert t in hw.tables
    assert "nvml" in hw.tables and len(hw.tables["nvml"]["t"]) > 0
    CostModel.from_hardware(hw)


def test_a_noisy_link_table_still_gives_a_bandwidth():
    """Three sizes timed on a busy machine can make the fitted line fall with size: the
    bandwidth is then the largest copy's rate, never an error; times that are not positive
    are one."""
    from kvsim.errors import KvsimError
    from kvsim.hw.fit import fit_alpha_beta
    n = np.array([4096, 65536, 1 << 20], float)
    alpha, beta = fit_alpha_beta(n, np.array([9e-5, 2e-5, 2.1e-5]))
    assert beta == pytest.approx(n[-1] / 2.1e-5) and alpha >= 0
    a2, b2 = fit_alpha_beta(n, 5e-6 + n / 50e9)  # a clean line is fitted exactly
    assert a2 == pytest.approx(5e-6, rel=1e-6) and b2 == pytest.approx(50e9, rel=1e-6)
    with pytest.raises(KvsimError, match="positive"):
        fit_alpha_beta(n, np.array([1e-5, 0.0, 1e-4]))
