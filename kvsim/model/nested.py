"""Nested captures: one long context whose prefixes are the shorter contexts, questions per length.

A *nested prompt* is a context cut into pieces (an intro, then sentences, documents or list
entries) and, per target length, the number of pieces its context keeps and questions about facts
inside that prefix. Causal attention makes the keys and values of a prefix the same whatever
follows it, so one prefill of the longest context serves every length: for each length the cache
is cut back to its prefix and each question (with its decode steps) runs from there. The facts are
spread over the whole context (each length's new stretch holds its own), so that a longer
context's question may ask about any depth.

Tasks, after RULER's (a prefix of the shortest length is RULER's task; longer prefixes add the
later stretches' facts):

- ``mk``: multi-key needles; four needles with different keys per stretch, one key asked.
- ``qa``: a person's city among many short documents; four asked documents per stretch.
- ``niah``: single needle. A nested prompt cannot keep one needle in every prefix and still ask
  about every depth, so each stretch holds exactly one needle, and the needles of different
  stretches are of different kinds (a magic number, word or code for a key, or the pass key of
  the original passkey test). What makes RULER's niah_single single is that nothing else in the
  haystack looks like the asked needle; here no other sentence has the asked needle's kind or key
  words, so each question has one matching needle (``mk`` is the contrast: same-template
  distractors). The 1K prefix holds one needle and one question; 8K holds four.
- ``mv``: multi-value; one key per stretch with four values spread through that stretch, all
  asked (match "all"). As in RULER's niah_multivalue the key's values are the only needles when
  the shortest length is asked; longer prefixes add the other stretches' keys.
- ``vt``: variable tracking; one chain per stretch, ``VAR AAAAA = 12345`` then four hops
  ``VAR BBBBB = VAR AAAAA`` in order through the stretch; asked: every variable of a chain
  (match "all"), as RULER's variable_tracking (one chain, four hops; 8K holds four chains).
- ``cwe``: common-word extraction over one numbered word list. The list is a sequence of rounds,
  each a shuffle of the ten common words and fifteen rare ones (each rare word once per nine
  rounds, about RULER's 30:3 frequency ratio), so the ten common words are the ten most frequent
  in every prefix (checked exactly per prefix, with a strict gap). One question per length.

Per stretch, ``niah``, ``mv`` and ``vt`` place one fact (so the shortest length has one question,
the next two, ...); ``mk`` and ``qa`` four.
"""

from __future__ import annotations

import collections
import random
import re
import string
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

NESTED_TASKS = ("niah", "mk", "mv", "vt", "qa", "cwe")
FACTS_PER_STRETCH = 4  # needles or asked documents placed in each length's new stretch (mk, qa)
_RESERVE = 70  # tokens of the question part and the chat template (SmolLM2: 45-60)
_RESERVE_LONG = {"vt": 95}  # RULER's long answer prefix: a question part of 63 tokens
_INTRO = {
    "mk": tasks._NIAH_INTRO, "mv": tasks._NIAH_INTRO,
    "qa": "Answer the question based on the given documents.\n",
    "niah": ("Some special magic values are hidden within the following text. Make sure to "
             "memorize them. I will quiz you about the values afterwards.\n"),
    "vt": tasks._VT_INTRO, "cwe": tasks._CWE_INTRO,
}


@dataclass
class Question:
    question: str
    answers: list[str]
    answer_prefix: str
    depth: float  # where the asked fact sits (its pieces' mean), as a share of the context
    match: str = "any"  # tasks.score's rule: "all" when every answer is asked for


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
        raise KvsimError(f"--task {task!r}: nested captures (--lengths) know "
                         f"{', '.join(NESTED_TASKS)}")
    if not 1 <= n_questions <= FACTS_PER_STRETCH:
        raise KvsimError(f"--questions must be 1..{FACTS_PER_STRETCH}, got {n_questions}")
    if task == "niah" and len(lengths) > len(_NIAH_KINDS):
        raise KvsimError(f"--task niah nests at most {len(_NIAH_KINDS)} lengths (one needle "
                         f"kind each), got {len(lengths)}")
    rng = random.Random(f"nested/{task}/{seed}")
    reserve = _RESERVE_LONG.get(task, _RESERVE)
    budgets = [n - reserve for n in lengths]
    if budgets[0] < 200:
        raise KvsimError(f"--lengths: the shortest must be at least {200 + reserve} tokens")
    if task == "cwe":
        return _cwe_prompt(rng, budgets, count)
    pieces, facts = _place(task, rng, budgets, count)
    cum = np.cumsum([0] + [count(p) for p in pieces])
    cuts = [int(np.searchsorted(cum, b, side="right")) - 1 for b in budgets]
    if task == "qa":
        _unique_cities(pieces, facts, rng)
    questions = []
    for cut in cuts:
        inside = [(at, q) for at, q in facts if at[-1] < cut]  # every piece of the fact inside
        chosen = rng.sample(inside, min(n_questions, len(inside)))
        questions.append([Question(q.question, q.answers, q.answer_prefix,
                                   sum(at) / len(at) / cut, q.match)
                          for at, q in sorted(chosen, key=lambda x: x[0])])
    return NestedPrompt(task, pieces, cuts, questions)


def _place(task, rng, budgets, count) -> tuple[list[str], list[tuple[list[int], Question]]]:
    """The pieces, and each fact's piece indices and question: per length's budget, the
    stretch's fact pieces at random (ordered) places among filler."""
    st = {"keys": set(), "vals": set(), "people": set(), "kinds": None}
    intro = _INTRO[task]
    pieces, total = [intro], count(intro)
    facts: dict[int, tuple[list[int], Question]] = {}  # by id of the question, in order
    for j, budget in enumerate(budgets):
        todo = _stretch(task, rng, st, j)  # makers of (text, question) in their order
        at = sorted(rng.uniform(total, budget - 60) for _ in todo)
        while True:
            fact = bool(at) and total >= at[0]
            q = None
            if fact:
                text, q = todo[0]()
            elif task == "qa":
                text = _document(rng, st["people"])[0]
            else:
                text = " " + tasks.filler_sentence(rng)
            c = count(text)
            if total + c > budget and not fact:
                if not at:
                    break
                at[0] = total  # the stretch is full: its remaining facts go here
                continue
            if fact:
                at.pop(0)
                todo.pop(0)
                facts.setdefault(id(q), ([], q))[0].append(len(pieces))
            pieces.append(text)
            total += c
    return pieces, list(facts.values())


def _stretch(task, rng, st, j) -> list:
    """Makers of the fact pieces of stretch ``j``. mk and qa draw each fact when it is placed
    (the shipped captures' order of draws); the other tasks draw the stretch's facts here."""
    if task in ("mk", "qa"):
        return [lambda: _fact(task, rng, st["keys"], st["vals"], st["people"])
                for _ in range(FACTS_PER_STRETCH)]
    if task == "niah":
        if st["kinds"] is None:
            st["kinds"] = rng.sample(_NIAH_KINDS, len(_NIAH_KINDS))
        made = _niah_fact(st["kinds"][j], rng, st["keys"], st["vals"])
    elif task == "mv":
        made = _mv_fact(rng, st["keys"], st["vals"])
    else:
        made = _vt_fact(rng, st["keys"], st["vals"])
    return [lambda m=m: m for m in made]


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


_NIAH_KINDS = ("number", "word", "code", "pass key")
_MAGIC_WORDS = ("pineapple", "saxophone", "glacier", "marmalade", "trombone", "cactus",
                "avalanche", "porcupine", "telescope", "origami", "volcano", "lemonade",
                "hammock", "compass", "tornado", "penguin", "asteroid", "mandolin", "walrus",
                "harmonica", "cinnamon", "accordion", "dragonfly", "kaleidoscope")  # in no filler


def _niah_fact(kind, rng, keys, vals) -> list[tuple[str, Question]]:
    """One needle of ``kind``: RULER's "One of the special magic {kind}s for {key} is: {value}."
    or, for the pass key, the original passkey test's sentence (no key)."""
    if kind == "pass key":
        v = _fresh(rng, vals, lambda: str(rng.randrange(10_000, 100_000)))
        return [(f" The pass key is {v}. Remember it. {v} is the pass key.",
                 Question("What is the pass key?", [v], "The pass key is", 0.0))]
    k = tasks._key(rng, keys)
    v = {"number": lambda: str(rng.randrange(1_000_000, 10_000_000)),
         "word": lambda: rng.choice(_MAGIC_WORDS),
         "code": lambda: "".join(rng.choices(string.ascii_uppercase, k=2))
                         + f"-{rng.randrange(1000, 10_000)}"}[kind]
    v = _fresh(rng, vals, v)
    q = Question(f"What is the special magic {kind} for {k} mentioned in the provided text?",
                 [v], f"The special magic {kind} for {k} mentioned in the provided text is", 0.0)
    return [(f" One of the special magic {kind}s for {k} is: {v}.", q)]


def _mv_fact(rng, keys, vals) -> list[tuple[str, Question]]:
    """One key with four values (RULER's niah_multivalue), all asked."""
    k = tasks._key(rng, keys)
    vs = [tasks._number(rng, vals) for _ in range(4)]
    q = Question(f"What are all the special magic numbers for {k} mentioned in the provided "
                 f"text?", vs, f"The special magic numbers for {k} mentioned in the provided "
                 f"text are", 0.0, "all")
    return [(f" One of the special magic numbers for {k} is: {v}.", q) for v in vs]


def _vt_fact(rng, names, vals) -> list[tuple[str, Question]]:
    """One chain of RULER's variable tracking: a value, then four hops, all names asked."""
    chain, value = tasks.vt_chain(rng, names, vals)
    q = Question(*tasks.vt_question(chain, value), 0.0, "all")
    return [(" " + line, q) for line in tasks.vt_lines(chain, value)]


def _fresh(rng, taken: set[str], draw) -> str:
    while True:
        v = draw()
        if v not in taken:
            taken.add(v)
            return v


def _cwe_prompt(rng, budgets, count) -> NestedPrompt:
    """A numbered word list in rounds (the ten common words and fifteen rare ones, shuffled);
    each length's question asks for the ten most frequent words of its prefix, counted here."""
    words = list(tasks._CWE_WORDS)
    rng.shuffle(words)
    common, rare = words[:10], words[10:]
    per_round = len(rare) // 9  # each rare word once per nine rounds
    pieces, total, order = [_INTRO["cwe"]], count(_INTRO["cwe"]), []
    while True:
        rng.shuffle(rare)
        for r in range(0, per_round * 9, per_round):
            block = common + rare[r:r + per_round]
            rng.shuffle(block)
            for w in block:
                text = f"{len(order) + 1}. {w}" if not order else f" {len(order) + 1}. {w}"
                total += count(text)
                pieces.append(text)
                order.append(w)
            if total > budgets[-1]:
                break
        if total > budgets[-1]:
            break
    cum = np.cumsum([0] + [count(p) for p in pieces])
    cuts = [int(np.searchsorted(cum, b, side="right")) - 1 for b in budgets]
    questions = [[Question(tasks.CWE_QUESTION, cwe_answers(order[:cut - 1]),
                           tasks.CWE_PREFIX, 0.5, "all")] for cut in cuts]
    return NestedPrompt("cwe", pieces, cuts, questions)


def cwe_answers(words: list[str], n: int = 10) -> list[str]:
    """The ``n`` most frequent of ``words``, most frequent first; an error unless they are
    strictly more frequent than every other word (the answer would be ambiguous)."""
    counts = collections.Counter(words).most_common()
    if len(counts) <= n or counts[n - 1][1] <= counts[n][1]:
        raise KvsimError(f"cwe: a prefix of {len(words)} words has no clear {n} most common "
                         f"words; use longer --lengths")
    return [w for w, _ in counts[:n]]


def list_words(text: str) -> list[str]:
    """The words of a numbered list ("1. apple 2. pear")."""
    return re.findall(r"\d+\. (\w+)", text)


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
    fact_at = {i for at, _ in facts for i in at}
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
            qs_out.append(cs.Asked(q.question, q.answers, q.answer_prefix, round(q.depth, 4),
                                   gen.text, _dense_score(codec, gen, q), m_q, per_layer))
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


def _dense_score(codec, gen, q: Question) -> float:
    """The reply's first line against one answer; a list answer ("all") may span lines, so it
    is scored up to the end of the model's turn."""
    if q.match == "any":
        return tasks.score(gen.text.strip().split("\n")[0], q.answers)
    ids = gen.ids
    end = next((i for i, t in enumerate(ids) if t in codec.eos_ids), len(ids))
    return tasks.score(codec.decode(ids[:end]), q.answers, "all")


def _f16(x: torch.Tensor) -> np.ndarray:
    return x.detach().to(torch.float16).cpu().numpy()
