"""A model-shaped decode layer (random weights) and the kernel sweeps built on it.

The same functions run in ``kvsim profile`` (timed one by one) and in ``kvsim validate`` (chained
into real decode steps), so the profile measures exactly the work the validation loop does:

* ``layer_pre`` + ``layer_post``: RMSNorm, QKV projection, output projection, residual, RMSNorm,
  gated MLP: the table ``kernel_gemm`` (seconds per layer vs batch);
* ``attend``: decode attention of one query token per sequence over its KV (GQA): the table
  ``kernel_decode_attn`` (seconds per layer vs KV tokens read over the batch);
* ``lm_head``: final norm + vocabulary projection (``kernel_lm_head``; the simulator charges the
  head from the measured ``hbm_bw`` and ``flops``, which ``sweep_roofline`` measures).

RoPE on one new token per sequence is omitted (a few elementwise ops on B x heads x d values).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from kvsim.errors import KvsimError
from kvsim.hw.catalog import ModelSpec
from profiler.backend import Backend, is_oom


@dataclass
class LayerWeights:
    ln1: torch.Tensor
    wqkv: torch.Tensor  # (hidden, (q + 2 kv) * d)
    wo: torch.Tensor  # (q * d, hidden)
    ln2: torch.Tensor
    wgu: torch.Tensor  # (hidden, 2 * intermediate)
    wd: torch.Tensor  # (intermediate, hidden)


def _randn(be: Backend, shape, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    """Random values made on the device itself (a CPU generator feeding a GPU would take
    minutes for a 4B-parameter stack); ``gen`` seeds a device generator."""
    dgen = torch.Generator(device=be.device).manual_seed(
        int(torch.randint(0, 2**62, (1,), generator=gen)))
    t = torch.empty(shape, device=be.device, dtype=torch.float32 if be.kind == "cpu" else be.dtype)
    return t.normal_(0.0, scale, generator=dgen).to(be.dtype)


def make_layer(m: ModelSpec, be: Backend, gen: torch.Generator) -> LayerWeights:
    def w(*shape):
        return _randn(be, shape, gen, shape[0] ** -0.5)
    h, d = m.hidden, m.head_dim
    ones = lambda: torch.ones(h, device=be.device, dtype=be.dtype)  # noqa: E731
    return LayerWeights(ones(), w(h, (m.q_heads + 2 * m.kv_heads) * d), w(m.q_heads * d, h),
                        ones(), w(h, 2 * m.intermediate), w(m.intermediate, h))


def make_head(m: ModelSpec, be: Backend, gen: torch.Generator) -> torch.Tensor:
    """The (vocab, hidden) output embedding."""
    return _randn(be, (m.vocab, m.hidden), gen, m.hidden ** -0.5)


def rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def layer_pre(x: torch.Tensor, W: LayerWeights, m: ModelSpec):
    """(B, hidden) -> q (B, kv, q/kv, d), new k and v (B, kv, 1, d)."""
    B, d = x.shape[0], m.head_dim
    qkv = rms_norm(x, W.ln1) @ W.wqkv
    q, k, v = qkv.split([m.q_heads * d, m.kv_heads * d, m.kv_heads * d], dim=-1)
    g = m.q_heads // m.kv_heads
    return (q.view(B, m.kv_heads, g, d), k.view(B, m.kv_heads, 1, d),
            v.view(B, m.kv_heads, 1, d))


def attend(q: torch.Tensor, K: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
    """Decode attention: q (B, kv, g, d) over K, V (B, kv, n, d) -> (B, kv * g * d).

    The g query heads that share a KV head form the query rows of one attention call, so each
    KV head is read once (GQA) by the fused SDPA kernel."""
    return F.scaled_dot_product_attention(q, K, V).reshape(q.shape[0], -1)


def layer_post(x: torch.Tensor, a: torch.Tensor, W: LayerWeights) -> torch.Tensor:
    x = x + a @ W.wo
    g, u = (rms_norm(x, W.ln2) @ W.wgu).chunk(2, dim=-1)
    return x + (F.silu(g) * u) @ W.wd


def lm_head(x: torch.Tensor, head: torch.Tensor, ln: torch.Tensor) -> torch.Tensor:
    """Logits (B, vocab). Computed as head @ h^T: the weight-streaming (GEMV-like) layout, which
    CPU BLAS runs up to 2x faster than h @ head^T at small batches; cuBLAS runs both alike."""
    return (head @ rms_norm(x, ln).T).T


# ------------------------------------------------------------------------------------ sweeps

def _x(be: Backend, B: int, m: ModelSpec, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(B, m.hidden, generator=gen).to(device=be.device, dtype=be.dtype)


def _layer_bytes(m: ModelSpec, be: Backend) -> int:
    return m.layer_params * be.dtype_bytes


def sweep_gemm(be: Backend, m: ModelSpec, batches: list[int], progress, seed=0) -> dict:
    """kernel_gemm: one layer's projections and MLP (everything but attention) vs batch.

    Calls rotate over enough layers' weights to exceed the last-level cache, as in a real step."""
    gen = torch.Generator().manual_seed(seed)
    n_sets = int(min(max(-(-be.flush_bytes // _layer_bytes(m, be)), 2), 16))
    Ws = [make_layer(m, be, gen) for _ in range(n_sets)]
    xs, ts = [], []
    with torch.inference_mode():
        for B in batches:
            x = _x(be, B, m, gen)
            a = torch.randn(B, m.q_heads * m.head_dim, generator=gen).to(be.device, be.dtype)

            def one(W):
                layer_pre(x, W, m)
                layer_post(x, a, W)
            try:
                ts.append(be.time(_cycle([lambda W=W: one(W) for W in Ws]), warmup=n_sets,
                                  repeats=30, target_s=0.05, max_repeats=max(30, 2 * n_sets)))
                xs.append(B)
            except Exception as e:
                if not is_oom(e):
                    raise
                be.free()
                be.shrunk.append(f"kernel_gemm: out of memory at batch {B}; stopped there")
                break
            progress()
    return {"kernel_gemm": {"batch": np.array(xs, np.int64), "seconds": np.array(ts)}}


def _cycle(fns: list):
    state = [0]

    def fn():
        f = fns[state[0] % len(fns)]
        state[0] += 1
        return f()
    return fn


def _kv_buffer(be: Backend, tokens: int, per_tok: int, what: str):
    """K and V buffers of ``tokens`` tokens (halving on OOM, recorded), filled with small values."""
    cap = tokens
    while cap >= 256:
        try:
            K = be.alloc(cap * per_tok).uniform_(-1, 1)
            V = be.alloc(cap * per_tok).uniform_(-1, 1)
            if cap < tokens:
                be.shrunk.append(f"{what}: out of memory at {tokens} KV tokens; using {cap}")
            return K, V, cap
        except Exception as e:
            if not is_oom(e):
                raise
            be.free()
            cap //= 2
    raise MemoryError(f"{what}: out of memory even at 256 KV tokens")


def sweep_attention(be: Backend, m: ModelSpec, contexts: list[int], batches: list[int],
                    max_tokens: int, progress, seed=0) -> dict:
    """kernel_decode_attn: decode attention of one layer vs context x batch (tokens = B * n).

    One buffer holds the largest point (or the cache-flushing working set if larger); smaller
    points rotate over disjoint slices of it."""
    gen = torch.Generator().manual_seed(seed)
    per_tok = m.kv_heads * m.head_dim
    flush_tok = be.flush_bytes // (2 * per_tok * be.dtype_bytes)
    K, V, cap = _kv_buffer(be, max(max_tokens, flush_tok), per_tok, "kernel_decode_attn")
    if cap < max_tokens:
        be.shrunk.append(f"kernel_decode_attn: measured up to {cap} KV tokens, "
                         f"not {max_tokens}")
    rows = {k: [] for k in ("context", "batch", "tokens", "seconds")}
    g = m.q_heads // m.kv_heads
    with torch.inference_mode():
        for n in contexts:
            for B in batches:
                tok = B * n
                if tok > min(cap, max_tokens):
                    continue
                q = torch.randn(B, m.kv_heads, g, m.head_dim, generator=gen).to(be.device,
                                                                                 be.dtype)
                views = []
                for i in range(max(1, min(8, cap // tok))):
                    sl = slice(i * tok * per_tok, (i + 1) * tok * per_tok)
                    views.append((K[sl].view(B, m.kv_heads, n, m.head_dim),
                                  V[sl].view(B, m.kv_heads, n, m.head_dim)))
                t = be.time(_cycle([lambda k=k, v=v: attend(q, k, v) for k, v in views]),
                            warmup=len(views), repeats=30, target_s=0.04,
                            max_repeats=max(30, 2 * len(views)))
                for key, val in zip(rows, (n, B, tok, t)):
                    rows[key].append(val)
                progress()
    del K, V
    return {"kernel_decode_attn": {k: np.array(v, np.float64 if k == "seconds" else np.int64)
                                   for k, v in rows.items()}}


def sweep_head(be: Backend, m: ModelSpec, batches: list[int], progress, seed=0) -> dict:
    """kernel_lm_head: final norm + vocabulary projection vs batch (for reference)."""
    gen = torch.Generator().manual_seed(seed)
    head = make_head(m, be, gen)
    ln = torch.ones(m.hidden, device=be.device, dtype=be.dtype)
    xs, ts = [], []
    with torch.inference_mode():
        for B in batches:
            x = _x(be, B, m, gen)
            ts.append(be.time(lambda: lm_head(x, head, ln), warmup=2, repeats=20, target_s=0.04))
            xs.append(B)
            progress()
    return {"kernel_lm_head": {"batch": np.array(xs, np.int64), "seconds": np.array(ts)}}


def sweep_roofline(be: Backend, mem_sizes: list[int], mm_sizes: list[int], progress,
                   seed=0) -> tuple[dict, dict]:
    """Achievable memory bandwidth and matmul throughput.

    ``mem_gemv``: a (rows, 4096) matrix times one vector: the weight-streaming pattern of decode
    (``gemv_bw``: its bytes / seconds at the largest sizes). ``mem_copy``: device-to-device copy
    (bytes moved = 2 x size). ``kernel_matmul``: square n x n x n matmul (flops = 2 n^3 / s).
    """
    gen = torch.Generator().manual_seed(seed)
    esz = be.dtype_bytes
    gemv = {"bytes": [], "seconds": []}
    copy = {"bytes": [], "seconds": []}
    with torch.inference_mode():
        for nbytes in mem_sizes:
            cols = 4096
            rows = max(nbytes // (cols * esz), 1)
            try:
                A = be.alloc(rows * cols).uniform_(-1, 1).view(rows, cols)
                x = torch.randn(cols, 1, generator=gen).to(be.device, be.dtype)
                B = torch.empty_like(A)
            except Exception as e:
                if not is_oom(e):
                    raise
                be.free()
                be.shrunk.append(f"mem_gemv: out of memory at {nbytes} bytes; stopped there")
                break
            gemv["seconds"].append(be.time(lambda: A @ x, warmup=2, repeats=20, target_s=0.04))
            gemv["bytes"].append(A.numel() * esz)
            copy["seconds"].append(be.time(lambda: B.copy_(A), warmup=2, repeats=20,
                                           target_s=0.04))
            copy["bytes"].append(2 * A.numel() * esz)
            A = B = None  # frees them before the next size
            progress()
        mm = {"n": [], "seconds": [], "flops": []}
        for n in mm_sizes:
            a = torch.randn(n, n, generator=gen).to(be.device, be.dtype)
            b = torch.randn(n, n, generator=gen).to(be.device, be.dtype)
            t = be.time(lambda: a @ b, warmup=2, repeats=10, target_s=0.1)
            mm["n"].append(n)
            mm["seconds"].append(t)
            mm["flops"].append(2.0 * n ** 3 / t)
            progress()
    tabs = {"mem_gemv": gemv, "mem_copy": copy, "kernel_matmul": mm}
    tabs = {k: {c: np.array(v, np.int64 if c in ("bytes", "n") else np.float64)
                for c, v in t.items()} for k, t in tabs.items()}
    extra = {"flops": float(tabs["kernel_matmul"]["flops"].max())}
    g, c = tabs["mem_gemv"], tabs["mem_copy"]
    if len(g["bytes"]):
        big = g["bytes"] >= g["bytes"].max() / 4  # the sizes that are no longer cache-resident
        extra["gemv_bw"] = float(np.median((g["bytes"] / g["seconds"])[big]))
        extra["mem_copy_bw"] = float((c["bytes"] / c["seconds"]).max())
    return tabs, extra


def stacked_model(m: ModelSpec, batch: int) -> ModelSpec:
    """The head shape of ``batch`` requests stacked along the head axis (one layer, one call)."""
    if batch == 1:
        return m
    return dataclasses.replace(m, name=f"{m.name} x{batch} requests stacked",
                               q_heads=batch * m.q_heads, kv_heads=batch * m.kv_heads)


def _decide_kernel(be: Backend, m: ModelSpec, n: int, B: int, seed: int, bench, base: dict,
                   keep: dict | None):
    """The kernel deciding ``B`` requests at context ``n``: a kernel's own ``stack(B)`` when it
    has one (requests generated once per context), else the bench on the stacked head shape.
    ``base`` holds the single-request kernel of this context; ``keep`` every kernel made (kept
    across rounds), or None."""
    if keep is not None and (n, B) in keep:
        return keep[n, B]
    if "one" not in base:
        base["one"] = keep.get((n, 1)) if keep is not None else None
        if base["one"] is None:
            base["one"] = bench(be.device, m, n, seed)
    one = base["one"]
    if B == 1:
        vk = one
    elif hasattr(one, "stack"):
        vk = one.stack(B)
    else:
        vk = bench(be.device, stacked_model(m, B), n, seed)
    if keep is not None:
        keep[n, B] = vk
    return vk


def sweep_decide(be: Backend, m: ModelSpec, contexts: list[int], batches: list[int], progress,
                 bench, table: str, seed=0, keep: dict | None = None) -> tuple[dict, list[str]]:
    """The table ``table``: one policy's decide step for one layer vs context x batch;
    ``seconds`` is one call that decides all ``batch`` requests together.

    ``bench(device, model, context, seed)`` builds the kernel for one request (an object with
    ``plan()``, the timed call, and ``fetched_frac``); the caller hands it in (``kvsim profile``
    gives each fetching policy's ``decide_kernel``), so the profiler times it without depending
    on policies. A batch of ``B`` is one layer with ``B`` times the heads (the requests stacked
    along the head axis): the kernel's ``stack(B)`` if it has one, else ``bench`` called with
    that head shape. Batches run largest first at each context; one that runs out of memory is
    recorded in ``shrunk`` and the smaller ones are still measured. ``keep``: a dict that holds
    the kernels between calls (rounds), so each is generated once."""
    points, missing = [], []
    evict = be.evictor()
    cap = max(batches)  # batches above an out-of-memory point are not tried again
    with torch.inference_mode():
        for n in contexts:
            base: dict = {}
            todo = sorted((B for B in set(batches) if B <= cap), reverse=True)
            progress_left = len(batches)
            for B in todo:
                try:
                    vk = _decide_kernel(be, m, n, B, seed, bench, base, keep)
                    # caches evicted before each call: in a decode step the layer's weights,
                    # KV and activations pass through the caches between two decide calls
                    t = be.time(vk.plan, warmup=2, repeats=10, target_s=0.1, before=evict)
                except KvsimError as e:  # e.g. the policy's budget does not fit this context
                    missing.append(f"{table} at context {n}: {e}")
                    break
                except Exception as e:
                    if not is_oom(e):
                        raise
                    vk = None
                    be.free()
                    cap = min(cap, B - 1)
                    be.shrunk.append(f"{table}: out of memory at context {n}, batch {B}; "
                                     f"batches above {cap} skipped from there")
                else:
                    points.append((n, B, t, vk.fetched_frac))
                del vk
                progress()
                progress_left -= 1
            base.clear()
            for _ in range(progress_left):
                progress()
            if cap < min(batches):
                break
    if not points:
        return {}, missing + [f"{table} (no context could be measured)"]
    points.sort()
    cols = list(zip(*points))
    return {table: {"context": np.array(cols[0], np.int64),
                    "batch": np.array(cols[1], np.int64),
                    "seconds": np.array(cols[2], np.float64),
                    "fetched_frac": np.array(cols[3], np.float64)}}, missing
