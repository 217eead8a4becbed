"""One simulated run: the scheduler process of :mod:`kvsim.sim.engine` and the state it keeps.

Per request: its arrival, how many of its tokens are to be prefilled (the prompt; prompt and
generated tokens again after a recompute preemption) and how many are, the tokens in its cache
(``ctx``), the tokens it still has to emit (``left``) and the HBM and host bytes it holds.
Requests wait, prefill (in chunks or whole), decode, are swapped out, and finish.
"""

from __future__ import annotations

import itertools
import math
from collections import deque

import numpy as np
import simpy

from kvsim.sim.engine import MAX_CHUNK, Chunk
from kvsim.sim.steps import Chunks


class Run:
    """``routed``: requests arrive only when a router (:mod:`kvsim.sim.replicas`) hands them
    over on the shared ``env``; the run ends when the router is done and it has served what it
    was given."""

    def __init__(self, sim, work, env: simpy.Environment | None = None, routed: bool = False):
        self.sim, self.work, self.n = sim, work, work.n
        self.sched = sim.scheduling
        self.env = env = env or simpy.Environment()
        self.routed, self.assigned, self.router_done = routed, 0, False
        self.cap_hbm, self.cap_host = sim.capacity()
        self.hbm = simpy.Container(env, capacity=max(self.cap_hbm, 1))
        self.host = simpy.Container(env, capacity=max(self.cap_host, 1))
        n = self.n
        self.arrival = work.arrival.astype(float).copy()
        self.first_token, self.finish, self.admitted = (np.full(n, np.nan) for _ in range(3))
        self.prompt = work.prompt.astype(np.int64)
        self.target = self.prompt.copy()  # tokens to prefill
        self.prefilled = np.zeros(n, np.int64)
        self.ctx = np.zeros(n)  # tokens in the cache while decoding
        self.left = work.output.astype(np.int64).copy()  # tokens still to emit
        self.held_hbm = np.zeros(n, np.int64)
        self.held_host = np.zeros(n, np.int64)
        self.order = np.zeros(n, np.int64)  # admission order (the preemption victim is the last)
        self.waiting: deque[int] = deque()
        self.prefilling: list[int] = []
        self.running = np.zeros(0, np.int64)
        self.swapped: deque[int] = deque()
        self.next, self.done, self.admissions, self.preemptions = 0, 0, 0, 0
        # after a preemption nothing is admitted or resumed until a request completes: memory
        # frees only then, and re-admitting at once would preempt again (thrash)
        self.pressure = False
        self.swap_host = np.zeros(n, np.int64)  # host bytes a swapped-out state occupies
        self.in_system, self.area, self.t = 0, 0.0, 0.0
        self.peak_hbm = self.peak_host = 0
        self.wake = env.event()
        if routed:
            pass
        elif work.concurrency is None:
            env.process(self.open_arrivals())
        else:
            for i in range(min(work.concurrency, n)):
                self.arrive(i)
            self.next = min(work.concurrency, n)

    # ------------------------------------------------------------------ arrivals, memory
    def mark(self, delta: int) -> None:  # integrate the number in system, then change it
        self.area += self.in_system * (self.env.now - self.t)
        self.t, self.in_system = self.env.now, self.in_system + delta

    def arrive(self, i: int) -> None:
        self.arrival[i] = self.env.now
        self.waiting.append(i)
        self.mark(+1)
        if not self.wake.triggered:
            self.wake.succeed()

    def open_arrivals(self):
        for i in range(self.n):
            yield self.env.timeout(max(self.arrival[i] - self.env.now, 0.0))
            self.next = i + 1
            self.arrive(i)

    def hold(self, ids, hbm, host=0) -> None:
        """Put ``hbm`` and ``host`` more bytes for request(s) ``ids`` (the caller checked room),
        in one put per memory."""
        for box, b in ((self.hbm, int(np.sum(hbm))), (self.host, int(np.sum(host)))):
            if b:
                box.put(b)
        self.held_hbm[ids] += hbm
        self.held_host[ids] += host
        self.peak_hbm = max(self.peak_hbm, self.hbm.level)
        self.peak_host = max(self.peak_host, self.host.level)

    def release(self, ids, hbm: bool = True, host: bool = True) -> None:
        for box, held, on in ((self.hbm, self.held_hbm, hbm), (self.host, self.held_host, host)):
            b = int(held[ids].sum()) if on else 0
            if b:
                box.get(b)
            if on:
                held[ids] = 0

    def free_hbm(self) -> int:
        return self.cap_hbm - self.hbm.level

    # ------------------------------------------------------------------------ admission
    def seats(self) -> int:
        return self.sim.max_batch - len(self.running) - len(self.prefilling)

    def admit(self) -> None:
        """Waiting requests start prefilling, in order, while seats and memory allow (the
        longest prefix of the queue that fits, in one put per memory)."""
        seats = self.seats()
        if not self.waiting or seats <= 0 or self.pressure:
            return
        grow, per_hbm, per_host = (self.sched.admission == "grow", self.sim.hbm_per_token,
                                   self.sim.host_per_token)
        free_hbm, free_host = self.free_hbm(), self.cap_host - self.host.level
        take, hbm, host = [], [], []
        for i in itertools.islice(self.waiting, seats):  # scalars: usually one or a few
            whole = int(self.prompt[i]) + int(self.work.output[i])
            h = math.ceil(per_hbm * float(self.target[i] if grow else whole))
            o = 0 if self.held_host[i] else math.ceil(per_host * float(whole))
            if sum(hbm) + h > free_hbm or sum(host) + o > free_host:
                break
            take.append(i)
            hbm.append(h)
            host.append(o)
        m = len(take)
        if not m:
            return
        ids, hbm, host = np.array(take, np.int64), np.array(hbm, np.int64), np.array(host, np.int64)
        for _ in range(m):
            self.waiting.popleft()
        self.hold(ids, hbm, host)
        new = np.isnan(self.admitted[ids])
        self.admitted[ids[new]] = self.env.now
        self.order[ids] = self.admissions + 1 + np.arange(m)
        self.admissions += m
        self.prefilled[ids] = 0
        self.prefilling += ids.tolist()

    def resume_swapped(self):
        """Swapped-out requests come back first, over the link, when their HBM state fits."""
        while self.swapped and self.seats() > 0 and not self.pressure:
            i = self.swapped[0]
            need = int(self.sim.hbm_need(self.ctx[i]))
            if need > self.free_hbm():
                return
            self.swapped.popleft()
            self.host.get(int(self.swap_host[i]))
            self.swap_host[i] = 0
            self.hold(i, need)
            yield from self.transfer(need, "h2d")
            self.running = np.append(self.running, i)

    def transfer(self, nbytes: int, path: str):
        """A swap: the GPU stream waits for the copy of ``nbytes`` over the link."""
        c = self.sim.costs
        t = float(c.link_time(nbytes, path, copies=2 * self.sim.model.layers))
        self.sim.chunks.append(Chunk(self.env.now, t, 0, 0, 0.0, t, "swap"))
        yield self.env.timeout(t)

    # ------------------------------------------------------------------------ preemption
    def preempt(self):
        """Free HBM by preempting the most recently admitted request that holds some."""
        cands = [int(i) for i in self.running] + self.prefilling
        victim = max(cands, key=lambda i: self.order[i])
        self.preemptions += 1
        self.pressure = True
        nbytes = int(self.held_hbm[victim])
        if victim in self.prefilling:
            self.prefilling.remove(victim)
            swap = False
        else:
            self.running = self.running[self.running != victim]
            swap = self.sched.preemption == "swap" and \
                self.host.level + nbytes <= self.cap_host  # else recompute: no host room
        if swap:  # the HBM state goes to host memory; the request resumes where it was
            self.release([victim], host=False)
            if nbytes:
                self.host.put(nbytes)
            self.swap_host[victim] = nbytes
            self.peak_host = max(self.peak_host, self.host.level)
            yield from self.transfer(nbytes, "d2h")
            self.swapped.append(victim)
        else:  # recompute: its cache is dropped
            self.release([victim], host=False)
            if not np.isnan(self.first_token[victim]):  # prompt and generated tokens, again
                self.target[victim] = int(self.ctx[victim]) - 1
            self.waiting.appendleft(victim)

    def grow_fit(self, ids: np.ndarray, k: int) -> int:
        """How many of the next ``k`` decode steps of ``ids`` fit in HBM (grow admission)."""
        if self.sched.admission != "grow" or not len(ids):
            return k
        per = self.sim.hbm_need(self.ctx[ids] + k) - self.held_hbm[ids]
        if int(per.sum()) <= self.free_hbm():
            return k
        per_step = max(float(per.sum()) / k, 1.0)
        k = int(self.free_hbm() // per_step)
        while k > 0 and int((self.sim.hbm_need(self.ctx[ids] + k)
                             - self.held_hbm[ids]).sum()) > self.free_hbm():
            k -= 1
        return k

    def grow(self, ids: np.ndarray, k: int) -> None:
        """Grow admission: ``ids`` hold their next ``k`` tokens' bytes."""
        if self.sched.admission == "grow" and len(ids):
            self.hold(ids, self.sim.hbm_need(self.ctx[ids] + k) - self.held_hbm[ids])

    # ------------------------------------------------------------------------------ steps
    def prefill_whole(self, dec: np.ndarray, pf: np.ndarray, size: np.ndarray):
        """One step in which every admitted prompt prefills the rest of itself (``size``
        tokens each), with a decode token for each of ``dec`` (prefill-first: none); each
        prompt then emits its first (or next) token. Scalars: the common step."""
        prefix = self.prefilled[pf]
        lengths = self.target[pf].astype(float)
        D = len(dec)
        step, gpu, link, alone = self.sim.steps.step(
            D, float(self.ctx[dec].sum()), float(size.sum()),
            float(self.sim.model.attention_flops(size.astype(float), prefix.astype(float)).sum()),
            len(pf), lengths)
        self.sim.chunks.append(Chunk(self.env.now, step, 1 if D else 0, D, gpu, link,
                                     "mixed" if D else "prefill", None, int(size.sum()), alone))
        yield self.env.timeout(step)
        self.ctx[dec] += 1
        self.left[dec] -= 1
        self.prefilled[pf] = self.target[pf]
        self.prefilling = []
        first = np.isnan(self.first_token[pf])
        self.first_token[pf[first]] = self.env.now
        self.ctx[pf[first]] = self.prompt[pf[first]]
        self.ctx[pf] += 1
        self.left[pf] -= 1
        self.running = np.concatenate([self.running, pf])

    def prefill_phase(self):
        """Steps with prefill chunks (chunked scheduler), as many at once as nothing else
        changes: each step's decodes first, then chunks of the prompts in order; a prompt that
        finishes emits a token and decodes from the next step. The run ends with the prefills,
        at a decode's completion, at the step after the next arrival, or after one step when
        memory grows per token (grow admission)."""
        sim = self.sim
        grow = self.sched.admission == "grow"
        pf = np.array(self.prefilling, np.int64)
        rest = self.target[pf] - self.prefilled[pf]
        if self.sched.scheduler != "chunked":  # prefill-first: whole prompts, decodes wait
            yield from self.prefill_whole(np.zeros(0, np.int64), pf, rest)
            return
        if not grow and rest.sum() <= self.sched.max_batched_tokens - len(self.running):
            yield from self.prefill_whole(self.running, pf, rest)  # it all fits in one step
            return
        dec = self.running
        while grow and self.grow_fit(dec, 1) < 1:
            yield from self.preempt()
            dec = self.running
        plan = self.plan_phase(dec, single=grow)
        rows = plan["rows"]
        S = len(rows["D"])
        if S == 1:  # the common case, in scalars
            lengths = self.target[plan["done"][0]].astype(float)
            one = sim.steps.step(len(dec), rows["tokens"][0], rows["ctok"][0],
                                 rows["cflops"][0], rows["count"][0], lengths)
            step, gpu, link, alone = (np.array([x]) for x in one)
        else:
            arr = {k: np.array(v, float) for k, v in rows.items()}
            ch = Chunks(arr["ctok"], arr["cflops"], arr["count"], arr["ndone"], arr["wf"],
                        arr["wb"])
            step, gpu, link, alone = sim.steps.run(arr["D"], arr["tokens"], ch)
        ends = np.cumsum(step)
        k = S
        if self.work.concurrency is None and self.next < self.n and not self.waiting:
            k = min(k, int(np.searchsorted(ends, self.arrival[self.next] - self.env.now)) + 1)
        t0 = self.env.now
        for j in range(k):
            Dj = rows["D"][j]
            sim.chunks.append(Chunk(t0 + (ends[j - 1] if j else 0.0), float(step[j]),
                                    1 if Dj else 0, Dj, float(gpu[j]), float(link[j]),
                                    "mixed" if Dj else "prefill", None, rows["ctok"][j],
                                    float(alone[j])))
        yield self.env.timeout(float(ends[k - 1]))
        if grow:
            self.grow(dec, 1)
        self.ctx[dec] += k
        self.left[dec] -= k
        for j in range(k):
            for i, size in plan["assign"][j]:
                self.prefilled[i] += size
        fin = [(i, j) for j in range(k) for i in plan["done"][j]]
        if fin:  # each emitted at the end of its step, then decoded k - 1 - j more
            ids, js = np.array([i for i, _ in fin], np.int64), np.array([j for _, j in fin])
            done_ids = set(ids.tolist())
            self.prefilling = [i for i in self.prefilling if i not in done_ids]
            first = np.isnan(self.first_token[ids])
            self.first_token[ids[first]] = t0 + ends[js[first]]
            self.ctx[ids[first]] = self.prompt[ids[first]]
            more = k - js
            self.ctx[ids] += more
            self.left[ids] -= more
            self.running = np.concatenate([self.running, ids])

    def plan_phase(self, dec: np.ndarray, single: bool) -> dict:
        """The schedule of the next steps, in scalars: per step the decodes (how many, their KV
        tokens), the chunks given out, the prompts that finish; stops where it must."""
        sim, m = self.sim, self.sim.model
        budget0 = self.sched.max_batched_tokens
        pf = np.array(self.prefilling, np.int64)
        work = sim.prefill_work
        queue = [list(q) for q in zip(pf.tolist(), (self.target[pf] - self.prefilled[pf]).tolist(),
                                      self.prefilled[pf].tolist())]
        D, tokens = len(dec), float(self.ctx[dec].sum())
        min_left = int(self.left[dec].min()) if D else None
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
            lengths = [float(self.target[i]) for i in fin]
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
                c = [float(self.prompt[i] if math.isnan(self.first_token[i]) else self.ctx[i])
                     + 1.0 for i in fin]
                tokens += sum(c)
                D += len(fin)
                lft = min(int(self.left[i]) for i in fin) - 1
                min_left = lft if min_left is None else min(min_left, lft)
            if single or (min_left is not None and min_left <= 0):
                break
        return {"rows": rows, "assign": assign, "done": done}

    def decode_steps(self):
        """Decode steps of a fixed batch, up to the next completion, arrival or memory limit."""
        ids = self.running
        k = int(min(self.left[ids].min(), MAX_CHUNK))
        k = self.grow_fit(ids, k)
        if k < 1:
            yield from self.preempt()
            return
        steps, gpu_s, link_s = self.sim.steps.decode(self.ctx[ids], k)
        ends = np.cumsum(steps)
        if self.work.concurrency is None and self.next < self.n and not self.waiting:
            # stop at the step boundary after the next arrival (it may be admitted)
            k = min(k, int(np.searchsorted(ends, self.arrival[self.next] - self.env.now)) + 1)
        self.sim.chunks.append(Chunk(self.env.now, float(ends[k - 1]), k, len(ids),
                                     float(gpu_s[:k].sum()), float(link_s[:k].sum()), "decode",
                                     self.ctx[ids].copy()))
        yield self.env.timeout(float(ends[k - 1]))
        self.grow(ids, k)
        self.ctx[ids] += k
        self.left[ids] -= k

    def complete(self) -> None:
        """Release finished requests (also those whose only token came from prefill)."""
        fin = self.left[self.running] <= 0
        if not fin.any():
            return
        ids = self.running[fin]
        self.pressure = False
        self.finish[ids] = self.env.now
        self.release(ids)
        self.running = self.running[~fin]
        self.done += len(ids)
        self.mark(-len(ids))
        if self.work.concurrency is not None:  # closed loop: replace each at once
            for _ in ids:
                if self.next < self.n:
                    self.arrive(self.next)
                    self.next += 1

    def finished(self) -> bool:
        if self.routed:
            return self.router_done and self.done == self.assigned
        return self.done >= self.n

    def scheduler(self):
        while not self.finished():
            if self.swapped:
                yield from self.resume_swapped()
            self.admit()
            if self.prefilling:
                yield from self.prefill_phase()
            elif len(self.running):
                yield from self.decode_steps()
            else:  # idle until the next arrival
                self.wake = self.env.event()
                yield self.wake
                continue
            self.complete()
