"""Real decode steps of a model-shaped stack (random weights) on a device, built from a policy's
decode cost: the loops ``kvsim validate`` times.

* :func:`resident_step`: every layer attends over the tokens the policy keeps in device memory;
* :func:`offload_step`: every layer's share of the KV streams from host memory into two staging
  buffers (double buffering: layer l+1 copies while layer l computes). On CUDA the copies run on a
  copy stream ordered by events; on the CPU a second thread does them with a single-threaded
  memcpy while the main thread computes;
* :func:`decide_step`: per layer and sequence a real decide (the policy's decide kernel on a
  synthetic attention layer), a real gather of the fetched rows, attention with the policy's
  reweighting.

The layer kernels are the profiler's (``profiler.kernels``), so the profile measured exactly the
work these loops do.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvsim.hw.catalog import ModelSpec
from profiler import kernels as K
from profiler.backend import Backend, runqueue_wait


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
    """Every layer attends over ``n`` tokens per sequence held in device memory."""
    views = [(kv.view(kv.k[l], B, n), kv.view(kv.v[l], B, n)) for l in range(st.m.layers)]
    x0 = torch.randn(B, st.m.hidden).to(be.device, be.dtype)

    def step():
        x = x0
        for l, (k, v) in enumerate(views):
            x = _layer(st, l, x, k, v)
        return _head(st, x)
    return step, lambda: None


def offload_step(be, st: Stack, host: KVStore, B: int, n: int):
    """Layer-wise double buffering of ``n`` tokens per sequence from host KV into two device
    staging buffers, one copy per sequence for K and one for V."""
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


def decide_step(be, st: Stack, host: KVStore, B: int, n: int, vk):
    """Per layer: projections, one real decide for the batch (``vk.stack(B).plan()``, a policy's
    decide kernel over the batch's requests stacked along the head axis), per sequence a real
    gather of its fetched K and V rows from the layer's host KV (over the link: pinned memory read
    by a device gather on CUDA), attention over resident + fetched rows with the policy's
    reweighting, MLP."""
    from profiler.link import uva_view
    m = st.m
    vk = vk.stack(B) if B > 1 else vk  # built before the timed steps
    L, T, H = m.layers, vk.t_max, m.kv_heads
    rows = lambda t: t[:B * n * host.per_tok].view(B, m.kv_heads * n, m.head_dim)  # noqa: E731
    src = [(uva_view(be, rows(host.k[l])), uva_view(be, rows(host.v[l]))) for l in range(L)]
    # per layer: the resident sample (filled once) with room for the fetched rows behind it
    comp = [tuple(torch.empty(B, m.kv_heads, T, m.head_dim, device=be.device,
                              dtype=be.dtype).uniform_(-1, 1) for _ in range(2))
            for _ in range(L)]
    x0 = torch.randn(B, m.hidden).to(be.device, be.dtype)
    res = vk.resident.tolist()  # per stacked KV head (request b's heads: b * H ...)

    def step():
        x = x0
        for l in range(L):
            kc, vc = comp[l]
            W = st.layers[l]
            q, _, _ = K.layer_pre(x, W, m)
            idx, slot, bias, counts = vk.plan()  # stacked heads: request b, head h is b * H + h
            ks, vs = src[l]
            per_req = counts.view(B, H).sum(1).tolist()
            for b, (ib, sb) in enumerate(zip(idx.split(per_req), slot.split(per_req))):
                if be.kind == "cuda":  # one gather over the link, then a device-local scatter
                    kc[b].view(-1, m.head_dim).index_copy_(0, sb - b * H * T,
                                                           ks[b].index_select(0, ib - b * H * n))
                    vc[b].view(-1, m.head_dim).index_copy_(0, sb - b * H * T,
                                                           vs[b].index_select(0, ib - b * H * n))
                else:  # per KV head straight into place: the scatter would cost as much here
                    heads = counts[b * H:(b + 1) * H].tolist()
                    for h, ih in enumerate((ib - b * H * n).split(heads)):
                        r = res[b * H + h]
                        torch.index_select(ks[b], 0, ih, out=kc[b, h, r:r + ih.numel()])
                        torch.index_select(vs[b], 0, ih, out=vc[b, h, r:r + ih.numel()])
            biases = bias.view(B, H, *bias.shape[1:])
            mask = biases.to(be.dtype)
            a = F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask).reshape(B, -1)
            x = K.layer_post(x, a, W)
        return _head(st, x)
    return step, lambda: None
