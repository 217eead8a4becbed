"""Generated open-loop workloads with prefix reuse, for prefix caching where no trace gives
block ids: each request's prompt comes with its block ids (``Workload.prefix_hashes``, as
:mod:`kvsim.sim.prefix` reads them: block ``j`` holds tokens ``[j B, (j + 1) B)``, the last may
be partial, and an id names the whole prefix up to its block, so two requests share exactly the
leading blocks whose tokens are the same). Deterministic for a seed; every parameter and the seed
are in the description. The kinds (:data:`KINDS`, spec strings read by :func:`parse`):

- :func:`conversations`: multi-turn chats. Sessions begin as a Poisson process; a session has a
  geometric number of turns (mean ``turns``, at least 1). Turn 1 is an optional system prompt
  shared by every session (``shared_system_tokens``) and a first message; each later turn
  resends the whole history: the previous prompt, its reply and a new user message. Turn t + 1
  shares turn t's full prompt blocks; the rest of it is new (turn t's partial last block is
  extended by the reply, so its content differs). The next turn arrives an exponential think
  time after the previous turn's *arrival*: when a reply ends is the simulator's to know, not
  the generator's, so the think time includes the reply's generation (a think time shorter than
  a reply's generation sends the next turn before the reply ends). ``max_tokens`` caps the
  prompt: a session ends before a turn whose prompt would exceed it. The stream is in steady
  state from time 0: the sessions begun before it are drawn as the process left running would
  have them (by memorylessness: Poisson(rate x think_s x (turns - 1)) of them, each with a
  geometric number of turns done, the next an exponential think time away), so the request rate
  is the stated one from the start; their earlier turns are not in the workload (a cache that
  starts empty while conversations are under way). The first ``n`` requests by arrival are kept,
  arrivals counted from the first.
- :func:`shared_prompts`: independent requests at Poisson ``qps``, each one of ``prompts``
  system prompts (Zipf popularity, uniform at exponent 0) followed by a user message of its
  own; the system prompt's full blocks are shared, the rest is the request's own.

Token counts are as given, or with ``spread`` > 0 each drawn uniform within +-spread of it
(rounded, at least 1; a system prompt's length is drawn once per prompt).

Not modelled: replies' blocks as cache content (engines such as vLLM and SGLang also keep the
blocks filled while decoding, so a next turn could reuse the previous reply's full blocks too;
here only the previous prompt's full blocks are shared, a lower bound on the reuse); chat
templates, retokenisation or edited histories (agents that rewrite or truncate their context);
reuse across sessions beyond the shared system prompt (common documents, retries); think times
that depend on the reply's latency (a closed loop per user); session abandonment; bursts or
daily cycles in the session rate.
"""

from __future__ import annotations

import math

import numpy as np

from kvsim.errors import KvsimError
from kvsim.sim.workload import PrefixBlocks, Workload

BLOCK = 512  # tokens per block (Mooncake's hash_ids)
CHUNK = 4096  # new sessions drawn at a time: a fixed size, so a seed's sessions do not depend on n
CHUNK_REQUESTS = 1 << 16  # requests whose block ids are made at a time (whole sessions)
MAX_TURNS = 1000  # mean turns per session at most
MAX_ROWS = 20_000_000  # turns drawn for the sessions under way at time 0, expected, at most


def _fail(where: str, name: str, rule: str, value) -> KvsimError:
    return KvsimError(f"{where}: {name} must be {rule}, got {value!r}")


def _whole(where: str, name: str, value, least: int) -> int:
    """``value`` as an int: a whole number >= ``least`` (an integral float accepted)."""
    ok = (isinstance(value, (int, np.integer)) and not isinstance(value, bool)) or (
        isinstance(value, float) and value.is_integer())
    if not ok:
        raise _fail(where, name, f"a whole number >= {least}", value)
    if value < least:
        raise _fail(where, name, f">= {least}", value)
    return int(value)


def _real(where: str, name: str, value, least: float, above: bool = False,
          most: float = math.inf) -> float:
    """``value`` as a finite float >= ``least`` (> where ``above``) and <= ``most``."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise _fail(where, name, "a number", value)
    v = float(value)
    if not math.isfinite(v):
        raise _fail(where, name, "finite", value)
    if v < least or (above and v == least):
        raise _fail(where, name, f"{'>' if above else '>='} {least:g}", value)
    if v > most:
        raise _fail(where, name, f"<= {most:g}", value)
    return v


def _spread(where: str, value) -> float:
    v = _real(where, "spread", value, 0.0)
    if v >= 1:
        raise _fail(where, "spread", "< 1 (a fraction: sizes uniform within +-spread)", value)
    return v


def _sizes(rng: np.random.Generator, mean: int, spread: float, count: int) -> np.ndarray:
    """``count`` token counts: ``mean`` (spread 0) or uniform within +-spread of it, rounded, at
    least 1 (the draws are made at spread 0 too, so the stream of draws is the same)."""
    draw = np.rint(mean * rng.uniform(1 - spread, 1 + spread, count)).astype(np.int64)
    return np.maximum(draw, 1) if mean > 0 else np.zeros(count, dtype=np.int64)


def _sizes_words(spread: float) -> str:
    return ("token counts fixed" if spread == 0 else
            f"token counts uniform within +-{spread:g} of each (rounded, >= 1)")


def _within(x: np.ndarray, first_row: np.ndarray, length: np.ndarray) -> np.ndarray:
    """Cumulative sums of ``x`` within each run of rows (runs start at ``first_row``, of
    ``length`` rows, back to back)."""
    c = np.cumsum(x)
    return c - np.repeat(c[first_row] - x[first_row], length)


def _layout(prompt: np.ndarray, shared: np.ndarray, block: int, first_fresh: int):
    """Requests of ``prompt`` tokens whose first ``shared`` blocks come from elsewhere: each
    block's request and position, where each request's blocks start, which blocks are shared,
    and ids for the rest, new and consecutive from ``first_fresh`` in request order."""
    count = -(-prompt // block)
    starts = np.zeros(len(prompt) + 1, np.int64)
    np.cumsum(count, out=starts[1:])
    req = np.repeat(np.arange(len(prompt)), count)
    pos = np.arange(int(starts[-1])) - starts[req]
    is_shared = pos < np.minimum(shared, count)[req]
    ids = np.zeros(len(pos), np.int64)
    ids[~is_shared] = first_fresh + np.arange(int((~is_shared).sum()))
    return req, pos, starts, is_shared, ids


# --- conversations ----------------------------------------------------------------------------

def _mean_turns(turns: float, first: int, user: int, output: int, system: int,
                max_tokens: int | None) -> float:
    """Expected turns per session: ``turns`` (geometric), or under the cap, where a session has
    at most K turns (K at the nominal token counts: exact at spread 0), E[min(G, K)] =
    turns (1 - (1 - 1 / turns)^K)."""
    if max_tokens is None:
        return turns
    most = (max_tokens - system - first) // (user + output) + 1
    return turns * (1 - (1 - 1 / turns) ** most)


def _sessions(rng, start, done, total, c: dict) -> tuple:
    """Sessions' requests, vectorised over their turns: session ``i`` has ``total[i]`` turns
    before the cap, the first ``done[i]`` already sent before time 0 (not returned: their sizes
    are drawn as the prompts' history), the next at ``start[i]``, each later one an exponential
    think time after the one before. Returns (arrival, prompt, output, session) of the turns
    returned, by session then turn."""
    m = len(start)
    first_row = np.cumsum(total) - total
    rows = int(total.sum())
    session = np.repeat(np.arange(m), total)
    turn = np.arange(rows) - np.repeat(first_row, total) + 1  # 1-based
    first = _sizes(rng, c["first_tokens"], c["spread"], m)
    user = _sizes(rng, c["user_tokens"], c["spread"], rows)
    output = _sizes(rng, c["output_tokens"], c["spread"], rows)
    think = rng.exponential(c["think_s"], rows)
    growth = np.where(turn > 1, np.roll(output, 1) + user, 0)  # the previous reply + a message
    prompt = c["shared_system_tokens"] + first[session] + _within(growth, first_row, total)
    after = done[session]
    gap = np.where(turn > after + 1, think, 0.0)
    arrival = start[session] + _within(gap, first_row, total)
    keep = turn > after
    if c["max_tokens"] is not None:  # prompts grow within a session: a cap keeps a prefix
        keep &= prompt <= c["max_tokens"]
    return arrival[keep], prompt[keep], output[keep], session[keep]


def _conversation_ids(session: np.ndarray, prompt: np.ndarray, system: int,
                      block: int) -> PrefixBlocks:
    """Block ids of requests listed by session then turn, each session's turns consecutive:
    a session's first listed turn shares only the system prompt's full blocks (ids 0, 1, ...;
    its earlier turns, if any, are not in the workload), each later one its previous turn's
    full blocks; the rest are new ids. Made in runs of whole sessions (bounded temporaries)."""
    new = np.flatnonzero(np.diff(session)) + 1  # where a session's turns begin
    cuts = [0, *new[np.searchsorted(new, np.arange(CHUNK_REQUESTS, len(prompt),
                                                   CHUNK_REQUESTS))].tolist(), len(prompt)]
    parts, fresh = [], system // block
    for a, b in zip(cuts, cuts[1:]):
        if b > a:
            part = _session_ids(session[a:b], prompt[a:b], system, block, fresh)
            parts.append(part)
            fresh = max(fresh, int(part.ids.max()) + 1) if len(part.ids) else fresh
    counts = np.concatenate([p.counts() for p in parts])
    starts = np.zeros(len(prompt) + 1, np.int64)
    np.cumsum(counts, out=starts[1:])
    return PrefixBlocks(np.concatenate([p.ids for p in parts]), starts)


def _session_ids(session: np.ndarray, prompt: np.ndarray, system: int, block: int,
                 first_fresh: int) -> PrefixBlocks:
    """:func:`_conversation_ids` of whole sessions, new ids from ``first_fresh``."""
    same = np.zeros(len(prompt), bool)
    same[1:] = session[1:] == session[:-1]
    previous = np.concatenate([[0], prompt[:-1]])
    shared = np.where(same, previous // block, system // block)
    req, pos, starts, is_shared, ids = _layout(prompt, shared, block, first_fresh)
    # a shared block of a later turn is its previous turn's block at that position: follow
    # those links (pointer jumping, log2 of the longest chain of turns) to where the id was
    # made: a new block, or the system prompt's (whose id is its position)
    link = np.arange(len(pos))
    later = is_shared & same[req]
    link[later] = starts[req[later] - 1] + pos[later]
    ids[is_shared & ~same[req]] = pos[is_shared & ~same[req]]
    while True:
        nxt = link[link]
        if np.array_equal(nxt, link):
            break
        link = nxt
    return PrefixBlocks(ids[link], starts)


def conversations(n: int, sessions_per_s: float | None = None, *, qps: float | None = None,
                  turns: float = 4.0, first_tokens: int = 2000, user_tokens: int = 300,
                  output_tokens: int = 300, think_s: float = 60.0, max_tokens: int | None = None,
                  shared_system_tokens: int = 0, spread: float = 0.0, block: int = BLOCK,
                  seed: int = 0) -> Workload:
    """The first ``n`` requests by arrival of multi-turn chat sessions in steady state (see the
    module's docstring). The rate: ``sessions_per_s``, or ``qps`` requests per second overall
    (sessions_per_s = qps / the mean turns per session after the ``max_tokens`` cap: exact at
    spread 0, at the nominal token counts otherwise)."""
    w = "--reuse conversations"
    n = _whole(w, "n (requests)", n, 1)
    turns = _real(w, "turns", turns, 1.0, most=MAX_TURNS)
    c = {k: _whole(w, k, v, 1) for k, v in (("first_tokens", first_tokens),
                                             ("user_tokens", user_tokens),
                                             ("output_tokens", output_tokens))}
    c["shared_system_tokens"] = _whole(w, "shared_system_tokens", shared_system_tokens, 0)
    c["think_s"] = _real(w, "think_s", think_s, 0.0, above=True)
    c["spread"] = _spread(w, spread)
    block, seed = _whole(w, "block", block, 1), _whole(w, "seed", seed, 0)
    biggest = c["shared_system_tokens"] + int(np.rint(c["first_tokens"] * (1 + c["spread"])))
    if max_tokens is not None:
        max_tokens = _whole(w, "max_tokens", max_tokens, 1)
        if max_tokens < biggest:
            raise KvsimError(f"{w}: max_tokens must be >= {biggest} (shared_system_tokens + "
                             f"first_tokens x (1 + spread): turn 1's prompt), got {max_tokens}")
    c["max_tokens"] = max_tokens
    mean = _mean_turns(turns, c["first_tokens"], c["user_tokens"], c["output_tokens"],
                       c["shared_system_tokens"], max_tokens)
    if (sessions_per_s is None) == (qps is None):
        raise KvsimError(f"{w}: give sessions_per_s or qps (requests per second), one of them")
    if qps is not None:
        rate = _real(w, "qps", qps, 0.0, above=True) / mean
    else:
        rate = _real(w, "sessions_per_s", sessions_per_s, 0.0, above=True)
    p = 1 / turns
    under_way = rate * c["think_s"] * (turns - 1)  # sessions with a turn to come, expected
    if under_way * 2 * turns > MAX_ROWS:
        raise KvsimError(f"{w}: about {under_way:.3g} sessions under way at any time "
                         f"(sessions/s x think_s x (turns - 1)) of {turns:g} turns each: too "
                         "many to draw; lower the rate, think_s or turns")

    rng = np.random.default_rng(seed)
    # sessions begun before time 0: k turns done with P(k) ~ (1 - p)^k (the process spends an
    # exponential think time in each state), then a geometric number more
    m = rng.poisson(under_way)
    done = rng.geometric(p, m)
    parts = [_sessions(rng, rng.exponential(c["think_s"], m), done, done + rng.geometric(p, m),
                       c)]
    count, sid, t = 0, m, 0.0
    while True:  # new sessions, until the n-th arrival is before any later session begins
        starts = t + np.cumsum(rng.exponential(1 / rate, CHUNK))
        part = _sessions(rng, starts, np.zeros(CHUNK, dtype=np.int64),
                         rng.geometric(p, CHUNK), c)
        parts.append((part[0], part[1], part[2], part[3] + sid))
        sid, t = sid + CHUNK, float(starts[-1])
        count = sum(int((a <= t).sum()) for a, *_ in parts)
        if count >= n:
            break
    arrival, prompt, output, session = (np.concatenate(x) for x in zip(*parts))
    order = np.argsort(arrival, kind="stable")[:n]  # ties: by session then turn
    listed = np.sort(order)  # by session then turn, each session's kept turns consecutive
    ids = _conversation_ids(session[listed], prompt[listed], c["shared_system_tokens"], block)
    hashes = ids[np.searchsorted(listed, order)]

    rate_words = (f"{qps:g} req/s overall = {rate:.6g} sessions/s x {mean:.6g} mean turns"
                  if qps is not None else f"{rate:g} sessions/s (x {mean:.6g} mean turns = "
                  f"{rate * mean:.6g} req/s)")
    system = c["shared_system_tokens"]
    words = [f"conversations (generated with prefix reuse, seed {seed}): {n} requests, the first "
             "by arrival from time 0 in steady state (sessions under way at time 0 included, "
             "their earlier turns not), arrivals from the first",
             f"sessions Poisson at {rate_words}",
             f"turns geometric with mean {turns:g} (>= 1)",
             "turn 1 = " + (f"a system prompt of {system} tokens shared by all sessions + "
                             if system else "") + f"a first message of {c['first_tokens']} tokens",
             f"each later turn = the previous prompt + its reply + a user message of "
             f"{c['user_tokens']} tokens",
             f"replies of {c['output_tokens']} tokens",
             _sizes_words(c["spread"]),
             f"the next turn an exponential think time of mean {c['think_s']:g} s after the "
             "previous turn's arrival (it includes the reply's generation)",
             f"prompts capped at {max_tokens} tokens (a session ends before a longer one)"
             if max_tokens is not None else "prompts uncapped",
             f"{block}-token blocks, a turn sharing its previous turn's full prompt blocks"]
    return Workload(arrival[order] - arrival[order[0]], prompt[order], output[order], None,
                    "; ".join(words), hashes, prefix_block=block)


# --- shared prompts ---------------------------------------------------------------------------

def shared_prompts(n: int, qps: float, *, prompts: int = 10, system_tokens: int = 8000,
                   user_tokens: int = 500, output_tokens: int = 200, zipf: float = 1.0,
                   spread: float = 0.0, block: int = BLOCK, seed: int = 0) -> Workload:
    """``n`` requests at Poisson ``qps`` (the first at time 0), each one of ``prompts`` system
    prompts of ``system_tokens`` (prompt k, k = 1..prompts, with probability proportional to
    k^-zipf) followed by a user message of ``user_tokens`` of its own; replies of
    ``output_tokens``. The system prompt's full blocks are shared ids, the rest new."""
    w = "--reuse shared-prompts"
    n = _whole(w, "n (requests)", n, 1)
    qps = _real(w, "qps", qps, 0.0, above=True)
    prompts = _whole(w, "prompts", prompts, 1)
    system_tokens = _whole(w, "system_tokens", system_tokens, 0)
    user_tokens = _whole(w, "user_tokens", user_tokens, 1)
    output_tokens = _whole(w, "output_tokens", output_tokens, 1)
    zipf = _real(w, "zipf", zipf, 0.0)
    spread = _spread(w, spread)
    block, seed = _whole(w, "block", block, 1), _whole(w, "seed", seed, 0)

    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1 / qps, n)
    weight = np.arange(1, prompts + 1, dtype=float) ** -zipf
    which = rng.choice(prompts, n, p=weight / weight.sum())
    system = _sizes(rng, system_tokens, spread, prompts)
    prompt = system[which] + _sizes(rng, user_tokens, spread, n)
    output = _sizes(rng, output_tokens, spread, n)
    full = system // block  # system prompt k's blocks: ids first[k], first[k] + 1, ...
    first = np.cumsum(full) - full
    req, pos, starts, is_shared, ids = _layout(prompt, full[which], block, int(full.sum()))
    ids[is_shared] = first[which][req[is_shared]] + pos[is_shared]
    hashes = PrefixBlocks(ids, starts)

    popularity = (f"Zipf popularity, exponent {zipf:g} (prompt k of 1..{prompts} with "
                  f"probability ~ k^-{zipf:g})" if zipf else "uniform popularity (zipf 0)")
    words = [f"shared prompts (generated with prefix reuse, seed {seed}): {n} requests, Poisson "
             f"arrivals at {qps:g} req/s from time 0",
             f"each = one of {prompts} system prompts of {system_tokens} tokens, {popularity}, "
             f"+ a user message of {user_tokens} tokens of its own",
             f"replies of {output_tokens} tokens",
             _sizes_words(spread) + (" (a system prompt's drawn once)" if spread else ""),
             f"{block}-token blocks, a system prompt's full blocks shared"]
    return Workload(np.cumsum(gaps) - gaps[0], prompt, output, None, "; ".join(words), hashes,
                    prefix_block=block)


# --- specs ------------------------------------------------------------------------------------

_MAKERS = {"conversations": conversations, "shared-prompts": shared_prompts}
_NOT_KEYS = ("qps", "block", "seed")  # given by the command's own options
_KEYS = {kind: {k: v for k, v in f.__kwdefaults__.items() if k not in _NOT_KEYS}
         for kind, f in _MAKERS.items()}
_FLOATS = ("turns", "think_s", "zipf", "spread")
_ABOUT = {
    "conversations": "multi-turn chats, each turn resending the history (previous prompt + "
                     "reply + a new message), the next turn a think time after; rate = qps",
    "shared-prompts": "requests of one of a few system prompts (Zipf popularity) + a message of "
                      "their own; rate = qps",
}


def _default_words(kind: str) -> str:
    return ",".join(f"{k}={'none' if v is None else f'{v:g}'}" for k, v in _KEYS[kind].items())


KINDS = {kind: f"{_ABOUT[kind]}; keys (defaults): {_default_words(kind)}" for kind in _MAKERS}


def _value(where: str, key: str, text: str):
    if key == "max_tokens" and text.lower() in ("none", "inf", "unlimited"):
        return None
    try:
        v = float(text)
    except ValueError:
        raise KvsimError(f"{where}: {key}={text!r} is not a number") from None
    if key in _FLOATS or not v.is_integer():  # a whole-number key given a fraction: refused
        return v
    return int(v)


def parse(text: str, qps: float, n: int, block: int = BLOCK, seed: int = 0) -> Workload:
    """A workload from a spec ``KIND[:KEY=VALUE,...]`` (kinds and keys in :data:`KINDS`), at
    ``qps`` requests per second overall, ``n`` requests."""
    kind, _, rest = text.strip().partition(":")
    kind = kind.strip()
    if kind not in _MAKERS:
        raise KvsimError(f"--reuse: unknown kind {kind!r}; one of {', '.join(_MAKERS)} "
                         "(KIND:key=value,...)")
    where, given = f"--reuse {kind}", {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, value = (s.strip() for s in item.partition("="))
        if not eq or not value:
            raise KvsimError(f"{where}: expected key=value, got {item!r}")
        if key not in _KEYS[kind]:
            raise KvsimError(f"{where}: unknown key {key!r}; accepted: "
                             f"{', '.join(_KEYS[kind])}")
        if key in given:
            raise KvsimError(f"{where}: {key} given twice")
        given[key] = _value(where, key, value)
    return _MAKERS[kind](n, qps=qps, **given, block=block, seed=seed)
