"""Prices: the catalog's examples name their source, the user's replace them, and every cost
figure is replicas x TP x price per GPU-hour, spread over the rate the configuration serves."""

import json
import math

import pandas as pd
import pytest
from conftest import run_cli

from kvsim.errors import KvsimError
from kvsim.hw import catalog
from kvsim.plan import cost


def test_every_catalog_gpu_has_a_price_with_its_source_or_says_none_was_found():
    for g in catalog.GPUS.values():  # (every record: a price is a field of it)
        assert g.price_source
        if g.usd_per_hour is None:
            assert "no public price found" in g.price_source
            assert cost.resolve([g.name], {})[g.name][0] is None
        else:
            assert g.usd_per_hour > 0 and "20" in g.price_source  # a dated public listing
            assert cost.resolve([g.name], {})[g.name] == (g.usd_per_hour, g.price_source)


def test_prices_parse_and_refuse_nonsense(tmp_path):
    assert cost.parse_price("h100-sxm=2.5") == ("h100-sxm", 2.5)
    for bad in ("h100-sxm", "=2", "h100-sxm=-1", "h100-sxm=nan", "h100-sxm=abc"):
        with pytest.raises(KvsimError):
            cost.parse_price(bad)
    f = tmp_path / "p.json"
    f.write_text(json.dumps({"h200": 4}))
    assert cost.load_prices(f) == {"h200": 4.0}
    for text in ("[1]", "{}", '{"h200": "x"}', "not json"):
        f.write_text(text)
        with pytest.raises(KvsimError):
            cost.load_prices(f)
    with pytest.raises(KvsimError, match="does not list"):
        cost.resolve(["h100-sxm"], {"l40s": 1.0})
    got = cost.resolve(["h100-sxm", "gh200"], {"h100-sxm": 9.0})
    assert got["h100-sxm"] == (9.0, "user override (--price/--prices)")
    assert got["gh200"][0] is None and "--price gh200" in got["gh200"][1]


def test_cost_is_replicas_times_tp_times_price(tmp_path):
    out = tmp_path / "plan"
    code, stdout, err = run_cli(
        "plan", "--gpu", "h100-sxm,l40s", "--model", "qwen3-4b", "--context", "4096",
        "--policy", "dense-resident", "--batch", "4", "--output-len", "32", "--requests", "32",
        "--tp", "2", "--replicas", "3", "--slo-tpot-ms", "60", "--slo-requests", "100",
        "--price", "l40s=1.25", "--out", out, "--json")
    assert code == 0, err
    df = pd.read_csv(out / "results.csv")
    assert list(df.gpu) == ["h100-sxm", "l40s"]
    price = {"h100-sxm": catalog.gpu("h100-sxm").usd_per_hour, "l40s": 1.25}
    for r in df.itertuples():
        assert r.usd_per_hour == pytest.approx(3 * 2 * price[r.gpu])
        assert r.slo_max_qps > 0  # priced at the sustained rate the SLO search found
        per_request = r.usd_per_hour / 3600 / r.slo_max_qps
        assert r.usd_per_request == pytest.approx(per_request)
        tokens = r.throughput_tok_s / r.requests_per_s
        assert math.isclose(tokens, 32, rel_tol=1e-6)
        assert r.usd_per_m_tokens == pytest.approx(per_request / tokens * 1e6)
    report = (out / "report.md").read_text()
    assert "user override" in report and catalog.gpu("h100-sxm").price_source in report
