"""One simulated run: the scheduler process of :mod:`kvsim.sim.engine` and the state it keeps.

Per request: its arrival, how many of its tokens are to be prefilled (the prompt; prompt and
generated tokens again after a recompute preemption) and how many are, the tokens in its cache
(``ctx``), the tokens it still has to emit (``left``) and the HBM and host bytes it holds.
Requests wait, prefill (in chunks or whole), decode, are swapped out, and finish.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np
import simpy

from kvsim.sim.chunking import plan_chunks
from kvsim.sim.engine import MAX_CHUNK, Chunk
from kvsim.sim.metrics import Requests
from kvsim.sim.steps import Chunks


class Run:
    """``routed``: requests arrive only when a router (:mod:`kvsim.sim.replicas`) hands them
    over on the shared ``env``; the run ends when the router is done and it has served what it
    was given."""

    SLOTS = ("arrival", "first_token", "admitted", "ctx", "prompt", "target", "prefilled",
             "left", "output", "held_hbm", "held_host", "order", "swap_host")

    def __init__(self, sim, work, env: simpy.Environment | None = None, routed: bool = False,
                 requests: Requests | None = None):
        self.sim, self.work, self.n = sim, work, work.n
        self.sched = sim.scheduling
        self.env = env = env or simpy.Environment()
        self.routed, self.assigned, self.router_done = routed, 0, False
        self.cap_hbm, self.cap_host = sim.capacity()
        self.used_hbm = self.used_host = 0  # whole bytes held (callers check room first)
        # per request in the system, by slot (a finished request's slot is reused): memory
        # follows the requests in the system, not the workload's length
        self.slots, self.free = 0, []
        self.requests = requests if requests is not None else Requests()
        self.waiting: deque[int] = deque()
        self.prefilling: list[int] = []
        self.running = np.zeros(0, np.int64)
        self.swapped: deque[int] = deque()
        self.next, self.done, self.admissions, self.preemptions = 0, 0, 0, 0
        # after a preemption nothing is admitted or resumed until a request completes: memory
        # frees only then, and re-admitting at once would preempt again (thrash)
        self.pressure = False
        self.may_finish = True  # whether the last turn may have finished a request
        self.in_system, self.area, self.t = 0, 0.0, 0.0
        self.peak_hbm = self.peak_host = 0
        self.wake = env.event()
        if routed:
            pass
        elif work.concurrency is None:
            env.process(self.open_arrivals())
        else:
            for i in range(min(work.concurrency, self.n)):
                self.arrive(i)
            self.next = min(work.concurrency, self.n)

    # ------------------------------------------------------------------ arrivals, memory
    def mark(self, delta: int) -> None:  # integrate the number in system, then change it
        self.area += self.in_system * (self.env.now - self.t)
        self.t, self.in_system = self.env.now, self.in_system + delta

    def _grow(self) -> None:
        """Twice the slots (at least 256): ``arrival`` .. ``admitted`` and ``ctx`` are float
        seconds / tokens, the rest whole numbers; ``order`` is the admission order (the
        preemption victim is the last), ``swap_host`` the host bytes of a swapped-out state."""
        old = self.slots
        new = self.slots = max(2 * old, 256)
        for name in self.SLOTS:
            a = getattr(self, name, None)
            b = np.zeros(new, float if name in ("arrival", "first_token", "admitted", "ctx")
                         else np.int64)
            if a is not None:
                b[:old] = a
            setattr(self, name, b)
        self.free.extend(range(new - 1, old - 1, -1))

    def arrive(self, i: int) -> None:
        """Request ``i`` of the workload arrives: it takes a free slot and waits."""
        if not self.free:
            self._grow()
        s = self.free.pop()
        self.arrival[s] = self.env.now
        self.first_token[s] = self.admitted[s] = np.nan
        self.prompt[s] = self.target[s] = self.work.prompt[i]
        self.output[s] = self.left[s] = self.work.output[i]
        self.ctx[s] = 0.0
        self.prefilled[s] = self.held_hbm[s] = self.held_host[s] = self.order[s] = 0
        self.swap_host[s] = 0
        self.waiting.append(s)
        self.mark(+1)
        if not self.wake.triggered:
            self.wake.succeed()

    def open_arrivals(self):
        arrival = self.work.arrival
        for i in range(self.n):
            yield self.env.timeout(max(float(arrival[i]) - self.env.now, 0.0))
            self.next = i + 1
            self.arrive(i)

    def hold(self, ids, hbm, host=0) -> None:
        """Put ``hbm`` and ``host`` more bytes for request(s) ``ids`` (a slot and whole numbers,
        or arrays of them); the caller checked room."""
        self.held_hbm[ids] += hbm
        self.held_host[ids] += host
        if isinstance(hbm, np.ndarray):
            hbm, host = int(hbm.sum()), int(np.sum(host))
        self.used_hbm += hbm
        self.used_host += host
        assert self.used_hbm <= self.cap_hbm and self.used_host <= self.cap_host
        self.peak_hbm = max(self.peak_hbm, self.used_hbm)
        self.peak_host = max(self.peak_host, self.used_host)

    def release(self, ids, hbm: bool = True, host: bool = True) -> None:
        """Give back what request(s) ``ids`` hold in HBM and/or host memory."""
        if hbm:
            self.used_hbm -= int(self.held_hbm[ids].sum())
            self.held_hbm[ids] = 0
        if host:
            self.used_host -= int(self.held_host[ids].sum())
            self.held_host[ids] = 0

    def free_hbm(self) -> int:
        return self.cap_hbm - self.used_hbm

    # ------------------------------------------------------------------------ admission
    def seats(self) -> int:
        return self.sim.max_batch - len(self.running) - len(self.prefilling)

    def admit(self) -> None:
        """Waiting requests start prefilling, in order, while seats and memory allow (the
        longest prefix of the queue that fits)."""
        seats = self.seats()
        if not self.waiting or seats <= 0 or self.pressure:
            return
        grow, per_hbm, per_host = (self.sched.admission == "grow", self.sim.hbm_per_token,
                                   self.sim.host_per_token)
        free_hbm, free_host = self.free_hbm(), self.cap_host - self.used_host
        now = self.env.now
        while self.waiting and seats > 0:  # scalars: usually one or a few
            i = self.waiting[0]
            whole = int(self.prompt[i]) + int(self.output[i])
            h = math.ceil(per_hbm * float(self.target[i] if grow else whole))
            o = 0 if self.held_host[i] else math.ceil(per_host * float(whole))
            if h > free_hbm or o > free_host:
                break
            self.waiting.popleft()
            self.hold(i, h, o)
            free_hbm, free_host, seats = free_hbm - h, free_host - o, seats - 1
            if math.isnan(self.admitted[i]):
                self.admitted[i] = now
            self.admissions += 1
            self.order[i] = self.admissions
            self.prefilled[i] = 0
            self.prefilling.append(i)

    def resume_swapped(self):
        """Swapped-out requests come back first, over the link, when their HBM state fits."""
        while self.swapped and self.seats() > 0 and not self.pressure:
            i = self.swapped[0]
            need = int(self.sim.hbm_need(self.ctx[i]))
            if need > self.free_hbm():
                return
            self.swapped.popleft()
            self.used_host -= int(self.swap_host[i])
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
                self.used_host + nbytes <= self.cap_host  # else recompute: no host room
        if swap:  # the HBM state goes to host memory; the request resumes where it was
            self.release([victim], host=False)
            self.used_host += nbytes
            self.swap_host[victim] = nbytes
            self.peak_host = max(self.peak_host, self.used_host)
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
        m, D = self.sim.model, len(dec)
        if len(pf) == 1:
            flops = m.attention_flops(float(size[0]), float(self.prefilled[pf[0]]))
        else:
            flops = float(m.attention_flops(size.astype(float),
                                            self.prefilled[pf].astype(float)).sum())
        step, gpu, link, alone = self.sim.steps.step(
            D, float(self.ctx[dec].sum()) if D else 0.0, float(size.sum()), flops, len(pf),
            self.target[pf].astype(float))
        self.sim.chunks.append(Chunk(self.env.now, step, 1 if D else 0, D, gpu, link,
                                     "mixed" if D else "prefill", None, int(size.sum()), alone))
        yield self.env.timeout(step)
        if D:
            self.ctx[dec] += 1
            self.left[dec] -= 1
        self.prefilling = []
        now = self.env.now
        for i in pf.tolist():  # scalars: usually one prompt
            self.prefilled[i] = self.target[i]
            if math.isnan(self.first_token[i]):
                self.first_token[i] = now
                self.ctx[i] = self.prompt[i]
            self.ctx[i] += 1
            self.left[i] -= 1
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
        plan = plan_chunks(self, dec, single=grow)
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
            k = min(k, int(np.searchsorted(ends, self.work.arrival[self.next] - self.env.now)) + 1)
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

    def decode_steps(self):
        """Decode steps of a fixed batch, up to the next completion, arrival or memory limit."""
        ids = self.running
        left = self.left[ids]
        soonest = int(left.min())
        k = self.grow_fit(ids, min(soonest, MAX_CHUNK))
        if k < 1:
            yield from self.preempt()
            return
        until = np.inf
        if self.work.concurrency is None and self.next < self.n and not self.waiting:
            # stop at the step boundary after the next arrival (it may be admitted)
            until = float(self.work.arrival[self.next]) - self.env.now
        ctx = self.ctx[ids]
        k, seconds, gpu_s, link_s = self.sim.steps.decode_run(ctx, k, until)
        log = self.sim.chunks
        log.append(Chunk(self.env.now, seconds, k, len(ids), gpu_s, link_s, "decode",
                         ctx if log.keeping else None))
        yield self.env.timeout(seconds)
        self.grow(ids, k)
        self.ctx[ids] = ctx + k
        self.left[ids] = left - k
        self.may_finish = k >= soonest  # else no sequence of the batch has finished

    def complete(self) -> None:
        """Release finished requests (also those whose only token came from prefill)."""
        if not self.may_finish:  # a decode run that stopped before any completion
            self.may_finish = True
            return
        fin = self.left[self.running] <= 0
        if not fin.any():
            return
        ids = self.running[fin]
        self.pressure = False
        self.requests.record(self.arrival[ids], self.admitted[ids], self.first_token[ids],
                             self.env.now, self.output[ids])
        self.release(ids)
        self.running = self.running[~fin]
        self.free.extend(ids.tolist())
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
