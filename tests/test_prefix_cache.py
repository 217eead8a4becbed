"""Prefix caching in the simulator (kvsim.sim.prefix, kvsim.sim.batching): the cache's own
rules on hand-made cases, the simulator's hits against the arrival-order replay
(kvsim.sim.prefix.hit_curve, an LRU without timing) where the two must agree, and the
conservation of tokens (prefilled + hit = prompt) and of blocks over the tiers."""

import json
import math

import numpy as np
import pytest
from conftest import replay_json, run_cli

from kvsim.contract import DecodeCost
from kvsim.hw import catalog
from kvsim.hw.costs import costs_for
from kvsim.sim.engine import Memory, Simulator
from kvsim.sim.prefix import LRU, PrefixCache, Tier, hit_curve
from kvsim.sim.records import ChunkLog, PrefixCaching
from kvsim.sim.rules import Scheduling
from kvsim.sim.workload import Workload

M = catalog.model("qwen3-4b")
RESIDENT = DecodeCost(1.0, 1.0, 0.0, 0.0, False)
CONVERSATION = "data/mooncake/conversation_trace.jsonl"
B = 16  # tokens per block in the hand-made workloads


def cache(host=0, disk=0, recompute=lambda n, p: math.inf, bb=100.0):
    lower = [Tier("host", host, 10.0, 10.0)] if host else []
    if disk:
        lower.append(Tier("disk", disk, 1.0, 1.0))
    return PrefixCache(B, bb, lower, recompute)


# ----------------------------------------------------------------------- the cache's rules
def test_a_prefix_is_hit_once_its_request_has_prefilled_and_the_last_token_is_computed():
    c = cache()
    ids = [1, 2, 3]
    hit, load, pins = c.admit(ids, 40)
    assert (hit, load, pins) == (0, 0.0, 0)  # nothing cached yet
    pins = c.prefilled(ids, pins)
    assert pins == 3
    c.finish(ids, pins)
    assert list(c.gpu.blocks) == [1, 2, 3] and not c.pinned
    # the same prompt again: all three blocks are cached, but its last token is prefilled
    hit, load, pins = c.admit(ids, 40)
    assert hit == 39 and load == 0.0 and pins == 3
    # a prompt sharing two blocks, then its own
    hit2, _, pins2 = c.admit([1, 2, 9], 45)
    assert hit2 == 2 * B and pins2 == 2
    assert c.pinned == {1: 2, 2: 2, 3: 1}
    counts = c.counts
    assert counts.prompt_tokens == 40 + 40 + 45
    assert counts.prefilled_tokens + sum(counts.hit_tokens.values()) == counts.prompt_tokens


def test_pinned_blocks_are_never_evicted_and_the_least_recently_used_go_first():
    c = cache(host=100)
    for ids in ([1, 2], [3, 4], [5, 6]):
        c.finish(ids, c.prefilled(ids, c.admit(ids, 2 * B)[2]))
    c.admit([3, 4], 2 * B + 1)  # pins 3 and 4 (a hit), 3 and 4 leave the GPU's LRU
    c.trim_gpu(free_bytes=0)  # no free HBM: every unpinned block goes to host memory
    assert c.where(3) == 0 and c.where(4) == 0  # pinned: still on the GPU
    assert list(c.lower[0].lru.blocks) == [1, 2, 5, 6]  # least recently used first
    assert c.counts.written_bytes["host"] == 4 * 100.0


def test_evicted_blocks_cascade_down_the_tiers_and_are_written_once():
    c = cache(host=2, disk=10)
    ids = list(range(1, 7))
    c.finish(ids, c.prefilled(ids, c.admit(ids, 6 * B)[2]))
    c.trim_gpu(0)  # 6 blocks to a 2-block host: 4 go on to disk
    assert list(c.lower[0].lru.blocks) == [5, 6] and list(c.lower[1].lru.blocks) == [1, 2, 3, 4]
    assert c.counts.written_bytes == {"host": 600.0, "pool": 0.0, "disk": 400.0}
    # a hit in host memory and on disk is loaded at each tier's rate; the blocks stay there
    hit, load, pins = c.admit(ids + [7], 7 * B)
    assert hit == 6 * B and pins == 6
    assert load == pytest.approx(4 * 100 / 1e9 + 2 * 100 / 10e9)
    assert c.counts.loaded_bytes == {"host": 200.0, "pool": 0.0, "disk": 400.0}
    assert c.counts.hit_tokens == {"gpu": 0, "host": 2 * B, "pool": 0, "disk": 4 * B}



def test_a_block_a_tier_holds_already_is_not_written_to_it_again():
    c = cache(host=10)
    ids = [1, 2, 3]
    c.finish(ids, c.prefilled(ids, c.admit(ids, 3 * B)[2]))
    c.trim_gpu(0)
    assert c.counts.written_bytes["host"] == 300.0
    _, _, pins = c.admit(ids + [4], 4 * B)  # loaded from host, kept there
    c.finish(ids + [4], c.prefilled(ids + [4], pins))
    c.trim_gpu(0)
    assert c.counts.written_bytes["host"] == 400.0  # block 4 only
    assert list(c.lower[0].lru.blocks) == [1, 2, 3, 4]


def test_a_lower_tier_hit_is_recomputed_where_that_is_quicker():
    c = cache(host=10, recompute=lambda n, p: 0.0)  # recomputing costs nothing
    ids = [1, 2, 3]
    c.finish(ids, c.prefilled(ids, c.admit(ids, 3 * B)[2]))
    c.trim_gpu(1 * 100.0)  # one block stays on the GPU (block 3, the most recent), 2 to host
    assert c.where(3) == 0 and c.where(1) == 1
    hit, load, pins = c.admit(ids + [4], 4 * B)
    assert (hit, load, pins) == (0, 0.0, 0)  # its first block is in host memory: recomputed
    assert c.counts.recomputed_tokens == 3 * B - 0


def test_lru_keeps_its_capacity():
    lru = LRU(2)
    assert lru.touch(1) == [] and lru.touch(2) == [] and lru.touch(1) == []
    assert lru.touch(3) == [2] and list(lru.blocks) == [1, 3]


# ------------------------------------------------------------------------------ the runs
ON = PrefixCaching(prefix_caching="on")


def sim_for(caching=ON, hbm_gib=None, batch=16, scheduling=None, keep=0):
    costs, _ = costs_for("h100-sxm", None, "roofline")
    hbm = costs.hbm_bytes if hbm_gib is None else M.weight_bytes + 2 * 2**30 + hbm_gib * 2**30
    return Simulator(M, costs, RESIDENT, Memory(hbm, 0, M.weight_bytes, 2 * 2**30), batch,
                     scheduling or Scheduling(), caching=caching, chunks=ChunkLog(keep=keep))


def conversations(n=120, seed=0, gap=5.0, block=B):
    """Sessions whose turns resend their history (each prompt ends in a block of its own, so
    that no prompt is cached whole), arriving ``gap`` seconds apart on average."""
    rng = np.random.default_rng(seed)
    ids, prompts, next_id = [], [], 0
    sessions = [[] for _ in range(8)]
    for _ in range(n):
        s = sessions[rng.integers(len(sessions))]
        grow = int(rng.integers(1, 6))
        fresh = list(range(next_id, next_id + grow))
        next_id += grow
        mine = s + fresh
        s[:] = mine
        ids.append(list(mine))
        prompts.append(len(mine) * block - int(rng.integers(0, block // 2)))
    arrival = np.cumsum(rng.exponential(gap, n))
    return Workload(arrival - arrival[0], np.array(prompts), np.full(n, 4), None, "test",
                    ids, block)


def test_requests_one_at_a_time_hit_what_the_arrival_order_replay_says():
    """Far apart, with HBM for every block: each request finds every earlier prefix cached, as
    the arrival-order LRU of unlimited capacity says (no prompt is cached whole here)."""
    work = conversations(gap=60.0)
    res = sim_for().run(work)
    c = res.cache
    expect = hit_curve(work.prefix_hashes, work.prompt, B, [math.inf])[0]
    assert sum(c.hit_tokens.values()) / c.prompt_tokens == pytest.approx(expect, abs=1e-12)
    assert c.hit_tokens["gpu"] == sum(c.hit_tokens.values())


def test_a_host_tier_serves_what_hbm_cannot_hold_and_loads_what_it_serves():
    """HBM for about one request's blocks: the rest of the history is hit in a host tier large
    enough for all of it, so the hit share is still the unlimited one; every byte loaded is a
    block hit there."""
    work = conversations(gap=60.0)
    bb = M.kv_bytes_per_token * B
    res = sim_for(PrefixCaching("on", cache_host_gib=1.0), hbm_gib=0.3).run(work)
    c = res.cache
    expect = hit_curve(work.prefix_hashes, work.prompt, B, [math.inf])[0]
    assert sum(c.hit_tokens.values()) / c.prompt_tokens == pytest.approx(expect, abs=1e-12)
    assert c.hit_tokens["host"] > 0 and c.hit_tokens["gpu"] > 0
    # loaded bytes are whole blocks; each host hit's block loaded once per admission
    assert c.loaded_bytes["host"] / bb == pytest.approx(round(c.loaded_bytes["host"] / bb))
    assert c.loaded_bytes["host"] >= c.hit_tokens["host"] / B * bb - 1e-6


@pytest.mark.parametrize("admission,preemption", [("reserve", "recompute"),
                                                  ("grow", "recompute"), ("grow", "swap")])
def test_tokens_are_conserved_prefilled_plus_hit_is_the_prompt(admission, preemption):
    """Busy (requests overlap, prompts chunked): the prompt tokens admitted are the tokens the
    steps prefilled plus the tokens hit, step by step from the chunk log; with reserve
    admission each request is admitted once, so they are the workload's prompt tokens."""
    work = conversations(n=200, gap=0.01)
    sched = Scheduling(max_batched_tokens=64, admission=admission, preemption=preemption)
    sim = sim_for(PrefixCaching("on", cache_host_gib=0.05), hbm_gib=0.4, batch=8,
                  scheduling=sched, keep=10**6)
    res = sim.run(work)
    c = res.cache
    stepped = sum(ch.prefill_tokens for ch in res.chunks)
    assert len(res.chunks.kept) == res.chunks.count  # every step kept
    assert c.prefilled_tokens + sum(c.hit_tokens.values()) == c.prompt_tokens
    if admission == "reserve":
        assert c.prompt_tokens == int(work.prompt.sum())
        assert stepped == c.prefilled_tokens
    else:  # a preempted request prefills its generated tokens again too
        assert stepped >= c.prefilled_tokens
    assert res.requests.count == work.n
    assert sum(c.hit_tokens.values()) > 0


def test_blocks_written_down_the_tiers_are_held_there_or_evicted_further():
    """A block is written to a tier only where it is not held there, and only evictions take
    blocks out: a tier's blocks written are those it holds at the end plus those it evicted;
    what it evicted went to the next tier, written there unless held already."""
    work = conversations(n=300, gap=0.5)
    bb = M.kv_bytes_per_token * B
    sim = sim_for(PrefixCaching("on", cache_host_gib=0.1, cache_disk_gib=100), hbm_gib=0.6)
    from kvsim.sim.batching import Run
    sim.check_feasible(work)
    run = Run(sim, work, cache=sim.prefix_cache(work))
    run.env.run(run.scheduler())
    c, (host, disk) = run.cache.counts, run.cache.lower
    ev = c.evicted_blocks
    assert c.written_bytes["host"] / bb == len(host.lru) + ev["host"]
    assert c.written_bytes["disk"] / bb == len(disk.lru)  # nothing falls off a 100 GiB disk
    assert ev["disk"] == 0 and 0 < c.written_bytes["disk"] / bb <= ev["host"]
    assert c.written_bytes["host"] / bb <= ev["gpu"]
    # every block loaded was hit in that tier (a hit block loaded once per admission)
    hits = {t: c.hit_tokens[t] for t in ("host", "disk")}
    for t in hits:
        assert (c.loaded_bytes[t] / bb - 1) * B < hits[t] <= c.loaded_bytes[t] / bb * B


def test_caching_off_is_the_run_without_prefix_blocks():
    work = conversations(n=60, gap=0.2)
    bare = Workload(work.arrival, work.prompt, work.output, None, "test")
    off = sim_for(PrefixCaching("off")).run(work)
    none = sim_for(PrefixCaching("auto")).run(bare)
    assert off.cache is None and none.cache is None
    assert off.requests.ttft.mean() == none.requests.ttft.mean()


# --------------------------------------------------------------- the replay, on the trace
def test_the_conversation_trace_hits_its_unlimited_share_and_lowers_ttft():
    """The issue's check: the first 2,000 requests with caching on and a large host tier
    (4,000 GiB: about 29M tokens of Qwen3-4B, more than the slice's 27M prompt tokens) hit
    their unlimited share, and the mean TTFT is lower than with caching off."""
    from kvsim.sim.workload import from_file
    w = from_file(CONVERSATION, limit=2000)
    unlimited = hit_curve(w.prefix_hashes, w.prompt, 512, [math.inf])[0]
    common = dict(policy="dense-resident", gpu="h100-sxm", model="qwen3-4b", batch=64,
                  workload_csv=CONVERSATION, workload_limit=2000)
    on = replay_json(**common, prefix_caching="on", cache_host_gib=4000)
    off = replay_json(**common, prefix_caching="off")
    assert on["prefix_hit_frac"] == pytest.approx(unlimited, abs=0.01)
    assert on["prefix_hit_frac"] <= unlimited + 1e-12  # the last token is always prefilled
    assert "prefix_hit_frac" not in off
    assert on["ttft_ms"] < off["ttft_ms"]
    pc = on["prefix_cache"]
    assert pc["prefix_tokens_prefilled"] + round(on["prefix_hit_frac"] *
                                                 pc["prefix_prompt_tokens"]) == \
        pc["prefix_prompt_tokens"] == int(w.prompt.sum())


def test_the_prefix_aware_router_finds_more_of_the_cache_than_round_robin():
    common = dict(policy="dense-resident", gpu="h100-sxm", model="qwen3-4b", batch=64,
                  workload_csv=CONVERSATION, workload_limit=1000, replicas=4,
                  cache_host_gib=500)
    hit = {r: replay_json(**common, router=r)["prefix_hit_frac"]
           for r in ("round-robin", "least-loaded", "prefix-aware")}
    assert hit["prefix-aware"] > 2 * hit["round-robin"]
    assert hit["prefix-aware"] > 2 * hit["least-loaded"]


def test_auto_caches_a_trace_with_hashes_and_says_when_the_policy_cannot():
    common = dict(gpu="h100-sxm", model="qwen3-4b", workload_csv=CONVERSATION,
                  workload_limit=50, batch=8)
    assert replay_json(policy="dense-resident", **common)["prefix_hit_frac"] > 0
    r = replay_json(policy="dense-offload", **common)
    assert "prefix_hit_frac" not in r
    assert any("prefix blocks" in w for w in r["warnings"])


@pytest.mark.parametrize("args,words", [
    (["--prefix-caching", "on"], "names no prefix blocks"),
    (["--policy", "dense-offload", "--prefix-caching", "on", "--workload", CONVERSATION,
      "--limit", "10"], "keep the whole KV cache in HBM"),
    (["--cache-host-gib", "-1"], "--cache-host-gib must be a size in [0, "),
    (["--cache-disk-gbps", "0"], "--cache-disk-gbps must be a rate in [0.01, "),
    (["--prefix-caching", "off", "--cache-host-gib", "8"], "need --prefix-caching on or auto"),
    (["--prefix-caching", "maybe"], "invalid choice"),
])
def test_bad_caching_options_get_one_line_and_status_2(args, words):
    code, out, err = run_cli("replay", *args)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and words in err


def test_the_json_names_the_hit_per_tier_and_the_bytes_moved():
    code, out, err = run_cli("replay", "--policy", "dense-resident", "--workload", CONVERSATION,
                             "--limit", "300", "--batch", "16", "--replicas", "2",
                             "--router", "prefix-aware", "--prefix-caching", "on",
                             "--cache-host-gib", "50", "--cache-pool-gib", "100", "--json")
    assert code == 0, err
    r = json.loads(out)
    pc = r["prefix_cache"]
    assert r["prefix_hit_frac"] == pc["prefix_hit_frac"] == pytest.approx(
        sum(pc[f"prefix_hit_frac_{t}"] for t in ("gpu", "host", "pool", "disk")))
    for key in ("ttft_ms", "prefix_tokens_prefilled", "prefix_loaded_gib_host",
                "prefix_written_gib_pool", "prefix_load_s"):
        assert key in r or key in pc or key in r["sim"]
    assert "pool 100 GiB" in r["provenance"]["prefix_cache"]


# --------------------------------------------------------------------------- the plan
def _trace_slice(path, n):
    with open(CONVERSATION) as f:
        path.write_text("".join(next(f) for _ in range(n)))
    return path


def test_a_plan_on_a_trace_with_hashes_sweeps_host_caches_and_prices_them(tmp_path):
    """With a workload that names its prefix blocks, the deployment search sweeps host-cache
    sizes per GPU (0, 64, 256 GiB unless told) and tries the prefix-aware router; each fleet
    is priced with its memory (GiB x GPUs x the DRAM price), and the answer names the host
    cache it needs, what it costs and what it serves."""
    wl = _trace_slice(tmp_path / "conv.jsonl", 1200)
    out = tmp_path / "plan"
    code, stdout, err = run_cli(
        "plan", "--gpu", "h100-sxm", "--model", "qwen3-4b", "--workload", wl, "--policy",
        "dense-resident", "--batch", "16", "--tp", "1", "--slo-tpot-ms", "60",
        "--slo-ttft-ms", "20000", "--slo-requests", "300", "--target-qps", "2", "--out", out,
        "--memory-price", "0.01", "--jobs", "1")
    assert code == 0, err
    import pandas as pd
    df = pd.read_csv(out / "results.csv")
    sizes = df.get("cache_host_gib", pd.Series(0.0, index=df.index)).fillna(0.0)
    assert sorted(sizes) == [0.0, 64.0, 256.0]
    assert all("prefix-aware" in str(r) for r in df.routers_tried)
    ok = df[df.replicas_needed.notna()]
    assert len(ok)
    for _, r in ok.iterrows():
        gpus = r.replicas_needed * r.tp
        assert r.cache_usd_per_hour == pytest.approx(gpus * sizes[_] * 0.01)
        assert r.usd_per_hour == pytest.approx(gpus * r.price_usd_per_gpu_hour
                                               + r.cache_usd_per_hour)
    a = json.loads((out / "answer.json").read_text())
    pc = a["prefix_cache"]
    host = pc["tiers"]["host"]
    assert host["gib_per_gpu"] in (0.0, 64.0, 256.0)
    assert host["gib_in_all"] == host["gib_per_gpu"] * a["gpus"]
    assert 0 < pc["hit_frac"] <= 1 and "--memory-price" in pc["price_source"]
    assert "Prefix cache:" in stdout


def test_a_plan_without_a_router_tries_every_router_that_applies():
    """--router unset: the deployment search tries every router (prefix-aware only where the
    plan caches prefixes); given, only those named."""
    from kvsim.cli import build_parser
    from kvsim.commands.plan import sweep_spec
    from kvsim.plan.deployment import target_of

    def routers(*extra):
        args = build_parser(["plan"]).parse_args(
            ["plan", "--gpu", "h100-sxm", "--model", "qwen3-4b", "--policy", "dense-resident",
             "--target-qps", "3", "--slo-ttft-ms", "15000", "--out", "x", *extra])
        return target_of(sweep_spec(args)).routers
    assert routers("--context", "1000") == ("round-robin", "least-loaded")
    assert routers("--workload", CONVERSATION) == ("round-robin", "least-loaded",
                                                   "prefix-aware")
    assert routers("--context", "1000", "--router", "least-loaded") == ("least-loaded",)


@pytest.mark.parametrize("gap", [2.0, 0.002])
def test_a_long_loop_in_pieces_is_the_serial_run_with_the_cache_carried_over(gap):
    """Pieces cut where the server empties, run in order from the cache the last one left,
    give the serial run's requests and cache counts (busy, most cuts fail and their pieces
    run again as one from the copy taken before)."""
    from kvsim.sim import segments
    from kvsim.sim.metrics import Requests
    work = conversations(n=400, gap=gap)
    caching = PrefixCaching("on", cache_host_gib=0.2)
    whole = sim_for(caching, hbm_gib=0.6).run_whole(work, Requests())
    pieces = segments.run_cached(sim_for(caching, hbm_gib=0.6), work, Requests(), piece=40)
    assert (gap > 1) == (pieces.pieces > 3), pieces.pieces  # (busy: cuts fail)
    assert pieces.requests.count == whole.requests.count == work.n
    assert pieces.requests.ttft.mean() == pytest.approx(whole.requests.ttft.mean(), rel=1e-12)
    assert pieces.requests.last_finish == whole.requests.last_finish
    for name in ("prompt_tokens", "prefilled_tokens", "hit_tokens", "loaded_bytes",
                 "written_bytes", "evicted_blocks"):
        assert getattr(pieces.cache, name) == getattr(whole.cache, name), name
