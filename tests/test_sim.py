"""Physics and bookkeeping of the simulator: link- and HBM-bound decode, admission, Little's law."""

import json

import numpy as np
import pytest
from conftest import replay_json

from kvsim.errors import Infeasible, KvsimError
from kvsim.hw import catalog


def replay(trace, **kw):
    """The physics of the bare hardware: the roofline engine (no engine overheads)."""
    return replay_json(trace=trace, **{"engine": "roofline", **kw})


def test_dense_offload_is_link_bound(attn_trace):
    m, g = catalog.model("qwen3-4b"), catalog.gpu("h100-sxm")
    r = replay(attn_trace, policy="dense-offload", gpu="h100-sxm", model="qwen3-4b",
               context=32768, batch=1)
    kv_bytes = m.kv_bytes_per_token * 32768
    assert 4.7e9 < kv_bytes < 4.9e9  # about 4.8 GB per token
    expected_ms = kv_bytes / (g.h2d_gbps * 1e9) * 1e3  # about 93 ms
    assert r["tpot_ms"] == pytest.approx(expected_ms, rel=0.10)
    assert r["kv_read_frac"] == 1.0 and r["link_util"] > 0.8
    assert r["host_gib"] > kv_bytes / 2**30  # the cache lives in host memory


def test_dense_resident_is_hbm_bound(attn_trace):
    m, g = catalog.model("qwen3-4b"), catalog.gpu("h100-sxm")
    r = replay(attn_trace, policy="dense-resident", gpu="h100-sxm", model="qwen3-4b",
               context=32768, batch=1, output_len=16)
    bytes_per_step = m.weight_bytes + m.kv_bytes_per_token * 32768
    floor_ms = bytes_per_step / (g.hbm_gbps * 1e9) * 1e3  # spec bandwidth: a hard floor
    assert floor_ms < r["tpot_ms"] < floor_ms / 0.85 * 1.05
    assert r["link_util"] == 0 and r["host_gib"] == 0


def test_throughput_rises_with_batch_until_memory_stops_admission(attn_trace):
    rows = [replay(attn_trace, policy="dense-resident", gpu="h100-sxm", model="qwen3-4b",
                   context=32768, batch=b, output_len=32) for b in (1, 2, 4, 8, 16, 32)]
    tput = [r["throughput_tok_s"] for r in rows]
    fit = rows[0]["memory"]["max_batch_fit"]
    assert 8 < fit < 16  # ~4.5 GiB of KV per request, ~68 GiB free
    assert all(b > a for a, b in zip(tput[:4], tput[1:4]))  # rises while it fits
    lim = [r["memory"]["hbm_limited"] for r in rows]
    assert lim[4] and lim[5] and not lim[3]
    assert rows[5]["sim"]["mean_batch"] <= fit + 1e-9
    assert tput[5] == pytest.approx(tput[4], rel=0.02)  # memory caps the batch: no further gain
    assert rows[5]["hbm_gib"] <= catalog.gpu("h100-sxm").hbm_gib


def test_littles_law_in_steady_state(attn_trace):
    qps = 3.0
    r = replay(attn_trace, policy="dense-resident", gpu="h100-sxm", model="qwen3-4b",
               context=2048, output_len=64, batch=16, qps=qps, requests=3000, seed=1)
    s = r["sim"]
    # time-averaged number in system (integrated by the engine) vs lambda * W (from timestamps)
    assert s["mean_in_system"] == pytest.approx(s["requests_per_s"] * r["e2e_s"], rel=0.02)
    assert s["requests_per_s"] == pytest.approx(qps, rel=0.06)  # stable: departures = arrivals
    assert s["mean_in_system"] == pytest.approx(qps * r["e2e_s"], rel=0.08)


def test_same_seed_same_json_other_seed_differs(attn_trace):
    kw = dict(policy="dense-offload", gpu="h200", model="llama-3.1-8b", context=8192, batch=4,
              qps=0.5, requests=40, output_len=32)
    a = json.dumps(replay(attn_trace, seed=7, **kw), sort_keys=True)
    b = json.dumps(replay(attn_trace, seed=7, **kw), sort_keys=True)
    c = json.dumps(replay(attn_trace, seed=8, **kw), sort_keys=True)
    assert a == b and a != c


def test_not_even_one_request_fits_is_infeasible(attn_trace):
    with pytest.raises(Infeasible, match="HBM"):
        replay(attn_trace, policy="dense-resident", gpu="a100-40gb", model="qwen3-4b",
               context=300000)
    with pytest.raises(Infeasible, match="host memory"):
        replay(attn_trace, policy="dense-offload", gpu="h100-sxm", model="llama-3.1-8b",
               context=1_000_000, host_gib=64)


def test_offload_pipeline_hides_compute_behind_the_link(attn_trace):
    """Double buffering: offload TPOT ~ max(link, compute), not their sum."""
    res = replay(attn_trace, policy="dense-resident", gpu="gh200", model="qwen3-4b",
                 context=32768, batch=4, output_len=16)
    off = replay(attn_trace, policy="dense-offload", gpu="gh200", model="qwen3-4b",
                 context=32768, batch=4, output_len=16)
    m = catalog.model("qwen3-4b")
    link_ms = 4 * m.kv_bytes_per_token * 32768 / 360e9 * 1e3
    serial = link_ms + res["tpot_ms"]
    assert off["tpot_ms"] < max(link_ms, res["tpot_ms"]) + 0.5 * min(link_ms, res["tpot_ms"])
    assert off["tpot_ms"] < serial
    assert off["tpot_ms"] >= max(link_ms, res["tpot_ms"])


def test_measured_tables_replace_the_catalog(hw_trace):
    r = replay(hw_trace, policy="dense-offload", model="qwen3-4b", context=32768)
    assert r["gpu"] == "FakeGPU"
    assert "measured" in r["provenance"]["hw.link_h2d"]
    # 4.8 GB over a ~50 GB/s measured link, 2 copies per layer
    assert r["tpot_ms"] == pytest.approx(4.83e9 / 50e9 * 1e3, rel=0.1)
    big = replay(hw_trace, policy="dense-resident", model="qwen3-4b", context=32768, batch=8)
    assert any("extrapolated" in w for w in big["warnings"])  # beyond the attention table
    cat = replay(hw_trace, policy="dense-offload", model="qwen3-4b", context=32768, gpu="h200")
    assert cat["gpu"] == "h200" and "not used" in cat["provenance"]["hw.trace_hardware"]


def test_csv_workload(attn_trace, tmp_path):
    csv = tmp_path / "w.csv"
    csv.write_text("arrival,prompt,output\n0,1000,10\n0.5,2000,20\n0.2,500,5\n")
    r = replay(attn_trace, policy="dense-resident", gpu="h100-sxm", model="qwen3-4b",
               workload_csv=csv, batch=2)
    assert r["sim"]["requests"] == 3 and r["sim"]["decode_steps"] > 0
    assert np.isfinite(r["tpot_ms"]) and r["ttft_ms"] > 0


def test_every_catalog_gpu_plans_and_names_its_source(attn_trace):
    """B200, H20, L40S and MI300X beside the Hopper parts: each plans, its figures cite their
    source, and a host-link-bound offload scales with its link (L40S: Gen4, half of Gen5)."""
    tpot = {}
    for name, g in catalog.GPUS.items():
        assert g.source and g.peer and g.peer_gbps > 0, name
        r = replay(attn_trace, policy="dense-offload", gpu=name, model="qwen3-4b", context=8192,
                   batch=1, output_len=8)
        assert g.source in r["provenance"]["hw.gpu"]
        tpot[name] = r["tpot_ms"]
    assert tpot["l40s"] == pytest.approx(tpot["h100-sxm"] * 52 / 25, rel=0.1)


def test_tensor_parallelism_splits_weights_kv_and_the_link(attn_trace):
    """TP 2: each GPU holds half the weights and KV heads, so an offload that is bound by its
    own host link takes half the time and twice the requests fit; one link shared by the pair
    gives the time back; the all-reduces are priced on the catalog's peer link."""
    kw = dict(policy="dense-offload", gpu="h100-sxm", model="qwen3-4b", context=32768, batch=8,
              requests=8, scheduler="prefill-first")
    one, two = replay(attn_trace, **kw), replay(attn_trace, tp=2, **kw)
    shared = replay(attn_trace, tp=2, tp_link="shared", **kw)
    assert two["tpot_ms"] == pytest.approx(one["tpot_ms"] / 2, rel=0.02)
    assert shared["tpot_ms"] == pytest.approx(one["tpot_ms"], rel=0.02)
    assert two["memory"]["max_batch_fit"] >= 2 * one["memory"]["max_batch_fit"] - 1
    m = catalog.model("qwen3-4b")
    assert two["memory"]["hbm_weights_gib"] == pytest.approx(
        m.shard(2).weight_bytes / 2**30) and m.shard(2).kv_bytes_per_token == \
        m.kv_bytes_per_token / 2
    assert "NVLink 4" in two["provenance"]["hw.tensor_parallel"] and two["tp"] == 2
    res = [replay(attn_trace, **{**kw, "policy": "dense-resident", "tp": t}) for t in (1, 2)]
    assert res[1]["tpot_ms"] < res[0]["tpot_ms"]  # half the bytes per GPU, plus all-reduces
    with pytest.raises(KvsimError, match="do not split 3 ways"):
        replay(attn_trace, tp=3, **kw)


def test_round_robin_replicas_are_independent_replicas(attn_trace):
    """A closed loop of 8 over 2 replicas is two loops of 4: the same latencies, twice the
    throughput, one replica's memory and utilisation; under Poisson load more replicas serve
    the same arrivals with shorter queues."""
    kw = dict(policy="dense-resident", gpu="h100-sxm", model="qwen3-4b", context=4096,
              output_len=32)
    one = replay(attn_trace, batch=4, concurrency=4, requests=8, **kw)
    two = replay(attn_trace, batch=4, concurrency=8, requests=16, replicas=2, **kw)
    assert two["tpot_ms"] == pytest.approx(one["tpot_ms"], rel=1e-9)
    assert two["ttft_ms"] == pytest.approx(one["ttft_ms"], rel=1e-9)
    assert two["throughput_tok_s"] == pytest.approx(2 * one["throughput_tok_s"], rel=1e-9)
    assert two["sim"]["gpu_util"] == pytest.approx(one["sim"]["gpu_util"], rel=1e-9)
    assert two["hbm_gib"] == one["hbm_gib"] and two["replicas"] == 2
    load = dict(kw, batch=16, qps=8.0, requests=300, seed=3)
    r1, r2 = replay(attn_trace, **load), replay(attn_trace, replicas=2, **load)
    assert r2["sim"]["requests"] == r1["sim"]["requests"] == 300
    assert r2["sim"]["ttft_p99_ms"] < r1["sim"]["ttft_p99_ms"]
    with pytest.raises(KvsimError, match="--replicas"):
        replay(attn_trace, replicas=0, **kw)


def test_least_loaded_router_balances_what_round_robin_cannot(attn_trace, tmp_path):
    """Requests alternate long and short: round-robin sends every long one to replica 1, the
    least-loaded router spreads them, so queues and latencies shrink. With one replica, or a
    workload where every replica is idle at each arrival, both routers give the same result."""
    kw = dict(policy="dense-resident", gpu="h100-sxm", model="qwen3-4b", batch=4, output_len=64)
    rows = ["arrival,prompt,output"] + [f"{0.2 * i:.3f},{16384 if i % 2 else 512},64"
                                        for i in range(120)]
    w = tmp_path / "alternating.csv"
    w.write_text("\n".join(rows) + "\n")
    rr = replay(attn_trace, replicas=2, workload_csv=w, **kw)
    ll = replay(attn_trace, replicas=2, workload_csv=w, router="least-loaded", **kw)
    assert ll["sim"]["requests"] == rr["sim"]["requests"] == 120
    assert ll["ttft_ms"] < 0.5 * rr["ttft_ms"] and ll["e2e_s"] < rr["e2e_s"]
    assert "least-loaded router" in ll["provenance"]["workload"]
    sparse = dict(kw, qps=0.01, requests=6, context=2048)
    a = replay(attn_trace, replicas=3, **sparse)
    b = replay(attn_trace, replicas=3, router="least-loaded", **sparse)
    assert a["tpot_ms"] == pytest.approx(b["tpot_ms"], rel=1e-9)
    assert a["ttft_ms"] == pytest.approx(b["ttft_ms"], rel=1e-9)
    one = replay(attn_trace, qps=4.0, requests=40, context=4096, **kw)
    one_ll = replay(attn_trace, qps=4.0, requests=40, context=4096, router="least-loaded", **kw)
    assert one["tpot_ms"] == one_ll["tpot_ms"]
    with pytest.raises(KvsimError, match="--router"):
        replay(attn_trace, router="random", **kw)
