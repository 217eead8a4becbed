"""The chunked scheduler's plan of its next steps (vLLM's): each step's token budget goes to the
decodes first, then to chunks of the prompts in arrival order; a prompt that finishes emits a
token and decodes from the next step. Planned in scalars, executed by
:meth:`kvsim.sim.batching.Run.prefill_phase`."""

from __future__ import annotations

import math

from kvsim.sim.engine import MAX_CHUNK


def plan_chunks(run, single: bool) -> dict:
    """The schedule of the next steps, in scalars: per step the decodes (how many, their KV
    tokens), the chunks given out, the prompts that finish; stops where it must (after one
    step if ``single``)."""
    sim, m = run.sim, run.sim.model
    budget0 = run.sched.max_batched_tokens
    work = sim.prefill_work
    queue = [[i, run.target[i] - run.prefilled[i], run.prefilled[i]] for i in run.prefilling]
    D, tokens = len(run.running), run.batch_tokens()
    min_left = run.soonest() if D else None
    rows = {k: [] for k in ("D", "tokens", "ctok", "cflops", "count", "ndone", "wf", "wb")}
    assign, done = [], []
    any_work = bool(work.flops_per_token or work.flops_per_token_sq or work.bytes_per_token)
    while queue and len(assign) < MAX_CHUNK:
        left = budget0 - D
        a, fin, ctok, cflops = [], [], 0, 0.0
        for q in queue:
            if left <= 0:
                break
            size = int(min(q[1], left))
            a.append((q[0], size))
            cflops += m.attention_flops(float(size), float(q[2]))
            ctok += size
            left -= size
            q[1] -= size
            q[2] += size
            if q[1] == 0:
                fin.append(q[0])
        lengths = [float(run.target[i]) for i in fin]
        for key, v in (("D", D), ("tokens", tokens), ("ctok", ctok), ("cflops", cflops),
                       ("count", len(a)), ("ndone", len(fin)),
                       ("wf", sum(work.flops(x) for x in lengths) if any_work else 0.0),
                       ("wb", sum(work.bytes(x) for x in lengths) if any_work else 0.0)):
            rows[key].append(v)
        assign.append(a)
        done.append(fin)
        queue = [q for q in queue if q[1] > 0]
        tokens += D  # each decode appended a token
        if min_left is not None:
            min_left -= 1
        if fin:  # they join the decodes with their first (or next) token
            c = [float(run.prompt[i] if math.isnan(run.first_token[i]) else run.ctx[i])
                 + 1.0 for i in fin]
            tokens += sum(c)
            D += len(fin)
            lft = min(int(run.left[i]) for i in fin) - 1
            min_left = lft if min_left is None else min(min_left, lft)
        if single or (min_left is not None and min_left <= 0):
            break
    return {"rows": rows, "assign": assign, "done": done}
