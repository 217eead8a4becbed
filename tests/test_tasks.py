"""Generated RULER-style tasks, the string-match scorer, JSONL prompts, eval's policy list."""

import collections
import json
import re

import pytest

from kvsim.errors import KvsimError
from kvsim.model import tasks


def count(text: str) -> int:  # a stand-in tokenizer: words and punctuation
    return len(re.findall(r"\w+|[^\w\s]", text))


@pytest.mark.parametrize("task", tasks.TASKS)
def test_each_task_is_seeded_sized_and_answerable(task):
    a = tasks.generate(task, 1500, 3, seed=7, count=count)
    b = tasks.generate(task, 1500, 3, seed=7, count=count)
    c = tasks.generate(task, 1500, 3, seed=8, count=count)
    assert [p.context for p in a] == [p.context for p in b]
    assert [p.context for p in a] != [p.context for p in c]
    assert len({p.context for p in a}) == 3
    for p in a:
        total = count(p.context) + count(p.question) + count(p.answer_prefix)
        assert 1200 <= total <= 1500, total
        assert p.answers and p.answer_prefix and p.task == task
        for ans in p.answers:  # every accepted answer is in the context
            assert ans in p.context
        assert p.question not in p.context  # the question comes after the context


@pytest.mark.parametrize("task", ["niah", "mk", "mv"])
def test_needles_hold_the_asked_values_and_only_them(task):
    for p in tasks.generate(task, 1200, 4, seed=1, count=count):
        key = p.meta["key"]
        found = re.findall(rf"special magic numbers for {key} is: (\d+)\.", p.context)
        assert sorted(found) == sorted(p.answers)
        assert p.meta["n_needles"] == (4 if task in ("mk", "mv") else 1)
        assert key in p.question and key in p.answer_prefix
        keys = re.findall(r"special magic numbers for ([\w-]+) is:", p.context)
        words = [w for k in set(keys) for w in k.split("-")]
        assert len(words) == len(set(words))  # distractor keys share no word with the asked one


def test_cwe_answers_are_the_most_common_words():
    p = tasks.generate("cwe", 2000, 1, seed=3, count=count)[0]
    words = re.findall(r"\d+\. (\w+)", p.context)
    top = [w for w, _ in collections.Counter(words).most_common(10)]
    assert sorted(top) == sorted(p.answers)
    freq = collections.Counter(words)
    assert min(freq[w] for w in p.answers) > max(f for w, f in freq.items() if w not in p.answers)


def test_qa_asked_fact_is_unique():
    for p in tasks.generate("qa", 1500, 3, seed=2, count=count):
        person = p.answer_prefix.removeprefix("Answer: ").removesuffix(" lives in")
        assert person in p.question
        facts = re.findall(rf"{person} is a [\w ]+ who lives in ([\w ]+)\.", p.context)
        assert facts == p.answers
        assert p.context.count(f"who lives in {p.answers[0]}.") == 1


def test_vt_answers_are_the_chain_followed_in_order():
    for p in tasks.generate("vt", 1500, 3, seed=4, count=count):
        holds: dict[str, str] = {}
        for name, rhs in re.findall(r"VAR (\w+) = (VAR \w+|\d+)\.", p.context):
            assert not rhs.startswith("VAR ") or rhs[4:] in holds  # a hop follows its source
            holds[name] = holds[rhs[4:]] if rhs.startswith("VAR ") else rhs
        value = p.meta["value"]
        assert sorted(n for n, v in holds.items() if v == value) == sorted(p.answers)
        assert len(p.answers) == 5 and p.match == "all" and value in p.question


def test_score_right_and_wrong_answers():
    assert tasks.score(" 1234567.", ["1234567"]) == 1.0
    assert tasks.score("The number is 7654321", ["1234567"]) == 0.0
    assert tasks.score("", ["1234567"]) == 0.0
    assert tasks.score("1234567 and 2345678", ["1234567", "9999999"], "any") == 1.0
    both = "1234567 and 2345678"
    assert tasks.score(both, ["1234567", "2345678", "3333333", "4444444"], "all") == 0.5
    assert tasks.score("HARWICK", ["Harwick"]) == 1.0  # case-insensitive


def test_generated_prompts_score_their_answers():
    for task in tasks.TASKS:
        p = tasks.generate(task, 800, 1, seed=0, count=count)[0]
        assert tasks.score(" " + ", ".join(p.answers), p.answers, p.match) == 1.0
        assert tasks.score(" nothing useful", p.answers, p.match) == 0.0


def test_bad_requests_are_one_line_errors():
    with pytest.raises(KvsimError, match="unknown task 'nope'; known: niah, mk, mv, cwe, qa, vt"):
        tasks.generate("nope", 1000, 1, 0, count)
    with pytest.raises(KvsimError, match="too short"):
        tasks.generate("niah", 50, 1, 0, count)


def test_load_prompts_reports_bad_lines_without_failing(tmp_path):
    f = tmp_path / "p.jsonl"
    good = {"context": "The code is 42.", "question": "What is the code?", "answers": ["42"],
            "answer_prefix": "The code is"}
    f.write_text("\n".join([json.dumps(good), "{not json", json.dumps({"context": "x"}),
                            "", json.dumps({**good, "answers": "7"})]) + "\n")
    prompts, errors = tasks.load_prompts(f)
    assert [p.answers for p in prompts] == [["42"], ["7"]]
    assert prompts[0].answer_prefix == "The code is" and prompts[1].match == "any"
    assert len(errors) == 2 and ":2:" in errors[0] and ":3:" in errors[1]
    f.write_text("{bad\n")
    with pytest.raises(KvsimError, match="no usable prompts"):
        tasks.load_prompts(f)
    with pytest.raises(KvsimError, match="no such prompts file"):
        tasks.load_prompts(tmp_path / "missing.jsonl")
