"""RULER-style long-context tasks, generated locally and seeded, with a string-match scorer.

Tasks: ``niah`` (one needle), ``mk`` (four needles with different keys, one asked), ``mv`` (four
values under one key, all asked), ``cwe`` (the ten most common words of a long word list), ``qa``
(a fact looked up among many short documents), ``vt`` (variable tracking: every variable of a
chain of assignments). The question comes after the context and the model's reply is primed with
an answer prefix, as in RULER. Haystacks are natural-ish sentences generated from templates here
(no download). ``load_prompts`` reads the user's own JSONL prompts.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvsim.errors import KvsimError

TASKS = ("niah", "mk", "mv", "cwe", "qa", "vt")


@dataclass
class Prompt:
    context: str
    question: str
    answers: list[str]
    answer_prefix: str = ""
    match: str = "any"  # "any": right if one answer occurs; "all": share of answers that occur
    task: str = ""
    id: str = ""
    meta: dict = field(default_factory=dict)


def score(prediction: str, answers: list[str], match: str = "any") -> float:
    """RULER's string match, case-insensitive: 1/0 for "any", the share found for "all"."""
    pred = prediction.lower()
    found = [a.lower() in pred for a in answers]
    if not found:
        return 0.0
    return float(any(found)) if match == "any" else sum(found) / len(found)


# ------------------------------------------------------------------------------ filler text

_NAMES = ("Mara", "Tobias", "Elena", "Jonah", "Priya", "Felix", "Nadia", "Oscar", "Lena", "Victor",
          "Ines", "Hugo", "Clara", "Mateo", "Sofia", "Arthur", "Yara", "Emil", "Talia", "Ruben",
          "Greta", "Silas", "Amira", "Dmitri", "Noor", "Callum", "Beatrix", "Kenji", "Lucia",
          "Anton", "Freya", "Ivo", "Zora", "Milan", "Petra", "Quentin", "Rosa", "Stellan")
_SURNAMES = ("Moreno", "Lindqvist", "Okafor", "Brandt", "Castell", "Novak", "Hargrove", "Ishida",
             "Varga", "Delacroix", "Marsh", "Petrov", "Quinlan", "Rasmussen", "Sato", "Tamm",
             "Ulloa", "Weller", "Ashby", "Bellamy", "Corvin", "Dunmore", "Everly", "Falk")
_CITIES = ("Harwick", "Lorne", "Celadon", "Brightwater", "Oakhaven", "Marrow", "Stillwell",
           "Ashford", "Kestrel Bay", "Duncliff", "Velmora", "Greystone", "Penhallow", "Rivenby",
           "Sorrento Vale", "Thornbury", "Umberfield", "Westmarch", "Yarrowby", "Zennor")
_JOBS = ("baker", "carpenter", "cartographer", "violinist", "beekeeper", "lighthouse keeper",
         "glassblower", "botanist", "ferry pilot", "watchmaker", "librarian", "stonemason",
         "translator", "weaver", "astronomer", "potter", "blacksmith", "gardener", "surveyor")
_ADJ = ("quiet", "old", "narrow", "bright", "distant", "small", "busy", "ancient", "cold", "warm",
        "green", "crooked", "gentle", "heavy", "hidden", "broad", "silver", "patient", "careful",
        "wooden", "golden", "stormy", "sleepy", "steep", "shallow", "tall", "dusty", "lonely",
        "clever", "restless", "muddy", "frozen", "crowded", "rusty", "fragrant", "pale")
_NOUN = ("river", "village", "harbor", "garden", "bridge", "market", "orchard", "mill", "forest",
         "valley", "tower", "library", "workshop", "meadow", "station", "castle", "farm", "lake",
         "road", "chapel", "school", "bakery", "field", "hill", "island", "square", "theater",
         "canal", "museum", "cottage", "kitchen", "barn", "pier", "vineyard", "quarry", "inn")
_THING = ("a basket of apples", "an old map", "a letter", "a wooden chair", "a lantern",
          "a bundle of firewood", "a pair of boots", "a loaf of bread", "a small boat",
          "a box of tools", "a jar of honey", "a worn notebook", "a violin", "a bicycle",
          "a bag of seeds", "a clay pot", "a silver spoon", "a kite", "a woolen scarf")
_VERB_PAST = ("walked to", "painted", "visited", "repaired", "cleaned", "described", "sketched",
              "photographed", "passed by", "wrote about", "returned to", "left", "measured",
              "admired", "searched", "explored")
_TIME = ("early in the morning", "after lunch", "late in the evening", "on a rainy Tuesday",
         "during the harvest", "before the first snow", "at dawn", "on market day",
         "in the middle of summer", "when the bells rang", "just after sunset", "last spring")
_WEATHER = ("The wind", "The rain", "A light fog", "The afternoon sun", "A cold breeze",
            "The morning mist", "A sudden storm", "The evening light")
_WEATHER_VERB = ("moved slowly over", "settled on", "drifted across", "touched", "covered",
                 "passed over", "lingered above")
_FEELING = ("everyone agreed it had been a good day", "nobody was in a hurry",
            "the talk turned to the coming winter", "the children laughed at the geese",
            "an old song was sung twice", "the prices were argued over at length",
            "the dogs slept in the shade", "the tea went cold on the table")


def _person(rng: random.Random) -> str:
    return f"{rng.choice(_NAMES)} {rng.choice(_SURNAMES)}"


def filler_sentence(rng: random.Random) -> str:
    """One natural-ish sentence from a template."""
    k = rng.randrange(7)
    a, n = rng.choice(_ADJ), rng.choice(_NOUN)
    if k == 0:
        return f"{rng.choice(_NAMES)} {rng.choice(_VERB_PAST)} the {a} {n} {rng.choice(_TIME)}."
    if k == 1:
        return (f"{rng.choice(_WEATHER)} {rng.choice(_WEATHER_VERB)} the {a} {n}, and "
                f"{rng.choice(_FEELING)}.")
    if k == 2:
        return (f"Near the {n} there was {rng.choice(_THING)} that {rng.choice(_NAMES)} had "
                f"brought from {rng.choice(_CITIES)}.")
    if k == 3:
        return (f"The {rng.choice(_JOBS)} of {rng.choice(_CITIES)} said that the {n} was "
                f"{a}er than it had been {rng.choice(_TIME)}." if a.endswith(("ld", "rm", "ll"))
                else f"The {rng.choice(_JOBS)} of {rng.choice(_CITIES)} thought the {n} looked "
                     f"{a} {rng.choice(_TIME)}.")
    if k == 4:
        return (f"In {rng.choice(_CITIES)}, the {a} {n} was known for {rng.choice(_THING)} and "
                f"for the way {rng.choice(_FEELING)}.")
    if k == 5:
        return (f"{rng.choice(_NAMES)} and {rng.choice(_NAMES)} {rng.choice(_VERB_PAST)} the "
                f"{n} together, carrying {rng.choice(_THING)}.")
    return f"It was {rng.choice(_TIME)} when {rng.choice(_FEELING)}."


def _key(rng: random.Random, taken: set[str]) -> str:
    """A fresh adjective-noun key sharing no word with the keys already taken."""
    used = {w for k in taken for w in k.split("-")}
    while True:
        a, n = rng.choice(_ADJ), rng.choice(_NOUN)
        if a not in used and n not in used:
            k = f"{a}-{n}"
            taken.add(k)
            return k


def _number(rng: random.Random, taken: set[str]) -> str:
    while True:
        v = str(rng.randrange(1_000_000, 10_000_000))
        if v not in taken:
            taken.add(v)
            return v


def _fill(rng: random.Random, budget: int, count: Callable[[str], int],
          sentence: Callable[[random.Random], str] = filler_sentence) -> list[str]:
    """Sentences whose joined token count is about ``budget``."""
    out: list[str] = []
    total = 0
    while total < budget:
        s = sentence(rng)
        c = count(" " + s)
        if total + c > budget and out:
            break
        out.append(s)
        total += c
    return out


def _trim_to(build: Callable[[list[str]], str], sentences: list[str], budget: int,
             count: Callable[[str], int]) -> str:
    """Drop sentences from the end of the filler until the built context fits ``budget``."""
    text = build(sentences)
    # Counting the whole text is exact; a few passes correct the per-sentence estimate.
    for _ in range(8):
        over = count(text) - budget
        if over <= 0 or len(sentences) <= 1:
            break
        per = max(1.0, count(" ".join(sentences)) / len(sentences))
        drop = max(1, math.ceil(over / per))
        sentences = sentences[:-drop] if drop < len(sentences) else sentences[:1]
        text = build(sentences)
    return text


# ------------------------------------------------------------------------------------ tasks

_NIAH_INTRO = ("Some special magic numbers are hidden within the following text. Make sure to "
               "memorize them. I will quiz you about the numbers afterwards.\n")
_TEMPLATE_RESERVE = 40  # tokens a chat template adds around the prompt (approximate)


def _needle_task(task: str, rng: random.Random, budget: int, count) -> Prompt:
    keys: set[str] = set()
    vals: set[str] = set()
    n_keys = 4 if task == "mk" else 1
    n_vals = 4 if task == "mv" else 1
    ks = [_key(rng, keys) for _ in range(n_keys)]
    needles, answers = [], []
    for i, k in enumerate(ks):
        for _ in range(n_vals):
            v = _number(rng, vals)
            needles.append(f"One of the special magic numbers for {k} is: {v}.")
            if i == 0:
                answers.append(v)
    rng.shuffle(needles)
    key = ks[0]
    if n_vals > 1:
        q = f"What are all the special magic numbers for {key} mentioned in the provided text?"
        prefix = f"The special magic numbers for {key} mentioned in the provided text are"
    else:
        q = f"What is the special magic number for {key} mentioned in the provided text?"
        prefix = f"The special magic number for {key} mentioned in the provided text is"
    room = budget - count(_NIAH_INTRO) - sum(count(" " + s) for s in needles)
    hay = _fill(rng, room, count)
    depths = [rng.random() for _ in needles]  # where each needle sits, as a share of the text

    def build(ss: list[str]) -> str:
        out = list(ss)
        for d, s in sorted(zip(depths, needles), reverse=True):
            out.insert(round(d * len(ss)), s)
        return _NIAH_INTRO + " ".join(out)

    ctx = _trim_to(build, hay, budget, count)
    return Prompt(ctx, q, answers, prefix, "all" if n_vals > 1 else "any", task,
                  meta={"key": key, "n_needles": len(needles)})


_CWE_WORDS = tuple(sorted(set(_ADJ + _NOUN + tuple(n.lower() for n in _NAMES)
                              + tuple(c.lower() for c in _CITIES if " " not in c)
                              + tuple(j for j in _JOBS if " " not in j))))


_CWE_INTRO = ("Below is a numbered list of words. In these words, some appear more often than "
              "others. Memorize the ones that appear most often.\n")
CWE_QUESTION = "What are the 10 most common words in the above list?"
CWE_PREFIX = "Answer: The top 10 words that appear most often in the list are:"


def _cwe_task(rng: random.Random, budget: int, count) -> Prompt:
    n_common = 10
    words = list(_CWE_WORDS)
    rng.shuffle(words)
    common, rare = words[:n_common], words[n_common:]
    per = max(1.0, count(" 1. " + " 2. ".join(rare[:20])) / 20)  # tokens per list entry
    entries = max(4 * n_common, int((budget - 60) / per))
    freq_c = min(30, max(3, entries // (2 * n_common)))
    left = entries - freq_c * n_common
    freq_r = max(1, min(freq_c - 2, math.ceil(left / len(rare))))
    n_rare = min(len(rare), left // freq_r)
    lst = common * freq_c + rare[:n_rare] * freq_r
    rng.shuffle(lst)
    build = lambda ws: _CWE_INTRO + " ".join(f"{i + 1}. {w}" for i, w in enumerate(ws))  # noqa: E731
    ctx = build(lst)
    for _ in range(8):  # drop rare entries until it fits (common words keep their counts)
        over = count(ctx) - budget
        rare_at = [j for j, w in enumerate(lst) if w not in common]
        if over <= 0 or not rare_at:
            break
        drop = set(rare_at[-max(1, math.ceil(over / per)):])
        lst = [w for j, w in enumerate(lst) if j not in drop]
        ctx = build(lst)
    return Prompt(ctx, CWE_QUESTION, common, CWE_PREFIX, "all", "cwe",
                  meta={"freq_common": freq_c, "freq_rare": freq_r, "entries": len(lst)})


def _qa_task(rng: random.Random, budget: int, count) -> Prompt:
    people: set[str] = set()
    docs = []
    total = count("Answer the question based on the given documents.\n")
    i = 0
    while True:
        p = _person(rng)
        if p in people:
            continue
        people.add(p)
        city, job = rng.choice(_CITIES), rng.choice(_JOBS)
        body = " ".join(filler_sentence(rng) for _ in range(rng.randint(2, 4)))
        d = f"Document {i + 1}: {p} is a {job} who lives in {city}. {body}"
        c = count("\n" + d)
        if total + c > budget and len(docs) >= 2:
            break
        docs.append((p, city, d))
        total += c
        i += 1
    target = rng.randrange(len(docs))
    p, city, _ = docs[target]
    others = [c for c in _CITIES if c != city]
    # the asked person's city is named in no other document's fact
    docs = [(q, c, d if c != city or j == target
             else d.replace(f"lives in {c}.", f"lives in {rng.choice(others)}."))
            for j, (q, c, d) in enumerate(docs)]
    ctx = "Answer the question based on the given documents.\n" + "\n".join(d for _, _, d in docs)
    q = f"Question: In which city does {p} live?"
    return Prompt(ctx, q, [city], f"Answer: {p} lives in", "any", "qa",
                  meta={"n_docs": len(docs), "target_doc": target + 1})


_VT_INTRO = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n"


def vt_chain(rng: random.Random, names: set[str], values: set[str],
             hops: int = 4) -> tuple[list[str], str]:
    """RULER's variable-tracking chain: ``hops + 1`` fresh five-letter names and a fresh value."""
    chain = []
    while len(chain) < hops + 1:
        v = "".join(rng.choices("ABCDEFGHIJKLMNOPQRSTUVWXYZ", k=5))
        if v not in names:
            names.add(v)
            chain.append(v)
    while True:
        value = str(rng.randrange(10_000, 100_000))
        if value not in values:
            values.add(value)
            return chain, value


def vt_lines(chain: list[str], value: str) -> list[str]:
    """The chain's assignments, in order: the value, then each name from the one before."""
    return [f"VAR {chain[0]} = {value}."] + [f"VAR {b} = VAR {a}."
                                             for a, b in zip(chain, chain[1:])]


def vt_question(chain: list[str], value: str) -> tuple[str, list[str], str]:
    """Question, answers (every name of the chain) and answer prefix, as RULER's."""
    return (f"Question: Find all variables that are assigned the value {value} in the text above.",
            list(chain), f"Answer: According to the chain(s) of variable assignment in the text "
            f"above, {len(chain)} variables are assigned the value {value}, they are:")


def _vt_task(rng: random.Random, budget: int, count) -> Prompt:
    chain, value = vt_chain(rng, set(), set())
    lines = vt_lines(chain, value)
    room = budget - count(_VT_INTRO) - sum(count(" " + s) for s in lines)
    hay = _fill(rng, room, count)
    depths = sorted(rng.random() for _ in lines)  # in order: each hop after the one it reads

    def build(ss: list[str]) -> str:
        out = list(ss)
        for d, s in sorted(zip(depths, lines), reverse=True):
            out.insert(round(d * len(ss)), s)
        return _VT_INTRO + " ".join(out)

    ctx = _trim_to(build, hay, budget, count)
    q, answers, prefix = vt_question(chain, value)
    return Prompt(ctx, q, answers, prefix, "all", "vt", meta={"value": value, "chain": chain})


def generate(task: str, context_tokens: int, n: int, seed: int,
             count: Callable[[str], int]) -> list[Prompt]:
    """``n`` prompts of ``task`` whose whole prompt is about ``context_tokens`` tokens.

    ``count(text)`` is the model's token count (a tokenizer); the same seed gives the same prompts.
    """
    if task not in TASKS:
        raise KvsimError(f"unknown task {task!r}; known: {', '.join(TASKS)}")
    if context_tokens < 128:
        raise KvsimError(f"--context {context_tokens} is too short (at least 128 tokens)")
    if n < 1:
        raise KvsimError("--n must be at least 1")
    out = []
    for i in range(n):
        rng = random.Random(f"{task}/{context_tokens}/{seed}/{i}")
        if task in ("niah", "mk", "mv"):
            probe = _needle_task(task, random.Random(0), 200, count)
        elif task == "cwe":
            probe = Prompt("", CWE_QUESTION, [], CWE_PREFIX)
        elif task == "vt":
            probe = Prompt("", *vt_question(["AAAAA"] * 5, "12345"))
        else:
            probe = Prompt("", "Question: In which city does Mara Moreno live?", [],
                           "Answer: Mara Moreno lives in")
        reserve = count("\n\n" + probe.question + "\n" + probe.answer_prefix) + _TEMPLATE_RESERVE
        budget = context_tokens - reserve
        if task in ("niah", "mk", "mv"):
            p = _needle_task(task, rng, budget, count)
        elif task == "cwe":
            p = _cwe_task(rng, budget, count)
        elif task == "vt":
            p = _vt_task(rng, budget, count)
        else:
            p = _qa_task(rng, budget, count)
        p.id = f"{task}-{context_tokens}-{seed}-{i}"
        out.append(p)
    return out


def load_prompts(path: str | Path) -> tuple[list[Prompt], list[str]]:
    """Prompts from JSONL (``context``, ``question``, ``answers``, optional ``answer_prefix``).

    Returns the prompts and one message per line that could not be read (not fatal).
    """
    path = Path(path)
    if not path.is_file():
        raise KvsimError(f"{path}: no such prompts file")
    prompts, errors = [], []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            if not isinstance(obj, dict):
                raise ValueError("not a JSON object")
            ctx, q, ans = obj.get("context"), obj.get("question"), obj.get("answers")
            if not isinstance(ctx, str) or not isinstance(q, str):
                raise ValueError("'context' and 'question' must be strings")
            if isinstance(ans, str):
                ans = [ans]
            if not isinstance(ans, list) or not ans or not all(isinstance(a, str) for a in ans):
                raise ValueError("'answers' must be a non-empty list of strings")
            prefix = obj.get("answer_prefix", "") or ""
            if not isinstance(prefix, str):
                raise ValueError("'answer_prefix' must be a string")
            match = obj.get("match", "any")
            if match not in ("any", "all"):
                raise ValueError("'match' must be 'any' or 'all'")
            prompts.append(Prompt(ctx, q, ans, prefix, match, "prompts",
                                  str(obj.get("id", f"{path.name}:{lineno}"))))
        except (json.JSONDecodeError, ValueError) as e:
            errors.append(f"{path}:{lineno}: {e}")
    if not prompts:
        raise KvsimError(f"{path}: no usable prompts ({len(errors)} lines could not be read"
                         + (f"; first: {errors[0]}" if errors else "") + ")")
    return prompts, errors
