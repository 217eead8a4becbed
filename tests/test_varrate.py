"""VarRate codec, calibration and the varrate/flat policies, checked against independent
float64 / brute-force computations on small synthetic tensors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvsim import trace as T
from kvsim.attention import rope as rp
from kvsim.errors import KvsimError
from kvsim.measure.harness import analyze
from kvsim.policies import make
from kvsim.policies.varrate import calibrate
from kvsim.policies.varrate import codec as vc


@pytest.fixture(autouse=True)
def _one_timing_run(monkeypatch):
    from kvsim.measure import harness
    monkeypatch.setattr(harness, "TIMING_REPEATS", 1)  # timings are reported, never asserted
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny LAPACK calls crawl when 2 MKL threads meet a busy machine
    yield
    torch.set_num_threads(threads)


G, D_H, N_Q = 3, 16, 9
DIM = 2 * G * D_H


def _rope(style="default", theta=1e4, d=D_H):
    return rp.rope_from_meta({"theta": theta, "type": style}, d)


def _context(n=300, seed=0, model_seed=7, rank=6, noise=0.05, dtype=torch.float32):
    """Post-RoPE keys and values (G, n, d) whose pre-RoPE joint vectors are near low-rank; the
    mixing (the "model") comes from ``model_seed``, the content from ``seed``."""
    gm = torch.Generator().manual_seed(model_seed)
    mix = torch.randn(rank, DIM, generator=gm) * torch.linspace(2, 0.3, rank)[:, None]
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, rank, generator=g) @ mix + noise * torch.randn(n, DIM, generator=g)
    kp, v = vc.split(z, G, D_H)
    return rp.rotate(kp, torch.arange(n), _rope()).to(dtype), v.contiguous().to(dtype)


def _trace(n=400, seed=0, layers=(0, 1), m_q=12, m_d=4, ctx_q=0, dtype=np.float16,
           snapkv=False):
    ls = []
    g = torch.Generator().manual_seed(100 + seed)
    for l in layers:
        k, v = _context(n, seed=seed * 10 + l, model_seed=7 + l)
        qq = torch.randn(N_Q, ctx_q + m_q, D_H, generator=g)
        qd = torch.randn(N_Q, m_d, D_H, generator=g)
        scores = {"snapkv": torch.rand(G, n, generator=g).numpy()} if snapkv else {}
        ls.append(T.LayerAttention(l, k.numpy().astype(dtype), v.numpy().astype(dtype),
                                   qq.numpy().astype(dtype), qd.numpy().astype(dtype), scores))
    ctx = n - m_q - m_d
    qpos = np.concatenate([np.arange(ctx - ctx_q, ctx), np.arange(ctx, ctx + m_q)])
    a = T.Attention(ls, ctx, qpos, np.arange(ctx + m_q, n), {"theta": 1e4, "type": "default"},
                    "synthetic")
    return T.Trace(T.new_meta("test", model="synthetic"), attention=a)


# ------------------------------------------------------------------------------------- RoPE

def _reference_rope(x: np.ndarray, pos: np.ndarray, theta: float) -> np.ndarray:
    """An independent HF-style (rotate_half) RoPE in float64: float32 angles as the model forms
    them, cos/sin and the rotation in float64."""
    d = x.shape[-1]
    inv = (1.0 / (np.float32(theta) ** (np.arange(0, d, 2, dtype=np.float32) / np.float32(d))))
    ang = pos.astype(np.float32)[:, None] * inv.astype(np.float32)[None, :]
    emb = np.concatenate([ang, ang], axis=-1).astype(np.float64)
    rot_half = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], axis=-1)
    return x * np.cos(emb) + rot_half * np.sin(emb)


def test_unrotation_inverts_reference_rope_float64():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((G, 257, D_H))
    pos = np.arange(257) * 31  # large positions: angles far from zero
    y = _reference_rope(x, pos, 1e4)
    back = rp.rotate(torch.from_numpy(y), torch.from_numpy(pos), _rope(theta=1e4),
                     inverse=True).numpy()
    assert np.abs(back - x).max() < 1e-12
    fwd = rp.rotate(torch.from_numpy(x), torch.from_numpy(pos), _rope(theta=1e4)).numpy()
    assert np.abs(fwd - y).max() < 1e-12


def test_rotation_matches_transformers_apply_rotary():
    hf = pytest.importorskip("transformers.models.llama.modeling_llama")
    x = torch.randn(1, G, 50, D_H, dtype=torch.float64)
    pos = torch.arange(50) * 7
    rope = _rope(theta=1e5)
    ang = pos.float()[:, None] * rope.inv_freq[None, :]
    emb = torch.cat([ang, ang], -1).double()
    ref, _ = hf.apply_rotary_pos_emb(x, x, emb.cos()[None], emb.sin()[None])
    assert torch.allclose(rp.rotate(x, pos, rope), ref, atol=1e-12, rtol=0)


@pytest.mark.parametrize("style", ["default", "interleaved"])
def test_unrotate_then_rerotate_is_identity(style):
    x = torch.randn(G, 200, D_H)
    pos = torch.arange(200) + 4000
    rope = _rope(style)
    assert torch.allclose(rp.rotate(rp.rotate(x, pos, rope, inverse=True), pos, rope), x,
                          atol=2e-6, rtol=0)
    x64 = x.double()
    assert torch.allclose(rp.rotate(rp.rotate(x64, pos, rope), pos, rope, inverse=True), x64,
                          atol=1e-13, rtol=0)
    # a rotation: norms of each pair are kept
    assert torch.allclose(rp.rotate(x64, pos, rope).norm(dim=-1), x64.norm(dim=-1), atol=1e-12)


# ------------------------------------------------------------------------- water-filling

def _paper_waterfill(s: np.ndarray, budget: float, r_min: float, r_max: float) -> np.ndarray:
    """Algorithm 1, lines 6-11, as written (real-valued), in float64."""
    r = np.full(s.shape, float(r_min))
    free = np.ones(s.shape, bool)
    for _ in range(10 * s.size + 10):
        delta = budget - r.sum()
        r[free] += delta * s[free] / s[free].sum()
        over = free & (r > r_max)
        r[over] = r_max
        free &= ~over
        if not over.any():
            break
    return r


@pytest.mark.parametrize("seed", range(5))
def test_waterfill_meets_budget_exactly_with_floor_and_cap(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(50, 400))
    s = rng.random(n) ** 4  # skewed, so the cap binds
    s_hat = vc.minmax(torch.from_numpy(s))
    r_min, r_max = 4, 40
    budget = int(rng.integers(n * 12, n * 20))  # high enough for the cap to bind
    ranks = vc.waterfill(s_hat, budget, r_min, r_max)
    assert ranks.dtype == torch.long
    assert int(ranks.sum()) == budget
    assert int(ranks.min()) >= r_min and int(ranks.max()) <= r_max
    real = _paper_waterfill(s_hat.numpy(), budget, r_min, r_max)
    assert abs(real.sum() - budget) < 1e-6
    assert np.abs(ranks.numpy() - real).max() < 1.0 + 1e-6  # rounding moves a rank by < 1
    assert (ranks.numpy() == r_max).any()  # the cap was exercised


def test_constant_salience_collapses_to_flat():
    n, budget = 137, 137 * 23 + 50
    ranks = vc.waterfill(vc.minmax(torch.full((n,), 0.3)), budget, 16, 64)
    assert int(ranks.sum()) == budget
    assert set(ranks.tolist()) == {23, 24}  # B/|C| = 23.36...
    assert int((ranks == 24).sum()) == 50


def test_waterfill_infeasible_floor_or_cap_is_an_error():
    s = torch.rand(10)
    with pytest.raises(KvsimError, match="floor"):
        vc.waterfill(s, 10 * 16 - 1, 16, 64)
    with pytest.raises(KvsimError, match="cap"):
        vc.waterfill(s, 10 * 64 + 1, 16, 64)


# -------------------------------------------------------------------- anchors, salience, basis

def test_layout_and_nearest_anchors_match_brute_force():
    anchors, exact, coded = vc.layout(100, 16, 10)
    assert anchors.tolist() == [0, 16, 32, 48, 64, 80, 96]
    assert exact.sum() == 7 + 10 - 1  # 96 is both an anchor and in the window
    assert set(coded.tolist()) == set(range(100)) - set(anchors.tolist()) - set(range(90, 100))
    z = torch.randn(100, 8, dtype=torch.float64)
    ids = vc.nearest_anchors(z[coded], z[anchors], 3)
    for i, t in enumerate(coded.tolist()[:20]):
        dist = [float((z[t] - z[a]).norm()) for a in anchors.tolist()]
        assert sorted(ids[i].tolist()) == sorted(np.argsort(dist)[:3].tolist())


def test_snapkv_salience_matches_brute_force():
    k = torch.randn(G, 40, D_H, dtype=torch.float64)
    q = torch.randn(N_Q, 5, D_H, dtype=torch.float64)
    pos = torch.tensor([30, 33, 36, 38, 39])
    s = vc.snapkv_salience(q, pos, k).double()
    ref = np.zeros(40)
    for h in range(N_Q):
        kv = h // (N_Q // G)
        for i, p in enumerate(pos.tolist()):
            lg = (k[kv, :p + 1] @ q[h, i]).numpy() / math.sqrt(D_H)
            w = np.exp(lg - lg.max())
            ref[:p + 1] += w / w.sum()
    ref /= N_Q * 5
    smooth = np.convolve(np.pad(ref, 2), np.ones(5) / 5, mode="valid")
    assert np.allclose(s.numpy(), smooth, atol=1e-6)


def test_basis_rows_orthonormal_ordered_and_equal_to_svd():
    e = torch.randn(300, 24, dtype=torch.float64) * torch.linspace(3, 0.1, 24)
    V, sv = vc.fit_basis(e, 10)
    assert torch.allclose(V @ V.T, torch.eye(10, dtype=torch.float64), atol=1e-12)
    assert (sv[:-1] >= sv[1:]).all()
    _, s_ref, vt = np.linalg.svd(e.numpy(), full_matrices=False)
    assert np.allclose(sv.numpy(), s_ref[:10], rtol=1e-9)
    assert np.allclose(np.abs(V.numpy() @ vt[:10].T), np.eye(10), atol=1e-8)  # up to sign


# ----------------------------------------------------------------------- encode / decode

def _encode(k, v, basis, kappa=0.3, bits=16, flat=True, r_min=2, cap=None, axis="channel",
            group=8, salience=None):
    rope = _rope()
    cap = cap or basis.shape[0]
    fn = (lambda p: torch.ones(p.coded.numel())) if flat else salience
    return vc.encode(k, v, basis, rope, kappa, fn, r_min, cap, 8, 3, 16, bits, group,
                     axis=axis)


def test_exact_tokens_come_back_bit_identical_and_decode_matches_float64_reference():
    for dtype in (torch.float16, torch.float32):
        k, v = _context(dtype=dtype)
        prep = vc.prepare(k.float(), v.float(), _rope(), 8, 3, 16)
        basis = vc.fit_basis(prep.resid, DIM)[0].float()
        code, info = _encode(k, v, basis)
        kh, vh = vc.decode(code, basis, _rope())
        ex = prep.exact
        assert kh.dtype == dtype and torch.equal(kh[:, ex], k[:, ex])
        assert torch.equal(vh[:, ex], v[:, ex])
        # independent reconstruction of the coded tokens in float64 from the encoder's view
        r = info["ranks"]
        c = (prep.resid.double() @ basis[:code.rank_cap].double().T)
        c = c * (torch.arange(c.shape[1])[None] < r[:, None])
        c = c.float().half().double()  # bits=16 stores fp16 coefficients
        z = prep.z_bar.double() + c @ basis[:code.rank_cap].double()
        kz, vz = vc.split(z, G, D_H)
        kz = rp.rotate(kz, prep.coded, _rope())
        tol = 1e-2 if dtype == torch.float16 else 1e-4  # fp16 output rounding
        assert torch.allclose(kh[:, prep.coded].double(), kz, atol=tol)
        assert torch.allclose(vh[:, prep.coded].double(), vz, atol=tol)


def test_reconstruction_error_falls_monotonically_with_rank():
    k, v = _context(rank=30, noise=0.2)
    prep = vc.prepare(k, v, _rope(), 8, 3, 16)
    basis = vc.fit_basis(prep.resid, DIM)[0].float()
    n, n_c = k.shape[1], prep.coded.numel()
    errs = []
    for r in (1, 2, 4, 8, 16, 32, 64):
        kappa = (n - n_c + r * n_c / DIM) / n + 1e-9  # budget = exactly r per coded token
        code, info = _encode(k, v, basis, kappa=kappa, r_min=1)
        assert set(info["ranks"].tolist()) == {r}
        kh, vh = vc.decode(code, basis, _rope())
        c = prep.coded
        errs.append(float(torch.cat([kh[:, c] - k[:, c], vh[:, c] - v[:, c]]).norm()))
    assert all(a > b for a, b in zip(errs, errs[1:])), errs
    # per token in float64 too: projection error never rises with rank
    e = prep.resid.double()
    B = basis.double()
    per = torch.stack([(e - (e @ B[:r].T) @ B[:r]).norm(dim=1) for r in range(0, DIM + 1, 8)])
    assert (per[1:] <= per[:-1] + 1e-9).all()


def test_budget_beyond_the_rank_cap_puts_every_token_at_the_cap():
    k, v = _context(n=300)
    code, info = _encode(k, v, torch.eye(DIM), kappa=0.9, cap=20, flat=False,
                         salience=lambda p: torch.rand(p.coded.numel()))
    assert set(info["ranks"].tolist()) == {20} and info["budget_unspent"] > 0
    assert info["budget"] == 20 * info["n_coded"]


def test_kappa_too_small_for_exact_set_is_a_clear_error():
    k, v = _context(n=300)
    basis = torch.eye(DIM)
    with pytest.raises(KvsimError, match="cannot hold the .* exact tokens"):
        _encode(k, v, basis, kappa=0.05)  # 38 + 16 exact tokens > 15 tokens of budget


def test_pack_bits_round_trip():
    for bits in (3, 4, 8):
        x = torch.randint(0, 2 ** bits, (1001,))
        p = vc.pack_bits(x, bits)
        assert p.dtype == torch.uint8 and p.numel() == math.ceil(1001 * bits / 8)
        assert torch.equal(vc.unpack_bits(p, bits, 1001), x)


@pytest.mark.parametrize("axis", ["channel", "token"])
def test_quantization_error_shrinks_with_bits(axis):
    k, v = _context(rank=20, noise=0.1)
    prep = vc.prepare(k, v, _rope(), 8, 3, 16)
    basis = vc.fit_basis(prep.resid, DIM)[0].float()
    errs = []
    for bits in (3, 4, 8, 16):
        rand = torch.rand(prep.coded.numel(), generator=torch.Generator().manual_seed(0))
        code, info = _encode(k, v, basis, bits=bits, axis=axis, flat=False,
                             salience=lambda p: rand)
        got = vc.dequantize(code.coef, info["ranks"], code.rank_cap)
        ref = info["coef"] * (torch.arange(code.rank_cap)[None] < info["ranks"][:, None])
        errs.append(float((got - ref).norm() / ref.norm()))
    assert errs[0] > errs[1] > errs[2] > errs[3], errs
    assert errs[3] < 1e-3 and errs[0] < 0.3


@pytest.mark.parametrize("bits,axis", [(16, "channel"), (3, "channel"), (4, "token"),
                                       (8, "channel")])
def test_footprint_matches_an_independent_count(bits, axis):
    k, v = _context(n=333)
    prep = vc.prepare(k, v, _rope(), 8, 3, 16)
    basis = vc.fit_basis(prep.resid, DIM)[0].float()
    group = 8
    code, info = _encode(k, v, basis, bits=bits, axis=axis, group=group, flat=False,
                         salience=lambda p: torch.linspace(0, 1, p.coded.numel()))
    ranks = info["ranks"].tolist()
    n, n_c = 333, len(ranks)
    n_e = n - n_c
    assert n_e == len(range(0, n, 8)) + 16 - sum(1 for a in range(0, n, 8) if a >= n - 16)
    kept = sum(ranks)
    assert kept == info["budget"] == math.floor(DIM * (0.3 * n - n_e) + 1e-6)
    if bits == 16:
        coef, scales = 2 * kept, 0
    else:
        coef = math.ceil(kept * bits / 8)
        if axis == "token":
            groups = sum(math.ceil(r / group) for r in ranks)
        else:
            groups = sum(math.ceil(sum(1 for r in ranks if r > j) / group)
                         for j in range(max(ranks)))
        scales = 4 * groups  # fp16 scale + fp16 zero
    expected = n_e * DIM * 2 + coef + scales + n_c * 3 * 2 + n_c * 2
    nb = code.nbytes()
    assert nb["full"] == n * DIM * 2
    assert sum(x for key, x in nb.items() if key != "full") == expected


# ------------------------------------------------------------------- calibration and policy

def test_calibrate_save_load_and_checks(tmp_path):
    paths = []
    for s in (1, 2):
        p = tmp_path / f"cal{s}.npz"
        T.save(_trace(seed=s), p)
        paths.append(str(p))
    b = calibrate.calibrate(paths, rank=40, stride=16, c=4, window=64)
    out = tmp_path / "basis.npz"
    calibrate.save(b, out)
    with pytest.raises(KvsimError, match="exists"):
        calibrate.save(b, out)
    got = calibrate.load(out)
    assert got.meta["D"] == DIM and got.meta["R"] == 40 and sorted(got.layers) == [0, 1]
    assert [t["path"] for t in got.meta["traces"]] == paths
    for l in (0, 1):
        V = got.layers[l].double()
        assert torch.allclose(V @ V.T, torch.eye(40, dtype=torch.float64), atol=1e-5)
    tr = _trace(seed=3, layers=(0, 1, 2))
    rope = rp.rope_from_meta(tr.attention.rope, D_H)
    with pytest.raises(KvsimError, match=r"no basis for trace layer\(s\) \[2\]"):
        got.check(tr, rope)
    other = rp.rope_from_meta({"theta": 5e5}, D_H)
    with pytest.raises(KvsimError, match="RoPE"):
        got.check(_trace(seed=3), other)


def test_cli_calibrate_refuses_overwrite(tmp_path, capsys):
    from kvsim.cli import main
    p = tmp_path / "c.npz"
    T.save(_trace(seed=1), p)
    out = tmp_path / "b.npz"
    assert main(["calibrate", "--traces", str(p), "--out", str(out), "--rank", "24"]) == 0
    assert out.exists()
    assert main(["calibrate", "--traces", str(p), "--out", str(out)]) == 2
    assert "exists" in capsys.readouterr().err
    assert main(["calibrate", "--traces", str(p), "--out", str(out), "--force"]) == 0
    assert calibrate.load(out).meta["R"] == DIM


SMALL = {"r_min": 2, "window": 16, "obs_window": 16}  # a floor and windows for D = 96




def test_policies_on_a_trace(tmp_path):
    tr = _trace(n=400, seed=0)
    cal = tmp_path / "cal.npz"
    T.save(_trace(n=400, seed=5), cal)
    bpath = tmp_path / "basis.npz"
    calibrate.save(calibrate.calibrate([str(cal)]), bpath)
    res = {}
    for name in ("varrate", "flat"):
        for basis in ("", str(bpath)):
            r = analyze(make(name, dict(SMALL, compression=4.0, basis=basis)), tr)
            res[name, basis] = r
            s = r.stats
            assert s["kv_read_frac"] == 0.0 and r.cost.host_read_frac == 0.0
            assert r.cost.resident_frac == 1.0  # reconstruct mode
            parts = s["footprint_parts_frac"]
            assert parts["exact"] + parts["coef"] == pytest.approx(0.25, abs=1e-4)  # kappa
            assert s["footprint_frac"] == pytest.approx(sum(parts.values()))
            assert parts["anchor_ids"] > 0 and parts["ranks"] > 0
            assert 0 < s["output_rel_err_mean"] < 0.5
            assert s["rank_min"] >= 2
            assert ("NOT the paper's protocol" in s["basis_source"]) == (basis == "")
    assert res["flat", ""].stats["rank_max"] - res["flat", ""].stats["rank_min"] <= 1
    assert res["varrate", ""].stats["rank_max"] > res["flat", ""].stats["rank_max"]
    fused = analyze(make("varrate", dict(SMALL, compression=4.0, mode="fused", coef_bits=4)), tr)
    assert fused.cost.resident_frac == pytest.approx(fused.stats["footprint_frac"])
    assert fused.cost.hbm_read_frac == fused.cost.resident_frac < 0.2
    parts = fused.stats["footprint_parts_frac"]  # scales, anchor ids and ranks are metadata
    assert fused.cost.meta_frac == pytest.approx(parts["scales"] + parts["anchor_ids"]
                                                 + parts["ranks"])
    assert set(fused.timings) >= {"prefill_compress_over_dense_attention", "basis_fit_s_per_layer"}
    with pytest.raises(KvsimError, match="cannot hold"):
        analyze(make("varrate", dict(SMALL, compression=20.0)), tr)
    with pytest.raises(KvsimError, match="agnostic"):
        analyze(make("varrate", dict(SMALL, setting="agnostic")), tr)
    agn = analyze(make("varrate", dict(SMALL, setting="agnostic")), _trace(n=400, ctx_q=64))
    assert agn.stats["output_rel_err_mean"] > 0
    assert agn.stats["salience_window"] == "last context rows' queries"
    agn = analyze(make("varrate", dict(SMALL, setting="agnostic")), _trace(n=400, snapkv=True))
    assert "snapkv" in agn.stats["salience_window"]


def test_policy_compress_attend_exact_on_exact_tokens():
    tr = _trace(n=300, dtype=np.float32)
    a = tr.attention
    pol = make("varrate", dict(SMALL, compression=3.0))
    pol.bind(a.rope, a.head_dim)
    la = a.layers[0]
    ctx = a.context_len
    k, v = torch.from_numpy(la.k), torch.from_numpy(la.v)
    st = pol.compress(k[:, :ctx], v[:, :ctx], {}, torch.from_numpy(la.q_question),
                      torch.from_numpy(a.question_pos), torch.Generator(), layer=0)
    ex = st.info["exact"]
    assert torch.equal(st.state.k[:, ex], k[:, :ctx][:, ex])
    out, _ = pol.attend(st.state, torch.from_numpy(la.q_decode), torch.from_numpy(a.decode_pos),
                        k, v)
    assert out.shape == (N_Q, la.q_decode.shape[1], D_H) and torch.isfinite(out).all()


def test_compress_needs_bind_and_a_matching_basis(tmp_path):
    """The model-in-the-loop path (kvsim eval) binds the model's RoPE, then compresses by layer."""
    cal = tmp_path / "cal.npz"
    T.save(_trace(seed=4), cal)
    bpath = tmp_path / "basis.npz"
    calibrate.save(calibrate.calibrate([str(cal)]), bpath)
    tr = _trace(seed=0, dtype=np.float32)
    a, la = tr.attention, tr.attention.layers[1]
    args = (torch.from_numpy(la.k[:, :a.context_len]), torch.from_numpy(la.v[:, :a.context_len]),
            {}, torch.from_numpy(la.q_question), torch.from_numpy(a.question_pos), None)
    opts = dict(SMALL, basis=str(bpath))
    with pytest.raises(KvsimError, match="bind"):
        make("varrate", opts).compress(*args, layer=1)
    pol = make("varrate", opts)
    pol.bind(a.rope, a.head_dim)
    pol.check(tr)
    st = pol.compress(*args, layer=1)
    assert st.state.k.shape == args[0].shape
    with pytest.raises(KvsimError, match="KV heads"):  # a basis for another model's shape
        pol.compress(args[0][:1], args[1][:1], *args[2:], layer=1)
