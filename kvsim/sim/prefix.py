"""Prefix caching: KV blocks named by the chain of prefix hashes (Mooncake's ``hash_ids``, or a
generated workload's), kept after their request in GPU memory and in tiers below it.

A request's prompt is a list of block ids, block ``j`` holding its tokens ``[j B, (j + 1) B)``
(the last block may be partial) and standing for the whole prefix up to it: equal ids are equal
prefixes. Its *hit* is its longest leading run of blocks that some tier holds; those tokens are
not prefilled (the rest is, attending over the whole context: :mod:`kvsim.sim.batching` starts
its prefill at the hit), but at least its last token always is (its logits give the first
output token), as vLLM and SGLang do.

Tiers, fastest first: ``gpu`` (the HBM its replica's running requests leave free: a finished
request's blocks stay there, least recently used evicted first, and a running request's are
never evicted), ``host`` (DRAM over PCIe), ``pool`` (DRAM of a pool shared by the replicas, over
RDMA) and ``disk`` (local NVMe). A block evicted from a tier is written back to the next one
(its bytes counted on that tier's link; asynchronous, so it costs link time but no step waits
for it). A hit in a lower tier is loaded into GPU memory layer by layer while the rest of the
prompt prefills (LMCache's and HiCache's overlap: the step that prefills the request's first
chunk takes at least the load), or recomputed where that is quicker.

:func:`hit_curve` replays the arrival sequence alone through an LRU cache of a given capacity,
no timing (Mooncake's Figure 9).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field

from kvsim.hw.catalog import GiB

TIERS = ("gpu", "host", "pool", "disk")  # fastest first


class LRU:
    """Blocks, least recently used first, at most ``capacity`` of them (inf: no limit)."""

    def __init__(self, capacity: float = math.inf):
        self.capacity = capacity
        self.blocks: OrderedDict = OrderedDict()

    def __contains__(self, block) -> bool:
        return block in self.blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def touch(self, block) -> list:
        """``block`` becomes the most recently used (added if absent); the blocks evicted to
        keep to the capacity, least recently used first."""
        self.blocks[block] = None
        self.blocks.move_to_end(block)
        return self.trim(self.capacity)

    def remove(self, block) -> None:
        self.blocks.pop(block, None)

    def trim(self, capacity: float) -> list:
        """Evict the least recently used down to ``capacity`` blocks; the evicted."""
        out = []
        while len(self.blocks) > capacity:
            out.append(self.blocks.popitem(last=False)[0])
        return out


def block_tokens_of(prompt: int, blocks: int, block: int) -> int:
    """Tokens of a prompt's first ``blocks`` blocks of ``block`` tokens (the last partial)."""
    return min(prompt, blocks * block)


def hit_curve(hashes: list, prompts, block: int, capacities: list[float]) -> list[float]:
    """The share of prompt tokens a cache of each capacity (tokens; inf: no limit) serves,
    replaying the requests in arrival order through one LRU over their blocks: a request's hit
    is its longest leading run of cached blocks, then all its blocks become the most recently
    used (no timing, no eviction of running requests: Mooncake's Figure 9)."""
    total = float(sum(int(p) for p in prompts))
    out = []
    for cap in capacities:
        cache = LRU(math.floor(cap / block) if math.isfinite(cap) else math.inf)
        hit = 0
        for ids, p in zip(hashes, prompts):
            k = 0
            while k < len(ids) and ids[k] in cache:
                k += 1
            hit += block_tokens_of(int(p), k, block)
            for b in ids:
                cache.touch(b)
        out.append(hit / total if total else math.nan)
    return out


@dataclass
class Tier:
    """A tier below the GPU: its capacity in blocks and the speed of loading from it into GPU
    memory (GB/s, the slower of its own link and PCIe) and of writing into it."""
    name: str
    capacity: float  # blocks
    read_gbps: float
    write_gbps: float
    lru: LRU = None  # (made from the capacity)

    def __post_init__(self):
        self.lru = LRU(self.capacity)


@dataclass
class Counts:
    """What a run's prefix cache did, summed over its requests (and replicas)."""
    prompt_tokens: int = 0
    prefilled_tokens: int = 0  # prompt tokens prefilled (recomputed lower-tier hits included)
    hit_tokens: dict = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    recomputed_tokens: int = 0  # lower-tier hits recomputed, quicker than loading them
    loaded_bytes: dict = field(default_factory=lambda: dict.fromkeys(TIERS[1:], 0.0))
    written_bytes: dict = field(default_factory=lambda: dict.fromkeys(TIERS[1:], 0.0))
    evicted_blocks: dict = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    load_seconds: float = 0.0  # link time of the loads (overlapped with prefill)
    write_seconds: float = 0.0  # link time of the write-backs (asynchronous)

    def add(self, other: Counts) -> None:
        self.prompt_tokens += other.prompt_tokens
        self.prefilled_tokens += other.prefilled_tokens
        self.recomputed_tokens += other.recomputed_tokens
        self.load_seconds += other.load_seconds
        self.write_seconds += other.write_seconds
        for mine, theirs in ((self.hit_tokens, other.hit_tokens),
                             (self.loaded_bytes, other.loaded_bytes),
                             (self.written_bytes, other.written_bytes),
                             (self.evicted_blocks, other.evicted_blocks)):
            for k, v in theirs.items():
                mine[k] += v


class PrefixCache:
    """One replica's prefix cache: its GPU tier and the tiers below (``lower``, fastest first;
    a pool tier may be shared with other replicas' caches). ``block``: tokens per block,
    ``block_bytes``: a block's KV bytes on one GPU; ``recompute(tokens, prefix)``: seconds to
    prefill ``tokens`` after ``prefix`` (to weigh a load against)."""

    def __init__(self, block: int, block_bytes: float, lower: list[Tier], recompute):
        self.block, self.block_bytes, self.lower = block, block_bytes, lower
        self.recompute = recompute
        self.gpu = LRU()  # finished requests' blocks, capacity set by free HBM (trim_gpu)
        self.pinned: dict = {}  # block -> running requests holding it
        self.counts = Counts()

    def where(self, block) -> int:
        """The fastest tier holding ``block`` (0: GPU), or -1."""
        if block in self.pinned or block in self.gpu:
            return 0
        for t, tier in enumerate(self.lower, 1):
            if block in tier.lru:
                return t
        return -1

    def match(self, ids) -> int:
        """Leading blocks of ``ids`` this replica's own tiers hold, the pool it shares not
        counted (what a prefix-aware router weighs)."""
        own = [t.lru for t in self.lower if t.name != "pool"]
        k = 0
        for b in ids:
            if not (b in self.pinned or b in self.gpu or any(b in lru for lru in own)):
                break
            k += 1
        return k

    def admit(self, ids, prompt: int) -> tuple[int, float, int]:
        """A request of ``prompt`` tokens and blocks ``ids`` is admitted: (tokens of its hit,
        which it does not prefill; seconds of loading its lower-tier hits; blocks it pins). Its
        hit blocks are pinned (loaded ones too) until :meth:`finish`."""
        c, block = self.counts, self.block
        tiers = []
        for b in ids:
            t = self.where(b)
            if t < 0:
                break
            tiers.append(t)
        hit = min(block_tokens_of(prompt, len(tiers), block), prompt - 1)
        blocks = math.ceil(hit / block) if hit > 0 else 0
        tiers = tiers[:blocks]
        load, loads = 0.0, {}
        for j, t in enumerate(tiers):
            if t > 0:
                tier = self.lower[t - 1]
                tier.lru.touch(ids[j])  # read: the most recently used there too
                loads[tier.name] = loads.get(tier.name, 0.0) + self.block_bytes
                load += self.block_bytes / (tier.read_gbps * 1e9)
        first_lower = next((j for j, t in enumerate(tiers) if t > 0), None)
        if first_lower is not None and load > 0:
            start = block_tokens_of(prompt, first_lower, block)
            if self.recompute(hit - start, start) < load:  # recompute the lower part instead
                c.recomputed_tokens += hit - start
                hit, tiers, load, loads = start, tiers[:first_lower], 0.0, {}
        c.prompt_tokens += prompt
        c.prefilled_tokens += prompt - hit
        for j, t in enumerate(tiers):  # (the last block's tokens: up to the hit)
            c.hit_tokens[TIERS[0] if t == 0 else self.lower[t - 1].name] += \
                min(hit, (j + 1) * block) - min(hit, j * block)
        for name, nbytes in loads.items():
            c.loaded_bytes[name] += nbytes
        c.load_seconds += load
        for b in ids[:len(tiers)]:
            self._pin(b)
        return hit, load, len(tiers)

    def _pin(self, b) -> None:
        self.gpu.remove(b)
        self.pinned[b] = self.pinned.get(b, 0) + 1

    def prefilled(self, ids, pinned: int) -> int:
        """A request that pinned its first ``pinned`` blocks ended its prefill: the rest are in
        GPU memory now, pinned too; the blocks it pins."""
        for b in ids[pinned:]:
            self._pin(b)
        return len(ids)

    def finish(self, ids, pinned: int) -> None:
        """A request that pinned its first ``pinned`` blocks left (done, or preempted): they
        are no longer pinned by it; those no running request holds stay in GPU memory as the
        most recently used."""
        for b in ids[:pinned]:
            n = self.pinned.get(b, 0) - 1
            if n > 0:
                self.pinned[b] = n
            elif n == 0:
                del self.pinned[b]
                self.gpu.touch(b)

    def trim_gpu(self, free_bytes: float) -> None:
        """Keep the GPU tier within the HBM its running requests leave free: the least recently
        used blocks are evicted, each written back to the next tier down."""
        cap = max(0, math.floor(free_bytes / self.block_bytes)) if self.block_bytes > 0 else 0
        evicted = self.gpu.trim(cap)
        self.counts.evicted_blocks["gpu"] += len(evicted)
        self._write_back(evicted, 0)

    def _write_back(self, blocks: list, level: int) -> None:
        """Blocks evicted from tier ``level`` (0: GPU) go to the next tier (written there
        unless it holds them already), whose own evictions go on down (and off the last)."""
        if not blocks or level >= len(self.lower):
            return
        tier, c = self.lower[level], self.counts
        spilled, written = [], 0
        for b in blocks:
            written += b not in tier.lru
            spilled += tier.lru.touch(b)
        nbytes = written * self.block_bytes
        c.evicted_blocks[tier.name] += len(spilled)
        c.written_bytes[tier.name] += nbytes
        c.write_seconds += nbytes / (tier.write_gbps * 1e9)
        self._write_back(spilled, level + 1)


def build(sim, options, block: int, pool: Tier | None = None) -> PrefixCache:
    """A replica's prefix cache for ``sim`` (a :class:`kvsim.sim.engine.Simulator`, per GPU):
    blocks of ``block`` tokens, the tiers ``options`` (:class:`kvsim.sim.records.PrefixCaching`)
    configures, ``pool`` the tier the replicas share (:func:`pool_tier`)."""
    block_bytes = sim.model.kv_bytes_per_token * block
    host = sim.costs.links["h2d"].beta / 1e9  # GB/s: the GPU's host link
    tp = getattr(sim.costs, "tp", 1)
    lower = []
    if options.cache_host_gib:
        lower.append(Tier("host", math.floor(options.cache_host_gib * GiB / block_bytes), host,
                          host))
    if pool is not None:
        lower.append(pool)
    if options.cache_disk_gib:  # the replica's SSD, shared by its TP GPUs
        rate = min(options.cache_disk_gbps / tp, host)
        lower.append(Tier("disk", math.floor(options.cache_disk_gib * GiB / block_bytes), rate,
                          rate))

    def recompute(tokens: int, prefix: int) -> float:
        flops = sim.model.attention_flops(float(tokens), float(prefix))
        return sim.steps.step(0, 0.0, tokens, flops, 1, [float(prefix + tokens)])[0]

    return PrefixCache(block, block_bytes, lower, recompute)


def pool_tier(sim, options, block: int) -> Tier | None:
    """The pool the replicas share (None without one): its capacity in one GPU's blocks (a
    replica's KV is its ``tp`` GPUs' shards, so the pool holds a ``tp``-th as many of them)."""
    if not options.cache_pool_gib:
        return None
    tp = getattr(sim.costs, "tp", 1)
    block_bytes = sim.model.kv_bytes_per_token * block
    rate = min(options.cache_pool_gbps / tp, sim.costs.links["h2d"].beta / 1e9)
    return Tier("pool", math.floor(options.cache_pool_gib * GiB / block_bytes / tp), rate, rate)
