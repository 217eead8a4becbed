"""Nested prompts of every task (kvsim.model.nested): each length's answers are right for its
prefix, its questions ask about facts inside that prefix, prompts are seeded; the shipped mk and qa
prompts are unchanged; the shipped capture sets are the prompts this code builds (slow)."""

import collections
import hashlib
import json
import re
from pathlib import Path

import pytest

from kvsim.errors import KvsimError
from kvsim.model import nested

LENGTHS = [1024, 2048, 4096, 8192]
ROOT = Path(__file__).resolve().parents[1]


def count(text: str) -> int:  # a stand-in tokenizer: words and punctuation
    return len(re.findall(r"\w+|[^\w\s]", text))


@pytest.fixture(scope="module")
def prompts():
    return {t: nested.nested_prompt(t, LENGTHS, 4, 0, count) for t in nested.NESTED_TASKS}


def prefixes(p):
    return ["".join(p.pieces[:cut]) for cut in p.cuts]


@pytest.mark.parametrize("task", nested.NESTED_TASKS)
def test_prefixes_fit_their_lengths_and_ask_inside(prompts, task):
    p = prompts[task]
    assert p.cuts == sorted(p.cuts) and p.cuts[-1] <= len(p.pieces)
    for n, text, qs in zip(LENGTHS, prefixes(p), p.questions):
        assert n - 200 <= count(text) <= n - 70  # the question part's reserve is left
        assert qs and all(0 <= q.depth < 1 for q in qs)
        for q in qs:
            assert all(a in text for a in q.answers)  # every answer inside this prefix
            assert q.match == ("any" if task in ("niah", "mk", "qa") else "all")
    assert len({q.question for q in p.questions[-1]}) == len(p.questions[-1])


def test_question_counts_per_length(prompts):
    per = {t: [len(qs) for qs in p.questions] for t, p in prompts.items()}
    assert per["mk"] == per["qa"] == [4, 4, 4, 4]
    assert per["niah"] == per["mv"] == per["vt"] == [1, 2, 3, 4]  # one fact per stretch
    assert per["cwe"] == [1, 1, 1, 1]


_NEEDLE = re.compile(r"One of the special magic (\w+)s for ([\w-]+) is: ([\w-]+)\.")
_PASS = re.compile(r"The pass key is (\d+)\. Remember it\. (\d+) is the pass key\.")


def test_niah_each_asked_needle_is_the_only_one_of_its_kind(prompts):
    p = prompts["niah"]
    for j, (text, qs) in enumerate(zip(prefixes(p), p.questions)):
        needles = _NEEDLE.findall(text)
        passes = _PASS.findall(text)
        assert len(needles) + len(passes) == j + 1  # one needle per stretch so far
        kinds = [k for k, _, _ in needles] + ["pass key"] * len(passes)
        assert len(set(kinds)) == len(kinds)  # no two needles of one kind
        words = [w for _, key, _ in needles for w in key.split("-")]
        assert len(words) == len(set(words))  # keys share no word
        for q in qs:
            assert text.count(q.answers[0]) == (2 if "pass key" in q.question else 1)
            if q.question == "What is the pass key?":
                assert [a for a, b in passes if a == b] == q.answers
                continue
            kind, key = re.search(r"magic (\w+) for ([\w-]+) ", q.question).groups()
            assert [v for k, kk, v in needles if k == kind] == q.answers
            assert [v for k, kk, v in needles if kk == key] == q.answers
            assert key in q.answer_prefix


def test_mv_asks_all_four_values_of_its_key(prompts):
    p = prompts["mv"]
    for text, qs in zip(prefixes(p), p.questions):
        for q in qs:
            key = re.search(r"numbers for ([\w-]+) mentioned", q.question).group(1)
            found = re.findall(rf"special magic numbers for {key} is: (\d+)\.", text)
            assert sorted(found) == sorted(q.answers) and len(found) == 4


def _follow(text: str, value: str) -> list[str]:
    """Every variable that holds ``value`` after the prefix's assignments, read in order."""
    holds: dict[str, str] = {}
    for name, rhs in re.findall(r"VAR (\w+) = (VAR \w+|\d+)\.", text):
        holds[name] = holds.get(rhs[4:]) if rhs.startswith("VAR ") else rhs
    return sorted(n for n, v in holds.items() if v == value)


def test_vt_answers_are_the_chain_followed_in_the_prefix(prompts):
    p = prompts["vt"]
    for text, qs in zip(prefixes(p), p.questions):
        for q in qs:
            value = re.search(r"the value (\d+) in", q.question).group(1)
            assert _follow(text, value) == sorted(q.answers) and len(q.answers) == 5
            assert f"{len(q.answers)} variables are assigned the value {value}" in q.answer_prefix


def test_cwe_answers_are_each_prefix_s_most_common_words(prompts):
    p = prompts["cwe"]
    for text, (q,) in zip(prefixes(p), p.questions):
        words = nested.list_words(text)
        assert [int(i) for i in re.findall(r"(\d+)\. \w+", text)] == \
            list(range(1, len(words) + 1))
        freq = collections.Counter(words)
        assert sorted(w for w, _ in freq.most_common(10)) == sorted(q.answers)
        assert min(freq[w] for w in q.answers) > max(f for w, f in freq.items()
                                                     if w not in q.answers)
    with pytest.raises(KvsimError, match="no clear 10 most common"):
        nested.cwe_answers(list("abcdefghijk"))  # eleven words, one each: a tie


@pytest.mark.parametrize("task", nested.NESTED_TASKS)
def test_prompts_are_seeded(prompts, task):
    again = nested.nested_prompt(task, LENGTHS, 4, 0, count)
    assert again == prompts[task]
    other = nested.nested_prompt(task, LENGTHS, 4, 1, count)
    assert other.pieces != prompts[task].pieces


def _digest(p) -> str:
    blob = json.dumps([p.pieces, p.cuts, [[[q.question, q.answers, q.answer_prefix, q.depth]
                                           for q in qs] for qs in p.questions]])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def test_mk_and_qa_prompts_are_unchanged(prompts):
    """The shipped captures were recorded from these prompts: same seeds, same draws."""
    assert _digest(prompts["mk"]) == "41a01037ae3d4aa6"
    assert _digest(prompts["qa"]) == "b2dc88bffff4cf85"


def test_bad_requests_are_one_line_errors():
    with pytest.raises(KvsimError, match="know niah, mk, mv, vt, qa, cwe") as e:
        nested.nested_prompt("nope", LENGTHS, 4, 0, count)
    assert "\n" not in str(e.value)
    with pytest.raises(KvsimError, match="--questions must be 1..4"):
        nested.nested_prompt("mv", LENGTHS, 5, 0, count)
    with pytest.raises(KvsimError, match="at most 4 lengths"):
        nested.nested_prompt("niah", [1024, 2048, 3072, 4096, 8192], 4, 0, count)
    with pytest.raises(KvsimError, match="at least 295 tokens"):
        nested.nested_prompt("vt", [280, 1024], 4, 0, count)


@pytest.mark.slow
def test_shipped_capture_sets_are_these_prompts():
    """Each traces/captures set holds the questions and context lengths this code builds (the
    real tokenizer, no model)."""
    from kvsim import captureset
    from kvsim.model.loading import SMOLLM2_GGUF, Codec, _smollm2_dir, _transformers
    tr = _transformers()
    codec = Codec(tr.AutoTokenizer.from_pretrained(str(_smollm2_dir()), gguf_file=SMOLLM2_GGUF,
                                                   local_files_only=True))
    sets = sorted((ROOT / "traces" / "captures").glob("smollm2-*-1k-8k.npz"))
    assert {captureset.load(f).task for f in sets} >= {"mk", "qa"}
    for f in sets:
        c = captureset.load(f)
        p = nested.nested_prompt(c.task, [ln.target for ln in c.lengths], 4, c.meta["seed"],
                                 codec.count)
        ids, _ = codec.nested_layout(p.pieces, "")
        for ln, cut, qs in zip(c.lengths, p.cuts, p.questions):
            assert ln.context_len == sum(len(x) for x in ids[:cut]), f.name
            assert [(a.question, a.answers) for a in ln.asked] == \
                [(q.question, q.answers) for q in qs], f.name
