"""Capture sets, policy profiles (build, resume, apply) and the context fits, on synthetic data
(the real profile's figures are checked in test_shipped_profile.py)."""

import json
import subprocess
import sys

import numpy as np
import pytest

from kvsim import captureset as cs
from kvsim import policy_profile as pp
from kvsim.errors import KvsimError
from kvsim.model.synthetic import synthetic_capture_set
from kvsim.policies.spec import parse
from kvsim.policy_profile import fit
from kvsim.policy_profile.build import build

LENGTHS = (256, 512, 1024)
GRID = dict(compression=[8.0, 16.0], eps=[0.05], sink=[4], local=[4])


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    d = tmp_path_factory.mktemp("sets")
    paths = []
    for seed, task in ((1, "a"), (2, "b")):
        p = d / f"{task}.npz"
        cs.save(synthetic_capture_set(LENGTHS, questions=2, seed=seed, task=task), p)
        paths.append(str(p))
    return paths


@pytest.fixture(scope="module")
def profile(sets, tmp_path_factory):
    out = tmp_path_factory.mktemp("prof") / "p.json"
    specs, _ = parse("verkv", GRID, grid=True)
    build(sets, specs, out, progress=False)
    return out


# ------------------------------------------------------------------------------ fits

def test_each_form_recovers_its_own_curve_and_the_backtest_picks_it():
    n = np.array([1000.0, 2000, 4000, 8000])
    curves = {"power": 0.5 * (n / 1000) ** -0.7, "logit": 1 / (1 + np.exp(-(2 - 0.9 * np.log(n)))),
              "inverse": 0.05 + 30 / n, "loglin": 0.9 - 0.08 * np.log(n)}
    for form, y in curves.items():
        assert fit.choose(n, y)[0] == form, form
        assert fit.predict(form, n, y, [n[-1]])[0] == pytest.approx(y[-1], rel=1e-9)


@pytest.mark.parametrize("tasks", [2, 6])
def test_interval_covers_the_truth_at_the_nominal_rate(tasks):
    """Monte-Carlo: noisy power-law shares, ``tasks`` tasks (sd 8%) x 4 questions (sd 10%); at 4x
    beyond the data the nominal 90% interval covers the truth in at least 90% of 200 draws,
    with 2 task types (the shipped profile's) and with 6. The bootstrap alone covers 81% and
    82.5% (it sees the tasks' spread, not the form's error beyond the data); the widening by
    the form's back-test error per doubling brings 94.5% and 92.5%."""
    n = np.array([1000.0, 2000, 4000, 8000])
    truth = lambda x: 0.4 * (x / 1000) ** -0.5  # noqa: E731
    rng = np.random.default_rng(0)
    hits, reps = 0, 200
    for r in range(reps):
        task_effect = rng.normal(0, 0.08, tasks)
        units = [[truth(v) * np.exp(task_effect[t] + rng.normal(0, 0.1, 4)) for v in n]
                 for t in range(tasks)]
        e = fit.estimate(n, units, 32000, seed=r)
        hits += e.lo <= truth(32000) <= e.hi
    assert hits / reps >= 0.9


def test_widening_is_the_back_test_error_per_doubling_beyond_the_data(monkeypatch):
    """Beyond the longest length the bootstrap interval is widened by the chosen form's
    back-test error per doubling it predicted over (4/3 for 1K-8K), times the doublings beyond
    the data (2 at 32K); within the data it is not widened."""
    n = np.array([1000.0, 2000, 4000, 8000])
    rng = np.random.default_rng(1)
    units = [[0.3 * (v / 1000) ** -0.4 * np.exp(rng.normal(0, 0.1, 4)) for v in n]
             for _ in range(2)]
    assert fit._doublings(n) == pytest.approx(4 / 3)
    got = {at: fit.estimate(n, units, at) for at in (8000, 32000)}
    monkeypatch.setattr(fit, "_doublings", lambda n: np.inf)  # no widening
    plain = {at: fit.estimate(n, units, at) for at in (8000, 32000)}
    assert got[8000] == plain[8000]
    w = got[32000].backtest_error / (4 / 3) * 2
    assert w > 0
    assert got[32000].lo == pytest.approx(plain[32000].lo * (1 - w), rel=1e-12)
    assert got[32000].hi == pytest.approx(plain[32000].hi * (1 + w), rel=1e-12)


def test_backtest_only_uses_shorter_lengths():
    n = np.array([1.0, 2, 4, 8]) * 1000
    y = np.array([0.5, 0.4, 0.3, 0.9])  # the last point is not seen by a fit that predicts it
    bt = fit.backtest(n, y)
    for form, splits in bt.items():
        for k, at, pred, _meas in splits:
            refit = fit.predict(form, n[:k], y[:k], [at])[0]
            assert refit == pytest.approx(pred)


# ------------------------------------------------------------------------------ capture sets

def test_capture_set_round_trip_and_views_are_valid_traces(tmp_path):
    c = synthetic_capture_set(LENGTHS, questions=2)
    p = cs.save(c, tmp_path / "c.npz")
    back = cs.load(p)
    views = list(back.views())
    assert len(views) == len(LENGTHS) * 2
    j, i, t = views[3]
    n = back.lengths[j].context_len
    la = t.attention.layers[0]
    assert t.attention.context_len == n
    np.testing.assert_array_equal(la.k[:, :n], c.ctx_k[la.layer][:, :n])
    np.testing.assert_array_equal(la.k[:, n:], c.lengths[j].asked[i].layers[la.layer].k)
    with pytest.raises(KvsimError, match="exists"):
        cs.save(c, p)


def test_subset_keeps_the_rotated_heads_and_their_query_rows():
    c = synthetic_capture_set(LENGTHS, questions=1, n_layers=2)
    s = cs.subset(c, [1], 1, {1: 5.0})
    assert s.heads == {1: [1]} and s.weights == {1: 5.0}
    np.testing.assert_array_equal(s.ctx_k[1][0], c.ctx_k[1][1])
    q = c.lengths[0].asked[0].layers[1].q_question  # 4 query heads, 2 per KV head
    np.testing.assert_array_equal(s.lengths[0].asked[0].layers[1].q_question, q[2:4])


@pytest.mark.parametrize("edit, msg", [
    (lambda m: m.update(version=99), "version"),
    (lambda m: m["weights"].update({"0": -1}), "weights"),
    (lambda m: m.update(layers=[0, 0]), "same layers"),
    (lambda m: m.update(lengths=[]), "no question"),
])
def test_bad_capture_sets_are_one_line_errors(tmp_path, edit, msg):
    p = cs.save(synthetic_capture_set(LENGTHS, questions=1), tmp_path / "c.npz")
    with np.load(p) as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(str(arrays.pop("meta")))
    edit(meta)
    np.savez(tmp_path / "bad.npz", meta=np.array(json.dumps(meta)), **arrays)
    with pytest.raises(KvsimError, match=msg):
        cs.load(tmp_path / "bad.npz")


# ------------------------------------------------------------------------------ profiles

def _params(**over):
    import dataclasses

    from kvsim.policies import make
    return dataclasses.asdict(make("verkv", {"sink": 4, "local": 4, "eps": 0.05, **over}).params)


def test_profile_at_a_measured_length_is_the_weighted_mean_of_its_rows(profile):
    prof = pp.load(profile)
    si = [i for i, (_, p) in enumerate(prof.settings) if p == _params(compression=16.0)][0]
    data = json.loads(profile.read_text())
    col = pp.COLUMNS.index("kv_read_frac")
    rows = [r for r in data["rows"] if r[0] == si and r[7] == "decode" and r[2] == prof.targets[1]]
    # per question, the layers' weighted mean; then the mean over questions (both tasks)
    by_q: dict = {}
    for r in rows:
        by_q.setdefault((r[1], r[4]), []).append((r[6], r[col]))
    want = np.mean([sum(w * v for w, v in x) / sum(w for w, _ in x) for x in by_q.values()])
    units = prof._units({si: 1.0}, "decode", "kv_read_frac")
    assert np.mean(np.concatenate([t[1] for t in units])) == pytest.approx(want)


def test_interpolation_between_grid_settings_lies_between_them(profile):
    prof = pp.load(profile)
    at = int(prof.n[1])
    lo = prof.at("verkv", _params(compression=8.0), at).stats["kv_read_frac"]
    hi = prof.at("verkv", _params(compression=16.0), at).stats["kv_read_frac"]
    mid = prof.at("verkv", _params(compression=11.3), at).stats["kv_read_frac"]
    assert min(lo, hi) - 1e-12 <= mid <= max(lo, hi) + 1e-12


@pytest.mark.parametrize("over, n, msg", [
    ({"compression": 32.0}, 256, "compression 32 is outside the grid's compression 8..16"),
    ({"compression": 16.0, "sketch": "perfect"}, 256,
     r"sketch perfect is not on the grid \(sketch 2bit\).*nearest in p.json: sketch 2bit"),
    ({"compression": 16.0, "sink": 8}, 256, r"sink 8 is not on the grid \(sink 4\)"),
    ({"compression": 16.0}, 100_000, "extrapolates to"),
    ({"compression": 16.0}, 60, "extrapolates to"),
])
def test_profile_refuses_what_it_did_not_measure(profile, over, n, msg):
    with pytest.raises(KvsimError, match=msg):
        pp.load(profile).at("verkv", _params(**over), n)


def test_an_interrupted_build_resumes_to_the_same_profile(sets, profile, tmp_path):
    """The journal of a build killed after some jobs (and mid-line) is picked up; the result is
    identical to the uninterrupted build's."""
    specs, _ = parse("verkv", GRID, grid=True)
    out = tmp_path / "p.json"
    clean = json.loads(profile.read_text())
    journal = out.with_name(f".{out.name}.journal")
    from kvsim.policy_profile.build import _job  # noqa: F401  (the journal's job naming)
    sig = {"captures": [c["sha256_16"] for c in clean["captures"]],
           "settings": clean["settings"], "seed": 0}
    first = [r for r in clean["rows"] if (r[1], r[2], r[4], r[0]) == (0, LENGTHS[0] + 32, 0, 0)]
    journal.write_text(json.dumps({"signature": sig}) + "\n"
                       + json.dumps({"job": "0/0/0/0", "rows": first}) + "\n" + '{"job": "0/0/0')
    build(sets, specs, out, progress=False)
    assert json.loads(out.read_text())["rows"] == clean["rows"]
    assert not journal.exists()
    journal.write_text(json.dumps({"signature": {**sig, "seed": 5}}) + "\n")
    with pytest.raises(KvsimError, match="journal of a different build"):
        build(sets, specs, tmp_path / "p.json", progress=False, force=True)


@pytest.mark.slow  # two builds in fresh processes, one killed
def test_a_build_killed_by_signal_resumes_to_the_same_profile(sets, profile, tmp_path):
    """kill -9 mid-build, by PID, then the same command: the same rows as a clean build."""
    import os
    import signal
    import time
    out = tmp_path / "k.json"
    cmd = [sys.executable, "-m", "kvsim.cli", "policy-profile", *sets, "--policy", "verkv",
           "--compression", "8,16", "--eps", "0.05", "--sink", "4", "--local", "4", "--out",
           str(out), "--no-progress"]
    p = subprocess.Popen(cmd)
    journal = out.with_name(f".{out.name}.journal")
    while p.poll() is None:  # (no time limit: a slow machine only waits longer)
        if journal.exists() and len(journal.read_text().splitlines()) >= 3:
            break
        time.sleep(0.05)
    assert p.poll() is None, "the build ended before it could be killed"
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    assert not out.exists() and journal.exists()
    subprocess.run(cmd, check=True)
    assert json.loads(out.read_text())["rows"] == json.loads(profile.read_text())["rows"]


def test_replay_with_a_profile_reports_intervals_and_where_they_came_from(profile):
    from conftest import replay_json
    r = replay_json(policy="verkv", policy_options={"sink": 4, "local": 4,
                                                    "eps": 0.05},
                    policy_profile=str(profile), context=2048, gpu="h100-sxm")
    assert r["kv_read_frac_lo"] <= r["kv_read_frac"] <= r["kv_read_frac_hi"]
    assert r["tpot_ms_lo"] <= r["tpot_ms"] <= r["tpot_ms_hi"]
    assert r["throughput_tok_s_lo"] <= r["throughput_tok_s"] <= r["throughput_tok_s_hi"]
    assert 0 <= r["question_kv_read_frac"] <= 1 and 0 <= r["overall_kv_read_frac"] <= 1
    assert "extrapolated to 2048" in r["provenance"]["policy"]
    assert r["policy_profile"]["extrapolated"] is True
    assert any("extrapolated" in w for w in r["warnings"])
    # a trace named on its own means exactly that trace: no profile
    from kvsim.replay import DEFAULT_TRACE
    t = replay_json(trace=DEFAULT_TRACE, policy="verkv",
                    policy_options={"sink": 4, "local": 4}, gpu="h100-sxm")
    assert "policy_profile" not in t and "kv_read_frac_lo" not in t


@pytest.mark.parametrize("args, msg", [
    ([], "give one of --out"),
    (["--out", "x.txt", "--policy", "verkv", "a.npz"], "must end in .json"),
    (["--show", "nope.json", "--policy", "verkv"], "no such policy profile"),
    (["--out", "x.json", "--policy", "dense", "{sets0}"], "needs no attention"),
])
def test_policy_profile_command_refuses_bad_input(args, msg, sets, tmp_path):
    args = [a.replace("{sets0}", sets[0]) for a in args]
    p = subprocess.run([sys.executable, "-m", "kvsim.cli", "policy-profile", *args],
                       capture_output=True, text=True, cwd=tmp_path)
    assert p.returncode == 2 and msg in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_float32_policy_runs_match_float64_traffic():
    """The profile runs policies in float32 (3-6x faster on CPU); its traffic statistics equal
    the float64 run's on real-structured keys."""
    import torch

    from kvsim.measure import harness
    from kvsim.model.synthetic import synthetic_attention_trace
    from kvsim.policies import make
    t = synthetic_attention_trace(n_layers=1, context=1024, kvzip=False)
    pol = make("verkv", {"sink": 4, "local": 4})
    a, _ = harness.run(pol, t, 0, dtype=torch.float64, timed=False)
    b, _ = harness.run(pol, t, 0, dtype=torch.float32, timed=False)
    assert b["kv_read_frac"] == pytest.approx(a["kv_read_frac"], abs=1e-6)
    assert b["violation_rate"] == pytest.approx(a["violation_rate"], abs=1e-6)


def test_plan_carries_the_intervals_and_draws_the_band(profile, tmp_path):
    from kvsim.plan import plots
    from kvsim.plan.executors import LocalExecutor
    from kvsim.plan.sweep import SweepSpec, sweep
    s = SweepSpec(gpus=["h100-sxm"], models=["qwen3-4b"], contexts=[1024, 2048],
                  policies=["verkv"], batches=[1], output_len=8,
                  option_grid={"sink": [4], "local": [4], "eps": [0.05], "compression": [16.0]},
                  engine={"policy_profile": str(profile)})
    df = sweep(s, LocalExecutor(1), progress=False)
    assert (df.status == "ok").all()
    assert (df.tpot_ms_lo <= df.tpot_ms).all() and (df.tpot_ms <= df.tpot_ms_hi).all()
    series = plots.tpot_vs_context(df, tmp_path)
    band = [k for k in series if k.endswith("|band")]
    assert len(band) == 1 and series[band[0]][0] == [1024, 2048]


@pytest.mark.parametrize("edit, msg", [
    (lambda d: d.update(format="x"), "not a kvsim policy profile"),
    (lambda d: d.update(version=7), "version 7"),
    (lambda d: d["rows"][0].__setitem__(8, "lots"), "does not match"),
    (lambda d: d["rows"][0].__setitem__(0, 99), "does not match"),
    (lambda d: d["rows"].__setitem__(0, [1, 2]), "does not match"),
    (lambda d: d.update(rows=[]), "no rows"),
])
def test_malformed_profiles_are_one_line(profile, tmp_path, edit, msg):
    d = json.loads(profile.read_text())
    edit(d)
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(d))
    with pytest.raises(KvsimError, match=msg):
        pp.load(p)


def test_a_setting_that_cannot_run_stops_a_parallel_build_with_its_error(sets, tmp_path):
    """A worker's error ends a --jobs 2 build at once, with the policy's one-line message (the
    pool used to run every pending unit before the error surfaced)."""
    specs, _ = parse("verkv", {"compression": [32.0], "eps": [0.05], "sink": [4000],
                               "local": [4]}, grid=True)
    with pytest.raises(KvsimError, match="budget"):
        build(sets, specs, tmp_path / "bad.json", progress=False, jobs_n=2)


def test_a_build_checks_the_reads_on_each_views_first_layer(sets, tmp_path, monkeypatch):
    """The read check (kvsim.measure.traffic) runs attend twice: a build runs it on the first
    captured layer of every view, as the harness does on a whole trace, not on every layer."""
    from kvsim.measure import harness
    seen, run = [], harness.run

    def spy(policy, one, *args, verify="first", **kw):
        seen.append((one.meta["capture_set"]["length"], one.meta["capture_set"]["question"],
                     int(one.attention.layers[0].layer), verify))
        return run(policy, one, *args, verify=verify, **kw)

    monkeypatch.setattr(harness, "run", spy)
    specs, _ = parse("verkv", {"compression": [8.0], "eps": [0.05], "sink": [4], "local": [4]},
                     grid=True)
    build(sets[:1], specs, tmp_path / "p.json", progress=False)
    views = {(length, q) for length, q, _, _ in seen}
    assert len(views) == len(LENGTHS) * 2
    for view in views:
        layers = sorted((layer, v) for length, q, layer, v in seen if (length, q) == view)
        assert [v for _, v in layers] == ["first"] + ["none"] * (len(layers) - 1), layers


def test_a_build_in_this_process_runs_one_torch_thread_and_restores_them(sets, tmp_path,
                                                                        monkeypatch):
    """As each worker of a parallel build does (the same figures whatever --jobs)."""
    import torch

    from kvsim.policy_profile import build as B
    seen, run_unit = [], B._run_unit
    monkeypatch.setattr(B, "_run_unit", lambda *a: seen.append(torch.get_num_threads())
                        or run_unit(*a))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        specs, _ = parse("verkv", {"compression": [8.0], "eps": [0.05], "sink": [4],
                                   "local": [4]}, grid=True)
        build(sets[:1], specs, tmp_path / "p.json", progress=False)
        assert seen and set(seen) == {1} and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
