"""Running a prompt through the hooked model: context prefill, scorer outputs, generation.

One prefill serves dense and every policy: after each generation the cache is cut back to the
context, which no policy modifies.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvsim.attention.scoring import snapkv_scores
from kvsim.model.hooks import Controller, active

SNAPKV_WINDOW = 32  # observation window: the last context rows (SnapKV's default)
KVZIP_PROMPT = "\n\nRepeat the previous context exactly.\n"
PREFILL_CHUNK = 2048
KVZIP_CHUNK = 512


def _new_cache(model):
    from transformers import DynamicCache
    try:
        return DynamicCache(config=model.config)
    except TypeError:
        return DynamicCache()


def cache_kv(cache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(n_kv, n, d) keys and values of one layer (batch 0)."""
    if hasattr(cache, "layers"):
        lay = cache.layers[layer]
        return lay.keys[0], lay.values[0]
    return cache.key_cache[layer][0], cache.value_cache[layer][0]


def truncate(cache, n: int) -> None:
    """Cut every layer of a dynamic cache back to its first ``n`` tokens."""
    if hasattr(cache, "layers"):
        for lay in cache.layers:
            if lay.keys is not None and lay.keys.numel():
                lay.keys, lay.values = lay.keys[..., :n, :], lay.values[..., :n, :]
    else:
        for i in range(len(cache.key_cache)):
            cache.key_cache[i] = cache.key_cache[i][..., :n, :]
            cache.value_cache[i] = cache.value_cache[i][..., :n, :]


def _cache_kw(model) -> str:
    """The forward's cache argument: "cache" in recent transformers, else "past_key_values"."""
    import inspect
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def n_layers(model) -> int:
    return model.config.num_hidden_layers


@dataclass
class Prefilled:
    cache: object
    ctx_ids: list[int]
    obs_q: dict[int, torch.Tensor]  # layer -> (n_q, w, d) window queries
    obs_pos: torch.Tensor  # (w,)
    scores: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)  # (n_kv, n_ctx)

    @property
    def n_ctx(self) -> int:
        return len(self.ctx_ids)


def _forward(model, ids: list[int], cache, chunk: int) -> torch.Tensor:
    """Feed ``ids`` in chunks; return the last position's logits."""
    out = None
    dev = next(model.parameters()).device
    for s in range(0, len(ids), chunk):
        x = torch.tensor([ids[s:s + chunk]], device=dev)
        out = model(input_ids=x, **{_cache_kw(model): cache}, use_cache=True, logits_to_keep=1)
    return out.logits[0, -1]


@torch.no_grad()
def prefill(model, ctx_ids: list[int], kvzip_ids: list[int] | None = None,
            window: int = SNAPKV_WINDOW, chunk: int = PREFILL_CHUNK) -> Prefilled:
    """Context prefill with stock attention; SnapKV scores; KVzip scores if ``kvzip_ids``.

    ``kvzip_ids`` are the reconstruction tokens (a repeat instruction then the context): fed after
    the context, each context token is scored by the max attention it gets from them over the
    query heads of its KV head; then the cache is cut back to the context.
    """
    cache = _new_cache(model)
    n = len(ctx_ids)
    ctl = Controller(mode="stock", record_last=window)
    with active(ctl):
        _forward(model, ctx_ids, cache, chunk)
    w = min(window, n)
    obs_q = {l: torch.cat(qs, dim=1)[:, -w:] for l, qs in ctl.queries.items()}
    obs_pos = torch.arange(n - w, n)
    pre = Prefilled(cache, list(ctx_ids), obs_q, obs_pos)
    for l in range(n_layers(model)):
        k, _ = cache_kv(cache, l)
        pre.scores[l] = {"snapkv": snapkv_scores(k, obs_q[l].to(k.dtype), obs_pos.to(k.device))}
    if kvzip_ids:
        z = Controller(mode="kvzip", n_ctx=n)
        with active(z):
            _forward(model, kvzip_ids, cache, KVZIP_CHUNK)
        truncate(cache, n)
        for l in range(n_layers(model)):
            pre.scores[l]["kvzip"] = z.kvzip[l]
    return pre


@torch.no_grad()
def prefill_recording(model, ctx_ids: list[int], layers: set[int],
                      chunk: int = PREFILL_CHUNK) -> tuple[object, dict[int, torch.Tensor]]:
    """Context prefill with stock attention that keeps every context row's queries of
    ``layers``: (cache, layer -> (n_q, n, d)). A nested capture takes each shorter context's
    SnapKV window from them."""
    cache = _new_cache(model)
    ctl = Controller(mode="stock", record_layers=set(layers))
    with active(ctl):
        _forward(model, ctx_ids, cache, chunk)
    return cache, {l: torch.cat(qs, dim=1) for l, qs in ctl.queries.items()}


@dataclass
class Generation:
    text: str
    ids: list[int]
    question_logits: torch.Tensor | None  # (m_q, vocab) when asked for
    stats: list  # (layer, rows, stats) per policy attend call, in order
    phases: list  # "question" or "decode" per attend call
    forwards: int  # model forward passes (question pass + decode steps)
    compressed: list  # what the policy's compress kept of each layer (kvsim.policies.base)


@torch.no_grad()
def generate(model, codec, pre: Prefilled, q_ids: list[int], max_new_tokens: int,
             policy=None, seed: int = 0, stop: bool = True, return_logits: bool = False,
             record_layers: set[int] | None = None, crop: bool = True,
             controller: Controller | None = None, attend=None) -> Generation:
    """Question pass then greedy decoding, through ``policy`` (None: stock attention).

    With a policy, ``compress`` runs per layer on the context first; the question pass and every
    decode step then go through ``attend``: the caller's call that runs it and counts what it read
    (``kvsim.measure.traffic.attend``; None: the policy's own, uncounted; see
    :class:`~kvsim.model.hooks.Controller`). ``stop``: end at an end-of-sequence token or at a
    newline after some text. ``record_layers``: keep those layers' queries (stock mode only).
    """
    dev = next(model.parameters()).device
    compressed = []
    if policy is not None:
        gen = torch.Generator(device="cpu").manual_seed(seed)
        ctl = Controller(mode="policy", policy=policy, attend=attend)
        for l in range(n_layers(model)):
            k, v = cache_kv(pre.cache, l)
            c = policy.compress(k[:, :pre.n_ctx], v[:, :pre.n_ctx], pre.scores[l],
                                pre.obs_q[l], pre.obs_pos.to(dev), gen, layer=l)
            compressed.append(c)
            ctl.states[l] = c
    else:
        ctl = controller or Controller(mode="stock", record_layers=record_layers or set())
    phases: list[str] = []
    out_ids: list[int] = []
    q_logits = None
    forwards = 0
    try:
        with active(ctl):
            x = torch.tensor([q_ids], device=dev)
            kw = {_cache_kw(model): pre.cache, "use_cache": True}
            out = model(input_ids=x, logits_to_keep=0 if return_logits else 1, **kw)
            forwards += 1
            phases += ["question"] * (len(ctl.stats) - len(phases))
            if return_logits:
                q_logits = out.logits[0].float().clone()
            nxt = int(out.logits[0, -1].argmax())
            while True:
                out_ids.append(nxt)
                if stop and nxt in codec.eos_ids:
                    out_ids.pop()
                    break
                if stop and "\n" in codec.decode(out_ids).lstrip():
                    break
                if len(out_ids) >= max_new_tokens:
                    break
                out = model(input_ids=torch.tensor([[nxt]], device=dev), logits_to_keep=1, **kw)
                forwards += 1
                phases += ["decode"] * (len(ctl.stats) - len(phases))
                nxt = int(out.logits[0, -1].argmax())
    finally:
        if crop:
            truncate(pre.cache, pre.n_ctx)
    text = codec.decode(out_ids)
    text = text.lstrip().split("\n", 1)[0] if stop else text
    return Generation(text, out_ids, q_logits, ctl.stats, phases, forwards, compressed)
