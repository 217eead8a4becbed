"""The attention-path policies (topk, poissoncomp, verkv) replayed on a synthetic trace."""

import math

import pytest
import torch

from kvsim.attention.dense import dense_attention
from kvsim.errors import KvsimError
from kvsim.measure.harness import analyze, run
from kvsim.model.synthetic import synthetic_attention_trace
from kvsim.policies import make
from kvsim.trace import Trace, new_meta

REQUIRED = ("decisions_fetch_frac", "kvhead_steps_fetch_frac", "tokens_per_fetch_frac",
            "kv_read_frac", "violation_rate", "output_rel_err_mean")
SMALL = {"sink": 4, "local": 4}


@pytest.fixture(scope="module")
def trace():
    return synthetic_attention_trace(n_layers=1, n_q=4, n_kv=2, d=32, context=1024,
                                     question=8, decode=4, seed=0)


@pytest.mark.parametrize("name,opts", [
    ("topk", {}), ("topk", {"scorer": "kvzip"}), ("topk", {"scorer": "oracle"}),
    ("poissoncomp", {}), ("verkv", {}), ("verkv", {"sketch": "perfect"}),
    ("verkv", {"variant": "paper"}), ("verkv", {"shrinkage": "bounded"}),
])
def test_analyze_reports_the_required_statistics(trace, name, opts):
    res = analyze(make(name, {**SMALL, **opts}), trace, seed=0)
    for key in REQUIRED:
        assert key in res.stats, key
        assert 0.0 <= res.stats[key] <= 1.0, (key, res.stats[key])
    assert "synthetic" in res.provenance and "1024 context tokens" in res.provenance
    assert res.stats["held_tokens"] > 0 and 0 < res.cost.resident_frac < 0.1
    assert 0 <= res.cost.meta_frac < res.cost.resident_frac  # sketch/probabilities, a part of it
    assert (res.cost.meta_frac > 0) == (name != "topk")
    if name == "verkv":
        assert res.cost.host_frac == 1.0 and res.cost.path == "gather"
        assert res.cost.overlap is False
        assert res.cost.host_read_frac == pytest.approx(res.stats["kv_read_frac"])
        assert res.stats["eps_hat_after_mean"] <= res.stats["eps_hat_mean"]
        if opts.get("sketch") == "perfect":
            assert res.stats["violation_rate"] <= 0.1  # adherence with exact weights
    else:
        assert res.cost.host_frac == 0.0 and res.cost.host_read_frac == 0.0
        assert res.stats["kv_read_frac"] == 0.0


def test_budgets_held(trace):
    n_ctx = trace.attention.context_len
    topk = analyze(make("topk", {**SMALL}), trace)
    assert topk.stats["held_tokens"] == n_ctx // 16
    assert topk.cost.resident_frac == pytest.approx(1 / 16)
    pc = make("poissoncomp", SMALL)
    layer = trace.attention.layers[0]
    k = torch.as_tensor(layer.k, dtype=torch.float64)[:, :n_ctx]
    q = torch.as_tensor(layer.q_question, dtype=torch.float64)
    pos = torch.as_tensor(trace.attention.question_pos)
    st = pc.compress(k, k, {}, q, pos, torch.Generator().manual_seed(0), layer=0)
    assert st.info["expected_tokens"] == pytest.approx(n_ctx / 16, rel=1e-9)
    vk = make("verkv", SMALL)
    sv = vk.compress(k, k, {}, q, pos, torch.Generator().manual_seed(0), layer=0)
    sketch_bytes = n_ctx * 8 * 2 / 8 + math.ceil(n_ctx / 128) * 8 * 2 * 2
    assert sv.info["expected_tokens"] == pytest.approx(n_ctx / 16 - sketch_bytes / (4 * 32),
                                                       rel=1e-9)
    # metadata: the sketch and an fp16 inclusion probability per context token
    assert sv.meta_bytes == pytest.approx(sketch_bytes + 2 * n_ctx)


@pytest.mark.parametrize("sketch", ["perfect", "2bit"])
def test_eps_to_zero_gives_dense(trace, sketch):
    pol = make("verkv", {**SMALL, "sketch": sketch, "eps": 1e-12})
    a = trace.attention
    layer = a.layers[0]
    t = lambda x: torch.as_tensor(x, dtype=torch.float64)  # noqa: E731
    k, v = t(layer.k), t(layer.v)
    n_ctx = a.context_len
    st = pol.compress(k[:, :n_ctx], v[:, :n_ctx], {}, t(layer.q_question),
                      torch.as_tensor(a.question_pos), torch.Generator().manual_seed(0), layer=0)
    for q, pos in ((t(layer.q_question), a.question_pos), (t(layer.q_decode), a.decode_pos)):
        pos = torch.as_tensor(pos)
        out, stats, _ = pol.attend(st.state, q, pos, k, v)
        ref, logd = dense_attention(q, k, v, pos)
        torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(stats["log_denominator"], logd, rtol=1e-9, atol=1e-9)
        assert bool((stats["eps_hat_after"] < 1e-12).all())


def test_fetching_beats_no_fetch_and_eviction(trace):
    runs = {name: analyze(make(name, SMALL), trace).stats for name in ("topk", "poissoncomp")}
    runs["verkv"] = analyze(make("verkv", {**SMALL, "sketch": "perfect"}), trace).stats
    den = {name: s["denominator_rel_err_mean"] for name, s in runs.items()}
    assert den["verkv"] < den["poissoncomp"] and den["verkv"] < den["topk"]
    assert runs["verkv"]["violation_rate"] < runs["poissoncomp"]["violation_rate"]
    # a looser tolerance fetches less
    loose = analyze(make("verkv", {**SMALL, "sketch": "perfect", "eps": 0.3}), trace).stats
    assert loose["kv_read_frac"] < runs["verkv"]["kv_read_frac"]


def test_deterministic_under_a_seed(trace):
    a = analyze(make("verkv", SMALL), trace, seed=3).stats
    b = analyze(make("verkv", SMALL), trace, seed=3).stats
    c = analyze(make("poissoncomp", SMALL), trace, seed=3).stats
    d = analyze(make("poissoncomp", SMALL), trace, seed=4).stats
    assert a == b
    assert c["output_rel_err_mean"] != d["output_rel_err_mean"]


@pytest.mark.parametrize("name,opts,match", [
    ("verkv", {"eps": 0.0}, "--eps must be > 0"),
    ("verkv", {"eps": -0.1}, "--eps must be > 0"),
    ("topk", {"eps": float("nan")}, "--eps must be > 0"),
    ("verkv", {"delta": 0.0}, "--delta must lie strictly between 0 and 1"),
    ("verkv", {"delta": 1.0}, "--delta must lie strictly between 0 and 1"),
    ("verkv", {"compression": 0.5}, "--compression must be >= 1"),
    ("poissoncomp", {"compression": 0.99}, "--compression must be >= 1"),
    ("verkv", {"sketch": "3bit"}, "--sketch must be one of"),
    ("topk", {"scorer": "h2o"}, "--scorer must be one of"),
    ("verkv", {"sink": -1}, "--sink must be"),
    ("verkv", {"delta": 0.1, "sketch": "2bit", "shortlist": -5}, "--shortlist"),
    ("topk", {"delta": 0.1}, "does not apply to policy topk"),
])
def test_bad_parameters(name, opts, match):
    with pytest.raises(KvsimError, match=match):
        make(name, opts)


def test_budget_too_small_names_sizes_that_fit(trace):
    # 16x of 1024 tokens = 64 tokens: sink 64 + local 64 given explicitly do not fit
    with pytest.raises(KvsimError) as e:
        analyze(make("verkv", {"compression": 16, "sink": 64, "local": 64}), trace)
    msg = str(e.value)
    assert "\n" not in msg
    assert "sink 64 + local 64 + sketch" in msg and msg.count("--sink") == 1  # one suggestion
    # the suggested sizes do fit
    size = int(msg.split("--sink ")[1].split()[0])
    analyze(make("verkv", {"compression": 16, "sink": size, "local": size}), trace)
    for name in ("topk", "poissoncomp"):
        with pytest.raises(KvsimError, match="--sink"):
            analyze(make(name, {"compression": 32, "sink": 64, "local": 64}), trace)


def test_default_sink_and_local_shrink_to_fit_and_say_so(trace):
    """Not given, sink and local are 64 each where that fits and a quarter of the budget where
    it does not, with a note the report turns into a warning; given, they are used as given."""
    for name in ("topk", "poissoncomp", "verkv"):
        st = analyze(make(name, {"compression": 16}), trace).stats
        assert any("shrunk" in n for n in st["notes"]), name
        p = make(name, {"compression": 16})
        p.budget(1024, sketch_tokens=0.0)
        assert p.sink_local == (16, 16)  # 64 tokens of budget: a quarter each
        p.budget(1 << 20)
        assert p.sink_local == (64, 64) and len(p.notes) == 1  # long context: the default
        q = make(name, {"compression": 16, "sink": 3, "local": 5})
        q.budget(1024)
        assert q.sink_local == (3, 5) and not q.notes


def test_needs_an_attention_section():
    for name in ("topk", "poissoncomp", "verkv"):
        with pytest.raises(KvsimError, match=f"policy {name} needs a trace with an attention "
                                             "section"):
            analyze(make(name, SMALL), Trace(new_meta("tests"), None, None))


def test_missing_kvzip_scores(trace):
    layer = trace.attention.layers[0]
    saved = layer.scores
    layer.scores = {}
    try:
        with pytest.raises(KvsimError, match="no 'kvzip' scores"):
            analyze(make("verkv", {**SMALL, "scorer": "kvzip"}), trace)
    finally:
        layer.scores = saved


def test_harness_is_generic_dense_policy_has_zero_error(trace):
    stats, timings = run(make("dense-resident"), trace)
    assert stats["output_rel_err_mean"] < 1e-12
    assert stats["kv_read_frac"] == 0.0 and stats["decisions_fetch_frac"] == 0.0
    assert "violation_rate" not in stats  # dense returns no denominator and has no eps
    assert stats["resident_frac"] == 1.0 and stats["meta_frac"] == 0.0 and timings == {}


def test_kv_read_never_exceeds_the_cache(trace):
    stats = analyze(make("verkv", {**SMALL, "eps": 1e-6}), trace).stats
    assert stats["kv_read_frac"] <= 1.0 and stats["question"]["kv_read_frac"] <= 1.0
    assert stats["decisions_fetch_frac"] == 1.0


def test_synthetic_trace_signature_and_meta():
    tr = synthetic_attention_trace()
    a = tr.attention
    assert len(a.layers) == 2 and a.n_q_heads == 8 and a.n_kv_heads == 2 and a.head_dim == 64
    assert a.context_len == 2048 and a.n_tokens == 2048 + 16 + 8
    assert tr.meta["synthetic"] is True and "synthetic" in tr.meta["notes"]
    assert a.layers[0].scores["kvzip"].shape == (2, a.n_tokens)
    again = synthetic_attention_trace()
    assert (again.attention.layers[1].k == a.layers[1].k).all()


@pytest.mark.parametrize("seed, eps", [(0, 0.5), (4, 0.3)])
def test_verkv_attention_applies_the_shrinkage_factor(seed, eps):
    """VerKV's output and denominator equal an independent float64 sum over the trace's own
    logits: exact weights on H and fetched tokens, lambda_i w_i / r_i on the other sampled
    tokens, with lambda from the decision. The cases are chosen with some sampled token shrunk
    (lambda_i = r_i < 1), so an attention path that uses w_i / r_i there fails."""
    import torch

    from kvsim.attention.dense import logits
    from kvsim.measure.harness import observation
    from kvsim.model.synthetic import synthetic_attention_trace
    from kvsim.policies import make
    from kvsim.policies.verkv.kvfetch import decide
    a = synthetic_attention_trace(n_layers=1, context=512, question=8, decode=2, seed=seed,
                                  kvzip=False).attention
    la = a.layers[0]
    pol = make("verkv", {"sink": 2, "local": 2, "eps": eps, "compression": 8.0,
                         "sketch": "perfect"})
    pol.bind(a.rope, a.head_dim)
    f = lambda x: torch.as_tensor(x).to(torch.float64)  # noqa: E731
    n = a.context_len
    k, v, qq, qd = f(la.k), f(la.v), f(la.q_question), f(la.q_decode)
    qpos, dpos = torch.as_tensor(a.question_pos), torch.as_tensor(a.decode_pos)
    c = pol.compress(k[:, :n], v[:, :n], {},
                     *observation(pol.observation, qq, qpos, qd, dpos, n),
                     torch.Generator().manual_seed(1), layer=0)
    q, pos = qd[:, :1], dpos[:1]
    out, st, _ = pol.attend(c.state, q, pos, k, v)
    extra_pos = torch.arange(n, k.shape[1])
    dec = decide(q, pos, c.state, pol.config(), extra_logits=logits(q, k[:, n:], pos, extra_pos))
    g = q.shape[0] // k.shape[0]
    smp = c.state.sample
    exact = (smp.in_h[:, None, :] | dec.exact_kv).repeat_interleave(g, 0)
    sampled = smp.sampled.repeat_interleave(g, 0)[:, None, :] & ~exact
    lam = dec.lam(c.state.factors)
    assert (lam[sampled] < 1 - 1e-9).any()  # the case shrinks a sampled token
    r = smp.r.to(torch.float64).repeat_interleave(g, 0)[:, None, :]
    s = logits(q, k, pos)  # (n_q, 1, n_all), -inf where masked
    factor = torch.ones_like(s)
    factor[..., :n] = torch.where(exact, 1.0, torch.where(sampled, lam / r, 0.0))
    w = factor * torch.exp(s)
    kq = k.repeat_interleave(g, 0)
    vq = v.repeat_interleave(g, 0)
    assert kq.shape[0] == q.shape[0]
    d_hat = w.sum(-1)
    o_hat = torch.einsum("hmn,hnd->hmd", w, vq) / d_hat[..., None]
    torch.testing.assert_close(st["log_denominator"].to(torch.float64), torch.log(d_hat),
                               rtol=0, atol=1e-9)
    torch.testing.assert_close(out.to(torch.float64), o_hat, rtol=1e-9, atol=1e-9)
    # the per-decision convention: only the decision's own fetches are exact
    own = smp.in_h.repeat_interleave(g, 0)[:, None, :] | dec.own_exact
    own_sampled = smp.sampled.repeat_interleave(g, 0)[:, None, :] & ~own
    f_own = torch.ones_like(s)
    f_own[..., :n] = torch.where(own, 1.0, torch.where(own_sampled, lam / r, 0.0))
    torch.testing.assert_close(st["log_denominator_own"].to(torch.float64),
                               torch.log((f_own * torch.exp(s)).sum(-1)), rtol=0, atol=1e-9)


def test_snapkv_softmax_runs_over_every_key_the_window_sees(monkeypatch):
    """SnapKV's scores against a loop in float64: each window row's softmax over the context and
    the question tokens up to it (as SnapKV does), its mass on the context summed, pooled; the
    harness hands the question's keys to the policy so that its scores are these."""
    from kvsim.attention.scoring import snapkv_scores
    g = torch.Generator().manual_seed(3)
    n_kv, n_q, n, a, d = 2, 4, 50, 7, 8
    k = torch.randn(n_kv, n + a, d, generator=g, dtype=torch.float64)
    k[:, n:] *= 3.0  # question tokens that take much of the attention
    q = torch.randn(n_q, a, d, generator=g, dtype=torch.float64)
    pos = torch.arange(n, n + a)  # the window: the question rows
    mass = torch.zeros(n_kv, n, dtype=torch.float64)
    for h in range(n_q):
        kv = h // (n_q // n_kv)
        for r in range(a):
            seen = k[kv, : int(pos[r]) + 1]
            p = torch.softmax(seen @ q[h, r] / math.sqrt(d), 0)
            mass[kv] += p[:n] / a / (n_q // n_kv)
    pooled = torch.stack([torch.stack([mass[h, max(0, i - 2):i + 3].mean() for i in range(n)])
                          for h in range(n_kv)])
    got = snapkv_scores(k[:, :n], q, pos, k_after=k[:, n:])
    torch.testing.assert_close(got, pooled)
    assert not torch.allclose(snapkv_scores(k[:, :n], q, pos), pooled)  # context-only differs
    # the harness passes the question's keys on: a policy sees these scores
    tr = synthetic_attention_trace(n_layers=1, n_q=4, n_kv=2, d=16, context=300, question=6,
                                   decode=2, seed=1, kvzip=False)
    seen = {}
    pol = make("topk", {"sink": 4, "local": 4})
    real = type(pol).compress

    def spy(self, k, v, scores, obs_q, obs_pos, generator, layer, obs_k=None):
        seen["obs_k"] = obs_k
        return real(self, k, v, scores, obs_q, obs_pos, generator, layer, obs_k=obs_k)
    monkeypatch.setattr(type(pol), "compress", spy)
    run(pol, tr)
    la = tr.attention.layers[0]
    assert seen["obs_k"] is not None and seen["obs_k"].shape[1] == la.k.shape[1] - 300
