"""One simulated run: the scheduler process and the state it keeps; what it schedules by is a set
of rules (:mod:`kvsim.sim.rules`), what a step costs is :mod:`kvsim.sim.steps`.

Per request: its arrival, how many of its tokens are to be prefilled (the prompt; prompt and
generated tokens again after a recompute preemption) and how many are, the tokens in its cache
(``ctx``), the tokens it still has to emit (``left``) and the HBM and host bytes it holds.
Requests wait, prefill (in chunks or whole), decode, are swapped out, and finish.

Every step advances either every running sequence by one token or none (prefill-first), so the
running batch keeps a decode ``clock`` (steps taken) and its sequences hold ``ctx`` and
``left`` relative to it: a run of k decode steps is ``clock += k``, the batch's KV tokens are a
running sum, and the next completion is the top of a heap of finishing clocks (each with its
slot in one int: ints compare faster than pairs). A scheduler turn
touches no per-sequence array unless memory grows per token (grow admission).

In an open loop the scheduler reads arrivals from the workload when it looks (at admission and
when it bounds a run of steps), so an arrival costs no event of its own; every request that has
arrived by then is seen, those that arrive at the same instant included. Routed runs
(:mod:`kvsim.sim.replicas`) are handed their arrivals and woken.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from heapq import heappop, heappush
from itertools import chain

import numpy as np

from kvsim.sim.metrics import Requests
from kvsim.sim.records import MAX_CHUNK, Chunks
from kvsim.sim.rules import RULES

SCALAR_RUN = 16  # a run of at most this many planned steps is costed step by step in scalars
SLOT_BITS = 32  # a heap key ``clock << SLOT_BITS | slot`` is one int (slots: fewer than 2**32)
SLOT_MASK = (1 << SLOT_BITS) - 1  # key & SLOT_MASK is the slot


class Clock:
    """The clock of a run alone: its one process only waits for time to pass, so it needs no
    event queue. ``run`` adds each delay (seconds) the process yields to ``now``, the sum
    simpy's ``Timeout`` makes (``now + delay``), so the times are simpy's to the last bit."""

    def __init__(self):
        self.now = 0.0

    def run(self, process) -> None:
        for delay in process:
            self.now += delay


def on_simpy(env, process):
    """A run's process (:meth:`Run.scheduler`) on a simpy clock: each delay it yields (seconds)
    is a ``Timeout``; an event (a routed run's wake-up) is waited for as it is."""
    for what in process:
        yield env.timeout(what) if isinstance(what, float) else what


class Run:
    """``routed``: requests arrive only when a router (:mod:`kvsim.sim.replicas`) hands them
    over on the shared ``env`` (a simpy Environment); the run ends when the router is done and
    it has served what it was given. A run alone keeps its time on a :class:`Clock`."""

    SLOTS = ("arrival", "first_token", "admitted", "ctx", "prompt", "target", "prefilled",
             "left", "output", "held_hbm", "held_host", "order", "swap_host", "item", "pins",
             "load")

    def __init__(self, sim, work, env=None, routed: bool = False,
                 requests: Requests | None = None, cache=None):
        self.sim, self.work, self.n = sim, work, work.n
        # the workload's columns as Python lists (a turn reads a few scalars of them)
        self.arrivals, self.prompts, self.outputs = (np.asarray(work.arrival, float).tolist(),
                                                     work.prompt.astype(np.int64).tolist(),
                                                     work.output.astype(np.int64).tolist())
        self.sched = sched = sim.scheduling
        self.scheduler_rule, self.admission, self.preemption = sched.rules()
        self.growing = self.admission.grows  # memory held grows per token
        self.fixed = sim.steps.fixed  # the policy charges each sequence on its own
        self.env = env if env is not None else Clock()
        self.routed, self.assigned, self.router_done = routed, 0, False
        self.open = work.concurrency is None
        self.pulls = self.open and not routed  # reads arrivals when it looks
        self.cap_hbm, self.cap_host = sim.capacity()
        self.used_hbm = self.used_host = 0  # whole bytes held (callers check room first)
        # per request in the system, by slot (a finished request's slot is reused): memory
        # follows the requests in the system, not the workload's length
        self.slots, self.free = 0, []
        for name in self.SLOTS:
            setattr(self, name, [])
        self.requests = requests if requests is not None else Requests()
        self.records: list[tuple] = []  # finished requests not yet handed to ``requests``
        self.waiting = RULES["order"][sched.admission_order](self)  # popleft() is admitted next
        self.prefilling: list[int] = []
        self.swapped: deque[int] = deque()
        # the running batch: its slots in order, its decode clock, the sum of its (relative)
        # ctx, and a heap of the clock at which each has emitted its last token (and its slot)
        self.running: list[int] = []
        self.clock, self.run_ctx, self.finish_at = 0, 0.0, []
        self.stalls: list[list] = []  # [sequences, seconds]: running ones waiting to decode
        self.next, self.done, self.admissions, self.preemptions = 0, 0, 0, 0
        # after a preemption nothing is admitted or resumed until a request completes: memory
        # frees only then, and re-admitting at once would preempt again (thrash)
        self.pressure = False
        self.in_system, self.area, self.t = 0, 0.0, 0.0
        self.peak_hbm = self.peak_host = 0
        self.wake = self.env.event() if routed else None
        self.one_step = getattr(self.scheduler_rule, "one_step", None)  # where the rule has one
        # the turns of a closed loop alone with reserve admission, in short (_closed_turns)
        # prefix caching (kvsim.sim.prefix): the cache, the workload's block ids, and how many
        # admitted requests still wait for lower-tier blocks to load
        self.cache, self.hashes, self.loading = cache, work.prefix_hashes, 0
        self.closed_turns = not routed and not self.open and not self.growing and \
            not sim.kv.fixed and self.one_step is not None and cache is None
        if work.concurrency is not None and not routed:
            for i in range(min(work.concurrency, self.n)):
                self.arrive(i)
            self.next = min(work.concurrency, self.n)

    # ------------------------------------------------------------------ arrivals, memory
    def mark(self, delta: int, since: float | None = None) -> None:
        """Integrate the number in system up to now, then change it by ``delta``; ``since``:
        an arrival read after it happened (its presence before now is added whole)."""
        now = self.env.now
        self.area += self.in_system * (now - self.t)
        if since is not None:
            self.area += now - since
        self.t, self.in_system = now, self.in_system + delta

    def _grow(self) -> None:
        """Twice the slots (at least 256), as Python lists (a turn reads and writes a few
        scalars of them): ``arrival`` .. ``admitted`` and ``ctx`` are float seconds / tokens,
        the rest whole numbers; ``order`` is the admission order (the preemption victim is
        the last), ``swap_host`` the host bytes of a swapped-out state."""
        old = self.slots
        new = self.slots = max(2 * old, 256)
        for name in self.SLOTS:
            zero = 0.0 if name in ("arrival", "first_token", "admitted", "ctx", "load") else 0
            getattr(self, name).extend([zero] * (new - old))
        self.free.extend(range(new - 1, old - 1, -1))

    def arrive(self, i: int, at: float | None = None, mark: bool = True) -> None:
        """Request ``i`` of the workload arrives (now, or at ``at`` if read later): it takes a
        free slot and waits (``mark``: counted in the system here, else by the caller). A free
        slot holds no memory; its other fields are set where they are first read (at admission
        and at the first token)."""
        if not self.free:
            self._grow()
        s = self.free.pop()
        self.arrival[s] = self.env.now if at is None else at
        self.first_token[s] = self.admitted[s] = math.nan
        self.prompt[s] = self.target[s] = self.prompts[i]
        self.output[s] = self.left[s] = self.outputs[i]
        self.item[s] = i
        self.waiting.append(s)
        if mark:
            self.mark(+1, at)
        if self.routed and not self.wake.triggered:
            self.wake.succeed()

    def pull(self) -> None:
        """Open loop: every request that has arrived by now joins the queue."""
        now, arr, i = self.env.now, self.arrivals, self.next
        while self.pulls and i < self.n and (at := arr[i]) <= now:
            self.arrive(i, at)
            i = self.next = i + 1

    def until_next_arrival(self) -> float:
        """Seconds to the next arrival that may be admitted at a step boundary (inf if there is
        none, or if requests already wait: they are admitted first); arrivals up to now were
        read (:meth:`pull`)."""
        if self.open and self.next < self.n and not self.waiting:
            return self.arrivals[self.next] - self.env.now
        return math.inf

    def hold(self, i: int, hbm: int, host: int = 0) -> None:
        """Put ``hbm`` and ``host`` more bytes for request ``i``; the caller checked room."""
        self.held_hbm[i] += hbm
        self.held_host[i] += host
        self.used_hbm += hbm
        self.used_host += host
        assert self.used_hbm <= self.cap_hbm and self.used_host <= self.cap_host
        self.peak_hbm = max(self.peak_hbm, self.used_hbm)
        self.peak_host = max(self.peak_host, self.used_host)

    def release(self, ids: list[int], hbm: bool = True, host: bool = True) -> None:
        """Give back what requests ``ids`` hold in HBM and/or host memory."""
        for i in ids:  # scalars: usually one
            if hbm:
                self.used_hbm -= self.held_hbm[i]
                self.held_hbm[i] = 0
            if host:
                self.used_host -= self.held_host[i]
                self.held_host[i] = 0

    def free_hbm(self) -> int:
        return self.cap_hbm - self.used_hbm

    # ----------------------------------------------------------------- the running batch
    def join(self, ids, emitted: int = 0, at: float | None = None) -> None:
        """Sequences ``ids`` join the running batch: their ``ctx`` and ``left`` are true but for
        the ``emitted`` tokens each has emitted since (whole numbers: exact in any order).
        ``at``: they are prompts that finished prefilling (the first ones: chunks go in order),
        a first token, if it is their first, emitted at ``at``."""
        c, ctx, left, heap = self.clock - emitted, self.ctx, self.left, self.finish_at
        run_ctx, first, prompt = self.run_ctx, self.first_token, self.prompt
        if at is not None:
            del self.prefilling[:len(ids)]
            if self.cache is not None:
                for i in ids:
                    self.pins[i] = self.cache.prefilled(self.hashes[self.item[i]], self.pins[i])
        for i in ids:
            if at is not None and first[i] != first[i]:  # (math.isnan, without the call)
                first[i] = at
                ctx[i] = prompt[i]
            ctx[i] -= c
            left[i] += c
            run_ctx += ctx[i]
            heappush(heap, left[i] << SLOT_BITS | i)
        self.run_ctx = run_ctx
        self.running.extend(ids)

    def leave(self, ids) -> None:
        """Sequences ``ids`` leave the running batch: their ``ctx`` and ``left`` are true again
        (the caller takes them out of the heap)."""
        c, ctx, left, run_ctx = self.clock, self.ctx, self.left, self.run_ctx
        for i in ids:
            run_ctx -= ctx[i]
            ctx[i] += c
            left[i] -= c
        self.run_ctx = run_ctx
        if len(ids) <= 8:  # a few: each found by the list itself
            for i in ids:
                self.running.remove(i)
        else:
            gone = set(ids)
            self.running = [i for i in self.running if i not in gone]

    def batch_tokens(self) -> float:
        """KV tokens held by the running batch."""
        return self.run_ctx + len(self.running) * self.clock if self.running else 0.0

    def soonest(self) -> int:
        """Decode steps until the running batch's next completion."""
        return (self.finish_at[0] >> SLOT_BITS) - self.clock

    def batch(self) -> tuple[list[int], np.ndarray]:
        """The running batch's slots and their true ``ctx`` (for per-sequence arithmetic)."""
        ctx = self.ctx
        return self.running, np.array([ctx[i] for i in self.running]) + self.clock

    # ------------------------------------------------------------------------ admission
    def seats(self) -> int:
        return self.sim.max_batch - len(self.running) - len(self.prefilling)

    def admit(self) -> None:
        """Waiting requests start prefilling, in the admission order, while seats and memory
        allow (the longest prefix of the queue that fits; :meth:`_closed_turns` admits as this
        does, in short)."""
        if self.pulls:
            self.pull()
        if not self.waiting or self.pressure:
            return
        sim = self.sim
        seats = sim.max_batch - len(self.running) - len(self.prefilling)  # (seats)
        if seats <= 0:
            return
        kv, grow = sim.kv, self.growing  # grow: HBM for the tokens to prefill, else all
        free_hbm, free_host = self.cap_hbm - self.used_hbm, self.cap_host - self.used_host
        now = self.env.now
        while self.waiting and seats > 0:  # scalars: usually one or a few
            i = self.waiting[0]
            whole = self.prompt[i] + self.output[i]
            n = self.target[i] if grow else whole
            if kv.fixed:
                h, o = int(kv.hbm_need(n)), 0 if self.held_host[i] else int(kv.host_need(whole))
            else:  # (in scalars: the hot path; float * int takes the int as a float)
                h = math.ceil(kv.hbm_per_token * n)
                o = 0 if self.held_host[i] else math.ceil(kv.host_per_token * whole)
            if h > free_hbm or o > free_host:
                break
            self.waiting.popleft()
            self.held_hbm[i] += h  # (hold, in scalars: room was checked above)
            self.held_host[i] += o
            free_hbm, free_host, seats = free_hbm - h, free_host - o, seats - 1
            if math.isnan(self.admitted[i]):
                self.admitted[i] = now
            self.admissions += 1
            self.order[i] = self.admissions
            self.prefilled[i] = 0
            if self.cache is not None:
                self.reuse(i)
            self.prefilling.append(i)
        self.used_hbm = used_hbm = self.cap_hbm - free_hbm
        if self.cache is not None:
            self.cache.trim_gpu(free_hbm)
        self.used_host = used_host = self.cap_host - free_host
        if used_hbm > self.peak_hbm:
            self.peak_hbm = used_hbm
        if used_host > self.peak_host:
            self.peak_host = used_host

    def reuse(self, i: int) -> None:
        """Prefix caching: admitted request ``i`` starts its prefill after its cached prefix,
        whose lower-tier blocks load while its first chunk prefills."""
        hit, load, self.pins[i] = self.cache.admit(self.hashes[self.item[i]], self.prompt[i])
        self.prefilled[i] = hit
        self.load[i] = load
        self.loading += load > 0

    # ------------------------------------------------------------------------------ steps
    def prefill_steps(self) -> float:
        """Steps with prefill chunks, as many at once as nothing else changes, as the scheduler
        rule plans them: carried out at once, and the seconds they take returned for the
        scheduler to wait (nothing reads what they change meanwhile). A prompt that finishes
        emits a token and decodes from the next step. The run ends with the prefills, at a
        decode's completion, at the step after the next arrival, or after one step when memory
        grows per token (grow admission)."""
        if self.loading:
            return self._loading_step()
        got = self.one_step(self, self.growing) if self.one_step else None  # (carried out)
        if got is not None:
            return self._one(*got)
        plans = self.scheduler_rule.plan(self, self.growing)
        if len(plans) > 1:
            return self._run_of_steps(plans)
        D, tokens, ctok, cflops, assign, done, lengths, _, _, read, fetch, written = plans[0]
        prefilled = self.prefilled
        for i, size in assign:
            prefilled[i] += size
        return self._one(D, tokens, ctok, cflops, len(assign), done, lengths, read, fetch,
                         written)

    def _loading_step(self) -> float:
        """One step while admitted prompts wait for cached blocks from a lower tier: a prompt's
        first chunk waits for its blocks (they load layer by layer while it computes, so the
        step takes at least the load)."""
        p = self.scheduler_rule.plan(self, True)[0]
        load = 0.0
        for i, size in p.assign:
            self.prefilled[i] += size
            if self.load[i]:
                load = max(load, self.load[i])
                self.load[i] = 0.0
                self.loading -= 1
        return self._one(p.decodes, p.decode_tokens, p.chunk_tokens, p.chunk_flops,
                         len(p.assign), p.done, p.done_lengths, p.read_tokens, p.fetch_tokens,
                         p.written_tokens, load)

    def _one(self, D: int, tokens: float, ctok: int, cflops: float, count: int, done: list,
             lengths: list, read=None, fetch=None, written=None, load: float = 0.0) -> float:
        """The rest of a step whose chunks went to the prompts (``D`` decodes holding ``tokens``,
        ``count`` chunks of ``ctok`` tokens and ``cflops`` of attention, prompts ``done``
        finishing, of ``lengths``; ``read``, ``fetch``, ``written``: a :class:`StepPlan`'s
        charges; ``load``: seconds of cached blocks loading beside it), in scalars: costed,
        logged and carried out; its seconds returned."""
        sim, t0 = self.sim, self.env.now
        step, gpu, link, alone = sim.steps.step(D, tokens, ctok, cflops, count, lengths, read,
                                                fetch, written)
        if load:
            step, link = max(step, load), link + load
        sim.chunks.add(t0, step, 1 if D else 0, D, gpu, link, "mixed" if D else "prefill", None,
                       ctok, alone)
        self.token_gaps(step, D)
        if D:
            if self.growing:
                self.admission.grow(self, 1)
            self.clock += 1
        if done:  # emitted at the end of the step
            self.join(done, 1, t0 + step)
        return step

    def _run_of_steps(self, plans) -> float:
        """:meth:`prefill_steps`'s run of several planned steps, costed in arrays (in scalars,
        step by step, when the run is short and the policy's steps cost no prefill work)."""
        sim, D, t0 = self.sim, plans[0].decodes, self.env.now
        costs, k = sim.steps, len(plans)
        until = self.until_next_arrival()
        if k <= SCALAR_RUN and not costs.works:
            got, ends, end = [], [], 0.0
            for p in plans:
                got.append(costs.step(p.decodes, p.decode_tokens, p.chunk_tokens, p.chunk_flops,
                                      len(p.assign), p.done_lengths, p.read_tokens,
                                      p.fetch_tokens, p.written_tokens))
                end += got[-1][0]  # (np.cumsum's order)
                ends.append(end)
                if end >= until:  # the step after the next arrival ends the run
                    k = len(ends)
                    break
            step, gpu, link, alone = zip(*got)
        else:
            step, gpu, link, alone = costs.run(
                np.array([p.decodes for p in plans], float),
                np.array([p.decode_tokens for p in plans], float), Chunks.of(plans),
                *costs.charges_of(plans))
            ends = np.cumsum(step)
            if until < np.inf:
                k = min(k, int(np.searchsorted(ends, until)) + 1)
        for j in range(k):
            Dj = plans[j].decodes
            sim.chunks.add(t0 + (ends[j - 1] if j else 0.0), float(step[j]),
                           1 if Dj else 0, Dj, float(gpu[j]), float(link[j]),
                           "mixed" if Dj else "prefill", None, plans[j].chunk_tokens,
                           float(alone[j]))
            self.token_gaps(float(step[j]), Dj)
        if D:
            if self.growing:
                self.admission.grow(self, k)
            self.clock += k
        prefilled = self.prefilled
        for j in range(k):
            p = plans[j]
            for i, size in p.assign:
                prefilled[i] += size
            if p.done:  # emitted at the end of step j, then decoded k - 1 - j more
                self.join(p.done, k - j, t0 + ends[j])
        return float(ends[k - 1])

    def decode_steps(self, k: int) -> float:
        """At most ``k`` decode steps of a fixed batch, up to the next arrival: carried out, and
        the seconds they take returned (as :meth:`prefill_steps`)."""
        B, log = len(self.running), self.sim.chunks
        keep = log.keeping
        ctx = self.batch()[1] if self.fixed or keep else None
        stalled = bool(self.stalls)  # the first step's gaps carry the waits: it runs alone
        k, seconds, gpu_s, link_s = self.sim.steps.decode_run(
            B, self.batch_tokens(), 1 if stalled else k, self.until_next_arrival(),
            ctx if self.fixed else None, None if stalled else self.requests.itl)
        if stalled:
            self.token_gaps(seconds, B)
        log.add(self.env.now, seconds, k, B, gpu_s, link_s, "decode", ctx if keep else None)
        if self.growing:
            self.admission.grow(self, k)
        self.clock += k
        return seconds

    def token_gaps(self, seconds: float, decodes: int) -> None:
        """A step of ``seconds`` in which ``decodes`` sequences emit a token: each token's gap
        to its sequence's previous one (:attr:`Requests.itl`). Running sequences that wait
        through steps without decoding (a prefill-first prefill, a swap) carry those steps'
        time into their next gap."""
        itl = self.requests.itl
        if decodes:
            carried = 0
            for n, waited in self.stalls:  # (those that waited longest first)
                n = min(n, decodes - carried)
                itl.add(seconds + waited, n)
                carried += n
            itl.add(seconds, decodes - carried)
            self.stalls = []
        elif self.running:  # every running sequence waits; those that joined since, less
            waiting = 0
            for entry in self.stalls:
                entry[1] += seconds
                waiting += entry[0]
            if len(self.running) > waiting:
                self.stalls.append([len(self.running) - waiting, seconds])

    # ------------------------------------------------------------------------ preemption
    def evict(self, victim: int) -> bool:
        """Preempt ``victim``: out of the batch (or of the prefills); whether it was
        prefilling. Nothing is admitted or resumed again until a request completes."""
        self.preemptions += 1
        self.pressure = True
        if victim in self.prefilling:
            self.prefilling.remove(victim)
            return True
        self.leave([victim])
        self.finish_at = [f for f in self.finish_at if f & SLOT_MASK != victim]
        heapq.heapify(self.finish_at)
        return False

    def recompute(self, victim: int) -> None:
        """An evicted request's cache is dropped: it waits first, to prefill again (its prompt
        and generated tokens once it has emitted any; its prompt's blocks stay cached where
        memory allows)."""
        self.release([victim], host=False)
        if self.cache is not None:
            self.unpin(victim)
        if not math.isnan(self.first_token[victim]):
            self.target[victim] = int(self.ctx[victim]) - 1
        self.waiting.appendleft(victim)

    def swap_out(self, victim: int, nbytes: int) -> None:
        """An evicted request's ``nbytes`` of HBM state go to host memory (copied by
        :meth:`transfer`); it resumes where it was."""
        self.release([victim], host=False)
        self.used_host += nbytes
        self.swap_host[victim] = nbytes
        self.peak_host = max(self.peak_host, self.used_host)
        self.swapped.append(victim)

    def resume_swapped(self):
        """Swapped-out requests come back first, over the link, when their HBM state fits."""
        while self.swapped and self.seats() > 0 and not self.pressure:
            i = self.swapped[0]
            need = int(self.sim.hbm_need(self.ctx[i]))
            if need > self.free_hbm():
                return
            self.swapped.popleft()
            self.used_host -= self.swap_host[i]
            self.swap_host[i] = 0
            self.hold(i, need)
            yield from self.transfer(need, "h2d")
            self.join([i])

    def transfer(self, nbytes: int, path: str):
        """A swap: the GPU stream waits for the copy of ``nbytes`` over the link."""
        t = float(self.sim.costs.link_time(nbytes, path, copies=2 * self.sim.model.layers))
        self.sim.chunks.add(self.env.now, t, 0, 0, 0.0, t, "swap")
        self.token_gaps(t, 0)
        yield t

    # -------------------------------------------------------------------------- completion
    def complete(self) -> None:
        """Release finished requests (also those whose only token came from prefill): the
        scheduler calls it when the top of the heap has finished (:meth:`_closed_turns`
        completes as this does, in short)."""
        heap, end = self.finish_at, (self.clock + 1) << SLOT_BITS
        ids = [heappop(heap) & SLOT_MASK]
        while heap and heap[0] < end:
            ids.append(heappop(heap) & SLOT_MASK)
        gone = len(ids)
        if gone > 1:
            ids.sort(key=self.running.index)  # batch order
        self.leave(ids)
        self.pressure = False
        now, records = self.env.now, self.records
        held_hbm, held_host, used_hbm, used_host = (self.held_hbm, self.held_host,
                                                    self.used_hbm, self.used_host)
        arrival, admitted, first, output = self.arrival, self.admitted, self.first_token, \
            self.output
        for i in ids:
            records.append((arrival[i], admitted[i], first[i], now, output[i]))
            if self.cache is not None:
                self.unpin(i)
            used_hbm -= held_hbm[i]  # (release, in scalars)
            used_host -= held_host[i]
            held_hbm[i] = held_host[i] = 0
        self.used_hbm, self.used_host = used_hbm, used_host
        if len(records) >= 1024:
            self.hand_over()
        self.free.extend(ids)
        self.done += gone
        if self.open:
            self.mark(-gone)
            return
        # closed loop: replace each at once (the number in the system drops and comes back at
        # the same instant, so the area integrates only up to now)
        rest = self.n - self.next
        more = rest if rest < gone else gone  # (min, without the call)
        self.mark(more - gone)
        for i in range(self.next, self.next + more):
            self.arrive(i, mark=False)
        self.next += more

    def unpin(self, i: int) -> None:
        """Request ``i`` no longer holds its cached blocks (done, or preempted)."""
        if self.load[i]:  # preempted before its first chunk: its load is not waited for
            self.load[i] = 0.0
            self.loading -= 1
        self.cache.finish(self.hashes[self.item[i]], self.pins[i])
        self.pins[i] = 0

    def hand_over(self) -> None:
        """The finished requests' metrics to ``requests``, in a block."""
        if n := len(self.records):  # (one flat pass: the fastest way into an array)
            self.requests.record(*np.fromiter(chain.from_iterable(self.records), float, 5 * n)
                                 .reshape(n, 5).T)
            self.records = []

    def finished(self) -> bool:
        if self.routed:
            return self.router_done and self.done == self.assigned
        return self.done >= self.n

    def _closed_turns(self):
        """The scheduler's turns while prompts prefill in a closed loop alone with reserve
        admission, a policy of shares only and a rule with a one-step path (:meth:`scheduler`),
        in short: each admits what fits (:meth:`admit`), takes its step (:meth:`prefill_steps`)
        and completes what finished with it, each replaced at once (:meth:`complete`), as those
        do, with the run's fields and counters in locals. Returns at the top of a turn with
        nothing to prefill, or at the end of the workload. ``tests/test_sim_rules.py`` holds it
        to the turns one by one, field by field."""
        sim, waiting, prefilling, heap, env = self.sim, self.waiting, self.prefilling, \
            self.finish_at, self.env
        hbm_per_token, host_per_token = sim.kv.hbm_per_token, sim.kv.host_per_token
        prompt, output, held_hbm, held_host, admitted, order, prefilled, arrival, first, ctx = (
            self.prompt, self.output, self.held_hbm, self.held_host, self.admitted, self.order,
            self.prefilled, self.arrival, self.first_token, self.ctx)
        cap_hbm, cap_host, max_batch, n = self.cap_hbm, self.cap_host, sim.max_batch, self.n
        used_hbm, used_host, peak_hbm, peak_host, done, admissions, area, t, in_system = (
            self.used_hbm, self.used_host, self.peak_hbm, self.peak_host, self.done,
            self.admissions, self.area, self.t, self.in_system)
        while done < n:
            seats, now = max_batch - len(self.running) - len(prefilling), env.now  # admit
            while waiting and seats > 0:  # (reserve: never preempted, so never admitted yet)
                i = waiting[0]
                h = math.ceil(hbm_per_token * (prompt[i] + output[i]))
                o = 0 if held_host[i] else math.ceil(host_per_token * (prompt[i] + output[i]))
                if h > cap_hbm - used_hbm or o > cap_host - used_host:
                    break
                waiting.popleft()
                held_hbm[i], held_host[i] = held_hbm[i] + h, held_host[i] + o
                used_hbm, used_host, seats = used_hbm + h, used_host + o, seats - 1
                admitted[i], order[i] = now, admissions + 1
                admissions, prefilled[i] = admissions + 1, 0
                prefilling.append(i)
                peak_hbm = used_hbm if used_hbm > peak_hbm else peak_hbm  # (max, without calls)
                peak_host = used_host if used_host > peak_host else peak_host
            if not prefilling:
                break
            got = self.one_step(self, False)
            yield self._one(*got) if got is not None else self.prefill_steps()  # (several)
            end = (self.clock + 1) << SLOT_BITS  # complete
            if not heap or heap[0] >= end:
                continue
            ids = [heappop(heap) & SLOT_MASK]
            while heap and heap[0] < end:
                ids.append(heappop(heap) & SLOT_MASK)
            running, run_ctx = self.running, self.run_ctx
            if len(ids) > 1:
                ids.sort(key=running.index)
            now, records = env.now, self.records
            for i in ids:  # out of the batch (as :meth:`leave`; a finished slot's ctx and left
                running.remove(i)  # are set again when it is reused)
                run_ctx -= ctx[i]
                records.append((arrival[i], admitted[i], first[i], now, output[i]))
                used_hbm, used_host = used_hbm - held_hbm[i], used_host - held_host[i]
                held_hbm[i] = held_host[i] = 0
            if len(records) >= 1024:
                self.hand_over()
            self.free.extend(ids)
            gone, rest = len(ids), n - self.next
            self.run_ctx, done, more = run_ctx, done + gone, rest if rest < gone else gone
            area, t, in_system = area + in_system * (now - t), now, in_system + more - gone
            for i in range(self.next, self.next + more):
                self.arrive(i, mark=False)
            self.next += more
        self.used_hbm, self.used_host, self.peak_hbm, self.peak_host, self.done, \
            self.admissions, self.area, self.t, self.in_system = (
                used_hbm, used_host, peak_hbm, peak_host, done, admissions, area, t, in_system)

    def scheduler(self):
        """The run's one process: it yields the seconds to wait (a run alone on a :class:`Clock`;
        routed, through :func:`on_simpy`) and, routed, the event of its next request."""
        n, routed = self.n, self.routed
        while (self.done < n) if not routed else not self.finished():
            if self.swapped:
                yield from self.resume_swapped()
            if self.waiting or self.pulls and self.next < self.n and \
                    self.arrivals[self.next] <= self.env.now:  # (else admit does nothing)
                self.admit()
            if self.prefilling:
                if self.growing and self.scheduler_rule.decodes_while_prefilling:
                    while self.admission.fit(self, 1) < 1:
                        yield from self.preemption.preempt(self)
                        self.pull()  # a swap-out took time
                if self.closed_turns:
                    yield from self._closed_turns()
                    continue
                yield self.prefill_steps()
            elif self.running:  # up to the next completion or memory limit
                k = min(self.soonest(), MAX_CHUNK)
                if self.growing:
                    k = self.admission.fit(self, k)
                if k >= 1:
                    yield self.decode_steps(k)
                else:  # the next step does not fit
                    yield from self.preemption.preempt(self)
            elif self.pulls and self.next < self.n:  # idle until the next arrival
                i, at = self.next, self.arrivals[self.next]
                yield max(at - self.env.now, 0.0)
                self.arrive(i, at)
                self.next = i + 1
                continue
            else:  # idle until a router hands over a request
                self.wake = self.env.event()
                yield self.wake
                continue
            if self.finish_at and self.finish_at[0] < (self.clock + 1) << SLOT_BITS:
                self.complete()
        self.hand_over()
