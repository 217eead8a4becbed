"""A plan's report: the answer in a few lines, and report.md and report.html (the same blocks
rendered twice: headings, paragraphs, lists, the plots, the table of runs), plus the columns the
terminal and the report show. Nothing here runs a simulation: it reads the plan's table."""

from __future__ import annotations

import base64
import datetime
import html
import json
import platform
import re
from pathlib import Path

import numpy as np
import pandas as pd

from kvsim import __version__
from kvsim.io import atomic_write
from kvsim.plan.sweep import KNOBS, SweepSpec

SUMMARY = ["gpu", "model", "context", "label", "tp", "replicas_needed", "batch", "qps",
           "tpot_ms", "tpot_p99_ms", "decode_tok_s", "ttft_ms", "ttft_p99_ms", "hbm_gib",
           "max_batch_fit", "link_util", "kv_read_frac", "goodput_rps", "slo_max_qps",
           "usd_per_hour", "usd_per_m_tokens", "binding", "status"]
# a deployment search's table: each configuration's fleet at the target rate
FLEET_SUMMARY = ["gpu", "model", "context", "label", "tp", "batch", "replicas_needed", "router",
                 "fleet_tpot_p99_ms", "fleet_ttft_p99_ms", "fleet_itl_p99_ms", "hbm_gib",
                 "max_batch_fit", "kv_read_frac", "usd_per_hour", "usd_per_m_tokens",
                 "binding", "status"]


def summary_columns(df: pd.DataFrame) -> list[str]:
    """The columns the terminal and the report show: a deployment search's fleets, else each
    configuration's own run."""
    cols = FLEET_SUMMARY if "router" in df and df["router"].notna().any() else SUMMARY
    return [c for c in cols if c in df and df[c].notna().any()]



def _range(ends) -> str:
    """`` (interval a-b)`` for a pair of finite numbers, else nothing."""
    import math
    if not ends or any(e is None or not math.isfinite(float(e)) for e in ends):
        return ""
    return f" (interval {float(ends[0]):.3g}-{float(ends[1]):.3g})"


def _span(ends, fmt: str = "g") -> str:
    """``4-7`` (or ``4`` where both ends agree; ``?`` for an end with no fleet)."""
    shown = ["?" if e is None else format(e, fmt) for e in ends]
    return shown[0] if shown[0] == shown[1] else f"{shown[0]}-{shown[1]}"


def _ms(x: float) -> str:
    """A latency for a sentence: ``21.7 ms``, or ``13.1 s`` from a second up (never 1.3e+04)."""
    return f"{x:.3g} ms" if x < 1000 else f"{x / 1000:.3g} s"

def _md_table(df: pd.DataFrame) -> str:
    cols = summary_columns(df)
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r[c]) for c in cols) + " |" for _, r in df.iterrows()]
    return "\n".join(lines)


PLOT_TEXT = {
    "throughput_vs_batch": "Decode throughput vs max batch, per policy.",
    "tpot_vs_context": "Time per output token vs context at the smallest batch.",
    "max_batch_fit": "How many requests fit in HBM and host memory at once, at the longest "
                     "context.",
    "hbm_breakdown": "What occupies HBM in the largest-batch run of each policy, one panel per "
                     "GPU.",
    "link_utilisation": "Share of time the host link is busy.",
    "crossover": "TPOT ratio of each policy that keeps the cache in host memory to dense offload; "
                 "where a line crosses 1, that policy stops winning.",
    "pareto": "Task accuracy (kvsim eval, % of dense) vs decode throughput.",
    "goodput_vs_rate": "Requests per second that meet every SLO given, against the offered "
                       "Poisson rate (DistServe's goodput); where a line leaves the diagonal, "
                       "requests start missing their SLO.",
    "cost_vs_latency": "Cost per million output tokens vs p99 TPOT (and TTFT) of each "
                       "configuration's fleet at the target rate (with an SLO search and no "
                       "target: of one replica at its sustained rate), for those that carry the "
                       "target within the SLO; the line joins the Pareto frontier (nothing both "
                       "cheaper and faster), the star is the answer.",
    "capacity_per_gpu": "Requests per second per GPU: the target over the GPUs of the fleet "
                        "that carries it (with an SLO search and no target: one replica's "
                        "sustained rate over its TP size), sorted; the answer in red.",
}


def answer_lines(answer: dict) -> list[str]:
    """The answer and the runner-up in a few lines (the terminal and the report open with
    them)."""
    if answer.get("gpu") is None:
        return [f"No answer for {answer['target_qps']:g} req/s with {answer['slo']}: "
                f"{answer['why']}."]

    def one(a: dict) -> str:
        lat, fewer = a["latency_at_target"], a.get("one_fewer")
        ends = (a.get("uncertainty") or {}).get("fleet_at_engine_ends")
        return (f"{a['replicas']} x {a['gpu']} TP{a['tp']} ({a['gpus']} GPUs) behind "
                f"{a['router']}, {a['label']}, batch {a['batch']}, KV {a['kv_dtype']}"
                + "".join(f", {k} {a[k]:g}" for _, k in KNOBS if a.get(k) is not None)
                + f": ${a['usd_per_hour']:.2f}/h, "
                f"${a['usd_per_m_tokens']:.3g} per M output tokens; at the target rate TPOT "
                f"p50/p99 {_ms(lat['tpot_p50_ms'])}/{_ms(lat['tpot_p99_ms'])}, TTFT p50/p99 "
                f"{_ms(lat['ttft_p50_ms'])}/{_ms(lat['ttft_p99_ms'])}, ITL p50/p99 "
                f"{_ms(lat['itl_p50_ms'])}/{_ms(lat['itl_p99_ms'])}"
                + (f"; {fewer['replicas']} replica(s) fail ({fewer['why']})" if fewer else "")
                + (f"; with the engine's times at its interval's ends: "
                   f"{_span(ends['replicas'])} replicas, {_span(ends['gpus'])} GPUs, "
                   f"${_span(ends['usd_per_hour'], '.2f')}/h" if ends else ""))

    lines = [f"Answer for {answer['target_qps']:g} req/s with {answer['slo']}: "
             + one(answer) + f"; its fleet replay of {answer['check']['requests']} requests at "
             f"the target rate kept up (completions "
             f"{100 * answer['check']['served_frac_window']:.0f}% of arrivals over its measured "
             f"window) within the SLO."]
    if answer.get("prefix_cache"):
        lines.append(cache_line(answer["prefix_cache"]))
    if answer.get("runner_up"):
        lines.append("Runner-up: " + one(answer["runner_up"]) + ".")
    lines += [f"Grid edge: {w}." for w in answer.get("grid_edges", [])]
    lines.append(f"{answer['configurations']} configurations, {answer['pruned']} pruned before "
                 f"simulation (weights do not fit in HBM); why each lost: `why_lost` and "
                 f"`binding` in results.csv, `rejected` in answer.json.")
    for d in answer.get("decided_by", []):
        flag = "--" + d["knob"].replace("_", "-")
        alt = "; ".join(f"{o['value'] if o['value'] is not None else 'the default'}: "
                        + (f"${o['usd_per_hour']:.2f}/h" if o["usd_per_hour"] is not None
                           else "does not carry the target within the SLO")
                        for o in d["otherwise"])
        lines.append(f"Decided by {flag} {d['value'] if d['value'] is not None else '(default)'}"
                     f": with {alt}.")
    return lines


def cache_line(pc: dict) -> str:
    """The answer's prefix cache in one sentence: what to buy and what it serves."""
    t = pc["tiers"]
    buy = []
    for name, what in (("host", "host memory"), ("disk", "local disk")):
        if t[name]["gib_per_gpu"]:
            buy.append(f"{t[name]['gib_per_gpu']:g} GiB of {what} per GPU "
                       f"({t[name]['gib_in_all']:,.0f} GiB in all)")
    if t["pool"]["gib_in_all"]:
        buy.append(f"a {t['pool']['gib_in_all']:,.0f} GiB pool shared by the replicas")
    served = ", ".join(f"{tier} {100 * v:.1f}%" for tier, v in pc["hit_frac_by_tier"].items()
                       if v)
    cost = pc.get("usd_per_hour")
    return (f"Prefix cache: {'; '.join(buy) if buy else 'GPU memory only (no tier below)'}"
            + (f", ${cost:.2f}/h" if buy and cost == cost and cost is not None else "")
            + f"; at the target rate {100 * pc['hit_frac']:.1f}% of prompt tokens hit the cache"
            + (f" ({served})" if served else "") + ".")


def _report_blocks(df, series, out: Path, command: str, spec: SweepSpec, quality,
                   answer: dict | None = None) -> list:
    """The report as a list of blocks, rendered to Markdown and to HTML: ("h1"|"h2"|"h3", text),
    ("p", text), ("ul", [text]), ("img", plot name), ("table", frame); text may hold **bold**
    and `code`."""
    from kvsim.plan import plots
    ok = df[df.status == "ok"]
    blocks: list = [("h1", "kvsim capacity plan")]
    if answer is not None:
        blocks += [("p", line) for line in answer_lines(answer)]
    blocks += [
        ("p", f"Generated {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M UTC} by "
              f"kvsim {__version__} on {platform.node()} ({platform.machine()})."),
    ]
    if command:
        blocks.append(("p", f"Command: `{command}`"))
    blocks += [("p", f"{len(df)} configurations: {len(ok)} ran, "
                     f"{(df.status == 'infeasible').sum()} infeasible, "
                     f"{(df.status == 'failed').sum()} failed. Table: `results.csv`, "
                     f"`results.parquet`."),
               ("h2", "Where the inputs came from")]
    prov: dict[str, set] = {}
    for p in ok.get("provenance", pd.Series(dtype=str)).dropna():
        for k, v in json.loads(p).items():
            if k not in ("workload", "trace"):
                prov.setdefault(k, set()).add(v)
    items = [f"**{k}**: {v}" for k in sorted(prov) for v in sorted(prov[k])]
    for gpu, g in df.groupby("gpu", sort=False):
        usd = g["price_usd_per_gpu_hour"].iloc[0]
        items.append(f"**price** of {gpu}: " + (f"${usd:.2f} per GPU-hour, " if usd == usd else "")
                     + f"{g['price_source'].iloc[0]}")
    if quality:
        items.append(f"**quality**: kvsim eval results from {', '.join(quality)}")
    blocks.append(("ul", items))
    said: dict[str, list[str]] = {}  # one entry per kind of warning (numbers aside)
    for w in ok.get("warnings", pd.Series(dtype=str)).dropna():
        for one in str(w).split(" | "):
            said.setdefault(re.sub(r"\d[\d.]*", "#", one), []).append(one)
    if said:
        blocks += [("h2", "Warnings"),
                   ("p", "How many configurations each kind applies to (one example each):"),
                   ("ul", [f"{len(v)} x {v[0]}"
                           for _, v in sorted(said.items(), key=lambda x: -len(x[1]))])]
    blocks.append(("h2", "Plots"))
    for name, text in PLOT_TEXT.items():
        if (out / f"{name}.png").exists() and series.get(name):
            blocks += [("h3", name.replace("_", " ")), ("p", text)]
            if name == "throughput_vs_batch":
                blocks.append(("p", plots.hbm_limited_note(df)))
            blocks.append(("img", name))
    crossings = series.get("crossover", {}).get("_crossings", {})
    if crossings:
        blocks += [("h2", "Crossovers"),
                   ("ul", [f"{k}: ratio crosses 1 at about {v:,.0f} tokens"
                           for k, v in crossings.items()])]
    if spec.slo and spec.target_qps is not None:
        blocks += _search_blocks(df, spec)
    elif spec.slo:
        from kvsim.plan import slo
        blocks += [("h2", "SLO"),
                   ("p", f"The highest Poisson rate that is sustained (completions keep "
                         f"pace with arrivals, the queue stays bounded) with "
                         f"{slo.describe(spec.slo)} ({spec.slo_requests} requests per probe, "
                         f"confirmed on a run twice as long): "
                         f"column `slo_max_qps` (`slo_max_qps_lo`/`_hi`: the same search with "
                         f"the engine's times at the ends of their prediction interval), with "
                         f"the p50/p99 TPOT and TTFT measured at it "
                         f"(`slo_at_*`), what binds there (`slo_binding`) and what failed at the "
                         f"next rate (`slo_fails_because`).")]
        items = []
        for r in ok.itertuples():
            if getattr(r, "slo_max_qps", None) is not None:
                ends = [getattr(r, "slo_max_qps_lo", None), getattr(r, "slo_max_qps_hi", None)]
                items.append(f"{r.gpu}, {r.model}, {r.context}, {r.label}, batch {r.batch}: "
                             f"{r.slo_max_qps:.3g} req/s"
                             f"{_range(ends)}"
                             f" (TPOT p50/p99 "
                             f"{_ms(r.slo_at_tpot_p50_ms)}/{_ms(r.slo_at_tpot_p99_ms)}, TTFT "
                             f"p50/p99 {_ms(r.slo_at_ttft_p50_ms)}/{_ms(r.slo_at_ttft_p99_ms)}; "
                             f"{r.slo_binding}); at "
                             f"{r.slo_qps_fails:.3g} req/s: {r.slo_fails_because}"
                             if r.slo_max_qps > 0 else
                             f"{r.gpu}, {r.model}, {r.context}, {r.label}, batch {r.batch}: "
                             f"no rate from {r.slo_qps_fails:g} req/s up: {r.slo_fails_because}")
        blocks.append(("ul", items))
    blocks += [("h2", "Runs"), ("table", df)]
    bad = df[df.status != "ok"]
    if len(bad):
        blocks += [("h2", "Not run"),
                   ("ul", [f"{r.gpu}, {r.model}, {r.context}, {r.label}, batch {r.batch}: "
                           f"{r.error}" for r in bad.itertuples()])]
    return blocks


def _search_blocks(df, spec: SweepSpec) -> list:
    """The deployment search in the report: how it sizes a fleet, and each configuration's."""
    from kvsim.plan import slo
    from kvsim.plan.deployment import target_of
    target = target_of(spec)
    items = []
    for r in df[df.status == "ok"].itertuples():
        knobs = getattr(r, "knobs", "")
        name = f"{r.gpu} TP{r.tp}, {r.label}, batch {r.batch}" + (
            f", {knobs}" if isinstance(knobs, str) and knobs else "")
        n = getattr(r, "replicas_needed", float("nan"))
        if n == n:
            items.append(f"{name}: {int(n)} replica(s) behind {r.router} "
                         f"({r.routers_tried}); TPOT p99 {_ms(r.fleet_tpot_p99_ms)}, TTFT p99 "
                         f"{_ms(r.fleet_ttft_p99_ms)}, ITL p99 {_ms(r.fleet_itl_p99_ms)}; "
                         f"one fewer: {r.fewer_fails_because}")
        else:
            items.append(f"{name}: no fleet: {r.fewer_fails_because}")
    return [("h2", "Deployment search"),
            ("p", f"For each configuration the fewest replicas behind each router "
                  f"({', '.join(target.routers)}) whose fleet replay of {target.requests} "
                  f"requests at {target.qps:g} req/s keeps up (completions at least 95% of "
                  f"arrivals over the measured window, the queue bounded) with "
                  f"{slo.describe(spec.slo)}: from the replicas that work conservation needs "
                  f"(one replica fed the whole rate completes what it can), up by half "
                  f"until a fleet passes, then by halves down to the fewest; the fleet with one "
                  f"replica fewer is run too, and what it misses is said. Columns "
                  f"`replicas_needed`, `router`, `fleet_*` (the fleet's figures at the "
                  f"target), `fewer_fails_because`, `routers_tried`."),
            ("ul", items)]


def _render_md(blocks: list) -> str:
    lines: list[str] = []
    for kind, body in blocks:
        if kind in ("h1", "h2", "h3"):
            lines += ["#" * int(kind[1]) + " " + body, ""]
        elif kind == "p":
            lines += [body, ""]
        elif kind == "ul":
            if body:
                lines += [f"- {x}" for x in body] + [""]
        elif kind == "img":
            lines += [f"![{body}]({body}.png)", ""]
        elif kind == "table":
            lines += [_md_table(body), ""]
    return "\n".join(lines) + "\n"


def _inline(text: str) -> str:
    """Escaped HTML of a report line, with its **bold** and `code`."""
    t = html.escape(str(text), quote=False)
    t = re.sub(r"`([^`]*)`", r"<code>\1</code>", t)
    return re.sub(r"\*\*([^*]+)\*\*", r"<strong>\1</strong>", t)




_CSS = """body{font:14px/1.45 system-ui,sans-serif;margin:1.5em auto;max-width:1200px;padding:0 1em;
color:#222}h1,h2,h3{line-height:1.2}code{background:#f3f3f3;padding:0 .2em}
figure{margin:1em 0}figure img{max-width:100%;height:auto}
.wrap{overflow-x:auto}table{border-collapse:collapse;font-size:12px}
th,td{border:1px solid #ccc;padding:2px 6px;text-align:right;white-space:nowrap}
td.s{text-align:left}th{background:#eee;cursor:pointer;user-select:none;position:sticky;top:0}
th[aria-sort=ascending]::after{content:" \\25B2"}th[aria-sort=descending]::after{content:" \\25BC"}
tr.bad td{color:#999}"""

# Click a header to sort (again: reverse). The hash #sort=COLUMN (or #sort=-COLUMN, descending)
# sorts on load, which is also how tests drive the sort in a headless browser.
_JS = """(function(){
var t=document.getElementById('results');if(!t)return;
function key(c){var v=c.getAttribute('data-v');var n=parseFloat(v);
return (v!==''&&!isNaN(n)&&isFinite(v))?n:v;}
function sortBy(col,desc){var hs=t.tHead.rows[0].cells,i=-1;
for(var j=0;j<hs.length;j++){if(hs[j].getAttribute('data-col')===col)i=j;
hs[j].removeAttribute('aria-sort');}if(i<0)return false;
var b=t.tBodies[0],rows=Array.prototype.slice.call(b.rows);
rows.sort(function(r,s){var x=key(r.cells[i]),y=key(s.cells[i]);
if(x===''&&y==='')return 0;if(x==='')return 1;if(y==='')return -1;
var c=(typeof x==='number'&&typeof y==='number')?x-y:
(typeof x==='number')?-1:(typeof y==='number')?1:String(x).localeCompare(String(y));
return desc?-c:c;});
rows.forEach(function(r){b.appendChild(r);});
hs[i].setAttribute('aria-sort',desc?'descending':'ascending');t.setAttribute('data-sorted',
(desc?'-':'')+col);return true;}
window.kvsimSort=sortBy;
var hs=t.tHead.rows[0].cells;for(var j=0;j<hs.length;j++){hs[j].addEventListener('click',
function(){var c=this.getAttribute('data-col');sortBy(c,this.getAttribute('aria-sort')===
'ascending');});}
function fromHash(){var m=/sort=(-?)([^&]+)/.exec(location.hash);
if(m)sortBy(decodeURIComponent(m[2]),m[1]==='-');}
window.addEventListener('hashchange',fromHash);fromHash();})();"""


def _html_table(df: pd.DataFrame) -> str:
    cols = [c for c in summary_columns(df) if c != "status"] + \
        [c for c in ("hbm_limited", "status") if c in df and df[c].notna().any()]
    head = "".join(f'<th data-col="{html.escape(c)}" title="click to sort">{html.escape(c)}</th>'
                   for c in cols)
    rows = []
    for _, r in df.iterrows():
        cells = []
        for c in cols:
            v = r[c]
            if v is None or (isinstance(v, float) and pd.isna(v)):
                raw, shown = "", ""
            elif isinstance(v, (bool, np.bool_)):
                raw = shown = str(bool(v)).lower()
            elif isinstance(v, (int, np.integer)):
                raw, shown = str(int(v)), f"{int(v):,}" if c != "context" else str(int(v))
            elif isinstance(v, (float, np.floating)):
                raw, shown = repr(float(v)), f"{float(v):.4g}"
            else:
                raw = shown = str(v)
            num = isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(
                v, (bool, np.bool_))
            cells.append(f'<td data-v="{html.escape(raw)}"{"" if num else " class=s"}>'
                         f"{html.escape(shown)}</td>")
        key = html.escape(str(r.get("key", "")))
        cls = "" if r.get("status") == "ok" else ' class="bad"'
        rows.append(f'<tr data-key="{key}"{cls}>{"".join(cells)}</tr>')
    return (f'<div class="wrap"><table id="results"><thead><tr>{head}</tr></thead>'
            f'<tbody>\n{chr(10).join(rows)}\n</tbody></table></div>')


def _render_html(blocks: list, out: Path) -> str:
    parts = []
    for kind, body in blocks:
        if kind in ("h1", "h2", "h3"):
            parts.append(f"<{kind}>{_inline(body)}</{kind}>")
        elif kind == "p":
            parts.append(f"<p>{_inline(body)}</p>")
        elif kind == "ul":
            if body:
                parts.append("<ul>" + "".join(f"<li>{_inline(x)}</li>" for x in body) + "</ul>")
        elif kind == "img":  # embedded: the page opens offline, without the files beside it
            svg, png = out / f"{body}.svg", out / f"{body}.png"
            mime, data = (("image/svg+xml", svg.read_bytes()) if svg.exists() else
                          ("image/png", png.read_bytes()))
            parts.append(f'<figure id="plot-{body}"><img data-plot="{body}" alt="{body}" '
                         f'src="data:{mime};base64,{base64.b64encode(data).decode()}">'
                         f"</figure>")
        elif kind == "table":
            parts.append(_html_table(body))
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<title>kvsim capacity plan</title>"
            f"<style>{_CSS}</style></head><body>\n" + "\n".join(parts)
            + f"\n<script>{_JS}</script>\n</body></html>\n")


def write_report(df, series, out: Path, command: str, spec: SweepSpec, quality,
                  answer: dict | None = None) -> None:
    blocks = _report_blocks(df, series, out, command, spec, quality, answer)
    text = _render_md(blocks)
    atomic_write(out / "report.md", lambda f: f.write(text.encode()), force=True)
    page = _render_html(blocks, out)
    atomic_write(out / "report.html", lambda f: f.write(page.encode()), force=True)
