"""A Chrome-trace / Perfetto timeline of a window of a simulated run, layer by layer.

The simulator works a batch-change at a time; this module re-expands the first decode steps of
the run (and the prefills between them) into per-layer events on two resources, the GPU stream
(compute, decide, LM head, prefill) and the host link (KV copies and fetches), placed by the
pipeline rule the step times come from (:mod:`kvsim.sim.pipeline`).

Open the JSON in https://ui.perfetto.dev or chrome://tracing.
"""

from __future__ import annotations

import numpy as np

from kvsim.sim.engine import Simulator
from kvsim.sim.pipeline import layer_starts, step_time
from kvsim.sim.records import SimResult

GPU, LINK = 1, 2


def _event(name, tid, start, dur, **args) -> dict:
    return {"name": name, "ph": "X", "pid": 1, "tid": tid, "ts": start * 1e6, "dur": dur * 1e6,
            "args": args}


def step_events(sim: Simulator, start: float, compute: float, decide: float, link: float,
                batch: int, step: int) -> tuple[list[dict], float]:
    """Per-layer events of one decode step starting at ``start``; returns (events, end)."""
    L, overlap, ev = sim.model.layers, sim.steps.overlap, []
    copy, comp = layer_starts(compute, decide, link, L, overlap)
    for l in range(L):
        if decide > 0 and not overlap:
            ev.append(_event(f"L{l} decide", GPU, start + copy[l] - decide, decide, step=step))
        if link > 0:
            ev.append(_event(f"L{l} {'KV copy' if overlap else 'fetch'}", LINK, start + copy[l],
                             link, step=step))
        ev.append(_event(f"L{l} compute", GPU, start + comp[l], compute, step=step, batch=batch))
    t = start + float(step_time(compute, decide, link, L, overlap))
    head = float(sim.costs.head_time(batch, sim.model))  # once per step
    ev.append(_event("LM head", GPU, t, head, step=step, batch=batch))
    t += head
    wait = sim.steps.floor - (t - start)
    if wait > 0:  # an eager engine's host still launching the step's kernels
        ev.append(_event("waiting for host launches", GPU, t, wait, step=step))
        t += wait
    ovh = sim.steps.overhead
    if ovh > 0:  # the engine's own work between steps (scheduling, sampling, launches)
        ev.append(_event("engine overhead", GPU, t, ovh, step=step))
    return ev, t + ovh


def build(sim: Simulator, res: SimResult, max_steps: int = 16) -> dict:
    """The timeline of the run's first ``max_steps`` decode steps (and prefills among them)."""
    events = [{"name": "thread_name", "ph": "M", "pid": 1, "tid": GPU, "args": {"name": "GPU"}},
              {"name": "thread_name", "ph": "M", "pid": 1, "tid": LINK,
               "args": {"name": "host link"}},
              {"name": "process_name", "ph": "M", "pid": 1, "args": {
                  "name": f"{sim.model.name} on {sim.costs.gpu_name}"}}]
    steps = 0
    for ch in res.chunks:
        if steps >= max_steps:
            break
        if ch.kind in ("prefill", "mixed", "swap"):  # one event: a whole forward pass or copy
            name = {"prefill": f"prefill {ch.prefill_tokens} tokens",
                    "mixed": f"step: {ch.batch} decodes + {ch.prefill_tokens} prefill tokens",
                    "swap": "swap KV over the link"}[ch.kind]
            if ch.kind != "swap":
                events.append(_event(name, GPU, ch.start, ch.duration, batch=ch.batch,
                                     step=steps))
            if ch.link_busy > 0:
                events.append(_event(name if ch.kind == "swap" else "KV to/from host", LINK,
                                     ch.start, min(ch.link_busy, ch.duration)))
            steps += ch.steps
            continue
        k = min(ch.steps, max_steps - steps)
        B, j = len(ch.ctx), np.arange(k, dtype=float)
        charges = sim.steps.charged_steps(ch.ctx, k) if sim.steps.fixed else ()
        compute, decide, link = sim.steps.layer_costs(np.full(k, B), float(ch.ctx.sum()) + B * j,
                                                      *charges)
        t = ch.start
        for i in range(k):
            ev, t = step_events(sim, t, float(compute[i]), float(decide[i]), float(link[i]),
                                ch.batch, steps + i)
            events += ev
        steps += k
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"decode_steps": steps, "model": sim.model.name,
                          "gpu": sim.costs.gpu_name}}
