"""kvsim.sim.reuse: generated workloads with prefix reuse (conversations, shared prompts)."""

import math
from collections import defaultdict

import numpy as np
import pytest

from kvsim.errors import KvsimError
from kvsim.sim import reuse
from kvsim.sim.prefix import hit_curve


def unlimited_share(w, block):
    return hit_curve(w.prefix_hashes, w.prompt, block, [math.inf])[0]


def check_shape(w, n, block):
    """Open-loop workload: types, sorted arrivals from 0, ids one per (partial) block."""
    assert w.n == n and w.concurrency is None and w.prefix_block == block
    assert w.arrival.dtype == np.float64 and w.prompt.dtype == np.int64
    assert w.output.dtype == np.int64
    assert w.arrival[0] == 0 and (np.diff(w.arrival) >= 0).all()
    assert (w.prompt >= 1).all() and (w.output >= 1).all()
    assert len(w.prefix_hashes) == n
    for ids, p in zip(w.prefix_hashes, w.prompt.tolist()):
        assert len(ids) == math.ceil(p / block)
        assert all(type(i) is int for i in ids)


def same(a, b):
    return (np.array_equal(a.arrival, b.arrival) and np.array_equal(a.prompt, b.prompt)
            and np.array_equal(a.output, b.output) and a.prefix_hashes == b.prefix_hashes
            and a.description == b.description)


def sessions_of(w, key_pos):
    """Requests grouped by session (the id at ``key_pos``: a session's first own block, full in
    its turn 1, so every later turn keeps it), each session's in arrival order."""
    out = defaultdict(list)
    for i, ids in enumerate(w.prefix_hashes):
        out[ids[key_pos]].append(i)
    return list(out.values())


# --- determinism, shapes -----------------------------------------------------------------------

@pytest.mark.parametrize("make", [
    lambda seed: reuse.conversations(800, qps=4, spread=0.4, max_tokens=9000, seed=seed),
    lambda seed: reuse.shared_prompts(800, 4, spread=0.4, seed=seed),
])
def test_deterministic_for_a_seed(make):
    assert same(make(3), make(3))
    assert not same(make(3), make(4))


def test_conversations_do_not_depend_on_n():
    """Sessions are drawn in fixed chunks: the first n requests are the same for any larger n."""
    a = reuse.conversations(300, 2.0, seed=5)
    b = reuse.conversations(3000, 2.0, seed=5)
    assert np.array_equal(a.arrival, b.arrival[:300])
    assert np.array_equal(a.prompt, b.prompt[:300]) and np.array_equal(a.output, b.output[:300])


@pytest.mark.parametrize("block", [1, 16, 100, 512])
def test_one_id_per_block(block):
    check_shape(reuse.conversations(1500, qps=3, spread=0.5, shared_system_tokens=700,
                                    block=block, seed=1), 1500, block)
    check_shape(reuse.shared_prompts(1500, 3, spread=0.5, block=block, seed=1), 1500, block)
    check_shape(reuse.shared_prompts(50, 3, system_tokens=0, block=block), 50, block)


# --- conversations -----------------------------------------------------------------------------

B = 64
SYSTEM, FIRST, USER, OUT = 200, 300, 70, 90  # system: 3 full blocks; block 3 full in turn 1


def conv(**kw):
    args = dict(qps=2.0, turns=5, first_tokens=FIRST, user_tokens=USER, output_tokens=OUT,
                think_s=20, shared_system_tokens=SYSTEM, block=B, seed=2)
    return reuse.conversations(3000, **{**args, **kw})


def test_conversation_turns_resend_the_history_and_share_its_full_blocks():
    w = conv()
    check_shape(w, 3000, B)
    hashes, system = w.prefix_hashes, SYSTEM // B
    assert all(ids[:system] == hashes[0][:system] for ids in hashes)  # the shared system prompt
    owner = {}
    groups = sessions_of(w, system)
    assert len(groups) > 100 and max(map(len, groups)) >= 5
    for g, rows in enumerate(groups):
        for a, b in zip(rows, rows[1:]):
            pa = int(w.prompt[a])
            assert w.prompt[b] == pa + w.output[a] + USER
            k = pa // B
            assert hashes[b][:k] == hashes[a][:k] and hashes[b][k] not in hashes[a]
        for i in rows:
            for h in hashes[i][system:]:
                assert owner.setdefault(h, g) == g  # no id shared with another session
        # turn 1 (or a later one of a session under way at time 0): S + F + j (U + O)
        assert (int(w.prompt[rows[0]]) - SYSTEM - FIRST) % (USER + OUT) == 0
    assert (w.output == OUT).all()
    assert ((w.prompt - SYSTEM - FIRST) % (USER + OUT) == 0).all()


def test_conversation_sizes_with_spread_and_the_cap():
    w = conv(spread=0.5, max_tokens=1500)
    check_shape(w, 3000, B)
    assert w.prompt.max() <= 1500 and w.prompt.min() >= SYSTEM + round(FIRST * 0.5)
    assert w.output.min() >= round(OUT * 0.5) and w.output.max() <= round(OUT * 1.5)
    for rows in sessions_of(w, SYSTEM // B):
        for a, b in zip(rows, rows[1:]):
            user = int(w.prompt[b] - w.prompt[a] - w.output[a])
            assert round(USER * 0.5) <= user <= round(USER * 1.5)
            k = int(w.prompt[a]) // B
            assert w.prefix_hashes[b][:k] == w.prefix_hashes[a][:k]
            assert w.prefix_hashes[b][k] not in w.prefix_hashes[a]


def expected_conversation_share(w, system):
    """Unlimited-cache hit share computed from the sessions: a turn whose previous turn came
    before hits that turn's full blocks; a session's first turn in the workload hits the shared
    system prompt's full blocks if any request came before it."""
    hit = 0
    for rows in sessions_of(w, system // B):
        first = rows[0]
        hit += (system // B) * B if first > 0 else 0
        hit += sum(int(w.prompt[a]) // B * B for a in rows[:-1])
    return hit / int(w.prompt.sum())


@pytest.mark.parametrize("kw", [{}, {"spread": 0.5, "max_tokens": 2000}, {"think_s": 200}])
def test_conversation_hit_share_is_what_the_sessions_give(kw):
    w = conv(**kw)
    assert unlimited_share(w, B) == pytest.approx(expected_conversation_share(w, SYSTEM),
                                                  abs=1e-12)


def test_single_turn_sessions_hit_only_the_system_prompt():
    w = conv(turns=1, qps=5.0)
    assert (w.prompt == SYSTEM + FIRST).all()
    expected = (w.n - 1) * (SYSTEM // B * B) / int(w.prompt.sum())
    assert unlimited_share(w, B) == pytest.approx(expected, abs=1e-12)


def test_conversation_rate_is_qps_from_time_zero():
    """Single-turn sessions are a Poisson process: n - 1 gaps of mean 1/qps, the span's standard
    deviation sqrt(n - 1)/qps; 4 of them allowed. Multi-turn ones are a Poisson cluster process:
    over a window T much longer than a session, Var N(T) ~ sessions/s x T x E[G^2] with G the
    turns per session (geometric: E[G^2] = (2 - p)/p^2, p = 1/turns); 5 standard deviations."""
    n, qps = 4000, 5.0
    w = reuse.conversations(n, qps=qps, turns=1, seed=11)
    assert abs(w.arrival[-1] * qps / (n - 1) - 1) < 4 / math.sqrt(n - 1)
    turns, p = 4, 0.25
    rate, g2 = qps / turns, (2 - p) / p ** 2
    w = reuse.conversations(n, qps=qps, turns=turns, think_s=5, seed=11)
    span = w.arrival[-1]
    assert abs((n - 1) / span - qps) < 5 * math.sqrt(rate * span * g2) / span
    # steady state from the start: the first minute already at qps (a cold start, every session
    # at its turn 1, would give ~ 1.35 sessions/s x 60 s = 0.34 qps in a 60 s think time)
    w = reuse.conversations(n, qps=50, turns=turns, think_s=60, seed=11)
    early = (w.arrival < 60).sum()
    assert abs(early - 50 * 60) < 5 * math.sqrt(50 / turns * 60 * g2)
    # and through parse, with the cap's shorter sessions accounted for
    w = reuse.parse("conversations:turns=4,max_tokens=4000", qps, n, 512, 11)
    assert abs((n - 1) / w.arrival[-1] - qps) < 5 * math.sqrt(rate * w.arrival[-1] * g2) / \
        w.arrival[-1]
    assert "mean turns" in w.description


# --- shared prompts ----------------------------------------------------------------------------

def test_shared_prompts_share_exactly_the_system_prompt_full_blocks():
    block, system = 128, 1000  # 7 full blocks, the 8th partial (system tail + user message)
    w = reuse.shared_prompts(2000, 10, prompts=6, system_tokens=system, user_tokens=300,
                             output_tokens=50, zipf=0.8, block=block, seed=7)
    check_shape(w, 2000, block)
    assert (w.prompt == system + 300).all() and (w.output == 50).all()
    full = system // block
    groups = defaultdict(list)
    for ids in w.prefix_hashes:
        groups[ids[0]].append(ids)
    assert len(groups) == 6
    heads = [g[0][:full] for g in groups.values()]
    assert all(len(set(h)) == full for h in heads)
    assert len({i for h in heads for i in h}) == 6 * full  # different prompts share nothing
    for g in groups.values():
        assert all(ids[:full] == g[0][:full] for ids in g)
    tails = [i for ids in w.prefix_hashes for i in ids[full:]]
    assert len(set(tails)) == len(tails)  # the rest is every request's own


def test_shared_prompts_popularity_is_zipf():
    n, prompts, zipf = 20000, 10, 1.0
    w = reuse.shared_prompts(n, 10, prompts=prompts, zipf=zipf, seed=3)
    counts = sorted((np.unique([ids[0] for ids in w.prefix_hashes], return_counts=True)[1]),
                    reverse=True)
    p = 1 / np.arange(1, prompts + 1) ** zipf
    p /= p.sum()
    sd = np.sqrt(n * p * (1 - p))  # binomial
    assert (np.abs(np.array(counts) - n * p) < 5 * sd).all()


@pytest.mark.parametrize("prompts", [1, 7])
def test_shared_prompts_hit_share_matches_the_assignment(prompts):
    """zipf 0, fixed sizes: every request after the first of its system prompt hits the
    prompt's 7 full blocks (896 of its 1300 tokens), nothing else."""
    n, block = 500, 128
    w = reuse.shared_prompts(n, 3, prompts=prompts, system_tokens=1000, user_tokens=300,
                             zipf=0, block=block, seed=9)
    used = len({ids[0] for ids in w.prefix_hashes})
    assert used == prompts  # all 7 drawn in 500 (missing one: 7 (6/7)^500 ~ 1e-33)
    expected = (n - used) * (1000 // block * block) / (n * 1300)
    assert unlimited_share(w, block) == pytest.approx(expected, abs=1e-12)


def test_shared_prompts_rate_is_qps():
    """n - 1 exponential gaps of mean 1/qps: the span's standard deviation is sqrt(n - 1)/qps;
    within 4 of them."""
    n, qps = 5000, 7.5
    for seed in range(3):
        w = reuse.parse("shared-prompts", qps, n, 512, seed)
        assert abs(w.arrival[-1] * qps / (n - 1) - 1) < 4 / math.sqrt(n - 1)


# --- specs, provenance, errors -----------------------------------------------------------------

def test_parse_reads_specs_and_descriptions_state_everything():
    w = reuse.parse("conversations:turns=4,first_tokens=2000,user_tokens=300,"
                    "output_tokens=300,think_s=60", 10, 500, 512, 42)
    for words in ("seed 42", "500 requests", "10 req/s", "mean 4", "2000 tokens", "300 tokens",
                  "mean 60 s", "uncapped", "512-token blocks", "token counts fixed"):
        assert words in w.description
    assert w.description == reuse.conversations(500, qps=10, seed=42).description
    w = reuse.parse(" shared-prompts : prompts=10, system_tokens=8000, user_tokens=500,"
                    "output_tokens=200,zipf=1.0,spread=0.25", 3, 100, 256, 1)
    for words in ("seed 1", "100 requests", "3 req/s", "10 system prompts of 8000 tokens",
                  "exponent 1", "500 tokens", "200 tokens", "+-0.25", "256-token blocks"):
        assert words in w.description
    assert reuse.parse("conversations:max_tokens=none", 1, 10, 512, 0).n == 10
    assert set(reuse.KINDS) == {"conversations", "shared-prompts"}
    assert all("\n" not in v and "keys (defaults)" in v for v in reuse.KINDS.values())
    assert "think_s=60" in reuse.KINDS["conversations"]


@pytest.mark.parametrize("spec, words", [
    ("chats", "unknown kind 'chats'; one of conversations, shared-prompts"),
    ("conversations:turn=4", "unknown key 'turn'; accepted: turns, first_tokens"),
    ("shared-prompts:turns=4", "accepted: prompts, system_tokens"),
    ("conversations:turns", "expected key=value"),
    ("conversations:turns=", "expected key=value"),
    ("conversations:turns=four", "turns='four' is not a number"),
    ("conversations:turns=0", "--reuse conversations: turns must be >= 1, got 0"),
    ("conversations:turns=nan", "turns must be finite"),
    ("conversations:turns=2,turns=3", "turns given twice"),
    ("conversations:first_tokens=2.5", "first_tokens must be a whole number >= 1, got 2.5"),
    ("conversations:think_s=0", "think_s must be > 0"),
    ("conversations:spread=1", "spread must be < 1"),
    ("conversations:max_tokens=1000", "max_tokens must be >= 2000"),
    ("conversations:think_s=1e9", "sessions under way"),
    ("shared-prompts:prompts=0", "--reuse shared-prompts: prompts must be >= 1, got 0"),
    ("shared-prompts:zipf=-1", "zipf must be >= 0"),
    ("shared-prompts:user_tokens=0", "user_tokens must be >= 1"),
])
def test_bad_specs_are_one_line_errors(spec, words):
    with pytest.raises(KvsimError) as e:
        reuse.parse(spec, 1.0, 10, 512, 0)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_bad_arguments():
    for call, words in [
        (lambda: reuse.parse("shared-prompts", 0, 10, 512, 0), "qps must be > 0"),
        (lambda: reuse.parse("conversations", 1, 0, 512, 0), "n (requests) must be >= 1"),
        (lambda: reuse.parse("conversations", 1, 10, 0, 0), "block must be >= 1"),
        (lambda: reuse.parse("shared-prompts", 1, 10, 512, -1), "seed must be >= 0"),
        (lambda: reuse.conversations(10), "give sessions_per_s or qps"),
        (lambda: reuse.conversations(10, 1.0, qps=1.0), "give sessions_per_s or qps"),
    ]:
        with pytest.raises(KvsimError, match=None) as e:
            call()
        assert words in str(e.value) and "\n" not in str(e.value)
