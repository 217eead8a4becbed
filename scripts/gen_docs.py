"""Generate the docs site's reference pages from the code: the CLI page from the real argparse
parsers (an index and a page per command; the policies page also lists every policy's options,
from the registered classes), and the metric glossary from the code's own metric names.

    python scripts/gen_docs.py            # writes docs/reference/cli.md, cli/*.md, metrics.md
    python scripts/gen_docs.py --check    # exit 1 if either page is stale (tests do this)
    python scripts/gen_docs.py --changelog  # also rewrite docs/changelog.md from git log
"""

from __future__ import annotations

import argparse
import io
import sys
from contextlib import redirect_stdout
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's kvsim, not an installed one
CLI_PAGE = ROOT / "docs" / "reference" / "cli.md"
CLI_DIR = ROOT / "docs" / "reference" / "cli"  # one page per command
METRICS_PAGE = ROOT / "docs" / "reference" / "metrics.md"

# What each metric means; the names come from the code (MEANING must cover every one of them,
# tests/test_docs.py checks it). Words taken from the user guide, nothing measured here.
MEANING = {
    "tpot_ms": "time per output token, mean over the decode steps, in milliseconds",
    "tpot_p99_ms": "the 99th percentile over requests of each request's time per output token "
                   "(its mean gap), in milliseconds",
    "itl_p99_ms": "inter-token latency: the 99th percentile over every decode token of its gap "
                  "to the sequence's previous token, prefill stalls included (also itl_ms, the "
                  "mean; itl_p50_ms, itl_p90_ms), in milliseconds",
    "router": "a deployment search's router for the fleet: round-robin or least-loaded",
    "fleet_tpot_p99_ms": "p99 TPOT of the fleet (replicas_needed behind router) replayed at "
                         "the target rate (every fleet_* column: that replay's figure)",
    "fleet_ttft_p99_ms": "p99 TTFT of the fleet replayed at the target rate",
    "fleet_itl_p99_ms": "p99 ITL of the fleet replayed at the target rate",
    "throughput_tok_s": "output tokens per second over the whole run, prefills included",
    "decode_tok_s": "output tokens per second of decoding (the decode throughput)",
    "ttft_ms": "time to first token (queueing and prefill), mean, in milliseconds",
    "ttft_p99_ms": "the 99th percentile of time to first token, in milliseconds",
    "e2e_s": "end-to-end latency of a request, arrival to last token, in seconds",
    "hbm_gib": "GPU memory held: weights, resident KV, activations, policy metadata (GiB)",
    "host_gib": "host memory holding the offloaded KV cache (GiB)",
    "link_util": "share of the host link's time spent moving KV (0-1)",
    "kv_read_frac": "share of the KV cache read per decode step",
    "hbm_meta_gib": "GPU memory of the policy's metadata (sketches, page bounds) (GiB)",
    "max_batch_fit": "the largest batch whose memory fits on the GPU",
    "goodput_rps": "requests per second served within the SLO",
    "slo_max_qps": "the highest arrival rate whose replay meets the SLO (sustained capacity)",
    "usd_per_hour": "the deployment's price per hour (catalog or --prices)",
    "usd_per_m_tokens": "price per million output tokens at the deployment's throughput",
    "binding": "what limits the configuration (memory, link, compute, SLO)",
    "status": "ok, infeasible (does not fit or misses the SLO) or failed",
    "replicas_needed": "the fewest replicas whose fleet replay at the target rate meets every "
                       "SLO (a deployment search; one fewer fails: fewer_fails_because)",
    "decisions_fetch_frac": "VerKV: share of decisions that fetch from host memory",
    "kvhead_steps_fetch_frac": "VerKV: share of (KV head, step) pairs that fetch",
    "tokens_per_fetch_frac": "VerKV: share of the context fetched by a fetching decision",
    "violation_rate": "VerKV: share of decisions whose attention error exceeds eps, counted "
                      "with the tokens each KV head actually fetched (union over its query heads)",
    "output_rel_err_mean": "mean relative error of the attention output against dense",
    "violation_rate_max_layer": "the worst layer's violation rate",
    "violation_rate_own": "violation rate with each decision's own fetch set, as the spec counts",
    "sketch_bytes_per_token": "the sketch's GPU bytes per context token and KV head",
    "output_violation_rate": "with verkv:eps_output=E: share of decisions whose output error "
                             "exceeds E times the norm of the values' per-dimension range",
}


def metric_names() -> dict[str, list[str]]:
    """Where each metric name is defined in the code -> the names, in the code's order."""
    from kvsim.plan.report import FLEET_SUMMARY, SUMMARY
    from kvsim.replay.report import HEADLINE, TABLE2
    skip = {"gpu", "model", "context", "label", "tp", "batch", "qps"}  # inputs, not metrics
    return {"kvsim.replay.report.HEADLINE (replay --json, top level)": list(HEADLINE),
            "kvsim.replay.report.TABLE2 (VerKV's statistics, replay --json top level)":
                list(TABLE2),
            "kvsim.plan.report.SUMMARY (plan's results.csv summary columns)":
                [n for n in SUMMARY if n not in skip],
            "kvsim.plan.report.FLEET_SUMMARY (a deployment search's summary columns)":
                [n for n in FLEET_SUMMARY if n not in skip and n not in SUMMARY],
            "kvsim.replay.result.Serving (replay --json sim: inter-token latency)":
                ["itl_p99_ms"]}


def metrics_page() -> str:
    out = ["# Metric glossary", "",
           "Generated by `python scripts/gen_docs.py` from the metric names in the code; the "
           "same names appear in `kvsim replay --json`, `kvsim plan`'s `results.csv` and "
           "`kvsim eval --json`. A policy profile adds `_lo` and `_hi` (its 90% interval) to "
           "each statistic it predicts.", ""]
    for where, names in metric_names().items():
        out += [f"## `{where.split(' ')[0]}`", "", where.split(" ", 1)[1].strip("()") + ".", "",
                "| name | meaning |", "|---|---|"]
        out += [f"| `{n}` | {MEANING.get(n, 'UNDOCUMENTED')} |" for n in names]
        out.append("")
    return "\n".join(out)


def changelog_page() -> str:
    """docs/changelog.md: ``git log --first-parent``, newest first, with commit hashes."""
    import subprocess
    log = subprocess.run(["git", "log", "--first-parent", "--format=%h\t%ad\t%s",
                          "--date=short"], capture_output=True, text=True, check=True,
                         cwd=ROOT).stdout.strip().split("\n")
    out = ["# Changelog", "",
           "Generated by `python scripts/gen_docs.py --changelog` from `git log --first-parent`"
           " (newest first; subjects shortened). The performance measurements that used to sit "
           "in the README are on the [simulator speed](results/simulator-speed.md) page, each "
           "with the commits it compares (e.g. `cde1039`, `b6cf96b`).", ""]
    for line in log:
        h, d, s = line.split("\t", 2)
        s = s.replace("|", "\\|").replace("<", "&lt;")
        out.append(f"- `{h}` {d}: {s[:157] + '...' if len(s) > 160 else s}")
    return "\n".join(out) + "\n"


def _help(argv: list[str]) -> str:
    from kvsim.cli import build_parser
    buf = io.StringIO()
    with redirect_stdout(buf):
        try:
            build_parser(argv).parse_args(argv)
        except SystemExit:
            pass
    return buf.getvalue()


def _output(argv: list[str]) -> str:
    """What ``kvsim ARGV`` prints."""
    from kvsim.cli import main
    buf = io.StringIO()
    with redirect_stdout(buf):
        main(argv)
    return buf.getvalue()


def policies_section() -> list[str]:
    """The policies page's tail: ``kvsim policies`` and each policy's options, from the
    registered classes (a policy's options live in its Params, nowhere else)."""
    from kvsim.policies import load_all
    out = ["", "## Every policy", "", "```text", "$ kvsim policies", _output(["policies"]).rstrip(),
           "```", ""]
    for name in sorted(load_all()):
        out += [f"## {name}", "", "```text", f"$ kvsim policies {name}",
                _output(["policies", name]).rstrip(), "```", ""]
    return out


def cli_pages() -> dict[Path, str]:
    """docs/reference/cli.md (``kvsim --help`` and a link to every command) and one page per
    command, docs/reference/cli/<command>.md (its full ``--help``), from the real parsers."""
    import os

    from kvsim.cli import commands
    os.environ["COLUMNS"] = "100"  # argparse wraps to the terminal; fix it for a stable page
    names = list(commands())
    index = ["# CLI reference", "",
             "Generated by `python scripts/gen_docs.py` from the real argparse parsers "
             "(`tests/test_docs.py` fails when a page is stale). One page per command, each "
             "with its full `--help`:", ""]
    index += [f"- [`kvsim {n}`](cli/{n}.md)" for n in names]
    index += ["", "## kvsim", "", "```text", _help(["--help"]).rstrip(), "```", ""]
    pages = {CLI_PAGE: "\n".join(index)}
    for n in names:
        pages[CLI_DIR / f"{n}.md"] = "\n".join([
            f"# kvsim {n}", "", "Generated by `python scripts/gen_docs.py` from the parser; "
            "[all commands](../cli.md).", "", "```text", _help([n, "--help"]).rstrip(), "```",
            "", *(policies_section() if n == "policies" else [])])
    return pages

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if a page is stale")
    ap.add_argument("--changelog", action="store_true", help="rewrite docs/changelog.md")
    args = ap.parse_args(argv)
    stale = []
    for path, text in (*cli_pages().items(), (METRICS_PAGE, metrics_page())):
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path.relative_to(ROOT)))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if args.changelog:
        (ROOT / "docs" / "changelog.md").write_text(changelog_page())
    if stale:
        print("stale: " + ", ".join(stale) + " (run python scripts/gen_docs.py)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
