"""How much a rigorous key sketch would force VerKV to fetch, before building one.

    python scripts/bounded_sketch_probe.py [--eps 0.05] [--length-index 3]

For each kept layer of the shipped capture sets, a sketch gives every context token a logit
estimate s^ and a bound e with |s - s^| <= e for any query. A certificate that plans with the
bounds must treat a token's weight as anywhere in [w^ e^-e, w^ e^e]; the tokens whose interval is
widest are made exact (fetched) until the unresolved mass, sum (w_hi - w_lo), is at most
eps * D_lo. This probe measures that forced fetch, per decode query row and head, at the 8K
length of the `mk` set (the basis is fitted on the `qa` set: other prompts, the same layer and
KV head). It ignores the sample's own variance, so VerKV would fetch at least this much.

Forms near the 2-bit sketch's bytes per token and KV head plus one fp16 (11 bytes at head dim
128, 6.5 at SmolLM2's 64: only ``2bit+dropped`` fits there; the last row prints each form's bytes):

* ``2bit+dropped``: the paper's 2-bit sketch (16 of 32 RoPE pairs, 2 bits, fp16 scale and zero per
  128 tokens) plus the fp16 norm of each key's dropped channels: e = |q_drop| |k_drop| + the
  quantisation error on the kept channels;
* ``rank-r/b`` (r x b <= 64): the key's coefficients on a rank-r PCA basis quantised to b bits
  (min-max per 128
  tokens, fp16 scale and zero), plus the fp16 norm of its residual: e = sum_j |(P^T q)_j| step_j/2
  + |q - P P^T q| |k - P c|.
"""

from __future__ import annotations

import argparse

import numpy as np

from kvsim.captureset import load

GROUP = 128


def quantise(x: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Min-max quantisation of ``x`` (n, c) per group of GROUP tokens and column: (values, step)."""
    n, c = x.shape
    out, step = np.empty_like(x), np.empty_like(x)
    levels = 2 ** bits - 1
    for g in range(0, n, GROUP):
        blk = x[g:g + GROUP]
        lo, hi = blk.min(0), blk.max(0)
        st = np.where(hi > lo, (hi - lo) / levels, 1.0)
        out[g:g + GROUP] = lo + np.round((blk - lo) / st) * st
        step[g:g + GROUP] = np.where(hi > lo, st, 0.0)
    return out, step


def forced_fetch(s_hat: np.ndarray, e: np.ndarray, eps: float) -> float:
    """Share of tokens to make exact so that the unresolved weight mass is <= eps * D_lo."""
    m = s_hat.max()
    w = np.exp(s_hat - m)
    hi, lo = w * np.exp(e), w * np.exp(-e)
    width = hi - lo
    order = np.argsort(-width)
    # fetching token i makes it exact: its width leaves the sum, its lower bound becomes exact
    # (planned with its estimate as the value, the conservative choice here)
    rest = width.sum() - np.cumsum(width[order])
    d_lo = lo.sum() + np.cumsum((w - lo)[order])
    ok = np.flatnonzero(rest <= eps * d_lo)
    k = (ok[0] + 1) if len(ok) else len(w)
    if width.sum() <= eps * lo.sum():
        k = 0
    return k / len(w)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--eps", type=float, default=0.05)
    ap.add_argument("--length-index", type=int, default=3, help="0..3: 1K, 2K, 4K, 8K")
    ap.add_argument("--eval", default="traces/captures/smollm2-mk-1k-8k.npz")
    ap.add_argument("--fit", default="traces/captures/smollm2-qa-1k-8k.npz")
    args = ap.parse_args()
    ev = load(args.eval).view(args.length_index, 0)
    fit = load(args.fit).view(3, 0)
    n = int(ev.attention.context_len)
    forms = [("2bit+dropped", None, None), ("rank-4/16", 4, 16), ("rank-8/8", 8, 8),
             ("rank-16/4", 16, 4), ("rank-32/2", 32, 2)]
    print(f"forced fetch at eps {args.eps} (share of the {n}-token context), mean over decode rows "
          f"and query heads")
    print(f"{'layer':>5} " + " ".join(f"{f[0]:>13}" for f in forms))
    totals = {f[0]: [] for f in forms}
    widths = {f[0]: [] for f in forms}
    for la_e, la_f in zip(ev.attention.layers, fit.attention.layers):
        k = la_e.k[0, :n].astype(np.float64)
        # logits are q.k / sqrt(d) (queries are stored unscaled: kvsim.model.hooks)
        q = la_e.q_decode.reshape(-1, k.shape[1]).astype(np.float64) / np.sqrt(k.shape[1])
        kf = la_f.k[0, : int(fit.attention.context_len)].astype(np.float64)
        d = k.shape[1]
        row = []
        for name, r, bits in forms:
            if r is None:  # 16 pairs of highest key energy (RoPE pairs: j and j + d/2)
                half = d // 2
                energy = (kf[:, :half] ** 2 + kf[:, half:] ** 2).mean(0)
                pairs = np.argsort(-energy)[: d // 4]
                keep = np.zeros(d, bool)
                keep[pairs] = keep[pairs + half] = True
                kq, step = quantise(k[:, keep], 2)
                drop = np.linalg.norm(k[:, ~keep], axis=1)
                s_hat = q[:, keep] @ kq.T
                e = np.abs(q[:, keep]) @ (step / 2).T + np.linalg.norm(q[:, ~keep], axis=1)[
                    :, None] * drop[None]
            else:
                mu = kf.mean(0)
                _, _, vt = np.linalg.svd(kf - mu, full_matrices=False)
                P = vt[:r].T  # (d, r)
                c = (k - mu) @ P
                cq, step = quantise(c, bits)
                res = np.linalg.norm(k - mu - c @ P.T, axis=1)
                qp = q @ P
                s_hat = q @ mu[:, None] + qp @ cq.T
                e = np.abs(qp) @ (step / 2).T + np.linalg.norm(q - qp @ P.T, axis=1)[
                    :, None] * res[None]
            got = float(np.mean([forced_fetch(s_hat[i], e[i], args.eps)
                                 for i in range(q.shape[0])]))
            totals[name].append(got)
            widths[name].append(float(np.median(e)))
            row.append(got)
        print(f"{la_e.layer:>5} " + " ".join(f"{x:>13.1%}" for x in row))
    print(f"{'mean':>5} " + " ".join(f"{np.mean(totals[f[0]]):>13.1%}" for f in forms))
    print(f"{'e50':>5} " + " ".join(f"{np.median(widths[f[0]]):>13.2f}" for f in forms)
          + "   (median logit half-width, nats)")
    c = d // 4  # the 2-bit sketch's kept channels, with an fp16 scale and zero per 128 tokens
    sizes = {"2bit+dropped": c * 2 / 8 + c * 4 / GROUP + 2}
    for name, r, bits in forms[1:]:
        sizes[name] = r * bits / 8 + r * 4 / GROUP + 2
    print(f"{'bytes':>5} " + " ".join(f"{sizes[f[0]]:>13.2f}" for f in forms))


if __name__ == "__main__":
    main()
