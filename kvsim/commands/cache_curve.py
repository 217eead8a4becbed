"""kvsim cache-curve: the share of a workload's prompt tokens that a prefix cache of each
capacity would serve, replaying its arrival sequence alone through one LRU cache over its prefix
blocks (no timing, no prefill, no running request pinned), as Mooncake's FAST'25 paper does in
its Figure 9. A request's hit is its longest leading run of cached blocks; then all its blocks
become the most recently used. A capacity is in tokens and holds floor(capacity / block) whole
blocks; "inf" (or "unlimited") is a cache that never evicts, whose share is always computed
(the curve's ceiling). The workload needs prefix hashes: a Mooncake trace's hash_ids."""

from __future__ import annotations

import argparse
import math
import sys

HELP = "prefix-cache hit share against cache capacity (LRU replay of a trace's prefix blocks)"
EPILOG = """examples:
  kvsim cache-curve data/mooncake/conversation_trace.jsonl
  kvsim cache-curve data/mooncake/conversation_trace.jsonl --capacity-tokens 3e6,1e7,inf --json
  kvsim cache-curve data/mooncake/synthetic_trace.jsonl --plot curve.png --force

--json prints one object: capacity_tokens and hit_frac (lists in the order given; unlimited is
null), unlimited_hit_frac, block_tokens, requests, prompt_tokens and source (how the workload
was read)."""

DEFAULT_CAPACITIES = "1e5,3e5,1e6,3e6,1e7,3e7,1e8,inf"
UNLIMITED = ("inf", "+inf", "infinity", "unlimited")
FORMATS = ("auto", "kvsim", "azure", "burstgpt", "mooncake")


def add_parser(sub) -> None:
    p = sub.add_parser("cache-curve", help=HELP, description=__doc__, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file", metavar="FILE", help="a workload file with prefix hashes (a "
                                                "Mooncake trace's hash_ids)")
    p.add_argument("--capacity-tokens", default=DEFAULT_CAPACITIES, metavar="LIST",
                   help="cache capacities in tokens, comma-separated, each > 0 (3e6, 10000000, "
                        f"inf or unlimited) [default: {DEFAULT_CAPACITIES}]")
    p.add_argument("--block-tokens", type=int, default=512, metavar="N",
                   help="tokens per prefix block, the size the hashes were made at (Mooncake's "
                        "hash_ids are 512-token blocks) [default: 512]")
    p.add_argument("--limit", type=int, metavar="N", help="only the first N requests by arrival")
    p.add_argument("--workload-format", default="auto", metavar="F", choices=FORMATS,
                   help="the file's format: mooncake (JSONL with hash_ids), kvsim, azure, "
                        "burstgpt (CSVs: no prefix hashes) or auto (told by its first line) "
                        "[default: auto]")
    p.add_argument("--plot", metavar="PNG", help="also draw hit share against capacity (log "
                                                 "x, the unlimited share dashed) into PNG")
    p.add_argument("--force", action="store_true", help="overwrite an existing --plot file")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def parse_capacities(text: str) -> list[float]:
    """``--capacity-tokens``' list: each item a number of tokens > 0, or inf/unlimited."""
    from kvsim.errors import KvsimError
    out = []
    for item in text.split(","):
        word = item.strip()
        if not word:
            raise KvsimError(f"--capacity-tokens {text!r}: an empty item (write numbers of "
                             "tokens separated by commas, e.g. 3e6,1e7,inf)")
        if word.lower() in UNLIMITED:
            out.append(math.inf)
            continue
        try:
            v = float(word)
        except ValueError:
            v = None
        if v is None or math.isnan(v):
            raise KvsimError(f"--capacity-tokens: {word!r} is not a number of tokens "
                             "(e.g. 3e6, 10000000, inf)")
        if v <= 0:
            raise KvsimError(f"--capacity-tokens: {word} must be > 0 tokens")
        if math.isinf(v):
            raise KvsimError(f"--capacity-tokens: {word} overflows; write inf for unlimited")
        out.append(v)
    from kvsim.checks import distinct
    return distinct(out, "--capacity-tokens")


def _check(args) -> list[float]:
    """The flags, checked before the file is read: the capacities."""
    from kvsim.errors import KvsimError
    from kvsim.io import check_destination
    caps = parse_capacities(args.capacity_tokens)
    if args.block_tokens < 1:
        raise KvsimError(f"--block-tokens must be >= 1, got {args.block_tokens}")
    if args.plot is not None:
        if not args.plot.lower().endswith(".png"):
            raise KvsimError(f"--plot {args.plot}: the figure is a PNG; name it .png")
        if not any(math.isfinite(c) for c in caps):
            raise KvsimError("--plot needs at least one finite capacity in --capacity-tokens")
        check_destination(args.plot, args.force)
    return caps


def _warn_block_size(hashes, prompts, block: int) -> None:
    """One line on stderr when the hashes do not count ceil(prompt / block) blocks."""
    off = sum(len(ids) != -(-int(p) // block) for ids, p in zip(hashes, prompts))
    if off:
        print(f"kvsim cache-curve: warning: {off:,} of {len(hashes):,} requests have a number of "
              f"prefix hashes other than ceil(prompt / {block}): is --block-tokens the size the "
              "hashes were made at?", file=sys.stderr)


def curve(hashes, prompts, block: int, caps: list[float]) -> tuple[list[float], float]:
    """(hit share at each capacity, unlimited share): one :func:`kvsim.sim.prefix.hit_curve`
    replay per distinct number of whole blocks (capacities holding as many share a replay), a
    progress bar on stderr when it is a terminal."""
    from tqdm import tqdm

    from kvsim.sim.prefix import hit_curve
    blocks = {}  # whole blocks -> a capacity of that many, in order
    for c in [*caps, math.inf]:
        blocks.setdefault(math.floor(c / block) if math.isfinite(c) else math.inf, c)
    shares = {}
    for n, c in tqdm(blocks.items(), desc="cache-curve", unit="capacity", disable=None,
                     file=sys.stderr, leave=False):  # disable=None: only on a terminal
        shares[n] = hit_curve(hashes, prompts, block, [c])[0]
    at = [shares[math.floor(c / block) if math.isfinite(c) else math.inf] for c in caps]
    return at, shares[math.inf]


def run(args) -> int:
    from kvsim.errors import KvsimError
    from kvsim.sim.workload import from_file
    caps = _check(args)
    w = from_file(args.file, args.workload_format, limit=args.limit)
    if w.prefix_hashes is None:
        raise KvsimError(f"{args.file}: the workload has no prefix hashes (a Mooncake trace's "
                         "hash_ids, on every line): no prefix cache to replay")
    block = args.block_tokens
    _warn_block_size(w.prefix_hashes, w.prompt, block)
    hit, unlimited = curve(w.prefix_hashes, w.prompt, block, caps)
    prompt_tokens = int(sum(int(p) for p in w.prompt))
    if args.json:
        from kvsim.commands._out import print_json
        print_json({"capacity_tokens": [(int(c) if c.is_integer() else c) if math.isfinite(c)
                                        else None for c in caps],  # null: unlimited
                    "hit_frac": hit, "unlimited_hit_frac": unlimited, "block_tokens": block,
                    "requests": w.n, "prompt_tokens": prompt_tokens, "source": w.description})
    else:
        _print_table(args.file, w.n, prompt_tokens, block, caps, hit, unlimited)
    if args.plot is not None:
        _plot(args.plot, args.force, args.file, w.n, block, caps, hit, unlimited)
        print(f"plot: {args.plot}", file=sys.stderr if args.json else sys.stdout)
    return 0


def _print_table(path, n: int, prompt_tokens: int, block: int, caps, hit, unlimited) -> None:
    from kvsim.commands._out import table
    print(f"{path}: {n:,} requests, {prompt_tokens:,} prompt tokens, {block}-token blocks; "
          f"LRU over prefix blocks in arrival order, no timing; unlimited cache: "
          f"{100 * unlimited:.2f}% of prompt tokens")
    cols = {"capacity (tokens)": [f"{c:,.0f}" if math.isfinite(c) else "unlimited" for c in caps],
            "blocks": [f"{math.floor(c / block):,}" if math.isfinite(c) else "unlimited"
                       for c in caps],
            "hit share": [f"{100 * h:.2f}%" for h in hit],
            "share of unlimited": [f"{100 * h / unlimited:.1f}%" if unlimited > 0 else "-"
                                   for h in hit]}
    # right-aligned: each column's cells padded to one width (the table left-aligns text)
    cols = {k: [s.rjust(max(map(len, v))) for s in v] for k, v in cols.items()}
    table([dict(zip(cols, row)) for row in zip(*cols.values())])


def _tokens(v: float) -> str:
    """A tick's token count: 10,000, 500,000, 3M, 1,000M (thousands are 1,000)."""
    if v >= 1e6:
        m = v / 1e6
        return f"{m:,.0f}M" if m >= 10 and m.is_integer() else f"{m:.3g}M"
    return f"{v:,.0f}"


def _plot(path, force: bool, source, n: int, block: int, caps, hit, unlimited) -> None:
    """Hit share against capacity (log x) with the unlimited share dashed, written atomically.
    The figure comes from the planner's axes module (matplotlib with the Agg backend, imported
    here, not when the command loads)."""
    from pathlib import Path

    from kvsim.io import atomic_write
    from kvsim.plan import axes
    pts = sorted((c, 100 * h) for c, h in zip(caps, hit) if math.isfinite(c))
    fig, ax = axes.single(6.4, 4.0)
    try:
        ax.plot([c for c, _ in pts], [h for _, h in pts], "o-", color="C0",
                label="LRU cache of this capacity")
        ax.axhline(100 * unlimited, ls="--", color="0.4",
                   label=f"unlimited cache: {100 * unlimited:.1f}%")
        ax.set_xscale("log")
        xs = [c for c, _ in pts]
        lo, hi = math.floor(math.log10(min(xs))), math.ceil(math.log10(max(xs)))
        ticks = [10.0 ** k for k in range(lo, hi + 1)] if hi - lo >= 2 else sorted(set(xs))
        ax.set_xticks(ticks, labels=[_tokens(t) for t in ticks])
        if hi - lo < 2:
            ax.minorticks_off()
        ax.set_xlabel("cache capacity (tokens)")
        ax.set_ylabel("prompt tokens served from the cache (%)")
        ax.set_ylim(0, max(100 * unlimited, *(h for _, h in pts)) * 1.12 or 1)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
        ax.set_title(f"{Path(source).name}: {n:,} requests, {block}-token blocks\n"
                     "prefix-cache hit share, LRU replay in arrival order (no timing)",
                     fontsize=9)
        atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=120), force=force)
    finally:
        axes.plt.close(fig)
