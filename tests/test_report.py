"""kvsim plan's report: plain tick labels, linear axes for narrow data, one legend per figure, no
empty panels, labelled bars, one HBM panel per GPU, and a self-contained
report.html whose results table sorts (checked in a headless browser where one is installed)."""

import base64
import re
import shutil
import subprocess
from html.parser import HTMLParser

import pandas as pd
import pytest

from kvsim.plan import plots
from kvsim.plan.executors import LocalExecutor
from kvsim.plan.planner import plan
from kvsim.plan.sweep import SweepSpec

GPUS = ["h100-sxm", "h200"]
NOT_PLAIN = re.compile(r"10\^|\$\^|\^\{|×10|\\times|mathdefault|e[+-]\d")


def _figure_facts(name, fig):
    """What a test needs from a figure, read before plots.py closes it."""
    fig.canvas.draw()
    axes = []
    for ax in fig.axes:
        axes.append(dict(
            title=ax.get_title(), xscale=ax.get_xscale(), yscale=ax.get_yscale(),
            ticks=[t.get_text() for a in (ax.xaxis, ax.yaxis) for t in
                   a.get_ticklabels(which="both")],
            offsets=[ax.xaxis.get_offset_text().get_text(),
                     ax.yaxis.get_offset_text().get_text()],
            has_data=bool(ax.lines or ax.patches or ax.collections),
            visible=ax.get_visible(), legend=ax.get_legend() is not None,
            n_bars=len(ax.patches), texts=[t.get_text() for t in ax.texts]))
    return dict(suptitle=fig._suptitle.get_text() if fig._suptitle else "",
                legends=len(fig.legends), axes=axes,
                notes=[t.get_text() for t in fig.texts] +
                [lg.get_title().get_text() for lg in fig.legends])


@pytest.fixture
def figures(monkeypatch):
    seen = {}
    monkeypatch.setattr(plots, "FIGURE_HOOK",
                        lambda name, fig: seen.__setitem__(name, _figure_facts(name, fig)))
    return seen


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """One small plan (no attention trace needed), with the facts of every figure it drew."""
    out = tmp_path_factory.mktemp("report") / "plan"
    seen = {}
    plots.FIGURE_HOOK = lambda name, fig: seen.__setitem__(name, _figure_facts(name, fig))
    try:
        summary = plan(SweepSpec(gpus=GPUS, models=["qwen3-4b"], contexts=[8192, 32768],
                                 policies=["dense-resident", "dense-offload"], batches=[1, 4]),
                       out, LocalExecutor(2), progress=False, command="kvsim plan (test)").summary
    finally:
        plots.FIGURE_HOOK = None
    return out, summary, seen, pd.read_csv(out / "results.csv")


class _Page(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags, self.imgs, self.rows, self.urls, self.headers, self.text = [], [], [], [], [], []
        self._in_th = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.append(tag)
        self.urls += [v for k, v in attrs if k in ("src", "href") and v]
        if tag == "img":
            self.imgs.append(a)
        if tag == "tr" and "data-key" in a:
            self.rows.append(a["data-key"])
        if tag == "th":
            self.headers.append(a.get("data-col"))

    def handle_data(self, data):
        self.text.append(data)


def _parse(text: str) -> _Page:
    p = _Page()
    p.feed(text)
    p.close()
    return p


def test_plots_have_plain_ticks_one_legend_and_no_empty_panels(planned):
    out, summary, seen, df = planned
    assert set(summary["plots"]) == {f"{n}.png" for n in seen}
    assert {"throughput_vs_batch", "tpot_vs_context", "max_batch_fit", "hbm_breakdown",
            "link_utilisation"} <= set(seen)
    for name, f in seen.items():
        assert f["legends"] == 1, name  # one legend per figure, beside the panels
        for ax in f["axes"]:
            assert ax["visible"] and ax["has_data"], (name, ax["title"])  # no empty cell
            assert not ax["legend"], name
            assert not any(NOT_PLAIN.search(t) for t in ax["ticks"]), (name, ax["ticks"])
            assert not any(ax["offsets"]), (name, ax["offsets"])
        svg = (out / f"{name}.svg").read_text()
        assert not NOT_PLAIN.search(" ".join(re.findall(r"<!-- (.*?) -->", svg))), name
    ticks = lambda name: {t for ax in seen[name]["axes"] for t in ax["ticks"]}  # noqa: E731
    assert {"8,192", "32,768"} <= ticks("tpot_vs_context")  # thousands are 1,000
    assert {"1", "4"} <= ticks("throughput_vs_batch")


def test_titles_say_what_is_drawn_and_the_hbm_limit_comes_from_the_results(planned):
    out, summary, seen, df = planned
    tput = seen["throughput_vs_batch"]
    assert tput["suptitle"] == "Decode throughput vs batch"
    assert len(tput["axes"]) == 4  # 2 GPUs x 2 contexts: no empty cells in the 3-wide grid
    assert any("HBM-limited" in n for n in tput["notes"])
    hbm = seen["hbm_breakdown"]
    assert sorted(ax["title"].split(" ")[0] for ax in hbm["axes"]) == GPUS  # one per GPU
    for ax in hbm["axes"]:
        assert any(t.endswith("GiB") for t in ax["texts"])  # each stack carries its total
    bars = seen["max_batch_fit"]["axes"][0]
    labels = [t for t in bars["texts"] if t]
    assert len(labels) == bars["n_bars"] == 2 * 2  # every bar carries its value
    ok = df[(df.status == "ok") & (df.context == df.context.max())]
    assert set(labels) == {f"{v:,}" for v in ok.max_batch_fit}


def test_narrow_data_get_a_linear_axis_and_hbm_limited_runs_are_named(figures, tmp_path):
    rows = [dict(status="ok", qps=None, gpu="h100-sxm", model="m", context=32768, label=lab,
                 policy=lab, batch=b, decode_tok_s=t, hbm_limited=lim, max_batch_fit=fit)
            for lab, pts in (("a", [(1, 10.6, False, 8), (4, 10.65, False, 8),
                                    (16, 10.7, True, 8)]),
                             ("b", [(1, 10.62, False, 99), (4, 10.68, False, 99),
                                    (16, 10.69, False, 99)]))
            for b, t, lim, fit in pts]
    plots.throughput_vs_batch(pd.DataFrame(rows), tmp_path)
    f = figures["throughput_vs_batch"]
    (ax,) = f["axes"]
    assert ax["yscale"] == "linear" and ax["xscale"] == "log"  # batch 1..16 spans > 3x
    assert not any(ax["offsets"]) and "memory" not in f["suptitle"].lower()
    assert {"1", "4", "16"} <= set(ax["ticks"])
    note = " ".join(f["notes"])
    assert "h100-sxm m 32,768 a batch 16 (fits 8)" in note and " b batch" not in note
    rows = [dict(r, hbm_limited=False) for r in rows]
    plots.throughput_vs_batch(pd.DataFrame(rows), tmp_path)
    assert "No configuration shown is HBM-limited" in " ".join(figures["throughput_vs_batch"]
                                                                ["notes"])


def test_report_html_is_self_contained_with_every_plot_and_row(planned):
    out, summary, seen, df = planned
    text = (out / "report.html").read_text()
    page = _parse(text)
    assert {"html", "head", "body", "table", "script"} <= set(page.tags)
    assert not [u for u in page.urls if re.match(r"\s*(https?:)?//", u, re.I)], page.urls
    assert "<link" not in text and not re.search(r"<script[^>]*\bsrc=", text)
    plotted = {img["data-plot"]: img["src"] for img in page.imgs}
    assert set(plotted) == {p.removesuffix(".png") for p in summary["plots"]}
    for name, src in plotted.items():
        assert src.startswith("data:image/svg+xml;base64,")
        assert base64.b64decode(src.split(",", 1)[1]) == (out / f"{name}.svg").read_bytes()
    assert sorted(page.rows) == sorted(df.key) and len(page.rows) == len(df)
    words = " ".join(page.text)
    assert "Where the inputs came from" in words and "hw.gpu" in words
    if df.warnings.notna().any():
        assert "Warnings" in words
    assert {"tpot_ms", "decode_tok_s", "hbm_limited", "status"} <= set(page.headers)
    md = (out / "report.md").read_text()
    assert "![tpot_vs_context](tpot_vs_context.png)" in md and "HBM-limited" in md


def _browser():
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if shutil.which(name):
            return shutil.which(name)
    return None


def _dump_dom(browser, url):
    p = subprocess.run([browser, "--headless", "--disable-gpu", "--no-sandbox",
                        "--no-first-run", "--dump-dom", url],
                       capture_output=True, text=True, timeout=900)  # only a hung browser
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout


@pytest.mark.skipif(_browser() is None, reason="no headless browser on PATH (chromium, "
                    "chromium-browser or google-chrome): the table's sort is not run")
def test_report_table_sorts_in_a_headless_browser(planned):
    out, summary, seen, df = planned
    browser = _browser()
    url = (out / "report.html").resolve().as_uri()
    for sort, col, desc in (("-tpot_ms", "tpot_ms", True), ("decode_tok_s", "decode_tok_s",
                                                            False), ("label", "label", False)):
        dom = _dump_dom(browser, f"{url}#sort={sort}")
        page = _parse(dom)
        assert len(page.rows) == len(df)
        assert re.search(rf'data-sorted="{re.escape(sort)}"', dom), sort  # the script ran
        by_key = df.set_index("key")[col]
        got = [by_key[k] for k in page.rows]
        assert got == sorted(got, reverse=desc), (sort, got)
    assert _parse(_dump_dom(browser, url)).rows == list(df.key)  # no hash: file order
