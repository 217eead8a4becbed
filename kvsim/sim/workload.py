"""Request streams: Poisson arrivals at a QPS, a closed loop with fixed concurrency, or a file:
kvsim's CSV or a public trace as published (names and units from the publishers' own files):

- ``kvsim``: CSV ``arrival`` (seconds, kept as written), ``prompt``, ``output`` (tokens).
- ``azure``: github.com/Azure/AzurePublicDataset ``AzureLLMInferenceDataset2023.md``/``2024.md``
  (``data/AzureLLMInferenceTrace_code.csv``, ``_conv.csv``; 2024: ``..._code_1week.csv``,
  ``_conv_1week.csv``): ``TIMESTAMP`` ("invocation time"), ``ContextTokens``,
  ``GeneratedTokens``; 2023 writes ``2023-11-16 18:17:03.9799600`` (7 digits, no zone), 2024
  ``2024-05-10 00:00:00.009930+00:00`` or ``2024-05-12 00:00:00+00:00``
  (``analysis/AzureLLMInferenceDataset2024.ipynb``). Read as ISO 8601 to the ns, no zone = UTC.
- ``burstgpt``: github.com/HPMLL/BurstGPT README "Schema" (``data/BurstGPT_1.csv``):
  ``Timestamp`` ("seconds from 0:00:00 on the first day"), ``Model``, ``Request tokens``,
  ``Response tokens``, ``Total tokens``, ``Log Type`` (v2 adds ``Session ID``, ``Elapsed
  time``: columns are found by name). ``BurstGPT_1/_2.csv`` hold failures with 0 ``Response
  tokens`` (``_without_fails`` files drop them): skipped and counted.
- ``mooncake``: github.com/kvcache-ai/Mooncake ``FAST25-release/traces/*.jsonl``
  (conversation, toolagent, synthetic; earlier ``mooncake_trace.jsonl``): JSON lines
  ``{"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, ...]}``,
  ``timestamp`` in ms since the first request, ``hash_ids`` the prompt's 512-token blocks, shared
  ids a shared prefix (NVIDIA Dynamo ``benchmarks/data_generator/README.md``); kept as
  ``Workload.prefix_hashes`` for prefix caching (:mod:`kvsim.sim.prefix`).

Traces' arrivals count from the earliest request; requests are sorted by arrival (stable), the
first ``limit`` kept, arrivals multiplied by ``time_scale`` (0.5: twice the rate). A bad value is
an error naming its line; token counts are whole numbers (``100.7`` refused, not truncated),
prompts and outputs at least 1. CSVs go through pandas' C parser in chunks (millions of rows in
seconds, bounded memory); a file the fast typed pass doubts is read again as text to say which
line is wrong and why.
"""

from __future__ import annotations

import csv
import itertools
import json
import math
import re
import stat
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvsim.errors import KvsimError
from kvsim.io import loads_json

FORMATS = ("kvsim", "azure", "burstgpt", "mooncake")
CHUNK_ROWS = 1 << 20
MAX_TOKENS = 2**31 - 1  # a token count above this is a broken file, not a request
MAX_SECONDS = 1e10  # a time beyond this (300 years; the epoch is 1.8e9 s) is a broken file


GATHER = 1 << 16  # requests gathered at a time (PrefixBlocks)


class PrefixBlocks:
    """Each request's prompt blocks, packed: ``ids`` holds every request's block ids, request
    after request, and request ``i``'s are ``ids[starts[i]:starts[i + 1]]`` (a few bytes per
    block: a 10-day stream of millions of requests holds its ids in tens of MB, where lists of
    Python ints would take ten times more). Indexed by a request, a list of its ids; by a slice
    or an index array, the requests it names."""

    def __init__(self, ids: np.ndarray, starts: np.ndarray):
        small = ids.dtype == np.int32 or len(ids) == 0 or (
            int(ids.min()) >= -2**31 and int(ids.max()) < 2**31)
        self.ids = np.ascontiguousarray(ids, np.int32 if small else np.int64)
        self.starts = np.asarray(starts, np.int64)

    @classmethod
    def of(cls, lists) -> PrefixBlocks:
        """From one list of ids per request."""
        counts = np.fromiter(map(len, lists), np.int64, len(lists))
        starts = np.zeros(len(lists) + 1, np.int64)
        np.cumsum(counts, out=starts[1:])
        ids = np.fromiter((b for ids in lists for b in ids), np.int64, int(starts[-1]))
        return cls(ids, starts)

    def __len__(self) -> int:
        return len(self.starts) - 1

    def counts(self) -> np.ndarray:
        """Blocks per request."""
        return np.diff(self.starts)

    def __getitem__(self, i):
        if isinstance(i, (int, np.integer)):
            return self.ids[self.starts[i]:self.starts[i + 1]].tolist()
        if isinstance(i, slice) and i.step in (None, 1):  # a view
            a, b, _ = i.indices(len(self))
            b = max(a, b)
            return PrefixBlocks(self.ids[self.starts[a]:self.starts[b]],
                                self.starts[a:b + 1] - self.starts[a])
        idx = np.arange(len(self))[i] if isinstance(i, slice) else np.asarray(i, np.int64)
        counts = self.counts()[idx]
        starts = np.zeros(len(idx) + 1, np.int64)
        np.cumsum(counts, out=starts[1:])
        ids = np.empty(int(starts[-1]), self.ids.dtype)
        for a in range(0, len(idx), GATHER):  # in chunks: no temporary of the whole size
            b = min(a + GATHER, len(idx))
            at = np.repeat(self.starts[idx[a:b]] - starts[a:b], counts[a:b]) + \
                np.arange(starts[a], starts[b])
            ids[starts[a]:starts[b]] = self.ids[at]
        return PrefixBlocks(ids, starts)

    def __iter__(self):
        ids, s = self.ids, self.starts.tolist()
        for a, b in zip(s, s[1:]):
            yield ids[a:b].tolist()

    def __eq__(self, other) -> bool:
        return len(self) == len(other) and all(a == list(b) for a, b in zip(self, other))

    __hash__ = None


@dataclass
class Workload:
    arrival: np.ndarray  # seconds (open loop); ignored for a closed loop
    prompt: np.ndarray  # prompt tokens per request
    output: np.ndarray  # output tokens per request (>= 1; the first comes from prefill)
    concurrency: int | None  # closed loop: this many requests in the system at all times
    description: str
    # per request, its prompt's block ids (Mooncake's hash_ids, or kvsim.sim.reuse's): equal
    # ids are equal prefixes; ``prefix_block`` tokens per block
    prefix_hashes: PrefixBlocks | None = None
    prefix_block: int = 512

    @property
    def n(self) -> int:
        return len(self.prompt)


def _check_sizes(prompt, output, where: str) -> None:
    if (np.asarray(prompt) < 1).any():
        raise KvsimError(f"{where}: prompt lengths must be positive")
    if (np.asarray(output) < 1).any():
        raise KvsimError(f"{where}: output lengths must be positive")


def poisson(qps: float, n: int, prompt: int, output: int, seed: int) -> Workload:
    if qps <= 0:
        raise KvsimError(f"--qps must be positive, got {qps}")
    if n < 1:
        raise KvsimError(f"--requests must be positive, got {n}")
    _check_sizes([prompt], [output], "workload")
    gaps = np.random.default_rng(seed).exponential(1.0 / qps, n)
    return Workload(np.cumsum(gaps) - gaps[0], np.full(n, prompt), np.full(n, output), None,
                    f"Poisson arrivals at {qps:g} req/s, {n} requests of {prompt}+{output} tokens "
                    f"(seed {seed})")


def closed_loop(concurrency: int, n: int, prompt: int, output: int) -> Workload:
    if concurrency < 1:
        raise KvsimError(f"--concurrency must be positive, got {concurrency}")
    if n < 1:
        raise KvsimError(f"--requests must be positive, got {n}")
    _check_sizes([prompt], [output], "workload")
    return Workload(np.zeros(n), np.full(n, prompt), np.full(n, output), concurrency,
                    f"closed loop of {concurrency} concurrent requests, {n} requests of "
                    f"{prompt}+{output} tokens")


@dataclass(frozen=True)
class _Format:
    title: str
    time: str  # the arrival time's column (key)
    prompt: str
    output: str
    unit: float  # seconds per unit of time (dates: ns since the epoch)
    datetime: bool = False  # the time is a date and time
    relative: bool = True  # arrivals count from the earliest request (else as written)
    failures: bool = False  # an output of 0 tokens is a failed request, skipped


SPECS = {
    "kvsim": _Format("kvsim workload CSV", "arrival", "prompt", "output", 1.0, relative=False),
    "azure": _Format("Azure LLM inference trace", "TIMESTAMP", "ContextTokens",
                     "GeneratedTokens", 1e-9, datetime=True),
    "burstgpt": _Format("BurstGPT trace", "Timestamp", "Request tokens", "Response tokens", 1.0,
                        failures=True),
    "mooncake": _Format("Mooncake trace", "timestamp", "input_length", "output_length", 1e-3),
}
TRIED = ", ".join(f"{k} ({'JSON lines with ' * (k == 'mooncake')}{v.time}, {v.prompt}, "
                  f"{v.output})" for k, v in SPECS.items())


def from_file(path: str | Path, fmt: str = "auto", time_scale: float = 1.0,
              limit: int | None = None) -> Workload:
    """A workload file in one of :data:`FORMATS` (``auto``: told by its header or first line),
    its arrivals multiplied by ``time_scale``, its first ``limit`` requests by arrival."""
    if fmt != "auto" and fmt not in FORMATS:
        raise KvsimError(f"--workload-format {fmt!r}: one of auto, {', '.join(FORMATS)}")
    check_scale_limit(time_scale, limit)
    first = _first_line(path)
    fmt = detect(path, first) if fmt == "auto" else fmt
    spec = SPECS[fmt]
    # times, prompts, outputs in file order; failures skipped; Mooncake's hash_ids
    time, prompt, output, skipped, hashes = (_read_mooncake(path) if fmt == "mooncake" else
                                             _read_csv(path, spec, first))
    seconds = (time - time.min() if spec.relative else time) * spec.unit
    order = np.argsort(seconds, kind="stable")[:limit]
    arrival = seconds[order] * float(time_scale)
    hashes = None if hashes is None else PrefixBlocks.of(hashes)[order]
    read, span = len(time) + skipped, float(arrival[-1] - arrival[0])
    words = [f"{spec.title} ({fmt}) {path}: {len(order)} requests used of {read} read",
             *([f"the first {len(order)} by arrival (--limit)"] if len(order) < len(time)
               else []),
             f"{skipped} skipped" + (" (0 response tokens: failed requests)" if skipped else ""),
             "arrivals span " + (f"{span:.6g} s" if span < 1e5 else
                                 f"{span:.0f} s ({span / 3600:.1f} h)")
             + (" from the earliest request" if spec.relative else ""),
             f"time scale {float(time_scale):g}" + (" (as recorded)" if time_scale == 1 else
                                                    " (--time-scale)"),
             *(["hash_ids kept as 512-token prefix blocks"] if hashes else [])]
    return Workload(arrival, prompt[order], output[order], None, "; ".join(words), hashes)


def from_csv(path: str | Path) -> Workload:
    """kvsim's own CSV: columns ``arrival`` (seconds), ``prompt`` and ``output`` (tokens)."""
    return from_file(path, "kvsim")


def check_scale_limit(time_scale: float, limit: int | None) -> None:
    if not (math.isfinite(time_scale) and time_scale > 0):
        raise KvsimError(f"--time-scale must be positive and finite, got {time_scale}")
    if limit is not None and limit < 1:
        raise KvsimError(f"--limit must be a positive number of requests, got {limit}")


def detect(path, first: str) -> str:
    """The format whose header (or first JSON line) ``first`` is."""
    text = first.strip()
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except ValueError:
            obj = None
        if isinstance(obj, dict) and all(k in obj for k in _keys(SPECS["mooncake"])):
            return "mooncake"
    else:
        names = set(_split(text))
        for name, spec in SPECS.items():
            if name != "mooncake" and set(_keys(spec)) <= names:
                return name
    shown = text if len(text) <= 80 else text[:77] + "..."
    raise KvsimError(f"{path}: cannot tell the workload format from its first line {shown!r}; "
                     f"tried {TRIED}; give --workload-format")


def _unreadable(path, e: Exception | str) -> KvsimError:
    if isinstance(e, UnicodeDecodeError):
        packed = Path(path).suffix.lower() in (".gz", ".bz2", ".xz", ".zst", ".zip")
        e = ": not UTF-8 text" + (" (compressed: decompress it first)" if packed else "")
    elif isinstance(e, OSError):
        e = f" ({(e.strerror or str(e)).lower()})"
    return KvsimError(f"{path}: cannot read the workload file{e}")


def _first_line(path) -> str:
    """The first line of a regular, readable, non-empty file (stat before opening: a FIFO or a
    directory is refused without blocking)."""
    try:
        st = Path(path).stat()
    except OSError as e:
        raise _unreadable(path, e) from None
    if not stat.S_ISREG(st.st_mode):
        kind = ("a directory" if stat.S_ISDIR(st.st_mode) else
                "a FIFO" if stat.S_ISFIFO(st.st_mode) else "a device or socket")
        raise _unreadable(path, f": it is {kind}, not a regular file")
    try:
        with open(path, encoding="utf-8-sig", newline="") as f:
            head = f.read(1 << 20)
    except (OSError, UnicodeDecodeError) as e:
        raise _unreadable(path, e) from None
    if not head.strip():
        raise KvsimError(f"{path}: the workload file is empty")
    first = head.splitlines()[0]
    if not first.strip():
        raise KvsimError(f"{path} line 1: empty; a CSV header or a JSON object must come first")
    return first


def _keys(spec: _Format) -> tuple[str, str, str]:
    return spec.time, spec.prompt, spec.output


def _split(text: str) -> list[str]:
    return [c.strip() for c in next(csv.reader([text.rstrip("\r\n")]), [])]


class _Retry(Exception):
    """The fast typed pass met something it cannot judge: read again as text."""


def _read_csv(path, spec: _Format, first: str) -> tuple:
    names = _split(first)
    if dup := next((c for i, c in enumerate(names) if c in names[:i]), None):
        raise KvsimError(f"{path} line 1: column {dup!r} appears more than once")
    needed = _keys(spec)
    if missing := [c for c in needed if c not in names]:
        fmt = next(k for k, v in SPECS.items() if v is spec)
        raise KvsimError(f"{path}: the {fmt} format needs columns {', '.join(needed)}; the "
                         f"header lacks {', '.join(missing)} (it has {', '.join(names)})")
    try:
        return _scan_csv(path, spec, [names.index(c) for c in needed], len(names), fast=True)
    except _Retry:
        return _scan_csv(path, spec, [names.index(c) for c in needed], len(names), fast=False)


def _scan_csv(path, spec: _Format, pos: list[int], width: int, fast: bool) -> tuple:
    """One pass over the CSV in chunks. ``fast``: typed columns, and any doubt raises
    :class:`_Retry`; else every column as text, to say which line is wrong and why."""
    import pandas as pd
    kw = ({"dtype": {i: str if spec.datetime and i == pos[0] else "float64" for i in pos}}
          if fast else {"dtype": str, "keep_default_na": False})
    parts, offset, skipped = [], 0, 0
    try:  # columns labelled by their positions (the header was read above)
        with pd.read_csv(path, header=0, names=list(range(width)), usecols=pos,
                         skip_blank_lines=False, chunksize=CHUNK_ROWS, encoding="utf-8-sig",
                         **kw) as reader:
            for chunk in reader:
                part = _check_chunk(path, spec, *(chunk[i] for i in pos), offset, fast)
                offset += len(chunk)
                skipped += part[3]
                parts.append(part)
    except pd.errors.ParserError as e:
        msg = " ".join(str(e).split())
        m = re.search(r"Expected (\d+) fields in line (\d+), saw (\d+)", msg)
        raise KvsimError(f"{path} line {m[2]}: {m[3]} fields, the header has {m[1]}" if m else
                         f"{path}: not a readable CSV ({msg})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise _unreadable(path, e) from None
    except (ValueError, TypeError, OverflowError) as e:
        if fast:
            raise _Retry() from None
        raise KvsimError(f"{path}: not a readable CSV ({' '.join(str(e).split())})") from None
    time, prompt, output = (np.concatenate([p[k] for p in parts]) for k in range(3))
    if len(time) == 0:
        why = f" ({skipped} failed requests with 0 response tokens skipped)" if skipped else ""
        raise KvsimError(f"{path}: the workload file has no requests{why}")
    return time, prompt, output, skipped, None


def _check_chunk(path, spec: _Format, t, p, o, offset: int, fast: bool):
    """One chunk's (times, prompts, outputs, failures skipped); a bad row is an error that
    names its line (in the fast pass, a :class:`_Retry`)."""
    import pandas as pd
    if fast:
        tv = _times(t) if spec.datetime else t.to_numpy(float)
        pv, ov = p.to_numpy(float), o.to_numpy(float)
        if ((np.isnat(tv) if spec.datetime else np.isnan(tv)) | np.isnan(pv) | np.isnan(ov)).any():
            raise _Retry()  # a blank line, a missing value or a value that is not a number
        keep = np.ones(len(t), dtype=bool)
    else:
        keep = ~np.logical_and.reduce([s.fillna("").str.strip().eq("").to_numpy(bool)
                                       for s in (t, p, o)])  # blank lines
        tv = _times(t) if spec.datetime else pd.to_numeric(t, errors="coerce").to_numpy(float)
        pv, ov = (pd.to_numeric(s, errors="coerce").to_numpy(float) for s in (p, o))
    with np.errstate(invalid="ignore"):
        bad = [np.isnat(tv) if spec.datetime else ~np.isfinite(tv) | (tv < 0) |
               (tv * spec.unit > MAX_SECONDS),
               _bad_tokens(pv, 1), _bad_tokens(ov, 0 if spec.failures else 1)]
    firsts = [(int(np.flatnonzero(b & keep)[0]), k) for k, b in enumerate(bad) if (b & keep).any()]
    if firsts:
        if fast:
            raise _Retry()
        row, k = min(firsts)
        why = _why(spec, k, (t, p, o)[k].iloc[row], (tv, pv, ov)[k][row])
        raise KvsimError(f"{path} line {_line_of(path, offset + row)}: {why}")
    failed = keep & (ov == 0) if spec.failures else np.zeros(len(t), dtype=bool)
    keep &= ~failed
    times = tv[keep].view(np.int64) if spec.datetime else tv[keep]  # ns since the epoch
    return times, pv[keep].astype(np.int64), ov[keep].astype(np.int64), int(failed.sum())


def _times(t) -> np.ndarray:
    """ISO 8601 dates and times (any zone; none: UTC) as datetime64[ns], NaT where not one."""
    import pandas as pd
    ts = pd.to_datetime(t, format="ISO8601", utc=True, errors="coerce")
    return ts.dt.tz_localize(None).to_numpy("datetime64[ns]")


def _bad_tokens(v: np.ndarray, least: int) -> np.ndarray:
    return ~np.isfinite(v) | (v != np.floor(v)) | (v < least) | (v > MAX_TOKENS)


def _why(spec: _Format, k: int, raw, value) -> str:
    """Why the value ``raw`` of the time (k = 0), prompt (1) or output (2) column is refused."""
    column = _keys(spec)[k]
    text = "" if raw is None or (isinstance(raw, float) and math.isnan(raw)) else str(raw).strip()
    if not text:
        return f"{column} is empty"
    if k == 0 and spec.datetime:
        return f"{column} {text!r} is not a date and time like 2023-11-16 18:15:46.6805900"
    if k == 0:
        return (f"{column} {_show(text)} is not a finite number of seconds"
                if not math.isfinite(value) else f"{column} {text} is negative" if value < 0
                else f"{column} {text} is beyond {MAX_SECONDS:g} s")
    return _token_problem(column, _show(text), value, k == 1)


def _token_problem(column: str, shown: str, value, prompt: bool) -> str:
    """Why a token count is refused; ``shown``: the value as the file wrote it."""
    if not math.isfinite(value) or value != math.floor(value):
        return f"{column} {shown} is not a whole number"
    text = shown.strip("'")
    if value < 0:
        return f"{column} {text} is negative"
    if value > MAX_TOKENS:
        return f"{column} {text} is too large (over 2^31 - 1 tokens)"
    return f"{column} {text}: " + ("a prompt needs at least 1 token" if prompt else
                                   "a request needs at least 1 output token")


def _line_of(path, record: int) -> int:
    """The line (header = 1) where data record ``record`` (0-based, blank lines too) starts."""
    with open(path, encoding="utf-8-sig", newline="") as f:
        reader = csv.reader(f)
        for _ in itertools.islice(reader, record + 1):  # the header and the records before
            pass
        return reader.line_num + 1


def _read_mooncake(path) -> tuple:
    """Mooncake's JSON lines; hash_ids kept when every line has them."""
    rows: list[tuple] = []
    hashes: list = []
    try:
        with open(path, encoding="utf-8-sig") as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path} line {line_no}"
                obj = loads_json(line, where, "Mooncake trace line")
                if missing := [k for k in _keys(SPECS["mooncake"]) if k not in obj]:
                    raise KvsimError(f"{where}: no {missing[0]!r}")
                ts, inp, out = (_number(obj[k]) for k in _keys(SPECS["mooncake"]))
                if not math.isfinite(ts) or ts < 0 or ts * 1e-3 > MAX_SECONDS:
                    raise KvsimError(f"{where}: timestamp {_show(obj['timestamp'])} is " + (
                        "negative" if ts < 0 else f"beyond {MAX_SECONDS:g} s"
                        if math.isfinite(ts) else "not a finite number of milliseconds"))
                for key, v in (("input_length", inp), ("output_length", out)):
                    if _bad_tokens(v, 1):
                        raise KvsimError(f"{where}: " + _token_problem(
                            key, _show(obj[key]), v, key[0] == "i"))
                if (ids := obj.get("hash_ids")) is not None and not (
                        isinstance(ids, list) and all(type(h) is int for h in ids)):
                    raise KvsimError(f"{where}: hash_ids {_show(ids, 60)} is not a list of ints")
                rows.append((ts, int(inp), int(out)))
                hashes.append(ids)
    except (OSError, UnicodeDecodeError) as e:
        raise _unreadable(path, e) from None
    if not rows:
        raise KvsimError(f"{path}: the workload file has no requests")
    time, prompt, output = (np.asarray(c, dtype=d) for c, d in
                            zip(zip(*rows), (float, np.int64, np.int64)))
    return time, prompt, output, 0, hashes if all(h is not None for h in hashes) else None


def _number(v) -> float:
    """A JSON number as a float (NaN if not a number; huge integers capped, not overflowed)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return math.nan
    return float(max(min(v, 2**62), -2**62)) if isinstance(v, int) else v


def _show(v, width: int = 40) -> str:
    text = repr(v) if isinstance(v, str) else json.dumps(v)
    return text if len(text) <= width else text[:width - 3] + "..."


def build(csv: str | Path | None, qps: float | None, concurrency: int | None, batch: int,
          requests: int | None, prompt: int, output: int, seed: int, fmt: str = "auto",
          time_scale: float = 1.0, limit: int | None = None) -> Workload:
    """The workload a replay asks for: a workload file (kvsim's CSV or a public trace, see
    :func:`from_file`), Poisson arrivals at ``qps`` (64 requests unless given), or a closed loop
    of ``concurrency`` (default ``batch``; 2 x concurrency requests)."""
    if csv is not None:
        return from_file(csv, fmt, time_scale, limit)
    if qps is not None:
        return poisson(qps, requests or 64, prompt, output, seed)
    conc = concurrency or batch
    return closed_loop(conc, requests or 2 * conc, prompt, output)
