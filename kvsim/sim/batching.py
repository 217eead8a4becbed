"""One simulated run: the scheduler process of :mod:`kvsim.sim.engine` and the state it keeps.

Per request: its arrival, how many of its tokens are to be prefilled (the prompt; prompt and
generated tokens again after a recompute preemption) and how many are, the tokens in its cache
(``ctx``), the tokens it still has to emit (``left``) and the HBM and host bytes it holds.
Requests wait, prefill (in chunks or whole), decode, are swapped out, and finish.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import simpy

from kvsim.sim.engine import MAX_CHUNK, Chunk


class Run:
    def __init__(self, sim, work):
        self.sim, self.work, self.n = sim, work, work.n
        self.sched = sim.scheduling
        self.env = env = simpy.Environment()
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
        if work.concurrency is None:
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

    def hold(self, i: int, hbm: int, host: int = 0) -> None:
        """Put ``hbm`` and ``host`` more bytes for request ``i`` (the caller checked room)."""
        for box, b in ((self.hbm, int(hbm)), (self.host, int(host))):
            if b:
                box.put(b)
        self.held_hbm[i] += hbm
        self.held_host[i] += host
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
        """Waiting requests start prefilling, in order, while seats and memory allow."""
        grow = self.sched.admission == "grow"
        while self.waiting and self.seats() > 0 and not self.pressure:
            i = self.waiting[0]
            whole = self.prompt[i] + self.work.output[i]
            hbm = int(self.sim.hbm_need(self.target[i] if grow else whole))
            host = 0 if self.held_host[i] else int(self.sim.host_need(whole))
            if hbm > self.free_hbm() or self.host.level + host > self.cap_host:
                return
            self.waiting.popleft()
            self.hold(i, hbm, host)
            if np.isnan(self.admitted[i]):
                self.admitted[i] = self.env.now
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
        else:  # recompute: its cache is dropped; prompt and generated tokens prefill again
            self.release([victim], host=False)
            if not np.isnan(self.first_token[victim]):  # it decoded: its tokens prefill again
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
        if self.sched.admission == "grow" and len(ids):
            for i, more in zip(ids, self.sim.hbm_need(self.ctx[ids] + k) - self.held_hbm[ids]):
                self.hold(int(i), int(more))

    # ------------------------------------------------------------------------------ steps
    def emitted(self, ids) -> None:
        """``ids`` finished a prefill: each emits a token (the first one, or the next after a
        recompute) and starts or resumes decoding."""
        for i in ids:
            if np.isnan(self.first_token[i]):
                self.first_token[i] = self.env.now
                self.ctx[i] = self.prompt[i] + 1
            else:
                self.ctx[i] += 1
            self.left[i] -= 1
        self.running = np.concatenate([self.running, np.asarray(ids, np.int64)])

    def prefill_step(self):
        """One step with prefill chunks: the decodes first (chunked), then chunks in order."""
        chunked = self.sched.scheduler == "chunked"
        dec = self.running if chunked else np.zeros(0, np.int64)
        while chunked and self.grow_fit(dec, 1) < 1:
            yield from self.preempt()
            dec = self.running
        budget = self.sched.max_batched_tokens - len(dec) if chunked else np.inf
        sizes, prefixes, ids = [], [], []
        for i in self.prefilling:
            size = int(min(self.target[i] - self.prefilled[i], max(budget, 0)))
            if size <= 0:
                break
            sizes.append(size)
            prefixes.append(int(self.prefilled[i]))
            ids.append(i)
            budget -= size
        done = [i for i, s, p in zip(ids, sizes, prefixes) if p + s >= self.target[i]]
        step, gpu, link = self.sim.steps.mixed(self.ctx[dec], np.array(sizes), np.array(prefixes),
                                               self.target[done].astype(float))
        kind = "mixed" if len(dec) else "prefill"
        alone = float(self.sim.steps.decode(self.ctx[dec], 1)[0][0]) if len(dec) else 0.0
        self.sim.chunks.append(Chunk(self.env.now, step, 1 if len(dec) else 0, len(dec), gpu,
                                     link, kind, self.ctx[dec].copy(), int(sum(sizes)),
                                     min(alone, step)))
        yield self.env.timeout(step)
        self.grow(dec, 1)
        self.ctx[dec] += 1
        self.left[dec] -= 1
        for i, s in zip(ids, sizes):
            self.prefilled[i] += s
        self.prefilling = [i for i in self.prefilling if i not in done]
        self.emitted(done)

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

    def scheduler(self):
        while self.done < self.n:
            yield from self.resume_swapped()
            self.admit()
            if self.prefilling:
                yield from self.prefill_step()
            elif len(self.running):
                yield from self.decode_steps()
            else:  # idle until the next arrival
                self.wake = self.env.event()
                yield self.wake
                continue
            self.complete()
