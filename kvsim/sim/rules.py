"""The rules a run (:class:`kvsim.sim.batching.Run`) schedules by, each a small class registered
by name in ``RULES`` and chosen by a field of :class:`Scheduling`:

* ``order``: which waiting request is admitted next (``arrival``, ``shortest-prompt-first``);
* ``scheduler``: what the next steps do while prompts are prefilling (``chunked``: vLLM's token
  budget per step, decodes first; ``prefill-first``: admitted prompts prefill whole while every
  decode waits);
* ``admission``: the HBM a request holds (``reserve``: its whole length from admission, never
  preempted; ``grow``: vLLM's, a token more at every decode step);
* ``preemption``: what happens to the most recently admitted request when a grow step does not
  fit (``recompute``: its KV is dropped and prefilled again; ``swap``: its state goes to host
  memory over the link and comes back when it fits).

A new rule is one class here, registered under a new name: the flag's choices, the validation
and the run pick it up. Rules read the run's state and change it through the run's methods.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field, fields

import numpy as np

from kvsim.errors import KvsimError
from kvsim.sim.records import MAX_CHUNK, StepPlan

RULES: dict[str, dict[str, type]] = {"order": {}, "scheduler": {}, "admission": {},
                                     "preemption": {}}


def rule(kind: str, name: str):
    """Register the decorated class as rule ``name`` of ``kind``."""
    def register(cls):
        RULES[kind][name] = cls
        return cls
    return register


# ------------------------------------------------------------------------- admission order
@rule("order", "arrival")
class ArrivalOrder(deque):
    """Waiting requests in arrival order; a preempted request goes back to the front."""
    summary = "arrival order"

    def __init__(self, run):
        super().__init__()


@rule("order", "shortest-prompt-first")
class ShortestPromptFirst:
    """The waiting request with the shortest prompt first (ties in arrival order); a preempted
    request goes back to the front, as in arrival order."""
    summary = "shortest prompt"

    def __init__(self, run):
        self.prompt, self.heap, self.count = run.prompt, [], 0

    def append(self, slot: int) -> None:
        self.count += 1
        heapq.heappush(self.heap, (1, self.prompt[slot], self.count, slot))

    def appendleft(self, slot: int) -> None:
        self.count += 1
        heapq.heappush(self.heap, (0, -self.count, 0, slot))

    def popleft(self) -> int:
        return heapq.heappop(self.heap)[3]

    def __getitem__(self, i: int) -> int:
        if i:
            raise IndexError("only the head of the queue is known")
        return self.heap[0][3]

    def __len__(self) -> int:
        return len(self.heap)


# ------------------------------------------------------------------------------ schedulers
def _work(run, lengths: list[float]) -> tuple[float, float]:
    """The policy's prefill work (FLOPs, bytes) for prompts of these lengths."""
    if not run.sim.steps.works:
        return 0.0, 0.0
    w = run.sim.prefill_work
    return sum(w.flops(x) for x in lengths), sum(w.bytes(x) for x in lengths)


def _whole(run, decodes: int) -> StepPlan:
    """One step in which every prompt prefills the rest of itself, beside a decode token of
    each of the running batch's ``decodes`` sequences (all of them, or none)."""
    sim, pf = run.sim, list(run.prefilling)
    costs, m = sim.steps, sim.model
    if len(pf) == 1:  # the common step, in scalars
        i = pf[0]
        done, target = run.prefilled[i], run.target[i]
        tokens = target - done
        assign, lengths = [(i, tokens)], [float(target)]
        s = float(tokens)  # (ModelSpec.attention_flops, in scalars: the same product)
        flops = m.flops_per_pair * (s * float(done) + s * (s + 1) / 2)
        if not costs.works and not costs.fixed:
            return StepPlan(decodes, run.batch_tokens() if decodes else 0.0, tokens, flops,
                            assign, pf, lengths, 0.0, 0.0)
    else:
        assign = [(i, run.target[i] - run.prefilled[i]) for i in pf]
        flops = sum(m.attention_flops(float(n), float(run.prefilled[i])) for i, n in assign)
        lengths, tokens = [float(run.target[i]) for i in pf], sum([n for _, n in assign])
    work = _work(run, lengths)
    if not costs.fixed:
        return StepPlan(decodes, run.batch_tokens() if decodes else 0.0, tokens, flops, assign,
                        pf, lengths, *work)
    charges = (costs.charged(run.batch()[1]) if decodes else (0.0, 0.0)) + (
        costs.written([run.prefilled[i] for i in pf], [n for _, n in assign]),)
    return StepPlan(decodes, run.batch_tokens() if decodes else 0.0, tokens, flops, assign, pf,
                    lengths, *work, *charges)


@rule("scheduler", "chunked")
class Chunked:
    """vLLM's: each step's token budget goes to the decodes first, then to chunks of the prompts
    in order; a prompt that finishes emits a token and decodes from the next step."""
    summary = "a token budget per step, decodes first, then prompt chunks (vLLM)"
    decodes_while_prefilling = True

    def plan(self, run, single: bool) -> list[StepPlan]:
        """The next steps, in scalars, up to the next completion, at most ``MAX_CHUNK``, one
        if ``single``."""
        budget, D, costs = run.sched.max_batched_tokens, len(run.running), run.sim.steps
        target, prefilled, slots = run.target, run.prefilled, run.prefilling
        todo = [target[i] - prefilled[i] for i in slots]
        if not single and sum(todo) <= budget - D:
            return [_whole(run, D)]  # it all fits in one step
        # each prompt's tokens still to prefill and prefilled; chunks go in order, so the
        # prompts that have finished are always the first ``first``
        at = [prefilled[i] for i in slots]
        first, count = 0, len(slots)
        per_pair = run.sim.model.flops_per_pair  # (ModelSpec.attention_flops)
        tokens = run.batch_tokens()
        min_left = run.soonest() if D else None
        held = run.batch()[1] if costs.fixed else None  # the decodes' tokens, one by one
        plans: list[StepPlan] = []
        while first < count and len(plans) < MAX_CHUNK:
            left = budget - D
            assign, fin, ctok, cflops = [], [], 0, 0.0
            j = first
            while j < count and left > 0:
                size, q = todo[j], at[j]
                if size > left:
                    size = int(left)
                assign.append((slots[j], size))
                s = float(size)
                cflops += per_pair * (s * float(q) + s * (s + 1) / 2)
                ctok += size
                left -= size
                todo[j] -= size
                at[j] = q + size
                if todo[j] == 0:
                    fin.append(slots[j])
                j += 1
            first += len(fin)
            lengths = [float(target[i]) for i in fin]
            work = _work(run, lengths)
            if held is None:
                plans.append(StepPlan(D, tokens, ctok, cflops, assign, fin, lengths, *work))
            else:
                prefixes = [at[k] - n for k, (_, n) in zip(range(j - len(assign), j), assign)]
                plans.append(StepPlan(D, tokens, ctok, cflops, assign, fin, lengths, *work,
                                      *costs.charged(held),
                                      costs.written(prefixes, [n for _, n in assign])))
            if single or (min_left is not None and min_left <= 1):
                break  # a decode finishes with this step (or one step was asked for)
            tokens += D  # each decode appended a token
            if held is not None:
                held = held + 1.0
            if min_left is not None:
                min_left -= 1
            if fin:  # they join the decodes with their first (or next) token
                c = [float(run.prompt[i] if math.isnan(run.first_token[i]) else run.ctx[i])
                     + 1.0 for i in fin]
                tokens += sum(c)
                if held is not None:
                    held = np.concatenate([held, c])
                D += len(fin)
                lft = int(min([run.left[i] for i in fin])) - 1
                min_left = lft if min_left is None else min(min_left, lft)
            if min_left is not None and min_left <= 0:
                break
        return plans

    def one_step(self, run, single: bool) -> tuple | None:
        """:meth:`plan` where it is one step and the policy's terms are shares only (no prefill
        work), carried out as it is planned (the common turn, in short): the chunks go to the
        prompts (``run.prefilled``) and the step's (decodes, their KV tokens, chunk tokens,
        attention FLOPs, chunks, prompts that finish, their lengths) are returned. None, with
        nothing changed, where the plan is several steps or the policy is not of shares only."""
        costs = run.sim.steps
        if costs.fixed or costs.works:
            return None
        D, slots = len(run.running), run.prefilling
        per_pair, prefilled, target = run.sim.model.flops_per_pair, run.prefilled, run.target
        left = run.sched.max_batched_tokens - D  # after the decodes, to the prompts in order
        fin, lengths, ctok, cflops, count, part = [], [], 0, 0.0, 0, None
        for i in slots:
            if left <= 0:
                break
            done = prefilled[i]
            size = target[i] - done
            if size > left:  # (only the last chunk)
                size = int(left)
                part = i, size
            else:
                fin.append(i)
                lengths.append(float(target[i]))
            count += 1
            s = float(size)
            cflops += per_pair * (s * done + s * (s + 1) / 2)  # (float * int: the int as a float)
            ctok += size
            left -= size
        if not (single or len(fin) == len(slots) or D and run.soonest() <= 1):
            return None  # several steps: no decode finishes with this one and prompts remain
        for i in fin:
            prefilled[i] = target[i]
        if part is not None:
            prefilled[part[0]] += part[1]
        return D, run.batch_tokens(), ctok, cflops, count, fin, lengths


@rule("scheduler", "prefill-first")
class PrefillFirst:
    """The earlier model: admitted prompts prefill together, whole, while every decode waits."""
    summary = "prompts prefill whole, decodes wait"
    decodes_while_prefilling = False

    def plan(self, run, single: bool) -> list[StepPlan]:
        return [_whole(run, 0)]


# ------------------------------------------------------------------------------- admission
@rule("admission", "reserve")
class Reserve:
    """HBM for a request's whole length (prompt + output) from admission on: never preempted.
    (A rule that ``grows`` holds the tokens to prefill at admission and has ``fit`` and
    ``grow`` for the decode steps; the run asks only such a rule.)"""
    summary = "HBM for the whole request at admission"
    grows = False


@rule("admission", "grow")
class Grow:
    """vLLM's: HBM for the tokens to prefill at admission, and a token more per decode step."""
    summary = "per token (vLLM), preempting when HBM runs out"
    grows = True

    def fit(self, run, k: int) -> int:
        """How many of the running batch's next ``k`` decode steps fit in HBM."""
        if not run.running:
            return k
        ids, ctx = run.batch()
        held = np.array([run.held_hbm[i] for i in ids], np.int64)
        need = run.sim.hbm_need
        per = need(ctx + k) - held
        if int(per.sum()) <= run.free_hbm():
            return k
        per_step = max(float(per.sum()) / k, 1.0)
        k = int(run.free_hbm() // per_step)
        while k > 0 and int((need(ctx + k) - held).sum()) > run.free_hbm():
            k -= 1
        return k

    def grow(self, run, k: int) -> None:
        """The running batch holds its next ``k`` tokens' bytes."""
        if run.running:
            ids, ctx = run.batch()
            for i, need in zip(ids, run.sim.hbm_need(ctx + k).tolist()):
                run.hold(i, need - run.held_hbm[i])


# ------------------------------------------------------------------------------ preemption
class Preemption:
    """The victim is the most recently admitted request that holds HBM; one still prefilling
    is always recomputed."""
    swaps = False

    def preempt(self, run):
        victim = max(run.running + run.prefilling, key=lambda i: run.order[i])
        nbytes = run.held_hbm[victim]
        prefilling = run.evict(victim)
        if not prefilling and self.swaps and run.used_host + nbytes <= run.cap_host:
            run.swap_out(victim, nbytes)
            yield from run.transfer(nbytes, "d2h")
        else:  # else recompute (also for lack of host room): its cache is dropped
            run.recompute(victim)


@rule("preemption", "recompute")
class Recompute(Preemption):
    """The victim's KV is dropped; it waits at the front and prefills prompt and generated
    tokens again."""
    summary = "prefill the victim again"


@rule("preemption", "swap")
class Swap(Preemption):
    """The victim's HBM state is copied to host memory and back when it fits again (resumed
    where it was); recomputed where host memory has no room."""
    summary = "copy it to host memory and back"
    swaps = True


# ------------------------------------------------------------------------------ the options
def _rule_field(kind: str, default: str, about: str = "", **meta):
    """An option naming a rule of ``kind``: its choices are the registry's (a rule registered
    later is one), its help each registered rule's ``summary`` (else its docstring's first
    sentence)."""
    said = "; ".join(f"{name}: {_summary(cls)}" for name, cls in RULES[kind].items())
    meta |= {"choices": RULES[kind].keys(), "help": f"{about}{said} [default: {default}]"}
    return field(default=default, metadata=meta)


def _summary(cls) -> str:
    text = getattr(cls, "summary", None) or " ".join((cls.__doc__ or "").split())
    return text.split(". ")[0].rstrip(".") if text else "(no description)"


@dataclass(frozen=True)
class Scheduling:
    """How the engine batches; each field is also a command-line flag of ``kvsim replay`` and
    ``kvsim plan`` (:mod:`kvsim.commands._option_flags`)."""
    scheduler: str = _rule_field("scheduler", "chunked")
    max_batched_tokens: int | None = field(default=None, metadata={
        "kind": int, "metavar": "N", "help": "chunked: tokens per step [default: vLLM's: 8192 "
        "on GPUs of 70+ GiB but A100, else 2048]"})
    admission: str = _rule_field("admission", "reserve")
    preemption: str = _rule_field("preemption", "recompute", "grow admission: ")
    admission_order: str = _rule_field("order", "arrival", "admitted next: ",
                                       keyed="when set")

    def check(self) -> None:
        for f in fields(Scheduling):  # (also the fields of a class made of more options)
            allowed = f.metadata.get("choices")
            if allowed and getattr(self, f.name) not in allowed:
                raise KvsimError(f"--{f.name.replace('_', '-')} must be one of "
                                 f"{', '.join(allowed)}; got {getattr(self, f.name)!r}")
        b = self.max_batched_tokens
        if b is not None and (isinstance(b, bool) or int(b) != b or b < 1):
            raise KvsimError(f"--max-batched-tokens must be a whole number >= 1; got {b}")

    def rules(self) -> tuple:
        """An instance of the scheduler, admission and preemption rules the fields name (the
        admission order is made per run: it holds the run's queue)."""
        return tuple(RULES[k][getattr(self, k)]() for k in ("scheduler", "admission",
                                                             "preemption"))
