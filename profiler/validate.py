"""``kvsim validate``: real decode loops on the profiled device vs the simulator's prediction.

For each configuration (policy x context x batch) a model-shaped stack with random weights runs
real decode steps on the device:

* ``dense-resident``: every layer's KV in device memory; attention reads all of it.
* ``dense-offload``: every layer's KV in host memory (pinned on CUDA); each step streams it layer
  by layer into two staging buffers (double buffering: layer l+1 copies while layer l computes),
  one copy per sequence for K and one for V, as the policy's cost model says. On CUDA the copies
  run on a copy stream ordered by events; on the CPU a second thread does them with a
  single-threaded memcpy while the main thread computes.

* ``verkv``: every layer's full KV in host memory; per layer and sequence a real VerKV decide
  pipeline (``profiler.kernels.VerKVData.plan``) on a synthetic attention layer of the model's
  head shape, a real gather of the fetched K and V rows from that layer's host KV (a device
  gather over pinned memory on CUDA), attention over the resident sample + fetched rows with
  VerKV's reweighting. The simulator is given the same synthetic layer (with the profile's
  hardware) so its VerKV statistics describe what the loop fetches. The shortlisted keys the
  decide step scores are read from device memory here, while the simulator charges them to
  the link (a few percent of the fetched bytes).

The loop attends over a fixed context (the new token's K/V is computed but not appended); the
simulator is asked for the same context (``context - output_len / 2`` so its growing context
averages to it). Measured TPOT is the median wall time of a step (synchronised at its end);
predicted TPOT is ``run_replay``'s on the same model shape, batch and context, from the profile.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from kvsim import trace as tracefile
from kvsim.errors import KvsimError
from kvsim.hw.catalog import ModelSpec
from profiler import kernels as K
from profiler.backend import Backend, is_oom, make_backend, runqueue_wait

POLICIES = ("dense-resident", "dense-offload", "verkv")
SIM_OUTPUT_LEN = 8
CPU_LAYERS = 12  # default depth of the CPU validation stack
VERKV_DEFAULT_MAX_CONTEXT = 16384


@dataclass
class Stack:
    """Weights of a model-shaped stack on the device."""
    m: ModelSpec
    layers: list
    head: torch.Tensor
    ln_f: torch.Tensor


def build_stack(be: Backend, m: ModelSpec, seed: int) -> Stack:
    gen = torch.Generator().manual_seed(seed)
    layers = [K.make_layer(m, be, gen) for _ in range(m.layers)]
    return Stack(m, layers, K.make_head(m, be, gen),
                 torch.ones(m.hidden, device=be.device, dtype=be.dtype))


class KVStore:
    """KV of every layer for up to ``max_tokens`` tokens (batch x context), device or host."""

    def __init__(self, be: Backend, m: ModelSpec, max_tokens: int, where: str):
        self.m, self.per_tok = m, m.kv_heads * m.head_dim
        n = max_tokens * self.per_tok
        dev = be.device if where == "device" else torch.device("cpu")
        pin = where == "host" and be.kind == "cuda"
        self.k = [torch.empty(n, dtype=be.dtype, device=dev, pin_memory=pin)
                  for _ in range(m.layers)]
        self.v = [torch.empty(n, dtype=be.dtype, device=dev, pin_memory=pin)
                  for _ in range(m.layers)]
        fill = torch.empty(n, dtype=be.dtype, device=be.device).uniform_(-1, 1)
        for t in self.k + self.v:  # small values (garbage could hold NaN or denormals)
            t.copy_(fill)

    def view(self, t: torch.Tensor, B: int, n: int) -> torch.Tensor:
        return t[:B * n * self.per_tok].view(B, self.m.kv_heads, n, self.m.head_dim)


def _layer(st: Stack, l: int, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    W = st.layers[l]
    q, _, _ = K.layer_pre(x, W, st.m)
    return K.layer_post(x, K.attend(q, k, v), W)


def _head(st: Stack, x: torch.Tensor) -> torch.Tensor:
    return K.lm_head(x, st.head, st.ln_f).argmax(-1)


def resident_step(be, st: Stack, kv: KVStore, B: int, n: int):
    views = [(kv.view(kv.k[l], B, n), kv.view(kv.v[l], B, n)) for l in range(st.m.layers)]
    x0 = torch.randn(B, st.m.hidden).to(be.device, be.dtype)

    def step():
        x = x0
        for l, (k, v) in enumerate(views):
            x = _layer(st, l, x, k, v)
        return _head(st, x)
    return step, lambda: None


def offload_step(be, st: Stack, host: KVStore, B: int, n: int):
    """Layer-wise double buffering from host KV into two device staging buffers."""
    m = st.m
    shape = (B, m.kv_heads, n, m.head_dim)
    stage = [(torch.empty(shape, device=be.device, dtype=be.dtype),
              torch.empty(shape, device=be.device, dtype=be.dtype)) for _ in range(2)]
    src = [(host.view(host.k[l], B, n), host.view(host.v[l], B, n)) for l in range(m.layers)]
    x0 = torch.randn(B, m.hidden).to(be.device, be.dtype)
    L = m.layers

    def copy_layer(l: int, slot: int) -> None:  # one copy per sequence for K and for V
        (ks, vs), (kd, vd) = src[l], stage[slot]
        for b in range(B):
            be.copy(kd[b], ks[b])
            be.copy(vd[b], vs[b])

    if be.kind == "cuda":
        cs = torch.cuda.Stream(be.device)
        ready = [torch.cuda.Event(), torch.cuda.Event()]
        free = [torch.cuda.Event(), torch.cuda.Event()]

        def issue(l):
            slot = l % 2
            with torch.cuda.stream(cs):
                cs.wait_event(free[slot])  # the compute that last read this slot is done
                copy_layer(l, slot)
                ready[slot].record(cs)

        def step():
            x = x0
            issue(0)
            for l in range(L):
                if l + 1 < L:
                    issue(l + 1)
                torch.cuda.current_stream().wait_event(ready[l % 2])
                x = _layer(st, l, x, *stage[l % 2])
                free[l % 2].record()
            return _head(st, x)
        return step, lambda: None

    pool = ThreadPoolExecutor(1, thread_name_prefix="copy-engine")

    def step():
        x = x0
        fut = pool.submit(copy_layer, 0, 0)
        for l in range(L):
            fut.result()  # layer l is in slot l % 2
            if l + 1 < L:  # slot (l + 1) % 2 was read by layer l - 1, which has finished
                fut = pool.submit(copy_layer, l + 1, (l + 1) % 2)
            x = _layer(st, l, x, *stage[l % 2])
        return _head(st, x)
    return step, pool.shutdown


def measure(be: Backend, step, warmup: int, steps: int) -> list[tuple[float, float | None]]:
    """(wall seconds, seconds the main thread waited for a core) per timed step."""
    out = []
    with torch.inference_mode():
        for i in range(warmup + steps):
            be.sync()
            w0 = runqueue_wait()
            t0 = time.perf_counter()
            step()
            be.sync()
            t = time.perf_counter() - t0
            w1 = runqueue_wait()
            if i >= warmup:
                out.append((t, None if w0 is None or w1 is None else w1 - w0))
    return out


def verkv_step(be, st: Stack, host: KVStore, B: int, n: int, vk: K.VerKVData):
    """Per layer: projections, one real decide per sequence, a real gather of the fetched K and
    V rows from the layer's host KV (over the link: pinned memory read by a device gather on
    CUDA), attention over resident + fetched rows with VerKV's reweighting, MLP."""
    from profiler.link import uva_view
    m = st.m
    L, g, T = m.layers, m.q_heads // m.kv_heads, vk.t_max
    rows = lambda t: t[:B * n * host.per_tok].view(B, m.kv_heads * n, m.head_dim)  # noqa: E731
    src = [(uva_view(be, rows(host.k[l])), uva_view(be, rows(host.v[l]))) for l in range(L)]
    # per layer: the resident sample (filled once) with room for the fetched rows behind it
    comp = [tuple(torch.empty(B, m.kv_heads, T, m.head_dim, device=be.device,
                              dtype=be.dtype).uniform_(-1, 1) for _ in range(2))
            for _ in range(L)]
    x0 = torch.randn(B, m.hidden).to(be.device, be.dtype)
    res = vk.resident.tolist()

    def step():
        x = x0
        for l in range(L):
            kc, vc = comp[l]
            W = st.layers[l]
            q, _, _ = K.layer_pre(x, W, m)
            biases = []
            for b in range(B):
                idx, slot, bias, counts = vk.plan()
                ks, vs = src[l]
                if be.kind == "cuda":  # one gather over the link, then a device-local scatter
                    kc[b].view(-1, m.head_dim).index_copy_(0, slot, ks[b].index_select(0, idx))
                    vc[b].view(-1, m.head_dim).index_copy_(0, slot, vs[b].index_select(0, idx))
                else:  # per KV head straight into place: the scatter would cost as much here
                    for h, ih in enumerate(idx.split(counts.tolist())):
                        r = res[h]
                        torch.index_select(ks[b], 0, ih, out=kc[b, h, r:r + ih.numel()])
                        torch.index_select(vs[b], 0, ih, out=vc[b, h, r:r + ih.numel()])
                biases.append(bias)
            mask = torch.stack(biases).to(be.dtype)
            a = F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask).reshape(B, -1)
            x = K.layer_post(x, a, W)
        return _head(st, x)
    return step, lambda: None


def _loadavg() -> list[float] | None:
    try:
        return [float(x) for x in open("/proc/loadavg").read().split()[:3]]
    except (OSError, ValueError):
        return None


def predict(profile: Path, policy: str, m: ModelSpec, n: int, B: int, seed: int) -> dict:
    from kvsim.replay import ReplayConfig, run_replay
    cfg = ReplayConfig(trace=profile, policy=policy, gpu=None, model=m,
                       context=max(n - SIM_OUTPUT_LEN // 2, 1), batch=B, concurrency=B,
                       requests=B, output_len=SIM_OUTPUT_LEN, seed=seed)
    return run_replay(cfg)


def default_grid(be: Backend, hw) -> tuple[list[int], list[int]]:
    """Contexts and batches inside the profiled attention table (no extrapolation)."""
    t = hw.tables["kernel_decode_attn"]
    if be.kind == "cuda":
        ctx, bat = [4096, 16384, 32768], [1, 4, 8]
    else:
        ctx, bat = [1024, 4096], [1, 4]
    ok = lambda n, b: (t["context"].min() <= n and n * b <= t["tokens"].max()  # noqa: E731
                       and b <= hw.tables["kernel_gemm"]["batch"].max())
    ctx = [n for n in ctx if any(ok(n, b) for b in bat)]
    bat = [b for b in bat if any(ok(n, b) for n in ctx)]
    return ctx, bat


def validate(profile: str | Path | None = None, gpu: int | None = None,
             device: str | None = None, contexts: list[int] | None = None,
             batches: list[int] | None = None, layers: int | None = None,
             policies: tuple[str, ...] | None = None, steps: int | None = None, warmup: int = 2,
             threads: int | None = None, save_profile: str | Path | None = None,
             seed: int = 0, progress: bool = True, rounds: int | None = None) -> dict:
    t_start = time.perf_counter()
    notes = []
    if device == "cpu" and threads is None:
        threads = 1  # as in the CPU profile: one core computes, the copy thread uses another
    tmpdir = None
    if profile is None:
        from profiler.run import profile as run_profile
        if save_profile is None:
            tmpdir = tempfile.TemporaryDirectory(prefix="kvsim-validate-")
            save_profile = Path(tmpdir.name) / "profile.npz"
        run_profile(save_profile, gpu=gpu, device=device, quick=True, threads=threads,
                    progress=progress, seed=seed)
        profile = Path(save_profile)
        where = profile if tmpdir is None else "a temporary file"
        notes.append(f"profiled first (--quick) into {where}")
    try:
        return _validate(Path(profile), gpu, device, contexts, batches, layers, policies, steps,
                         warmup, threads, seed, progress, notes, t_start, rounds)
    finally:
        if tmpdir is not None:
            tmpdir.cleanup()


def _validate(profile, gpu, device, contexts, batches, layers, policies, steps, warmup, threads,
              seed, progress, notes, t_start, rounds) -> dict:
    tr = tracefile.load(profile)
    hw = tr.hardware
    if hw is None:
        raise KvsimError(f"{profile}: no hardware section; make one with kvsim profile")
    be = make_backend(gpu, device, threads)
    if hw.device.get("kind") != be.kind:
        raise KvsimError(f"{profile} was profiled on {hw.device.get('name')!r} "
                         f"({hw.device.get('kind')}); validate it on that device")
    if be.kind == "cpu" and hw.extra.get("threads") not in (None, be.threads):
        notes.append(f"profile measured with {hw.extra.get('threads')} threads, "
                     f"validating with {be.threads}")
    try:
        m = ModelSpec(**hw.extra["model"])
    except (KeyError, TypeError) as e:
        raise KvsimError(f"{profile}: hardware section lacks the profiled model shape ({e})") \
            from None
    if m.dtype_bytes != be.dtype_bytes:
        raise KvsimError(f"{profile}: profiled with {m.dtype_bytes}-byte values, this device "
                         f"runs {be.dtype_bytes}-byte values")
    if layers is None:  # the CPU runs a shorter stack (per-layer costs do not depend on depth)
        layers = m.layers if be.kind == "cuda" else min(m.layers, CPU_LAYERS)
    m = dataclasses.replace(m, name=f"{m.name} (validation stack, {layers} layers)",
                            layers=layers)
    dc, db = default_grid(be, hw)
    given_contexts = contexts
    contexts, batches = contexts or dc, batches or db
    if not contexts or not batches:
        raise KvsimError(f"{profile}: its attention table is too small for any validation "
                         "configuration; pass --contexts and --batches")
    steps = steps or (6 if be.kind == "cuda" else 3)
    policies = tuple(policies or POLICIES)
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise KvsimError(f"validate runs {', '.join(POLICIES)}; not {', '.join(unknown)}")
    explicit = given_contexts is not None
    configs = [(p, n, b) for p in policies for n in contexts for b in batches
               if p != "verkv" or explicit or n <= VERKV_DEFAULT_MAX_CONTEXT]
    if not explicit and any(n > VERKV_DEFAULT_MAX_CONTEXT for n in contexts) \
            and "verkv" in policies:
        notes.append(f"verkv runs at contexts <= {VERKV_DEFAULT_MAX_CONTEXT} by default (its "
                     "synthetic layer and the simulator's VerKV analysis take minutes beyond); "
                     "pass --contexts to choose")
    vk: dict[int, K.VerKVData] = {}
    if "verkv" in policies:
        for n in dict.fromkeys(c[1] for c in configs if c[0] == "verkv"):
            try:
                with torch.inference_mode():
                    vk[n] = K.VerKVData(be, m, n, seed)
            except KvsimError as e:  # a context too short for VerKV's budget
                notes.append(f"verkv skipped at context {n}: {e}")
        configs = [c for c in configs if c[0] != "verkv" or c[1] in vk]
    if not configs:
        raise KvsimError("no configuration left to validate")
    max_tok = max(n * b for _, n, b in configs)
    rounds = rounds or (1 if be.kind == "cuda" else 3)
    times: dict = {c: [] for c in configs}
    bar = tqdm(total=len(configs) * rounds, desc=f"validate {be.kind}", unit="cfg",
               disable=not progress, leave=False)
    try:
        with torch.inference_mode():
            st = build_stack(be, m, seed)
        stores = {}
        for where in dict.fromkeys("device" if p == "dense-resident" else "host"
                                   for p, _, _ in configs):
            try:
                with torch.inference_mode():
                    stores[where] = KVStore(be, m, max_tok, where)
            except Exception as e:  # noqa: BLE001
                if not is_oom(e):
                    raise
                be.free()
                raise KvsimError(f"validate: the KV of {max_tok} tokens x {m.layers} layers "
                                 f"does not fit in {where} memory; pass smaller --contexts, "
                                 "--batches or --layers") from None
        # rounds interleave the configurations, so a burst of load from other processes
        # does not land on one configuration only
        for _ in range(rounds):
            for policy, n, B in configs:
                bar.set_postfix_str(f"{policy} n={n} B={B}")
                with torch.inference_mode():
                    if policy == "dense-resident":
                        step, close = resident_step(be, st, stores["device"], B, n)
                    elif policy == "dense-offload":
                        step, close = offload_step(be, st, stores["host"], B, n)
                    else:
                        step, close = verkv_step(be, st, stores["host"], B, n, vk[n])
                    try:
                        times[(policy, n, B)] += measure(be, step, warmup, steps)
                    finally:
                        close()
                bar.update(1)
        del stores
        be.free()
    finally:
        bar.close()
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvsim-validate-") as tmp:
        traces = {}
        for n, d in vk.items():  # the profile's hardware + the layer VerKV decided on
            traces[n] = Path(tmp) / f"verkv-{n}.npz"
            tracefile.save(tracefile.Trace(
                tracefile.new_meta("kvsim validate", model=m.name, context=n,
                                   notes="profile hardware + synthetic attention layer"),
                hardware=hw, attention=d.trace.attention), traces[n])
        preds = {c: predict(traces[c[1]] if c[0] == "verkv" else profile, *c[:1], m, c[1], c[2],
                            seed) for c in times}
    for (policy, n, B), samples in times.items():
        pred = preds[(policy, n, B)]
        ts = np.array([t for t, _ in samples])
        meas = float(np.median(ts)) * 1e3
        row = {
            "policy": policy, "context": n, "batch": B,
            "measured_tpot_ms": meas,
            "measured_tpot_mean_ms": float(np.mean(ts)) * 1e3,
            "measured_tpot_min_ms": float(np.min(ts)) * 1e3,
            "predicted_tpot_ms": pred["tpot_ms"],
            "error_pct": 100.0 * (pred["tpot_ms"] - meas) / meas,
            "predicted_warnings": pred.get("warnings", []),
        }
        if policy == "verkv":
            row["loop_fetched_frac"] = vk[n].fetched_frac
            row["predicted_kv_read_frac"] = pred.get("kv_read_frac")
        waits = [w for _, w in samples if w is not None]
        if len(waits) == len(samples):  # other processes' share of the cores, made visible
            excl = float(np.median(ts - np.array(waits))) * 1e3
            row |= {"runqueue_wait_ms": float(np.median(waits)) * 1e3,
                    "measured_excl_wait_ms": excl,
                    "error_excl_wait_pct": 100.0 * (pred["tpot_ms"] - excl) / excl}
        rows.append(row)
    mape = float(np.mean([abs(r["error_pct"]) for r in rows]))
    extra = {}
    if all("error_excl_wait_pct" in r for r in rows):
        extra["mape_excl_wait"] = float(np.mean([abs(r["error_excl_wait_pct"]) for r in rows]))
        share = np.mean([r["runqueue_wait_ms"] / r["measured_tpot_ms"] for r in rows])
        extra["runqueue_wait_share"] = float(share)
        if share > 0.05:
            notes.append(f"the main thread waited for a core {share:.0%} of each step on "
                         "average (other processes share this machine); mape_excl_wait "
                         "removes that wait from the measured steps (the copy thread's own "
                         "waits still count)")
    by_policy = {p: float(np.mean([abs(r["error_pct"]) for r in rows if r["policy"] == p]))
                 for p in dict.fromkeys(r["policy"] for r in rows)}
    return {
        "device": hw.device.get("name"), "kind": be.kind, "profile": str(profile),
        "profile_provenance": hw.provenance, "model": m.name,
        "model_shape": {k: getattr(m, k) for k in ("layers", "q_heads", "kv_heads", "head_dim",
                                                    "hidden", "intermediate", "vocab",
                                                    "dtype_bytes")},
        "threads": be.threads, "steps": steps, "warmup": warmup, "rounds": rounds,
        "mape": mape, "mape_by_policy": by_policy, **extra, "n_configs": len(rows),
        "configs": rows, "load_avg": _loadavg(),
        "notes": notes, "wall_s": time.perf_counter() - t_start,
    }
