"""An interval on every prediction: TPOT, TTFT and throughput ends for every registered policy,
the engine's out-of-sample spread combined with a policy profile's interval, wider outside what
the engine was checked on, and carried into a table row."""

import dataclasses
import math

import pytest
from conftest import replay_json
from test_policy_contract import FIT

from kvsim.hw import engine as E
from kvsim.model.synthetic import synthetic_attention_trace
from kvsim.policies import load_all, make
from kvsim.replay import report

KEYS = ("tpot_ms", "ttft_ms", "throughput_tok_s")


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    from kvsim import trace as T
    path = tmp_path_factory.mktemp("t") / "t.npz"
    T.save(synthetic_attention_trace(n_layers=2, n_q=4, n_kv=2, d=32, context=512, question=8,
                                     decode=3, seed=0), path)
    return path


def _replay(trace, name="dense-resident", **kw):
    taken = {f.name for f in dataclasses.fields(load_all()[name].Params)}
    opts = dataclasses.asdict(make(name, {k: v for k, v in FIT.items() if k in taken}).params)
    return replay_json(**{"trace": trace, "policy": name, "policy_options": opts,
                          "gpu": "h100-sxm", "model": "qwen3-4b", "context": 8192,
                          "batch": 2, "output_len": 4, **kw})


@pytest.mark.parametrize("name", sorted(load_all()))
def test_every_registered_policy_gets_every_interval_key(name, trace):
    r = _replay(trace, name)
    row = report.flatten(r)  # what plan writes to results.csv
    for key in KEYS:
        lo, hi = r[f"{key}_lo"], r[f"{key}_hi"]
        assert math.isfinite(lo) and math.isfinite(hi)
        assert 0 < lo < r[key] < hi, key
        assert row[f"{key}_lo"] == lo and row[f"{key}_hi"] == hi
    eng = E.load(E.CATALOG_DEFAULT)  # checked on published points, by regime
    s, ttft = eng.spread("decode")[0], eng.spread("prefill")[0]
    assert r["interval"]["spread"] == pytest.approx(s)  # H100, bf16, TP 1, dense: checked
    assert r["tpot_ms_hi"] == pytest.approx(r["tpot_ms"] * math.exp(s))
    assert r["ttft_ms_hi"] == pytest.approx(r["ttft_ms"] * math.exp(ttft))


def test_the_shipped_engine_spread_is_its_out_of_sample_errors():
    """Leave-one-out on the fitted rows it can be computed for, and the check rows, except the
    Figure 8 kernel times (only a bound of TPOT)."""
    eng = E.load("vllm-paper")
    res = eng.residuals()
    assert {r["row"] for r in res} == {2, 7, 8, 9}
    s, words = eng.spread()
    assert s == pytest.approx(abs(math.log(1 - 0.2198)), rel=1e-3)  # dense-resident's LOO
    assert "-22.0%" in words
    assert E.ROOFLINE.spread()[0] is None


def test_outside_the_checked_regime_the_interval_widens_and_says_why(trace):
    s = E.load("vllm-paper").spread()[0]
    far = _replay(trace, gpu="a100-80gb", tp=2, weight_dtype="fp8", engine="vllm-paper")
    assert far["interval"]["spread"] == pytest.approx(4 * s)  # three dimensions unchecked
    warn = next(w for w in far["warnings"] if w.startswith("outside what engine"))
    assert "GPU a100-80gb (checked on h100-sxm)" in warn and "TP 2" in warn
    assert "weights 1 B per element" in warn and "x4" in warn
    assert far["tpot_ms_lo"] == pytest.approx(far["tpot_ms"] * math.exp(-4 * s))
    # a published family names what its points cover: here a GPU none of them ran on
    eng = E.load(E.CATALOG_DEFAULT)
    assert "gh200" not in eng.fit["checked"]["gpu"]
    gh = _replay(trace, gpu="gh200")
    warn = next(w for w in gh["warnings"]
                if w.startswith(f"outside what engine {E.CATALOG_DEFAULT}"))
    assert "GPU gh200 (checked on" in warn
    assert gh["interval"]["spread"] == pytest.approx(2 * eng.spread("decode")[0])
    rough = _replay(trace, engine="roofline")
    assert rough["interval"]["spread"] == pytest.approx(math.log(2))
    assert any("no out-of-sample check" in w for w in rough["warnings"])


def test_a_policy_profile_interval_is_widened_by_the_engine():
    r = replay_json(policy="verkv", policy_options={"sink": 4, "local": 4},
                    context=32768, gpu="h100-sxm", output_len=16)
    lo, hi = r["interval"]["before_engine"]["tpot_ms"]
    assert lo < hi  # the profile's own interval
    s = r["interval"]["spread"]
    assert r["tpot_ms_lo"] == pytest.approx(lo * math.exp(-s))
    assert r["tpot_ms_hi"] == pytest.approx(hi * math.exp(s))
