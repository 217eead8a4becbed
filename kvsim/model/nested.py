"""Nested captures: one long context whose prefixes are the shorter contexts, questions per length.

A *nested prompt* is a context cut into pieces (an intro, then sentences or documents) and, per
target length, the number of pieces its context keeps and questions about facts inside that
prefix. Causal attention makes the keys and values of a prefix the same whatever follows it, so
one prefill of the longest context serves every length: for each length the cache is cut back to
its prefix and each question (with its decode steps) runs from there. The facts are spread over
the whole context (each length's new stretch holds its own), so that a longer context's question
may ask about any depth.

Tasks: ``mk`` (RULER's multi-key needles: many keys, one asked) and ``qa`` (a person's city among
many short documents).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import numpy as np
import torch

from kvsim import captureset as cs
from kvsim.attention.scoring import snapkv_scores
from kvsim.captureset import kv_heads_for
from kvsim.errors import KvsimError
from kvsim.model import tasks
from kvsim.model.hooks import Controller
from kvsim.model.runner import (
    SNAPKV_WINDOW,
    Prefilled,
    cache_kv,
    generate,
    prefill_recording,
    truncate,
)

NESTED_TASKS = ("mk", "qa")
FACTS_PER_STRETCH = 4  # needles or asked documents placed in each length's new stretch
_RESERVE = 70  # tokens of the question part and the chat template (SmolLM2: 45-60)


@dataclass
class Question:
    question: str
    answers: list[str]
    answer_prefix: str
    depth: float  # where the asked fact sits, as a share of this length's context


@dataclass
class NestedPrompt:
    task: str
    pieces: list[str]
    cuts: list[int]  # per length: pieces its context keeps
    questions: list[list[Question]]  # per length


def nested_prompt(task: str, lengths: list[int], n_questions: int, seed: int,
                  count) -> NestedPrompt:
    """Pieces, cuts and questions for ``lengths`` (ascending prompt lengths in tokens)."""
    if task not in NESTED_TASKS:
        raise KvsimError(f"--task {task!r}: nested captures (--lengths) know {NESTED_TASKS}")
    if not 1 <= n_questions <= FACTS_PER_STRETCH:
        raise KvsimError(f"--questions must be 1..{FACTS_PER_STRETCH}, got {n_questions}")
    rng = random.Random(f"nested/{task}/{seed}")
    budgets = [n - _RESERVE for n in lengths]
    if budgets[0] < 200:
        raise KvsimError(f"--lengths: the shortest must be at least {200 + _RESERVE} tokens")
    taken_keys: set[str] = set()
    taken_vals: set[str] = set()
    intro = tasks._NIAH_INTRO if task == "mk" else \
        "Answer the question based on the given documents.\n"
    pieces, facts, total = [intro], [], count(intro)  # facts: (piece index, Question)
    people: set[str] = set()
    for budget in budgets:
        at = sorted(rng.uniform(total, budget - 60) for _ in range(FACTS_PER_STRETCH))
        while True:
            fact = bool(at) and total >= at[0]
            q = None
            if fact:
                text, q = _fact(task, rng, taken_keys, taken_vals, people)
            else:
                text = " " + tasks.filler_sentence(rng) if task == "mk" else \
                    _document(rng, people)[0]
            c = count(text)
            if total + c > budget and not fact:
                if not at:
                    break
                at[0] = total  # the stretch is full: its remaining facts go here
                continue
            if fact:
                at.pop(0)
                facts.append((len(pieces), q))
            pieces.append(text)
            total += c
    cum = np.cumsum([0] + [count(p) for p in pieces])
    cuts = [int(np.searchsorted(cum, b, side="right")) - 1 for b in budgets]
    if task == "qa":
        _unique_cities(pieces, facts, rng)
    questions = []
    for cut in cuts:
        inside = [(i, q) for i, q in facts if i < cut]
        chosen = rng.sample(inside, min(n_questions, len(inside)))
        questions.append([Question(q.question, q.answers, q.answer_prefix, i / cut)
                          for i, q in sorted(chosen, key=lambda x: x[0])])
    return NestedPrompt(task, pieces, cuts, questions)


def _fact(task, rng, keys, vals, people) -> tuple[str, Question]:
    if task == "mk":
        k, v = tasks._key(rng, keys), tasks._number(rng, vals)
        q = Question(f"What is the special magic number for {k} mentioned in the provided text?",
                     [v], f"The special magic number for {k} mentioned in the provided text is",
                     0.0)
        return f" One of the special magic numbers for {k} is: {v}.", q
    text, person, city = _document(rng, people)
    return text, Question(f"Question: In which city does {person} live?", [city],
                          f"Answer: {person} lives in", 0.0)


def _document(rng, people: set[str]) -> tuple[str, str, str]:
    while True:
        p = tasks._person(rng)
        if p not in people:
            people.add(p)
            break
    city, job = rng.choice(tasks._CITIES), rng.choice(tasks._JOBS)
    body = " ".join(tasks.filler_sentence(rng) for _ in range(rng.randint(2, 4)))
    return f"\nDocument {len(people)}: {p} is a {job} who lives in {city}. {body}", p, city


def _unique_cities(pieces: list[str], facts, rng) -> None:
    """No unasked document names an asked person's city (the answer is unambiguous)."""
    asked = {q.answers[0] for _, q in facts}
    others = [c for c in tasks._CITIES if c not in asked]
    fact_at = {i for i, _ in facts}
    if not others:
        raise KvsimError("too many qa questions for the city list; use fewer --lengths")
    for i, p in enumerate(pieces):
        if i in fact_at or " lives in " not in p:
            continue
        city = p.split(" lives in ")[1].split(".")[0]
        if city in asked:
            pieces[i] = p.replace(f" lives in {city}.", f" lives in {rng.choice(others)}.", 1)


@torch.no_grad()
def capture_nested(lm, prompt: NestedPrompt, lengths: list[int], layers: list[int],
                   heads_per_layer: int, weights: dict[int, float], decode_steps: int = 8,
                   progress: bool = True, seed: int = 0, notes: str = "") -> cs.CaptureSet:
    """One prefill of the longest context, then each length's questions from its prefix."""
    from tqdm import tqdm
    model, codec, info = lm.model, lm.codec, lm.info
    n_kv, g = info["kv_heads"], info["q_heads"] // info["kv_heads"]
    if not 1 <= heads_per_layer <= n_kv:
        raise KvsimError(f"--kv-heads must be 1..{n_kv}, got {heads_per_layer}")
    if lengths[-1] > info.get("max_position_embeddings", 1 << 30):
        raise KvsimError(f"--lengths {lengths[-1]} is beyond the model's "
                         f"{info['max_position_embeddings']} positions")
    t0 = time.perf_counter()
    piece_ids, _ = codec.nested_layout(prompt.pieces, "")
    ctx_ids = [t for p in piece_ids for t in p]
    cut_tok = [sum(len(p) for p in piece_ids[:c]) for c in prompt.cuts]
    heads = {l: kv_heads_for(l, heads_per_layer, n_kv) for l in layers}
    qrows = {l: [h * g + i for h in heads[l] for i in range(g)] for l in layers}
    steps = sum(len(qs) for qs in prompt.questions)
    bar = tqdm(total=1 + steps, desc="nested capture", unit="pass",
               disable=None if progress else True)  # on a terminal
    bar.set_postfix_str(f"prefill of {len(ctx_ids)} tokens")
    cache, ctx_q = prefill_recording(model, ctx_ids, set(layers))
    bar.update(1)
    kv = {l: tuple(x[heads[l]].clone() for x in cache_kv(cache, l)) for l in layers}
    out_lengths = []
    for j in reversed(range(len(lengths))):  # longest first: each cut shortens the cache
        n = cut_tok[j]
        truncate(cache, n)
        snap = {}
        for l in layers:
            w = min(SNAPKV_WINDOW, n)
            obs = ctx_q[l][qrows[l], n - w:n]
            snap[l] = snapkv_scores(kv[l][0][:, :n], obs.to(kv[l][0].dtype), torch.arange(n - w, n))
        qs_out = []
        for qi, q in enumerate(prompt.questions[j]):
            bar.set_postfix_str(f"{lengths[j]} tokens, question {qi + 1}")
            _, q_ids = codec.nested_layout(prompt.pieces[:1], q.question, q.answer_prefix)
            pre = Prefilled(cache, ctx_ids[:n], {}, torch.arange(0))
            ctl_rec = Controller(mode="stock", record_layers=set(layers))
            gen = generate(model, codec, pre, q_ids, decode_steps + 1, stop=False, crop=False,
                           controller=ctl_rec)
            m_q = len(q_ids)
            per_layer = {}
            for l in layers:
                k, v = cache_kv(cache, l)
                if k.shape[1] != n + m_q + decode_steps:
                    raise RuntimeError(f"layer {l}: cache holds {k.shape[1]} tokens")
                rows = torch.cat(ctl_rec.queries[l], dim=1)[qrows[l]]
                per_layer[l] = cs.Suffix(_f16(k[heads[l], n:]), _f16(v[heads[l], n:]),
                                         _f16(rows[:, :m_q]), _f16(rows[:, m_q:]))
            truncate(cache, n)
            answer = gen.text.strip().split("\n")[0]
            qs_out.append(cs.Asked(q.question, q.answers, q.answer_prefix, round(q.depth, 4),
                                   gen.text, tasks.score(answer, q.answers), m_q, per_layer))
            bar.update(1)
        out_lengths.append(cs.Length(lengths[j], n, {l: snap[l].float().numpy() for l in layers},
                                     qs_out))
    bar.close()
    out_lengths.reverse()
    prov = (f"captured by kvsim capture --lengths from {lm.description}, stock attention; one "
            f"prefill of {len(ctx_ids)} context tokens whose prefixes are the shorter contexts; "
            f"{len(layers)} of {info['layers']} layers, {heads_per_layer} of {n_kv} KV heads "
            f"each; K/V post-RoPE fp16")
    return cs.CaptureSet(
        meta={"task": prompt.task, "model": lm.description, "model_info": info, "seed": seed,
              "decode_steps": decode_steps, "notes": notes,
              "seconds": round(time.perf_counter() - t0, 1)},
        layers=layers, heads=heads, weights={l: float(weights.get(l, 1.0)) for l in layers},
        ctx_k={l: _f16(kv[l][0]) for l in layers}, ctx_v={l: _f16(kv[l][1]) for l in layers},
        lengths=out_lengths, rope=dict(info["rope"]), provenance=prov)


def _f16(x: torch.Tensor) -> np.ndarray:
    return x.detach().to(torch.float16).cpu().numpy()
