"""Memory pressure in a run (:class:`kvsim.sim.batching.Run`): grow admission's per-token HBM,
preemption of the most recently admitted request (recompute or swap) and swapped-out requests
coming back over the link."""

from __future__ import annotations

import heapq
import math

import numpy as np


def resume_swapped(run):
    """Swapped-out requests come back first, over the link, when their HBM state fits."""
    while run.swapped and run.seats() > 0 and not run.pressure:
        i = run.swapped[0]
        need = int(run.sim.hbm_need(run.ctx[i]))
        if need > run.free_hbm():
            return
        run.swapped.popleft()
        run.used_host -= run.swap_host[i]
        run.swap_host[i] = 0
        run.hold(i, need)
        yield from transfer(run, need, "h2d")
        run.join([i])


def transfer(run, nbytes: int, path: str):
    """A swap: the GPU stream waits for the copy of ``nbytes`` over the link."""
    c = run.sim.costs
    t = float(c.link_time(nbytes, path, copies=2 * run.sim.model.layers))
    run.sim.chunks.add(run.env.now, t, 0, 0, 0.0, t, "swap")
    yield run.env.timeout(t)


def preempt(run):
    """Free HBM by preempting the most recently admitted request that holds some."""
    victim = max(run.running + run.prefilling, key=lambda i: run.order[i])
    run.preemptions += 1
    run.pressure = True
    nbytes = run.held_hbm[victim]
    if victim in run.prefilling:
        run.prefilling.remove(victim)
        swap = False
    else:
        run.leave([victim])
        run.finish_at = [f for f in run.finish_at if f[1] != victim]
        heapq.heapify(run.finish_at)
        swap = run.sched.preemption == "swap" and \
            run.used_host + nbytes <= run.cap_host  # else recompute: no host room
    if swap:  # the HBM state goes to host memory; the request resumes where it was
        run.release([victim], host=False)
        run.used_host += nbytes
        run.swap_host[victim] = nbytes
        run.peak_host = max(run.peak_host, run.used_host)
        yield from transfer(run, nbytes, "d2h")
        run.swapped.append(victim)
    else:  # recompute: its cache is dropped
        run.release([victim], host=False)
        if not math.isnan(run.first_token[victim]):  # prompt and generated tokens, again
            run.target[victim] = int(run.ctx[victim]) - 1
        run.waiting.appendleft(victim)


def grow_fit(run, k: int) -> int:
    """How many of the running batch's next ``k`` decode steps fit in HBM (grow
    admission)."""
    if not run.growing or not run.running:
        return k
    ids, ctx = run.batch()
    held = np.array([run.held_hbm[i] for i in ids], np.int64)
    per = run.sim.hbm_need(ctx + k) - held
    if int(per.sum()) <= run.free_hbm():
        return k
    per_step = max(float(per.sum()) / k, 1.0)
    k = int(run.free_hbm() // per_step)
    while k > 0 and int((run.sim.hbm_need(ctx + k) - held).sum()) > run.free_hbm():
        k -= 1
    return k


def grow(run, k: int) -> None:
    """Grow admission: the running batch holds its next ``k`` tokens' bytes."""
    if run.growing and run.running:
        ids, ctx = run.batch()
        for i, need in zip(ids, run.sim.hbm_need(ctx + k).tolist()):
            run.hold(i, need - run.held_hbm[i])
