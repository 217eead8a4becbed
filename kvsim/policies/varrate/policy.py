"""VarRate (salience-allocated variable-rank low-rank KV codec) and its uniform-rank ablation.

Both keep every context token in HBM: anchors and the recent window exactly, the rest as a residual
to nearby anchors coded on a per-layer basis (``kvsim.policies.varrate.codec``). ``varrate`` gives
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

from kvsim._torch import torch
from kvsim.attention.dense import dense_attention
from kvsim.attention.rope import rope_from_meta
from kvsim.contract import DecodeCost, PrefillWork
from kvsim.errors import KvsimError
from kvsim.policies import options as O
from kvsim.policies.base import Compressed, MaskPolicy
from kvsim.policies.registry import register
from kvsim.policies.varrate import codec as vc

SELF_BASIS = ("basis fit on the evaluated context itself (in-sample, optimistic; NOT the paper's "
              "protocol, which calibrates on other contexts: pass --basis FILE from `kvsim "
              "calibrate`)")
META_PARTS = ("scales", "anchor_ids", "ranks")  # stored bytes: neither tokens nor coefficients


@dataclass
class VarRateParams:
    compression: float = O.compression_field(5.0)  # kappa = 1/compression, in coefficients
    coef_bits: int = field(default=16, metadata={
        "help": "bits per kept coefficient (16 = fp16: the bytes fill the --compression budget; "
                "8/4/3 = group quantization with fp16 scale and zero per group: the same "
                "coefficients in fewer bytes)", "choices": list(vc.BITS)})
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
        for name in ("group_size", "stride", "anchors_c", "obs_window"):
            if getattr(self, name) < 1:
                raise KvsimError(f"--{name.replace('_', '-')} must be >= 1")
        if self.r_min < 0 or self.rank_cap < 0 or self.window < 0:
            raise KvsimError("--r-min, --rank-cap and --window must be >= 0")
        if self.rank_cap and self.r_min > self.rank_cap:
            raise KvsimError(f"--r-min {self.r_min} exceeds --rank-cap {self.rank_cap}")


@dataclass
class Coded:
    k: torch.Tensor  # (G, n_ctx, d) reconstructed post-RoPE keys
    v: torch.Tensor


@register
class VarRate(MaskPolicy):
    name = "varrate"
    Params = VarRateParams
    needs_attention = True
    times_compress = True
    summary = ("every token kept in HBM: anchors + recent window exact, the rest coded at a "
               "per-token rank water-filled from SnapKV salience on a per-layer basis")
    flat = False

    def __init__(self, params):
        super().__init__(params)
        self._basis = None  # calibrate.Basis
        self._rope = None  # kvsim.attention.rope.Rope

    @property
    def observation(self) -> str:
        return "question" if self.params.setting == "aware" else "context"

    def bind(self, rope: dict, head_dim: int) -> None:
        """The model's RoPE (to un-rotate keys); loads the basis file once."""
        super().bind(rope, head_dim)
        self._rope = rope_from_meta(rope, head_dim)
        if self.params.basis and self._basis is None:
            from kvsim.policies.varrate import calibrate
            self._basis = calibrate.load(self.params.basis)

    def check(self, trace) -> None:
        """The basis file must match the trace's layers, shapes and RoPE."""
        if self._basis is not None:
            self._basis.check(trace, self._rope)
        if self.params.mode == "reconstruct":
            self.notes.add(f"{self.name} in decode mode reconstruct rebuilds the full cache "
                           f"after prefill: the serving figures are dense-resident's (its error "
                           f"is VarRate's); --mode fused plans with the compressed footprint")

    def _layer_basis(self, layer: int, prep: vc.Prepared) -> torch.Tensor:
        if self._basis is None:
            return vc.fit_basis(prep.resid, prep.resid.shape[1])[0].float()
        if layer not in self._basis.layers:
            raise KvsimError(f"{self._basis.path}: no basis for layer {layer}")
        return self._basis.layers[layer]

    def _salience(self, scores, obs_q, obs_pos, k):
        """(the salience function of the coded set, what the window was)."""
        w = self.params.obs_window
        if self.flat:
            return (lambda prep: torch.ones(prep.coded.numel())), "none (flat)"
        if obs_q.shape[1]:
            q, pos = obs_q[:, -w:], obs_pos[-w:].to(torch.long)
            where = (f"last {w} question rows" if self.observation == "question"
                     else "last context rows' queries")
            return (lambda prep: vc.minmax(vc.snapkv_salience(q, pos, k)[prep.coded])), where
        if self.observation == "question":
            raise KvsimError("the trace has no question queries for the query-aware window")
        if "snapkv" in scores:  # kvsim capture: window = the last context rows, per KV head
            s = scores["snapkv"].double().mean(0)
            return (lambda prep: vc.minmax(s[prep.coded])), (
                "the trace's 'snapkv' scores (capture window: the last context rows), mean over "
                "KV heads")
        raise KvsimError("--setting agnostic needs queries of the last context tokens (rows at "
                         "positions < context_len) or the 'snapkv' scores of kvsim capture; "
                         "this trace holds neither")

    def compress(self, k, v, scores, obs_q, obs_pos, generator, layer, obs_k=None):
        if self._rope is None:
            raise KvsimError(f"{self.name}: bind(rope, head_dim) must come before compress")
        if self._basis is not None:
            meta = self._basis.meta
            if k.shape[-1] != meta["head_dim"] or 2 * k.shape[0] * k.shape[-1] != meta["D"]:
                raise KvsimError(f"{self._basis.path}: basis is for {meta['n_kv_heads']} KV heads "
                                 f"x head dim {meta['head_dim']}, the model has {k.shape[0]} x "
                                 f"{k.shape[-1]}")
        p = self.params
        kf, vf = k.float(), v.float()
        salience, window = self._salience(scores, obs_q, obs_pos, kf)
        prep = vc.prepare(kf, vf, self._rope, p.stride, p.anchors_c, p.window)
        t0 = time.perf_counter()
        basis = self._layer_basis(layer, prep)
        t_fit = time.perf_counter() - t0 if self._basis is None else 0.0
        code, info = vc.encode(k, v, basis, self._rope, 1.0 / p.compression, salience, p.r_min,
                               p.rank_cap or basis.shape[1] // 2, p.stride, p.anchors_c,
                               p.window, p.coef_bits, p.group_size, prep, p.quant_axis)
        k_hat, v_hat = vc.decode(code, basis, self._rope)
        t0 = time.perf_counter()
        coded = prep.coded
        parts = code.nbytes()
        n_kv = k.shape[0]
        stored = sum(b for part, b in parts.items() if part != "full")
        held = parts["full"] if p.mode == "reconstruct" else stored
        meta = 0.0 if p.mode == "reconstruct" else sum(parts[x] for x in META_PARTS)
        facts = {"parts": parts, "ranks": info["ranks"], "budget": info["budget"],
                 "budget_unspent": info["budget_unspent"], "n_exact": info["n_exact"],
                 "n_coded": info["n_coded"], "basis_rows": basis.shape[0], "window": window,
                 "D": 2 * n_kv * k.shape[-1],
                 "key_rel_err": _rel(k_hat[:, coded], kf[:, coded]),
                 "value_rel_err": _rel(v_hat[:, coded], vf[:, coded]),
                 "exact": prep.exact, "seconds_basis_fit": t_fit}
        # calibration and statistics are not the per-sequence compress the harness times
        facts["seconds_excluded"] = t_fit + time.perf_counter() - t0
        return Compressed(Coded(k_hat, v_hat), float(k.shape[1]), held / n_kv, meta / n_kv,
                          facts)

    def attend(self, state, q, q_pos, k, v):
        n = state.k.shape[1]
        kk = torch.cat([state.k.to(k.dtype), k[:, n:]], dim=1)
        vv = torch.cat([state.v.to(v.dtype), v[:, n:]], dim=1)
        out, _ = dense_attention(q, kk, vv, q_pos)
        # nothing comes from host memory: every token is in the code (coded or exact)
        return out, {}

    def summarize(self, infos: list[dict]) -> dict:
        p = self.params
        parts: dict[str, int] = {}
        for i in infos:
            for key, val in i["parts"].items():
                parts[key] = parts.get(key, 0) + val
        full = parts.pop("full")
        first, last = infos[0], infos[-1]
        ranks = torch.cat([i["ranks"] for i in infos]).double()
        n_ctx, dim = first["n_exact"] + first["n_coded"], first["D"]
        cap = min(p.rank_cap or dim // 2, first["basis_rows"])
        mean = lambda key: sum(i[key] for i in infos) / len(infos)  # noqa: E731
        return {
            "footprint_frac": sum(parts.values()) / full,
            "footprint_parts_frac": {k_: v_ / full for k_, v_ in parts.items()},
            "kappa": 1.0 / p.compression,
            "budget_coefficients_per_layer": first["budget"],
            "budget_unspent_coefficients_per_layer": first["budget_unspent"],  # cap binds all
            "exact_tokens_frac": first["n_exact"] / n_ctx,
            "coded_tokens": first["n_coded"],
            "D": dim, "rank_cap": cap, "rank_mean": float(ranks.mean()),
            "rank_min": int(ranks.min()), "rank_max": int(ranks.max()),
            "frac_at_floor": float((ranks <= p.r_min).double().mean()),
            "frac_at_cap": float((ranks >= cap).double().mean()),
            "coded_key_rel_err": mean("key_rel_err"),
            "coded_value_rel_err": mean("value_rel_err"),
            "setting": "n/a (flat ignores salience)" if self.flat else p.setting,
            "salience_window": last["window"],
            "basis_source": self._basis.path if self._basis is not None else SELF_BASIS,
            "basis_codec_settings": None if self._basis is None else
            self._basis.meta.get("codec"),
            # model-side, not charged: the rank_cap rows kept resident, 16-bit
            "basis_bytes": len(infos) * cap * dim * vc.CACHE_BYTES,
            "basis_over_one_sequence_cache": cap / n_ctx,
            "decode_mode": p.mode + ("" if p.mode == "reconstruct" else
                                     " (a fused kernel is assumed, not measured: HBM follows the "
                                     "footprint)"),
        }

    def prefill_work(self, model):
        """Counted from the codec, per layer and context token, D = 2 x KV heads x head dim:
        salience (the window's queries against every key, 2 d FLOPs per pair and query head),
        the nearest-anchor search (every token against every anchor: 2 D / stride FLOPs per
        token squared), the projection on R = rank cap basis rows (2 D R) and the rebuilt cache
        in reconstruct mode (2 R D more); the joint K/V is read once."""
        p, m = self.params, model
        dim = 2 * m.kv_heads * m.head_dim
        rank = p.rank_cap or dim // 2
        window = 0.0 if self.flat else 2.0 * p.obs_window * m.head_dim * m.q_heads
        per_token = window + 2.0 * dim * rank * (2 if p.mode == "reconstruct" else 1)
        return PrefillWork(m.layers * per_token, m.layers * 2.0 * dim / p.stride,
                           m.kv_bytes_per_token,
                           f"modelled: salience, anchor search, projection on {rank} rows"
                           + (" and reconstruction" if p.mode == "reconstruct" else "")
                           + "; the measured CPU ratio to dense prefill attention is in "
                             "policy_timings")

    def provenance(self, stats: dict) -> str:
        return (f"footprint measured from the stored bytes; basis: {stats['basis_source']}; "
                f"decode mode {stats['decode_mode']}")

    def decode_cost(self, stats, model):
        """Shares of the stored bytes, as measured: the codec's basis is calibrated for one
        model (``check`` refuses another head shape on a trace), so nothing is restated."""
        if self.params.mode == "reconstruct":  # a full cache is rebuilt: no HBM saving
            return DecodeCost(resident_frac=1.0, hbm_read_frac=1.0, host_read_frac=0.0,
                              host_frac=0.0, overlap=False)
        f = min(1.0, stats["footprint_frac"])
        return DecodeCost(resident_frac=f, hbm_read_frac=f, host_read_frac=0.0, host_frac=0.0,
                          overlap=False, meta_frac=min(f, stats["meta_frac"]))


@register
class Flat(VarRate):
    name = "flat"
    summary = ("VarRate's uniform-rank ablation: the same exact set, anchors, basis and budget, "
               "every coded token at rank B/|C|")
    flat = True


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))
