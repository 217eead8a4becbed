"""VarRate (salience-allocated variable-rank low-rank KV codec) and its uniform-rank ablation.

Both keep every context token in HBM: anchors and the recent window exactly, the rest as a residual
to nearby anchors coded on a per-layer basis (``kvsim.kernels.varrate_codec``). ``varrate`` gives
each coded token a rank water-filled from SnapKV salience; ``flat`` gives all of them the same rank
(B / |C|, largest-remainder rounded) at the same budget. Nothing lives in host memory.

Decode modes: ``reconstruct`` rebuilds a full-size cache after prefill (the paper's harness: no HBM
saving at decode, no speed-up); ``fused`` assumes an attention kernel that reads coefficients and
basis directly, so HBM holds and reads the measured footprint (not measured here: no such kernel).

Basis: ``--basis FILE`` (from ``kvsim calibrate`` on other contexts: the paper's protocol). Without
it the basis is fit on the very context being coded -- an in-sample, optimistic basis that is *not*
the paper's protocol; stats and provenance say so.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from kvsim.errors import KvsimError
from kvsim.kernels import varrate_codec as vc
from kvsim.kernels.attention import dense_attention, expand_kv
from kvsim.policies.base import DecodeCost, Policy, register
from kvsim.trace import Trace

TIMING_LAYERS, TIMING_REPEATS = 4, 5  # prefill timing: layers spread over the trace, min of runs
SELF_BASIS = ("basis fit on the evaluated context itself (in-sample, optimistic; NOT the paper's "
              "protocol, which calibrates on other contexts: pass --basis FILE from `kvsim "
              "calibrate`)")


@dataclass
class VarRateParams:
    compression: float = field(default=5.0, metadata={
        "help": "budget as 1/compression of the full cache (varrate/flat: kappa at 16-bit "
                "coefficients, default 5 = 20%%; lower --coef-bits shrinks it further)"})
    coef_bits: int = field(default=16, metadata={
        "help": "bits per kept coefficient (16 = fp16; 8/4/3 = group quantization with fp16 "
                "scale and zero per group)", "choices": list(vc.BITS)})
    group_size: int = field(default=32, metadata={
        "help": "coefficients per quantization group (consecutive coefficients of one token)"})
    quant_axis: str = field(default="channel", metadata={
        "help": "quantization groups: 'channel' = one coefficient index over consecutive coded "
                "tokens; 'token' = consecutive coefficients of one token",
        "choices": ["channel", "token"]})
    basis: str = field(default="", metadata={
        "help": "basis file from `kvsim calibrate`; empty: fit on the evaluated context itself "
                "(optimistic, not the paper's protocol; reported)"})
    setting: str = field(default="aware", metadata={
        "help": "salience window in replay: 'aware' = the last question rows' queries; "
                "'agnostic' = the last context rows (compress before the question is known; "
                "kvsim eval always compresses after the context prefill, i.e. agnostic)",
        "choices": ["aware", "agnostic"]})
    mode: str = field(default="reconstruct", metadata={
        "help": "decode: 'reconstruct' rebuilds a full cache (no HBM saving); 'fused' reads "
                "coefficients and basis (HBM follows the footprint)",
        "choices": ["reconstruct", "fused"]})
    r_min: int = field(default=16, metadata={"help": "rank floor of a coded token"})
    rank_cap: int = field(default=0, metadata={
        "help": "rank cap R (basis rows used); 0 = D/2 (the paper's R=1024 for D=2048)"})
    stride: int = field(default=16, metadata={"help": "anchor stride (anchors are exact)"})
    anchors_c: int = field(default=4, metadata={"help": "nearest anchors averaged per token"})
    window: int = field(default=64, metadata={"help": "recent tokens kept exact (w)"})
    obs_window: int = field(default=64, metadata={
        "help": "salience observation window: last queries used (w_obs)"})

    def validate(self) -> None:
        if not self.compression > 1.0:
            raise KvsimError(f"--compression {self.compression} must be > 1")
        if self.coef_bits not in vc.BITS:
            raise KvsimError(f"--coef-bits {self.coef_bits} not in {vc.BITS}")
        for name in ("group_size", "stride", "anchors_c", "obs_window"):
            if getattr(self, name) < 1:
                raise KvsimError(f"--{name.replace('_', '-')} must be >= 1")
        if self.r_min < 0 or self.rank_cap < 0 or self.window < 0:
            raise KvsimError("--r-min, --rank-cap and --window must be >= 0")
        if self.rank_cap and self.r_min > self.rank_cap:
            raise KvsimError(f"--r-min {self.r_min} exceeds --rank-cap {self.rank_cap}")
        if self.quant_axis not in ("channel", "token"):
            raise KvsimError("--quant-axis is channel|token")
        if self.setting not in ("aware", "agnostic") or self.mode not in ("reconstruct", "fused"):
            raise KvsimError("--setting is aware|agnostic and --mode reconstruct|fused")


@dataclass
class _State:
    k: torch.Tensor  # (G, n_ctx, d) reconstructed post-RoPE keys
    v: torch.Tensor
    code: vc.Code
    info: dict


@register
class VarRate(Policy):
    name = "varrate"
    Params = VarRateParams
    needs_attention = True
    summary = ("every token kept in HBM: anchors + recent window exact, the rest coded at a "
               "per-token rank water-filled from SnapKV salience on a per-layer basis")
    flat = False

    def __init__(self, params):
        super().__init__(params)
        self._basis = None  # calibrate.Basis
        self._rope: vc.Rope | None = None
        self._rope_meta: dict | None = None
        self._override = None  # analyze(): the salience window of the chosen setting
        self._last_state = None

    # ------------------------------------------------------------------------- set-up
    def bind(self, rope: dict, head_dim: int) -> None:
        """The model's RoPE (to un-rotate keys); loads the basis file once."""
        super().bind(rope, head_dim)
        self._rope = vc.rope_from_meta(rope, head_dim)
        self._rope_meta = rope
        if self.params.basis and self._basis is None:
            from kvsim import calibrate
            self._basis = calibrate.load(self.params.basis)

    def check_basis(self, trace: Trace) -> None:
        """The basis file must match the trace's layers, shapes and RoPE."""
        if self._basis is not None:
            self._basis.check(trace, self._rope)

    def _layer_basis(self, layer: int, prep: vc.Prepared) -> torch.Tensor:
        if self._basis is None:
            return vc.fit_basis(prep.resid, prep.resid.shape[1])[0].float()
        if layer not in self._basis.layers:
            raise KvsimError(f"{self._basis.path}: no basis for layer {layer}")
        return self._basis.layers[layer]

    def _salience(self, obs_q, obs_pos, k):
        if self.flat:
            return lambda prep: torch.ones(prep.coded.numel())
        if self._override is not None:  # analyze() chose the window for the setting
            if self._override[0] == "scores":
                s = self._override[1]
                return lambda prep: vc.minmax(s[prep.coded])
            obs_q, obs_pos = self._override[1], self._override[2]
        if obs_q.shape[1] == 0:
            raise KvsimError("varrate needs observation-window queries for its salience")
        return lambda prep: vc.minmax(vc.snapkv_salience(obs_q, obs_pos.to(torch.long), k)[
            prep.coded])

    # ---------------------------------------------------------------------- attention path
    def compress(self, k, v, scores, obs_q, obs_pos, generator, layer):
        if self._rope is None:
            raise KvsimError(f"{self.name}: bind(rope, head_dim) must come before compress")
        if self._basis is not None:
            if k.shape[-1] != self._basis.meta["head_dim"] or \
                    2 * k.shape[0] * k.shape[-1] != self._basis.meta["D"]:
                meta = self._basis.meta
                raise KvsimError(f"{self._basis.path}: basis is for {meta['n_kv_heads']} KV heads "
                                 f"x head dim {meta['head_dim']}, the model has {k.shape[0]} x "
                                 f"{k.shape[-1]}")
        p = self.params
        kf, vf = k.float(), v.float()
        t0 = time.perf_counter()
        prep = vc.prepare(kf, vf, self._rope, p.stride, p.anchors_c, p.window)
        t_prep = time.perf_counter() - t0
        t_fit = 0.0
        if self._basis is None:  # calibration, not a per-sequence cost: timed apart
            t1 = time.perf_counter()
            basis = self._layer_basis(layer, prep)
            t_fit = time.perf_counter() - t1
        else:
            basis = self._layer_basis(layer, prep)
        t1 = time.perf_counter()
        dim = basis.shape[1]
        cap = p.rank_cap or dim // 2
        code, info = vc.encode(k, v, basis, self._rope, 1.0 / p.compression,
                               self._salience(obs_q, obs_pos, kf), p.r_min, cap, p.stride,
                               p.anchors_c, p.window, p.coef_bits, p.group_size, prep,
                               p.quant_axis)
        k_hat, v_hat = vc.decode(code, basis, self._rope)
        info["seconds_compress"] = t_prep + time.perf_counter() - t1
        info["seconds_basis_fit"] = t_fit
        info["basis_rows"] = basis.shape[0]
        info["prep"] = prep
        self._last_state = _State(k_hat, v_hat, code, info)
        return self._last_state

    def attend(self, state, q, q_pos, k, v):
        n = state.k.shape[1]
        kk = torch.cat([state.k.to(k.dtype), k[:, n:]], dim=1)
        vv = torch.cat([state.v.to(v.dtype), v[:, n:]], dim=1)
        out, _ = dense_attention(q, kk, vv, q_pos)
        # nothing comes from host memory: every token is resident (coded or exact)
        return out, {"kv_read_frac": torch.zeros(q.shape[:2], dtype=torch.float64)}

    # ---------------------------------------------------------------------------- analysis
    def _window(self, trace: Trace, la):
        """Salience input for ``la`` in the chosen setting: ("queries", q, pos) or
        ("scores", s) with s (n_ctx,) already smoothed."""
        a = trace.attention
        w = self.params.obs_window
        ctx = a.context_len
        if self.params.setting == "aware":
            if la.q_question.shape[1] == 0:
                raise KvsimError("the trace has no question queries for the query-aware window")
            return ("queries", torch.from_numpy(la.q_question[:, -w:]).float(),
                    torch.from_numpy(a.question_pos[-w:]).long())
        # agnostic: queries of the last context rows if the trace holds any, else the trace's
        # "snapkv" scores (kvsim capture: window = the last context rows, smoothed, per KV head)
        rows = [(la.q_question, a.question_pos), (la.q_decode, a.decode_pos)]
        qs = [(torch.from_numpy(q[:, pos < ctx]).float(), torch.from_numpy(pos[pos < ctx]).long())
              for q, pos in rows]
        pos = torch.cat([x[1] for x in qs])
        if pos.numel():
            q = torch.cat([x[0] for x in qs], dim=1)
            order = torch.argsort(pos)[-w:]
            return ("queries", q[:, order], pos[order])
        if "snapkv" in la.scores:
            return ("scores", torch.from_numpy(la.scores["snapkv"][:, :ctx]).double().mean(0))
        raise KvsimError("--setting agnostic needs queries of the last context tokens (rows at "
                         "positions < context_len) or the 'snapkv' scores of kvsim capture; "
                         "this trace holds neither")

    @staticmethod
    def _timing_window(sal, la, a):
        if sal[0] == "queries":
            return sal[1], sal[2]
        return (torch.from_numpy(la.q_question).float(),  # unused: the override gives scores
                torch.from_numpy(a.question_pos).long())

    def analyze(self, trace: Trace | None, seed: int = 0):
        from kvsim.policies import _measure as M
        from kvsim.trace import Attention
        M.require_attention(trace, self.name)
        a = trace.attention
        p = self.params
        self.bind(a.rope, a.head_dim)
        self.check_basis(trace)
        ctx = a.context_len
        parts: dict[str, int] = {}
        k_err, v_err, t_comp, t_dense, t_fit, ranks_all, runs = [], [], [], [], [], [], []
        window_kind = None
        info0 = None
        ids = [la.layer for la in a.layers]
        timed = {ids[i] for i in np.linspace(0, len(ids) - 1, min(TIMING_LAYERS, len(ids)))
                 .round().astype(int)}
        try:
            for la in a.layers:
                sal = self._window(trace, la)
                window_kind = sal[0]
                self._override = sal
                sub = Trace(trace.meta, None, Attention([la], ctx, a.question_pos, a.decode_pos,
                                                        a.rope, a.provenance))
                runs.append(M.measure(self, sub, seed))  # compress + attend vs float64 dense
                st = self._last_state
                info0 = info0 or st.info
                for key, val in st.code.nbytes().items():
                    parts[key] = parts.get(key, 0) + val
                ranks_all.append(st.info["ranks"])
                t_fit.append(st.info["seconds_basis_fit"])
                k = torch.from_numpy(la.k[:, :ctx]).float()
                v = torch.from_numpy(la.v[:, :ctx]).float()
                if la.layer in timed:  # compress and dense prefill attention, interleaved
                    obs = self._timing_window(sal, la, a)
                    tc, td = [], []
                    for _ in range(TIMING_REPEATS):
                        tc.append(self.compress(k, v, {}, *obs, None, layer=la.layer)
                                  .info["seconds_compress"])
                        td.append(_time_prefill_attention(k, a.n_q_heads, repeats=1))
                    t_comp.append(min(tc))
                    t_dense.append(min(td))
                coded = st.info["prep"].coded
                k_err.append(_rel(st.k[:, coded], k[:, coded]))
                v_err.append(_rel(st.v[:, coded], v[:, coded]))
                self._last_state = None
        finally:
            self._override = None
        full = parts.pop("full")
        footprint = sum(parts.values()) / full
        ranks = torch.cat(ranks_all).double()
        dim = 2 * a.n_kv_heads * a.head_dim
        cap = min(p.rank_cap or dim // 2, info0["basis_rows"])
        n_layers = len(a.layers)
        sec_comp = float(np.median(t_comp)) / (ctx / 1000)
        sec_dense = float(np.median(t_dense)) / (ctx / 1000)
        basis_src = self._basis.path if self._basis is not None else SELF_BASIS
        stats = _merge_runs(runs)
        stats.update({
            "footprint_frac": footprint,
            "footprint_parts_frac": {k_: v_ / full for k_, v_ in parts.items()},
            "kappa": 1.0 / p.compression,
            "budget_coefficients_per_layer": info0["budget"],
            "budget_unspent_coefficients_per_layer": info0["budget_unspent"],  # cap binds all
            "exact_tokens_frac": info0["n_exact"] / ctx,
            "coded_tokens": info0["n_coded"],
            "D": dim, "rank_cap": cap, "rank_mean": float(ranks.mean()),
            "rank_min": int(ranks.min()), "rank_max": int(ranks.max()),
            "frac_at_floor": float((ranks <= p.r_min).double().mean()),
            "frac_at_cap": float((ranks >= cap).double().mean()),
            "coded_key_rel_err": float(np.mean(k_err)),
            "coded_value_rel_err": float(np.mean(v_err)),
            "kv_read_frac": 0.0,
            "setting": "n/a (flat ignores salience)" if self.flat else p.setting,
            "salience_window": "none (flat)" if self.flat else
            (f"last {p.obs_window} question rows" if p.setting == "aware" else
             "last context rows' queries" if window_kind == "queries" else
             "the trace's 'snapkv' scores (capture window: the last context rows), mean over "
             "KV heads"),
            "basis_source": basis_src,
            "basis_codec_settings": None if self._basis is None else
            self._basis.meta.get("codec"),
            # model-side, not charged: the rank_cap rows kept resident, 16-bit
            "basis_bytes": n_layers * cap * dim * vc.CACHE_BYTES,
            "basis_over_one_sequence_cache": cap / ctx,
            "prefill_compress_s_per_1k_tokens_per_layer": sec_comp,
            "prefill_dense_attention_s_per_1k_tokens_per_layer": sec_dense,
            "prefill_compress_over_dense_attention": sec_comp / sec_dense if sec_dense else None,
            "prefill_timing_note": "CPU, this machine; the paper's +44% is over the whole "
                                   "prefill (MLPs included) on a GPU, this is over attention only",
            "basis_fit_s_per_layer": float(np.mean(t_fit)),
        })
        if p.mode == "reconstruct":
            cost = DecodeCost(resident_frac=1.0, hbm_read_frac=1.0, host_read_frac=0.0,
                              host_frac=0.0, overlap=False)
        else:
            f = min(1.0, footprint)
            cost = DecodeCost(resident_frac=f, hbm_read_frac=f, host_read_frac=0.0,
                              host_frac=0.0, overlap=False)
        prov = (M.provenance(trace, self.name, seed) + f"; footprint measured from the stored "
                f"bytes; basis: {basis_src}; prefill timings on this machine (CPU torch, "
                f"{torch.get_num_threads()} threads; compress (salience, anchors, projection, "
                f"quantization, reconstruction) vs one layer's SDPA causal attention, best of "
                f"{TIMING_REPEATS} interleaved runs on {len(timed)} layer(s)); decode mode {p.mode}"
                + ("" if p.mode == "reconstruct" else
                   " (a fused kernel is assumed, not measured: HBM follows the footprint)"))
        return self.result(cost, stats, prov)


def _merge_runs(runs: list[dict]) -> dict:
    """Per-layer :func:`measure` results -> one: maxima of ``*_max``, sums of ``decisions``,
    decision-weighted means of the rest (every layer has the same decisions)."""
    out: dict = {}
    w = [r.get("decisions", 1) for r in runs]
    for key in runs[0]:
        vals = [r.get(key) for r in runs]
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in vals):
            out[key] = vals[0]
        elif key.endswith("_max"):
            out[key] = max(vals)
        elif key in ("decisions",):
            out[key] = sum(vals)
        elif key in ("context_tokens",):
            out[key] = vals[0]
        elif key == "layers":
            out[key] = len(runs)
        else:
            out[key] = sum(x * wi for x, wi in zip(vals, w)) / sum(w)
    return out


@register
class Flat(VarRate):
    name = "flat"
    summary = ("VarRate's uniform-rank ablation: the same exact set, anchors, basis and budget, "
               "every coded token at rank B/|C|")
    flat = True


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def _time_prefill_attention(k: torch.Tensor, n_q: int, repeats: int = 3) -> float:
    """Seconds of one layer's causal prefill attention over the context on this machine (SDPA;
    the keys stand in for the queries, whose values do not change the time)."""
    kq = expand_kv(k, n_q)[None]
    vq = kq.clone()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        F.scaled_dot_product_attention(kq, kq, vq, is_causal=True)
        best = min(best, time.perf_counter() - t0)
    return best
