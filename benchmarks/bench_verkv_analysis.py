"""VerKV's CPU analysis per layer and KV head, this tree against an earlier commit, side by side in
one run, with a check that both give the same decisions and statistics to the bit.

    python benchmarks/bench_verkv_analysis.py [--base 6e5e1a5] [--contexts 2048,4096,8192]
        [--capture traces/captures/smollm2-niah-1k-8k.npz | none] [--threads 1] [--rounds 2]
        [--eval]

Per context: one synthetic layer of SmolLM2-135M's head shape (9 query heads, 3 KV heads, head
dim 64; kvsim.model.synthetic), compressed by VerKV at 16x with the 2-bit sketch, sink 4, local 4
(not timed), then one question pass of 36 rows and 8 decode steps, float32 (as ``kvsim
policy-profile`` runs policies). Two timings, each per layer and KV head (the layer's time / 3):

* ``analysis``: what VerKV decides per pass (the pass's shortlist, the later tokens' logits, then
  ``decide``: sketch scores, shrinkage, certificate, k* search, GQA union);
* ``attend``: the whole ``VerKV.attend`` of every pass, i.e. the per-layer hook of ``kvsim
  eval`` (``kvsim.model.hooks`` calls it through ``kvsim.measure.traffic.attend``) and of the
  trace harness.

``captured``: the same analysis on real attention, every layer and question a capture set holds
at its longest length (the shipped niah set: SmolLM2's 8 sampled layers, one KV head each, 4
questions at 8,140 context tokens, 38 question rows and 8 decode steps; its SnapKV scores, as
``kvsim policy-profile`` runs it): the mean per layer and KV head, and the range of the per-layer
ratios. Real attention is peakier than the synthetic layer: most question rows fetch thousands of
tokens, past the fetch order's 4,096-token head, and equal gains are common.

Times are CPU seconds of the process (``time.process_time``; one torch thread by default), best
of all repeats: wall-clock time on a loaded machine swings by 2x between runs. The base commit's
``kvsim`` package is unpacked with ``git archive`` into a temporary folder and
each side runs in its own subprocess (rounds alternate old / new; best of all repeats). Each
side also writes what it decided; the parent compares them array by array (``identical``):
bit for bit, whether or not this tree runs VerKV's compiled loops (numba, ``_rows.py``).
``--eval`` also times ``kvsim eval`` with VerKV in every layer of the real model (one 2K needle
prompt; needs the model, see the README) on both sides, and compares their JSON reports.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
SHAPE = {"n_q": 9, "n_kv": 3, "d": 64, "question": 36, "decode": 8}
CAPTURE = ROOT / "traces" / "captures" / "smollm2-niah-1k-8k.npz"  # real attention, to 8K


def worker(contexts: list[int], repeat: int, out: Path, capture: str | None = None) -> None:
    """Runs inside a subprocess whose ``kvsim`` is the side under test."""
    import torch

    times, arrays = {}, {}
    for n in contexts:
        from kvsim.model.synthetic import synthetic_attention_trace

        tr = synthetic_attention_trace(n_layers=1, context=n, seed=0, kvzip=False, **SHAPE)
        a = tr.attention
        timed, kept = _layer(a.layers[0], a, n, {}, 0, repeat, attend=True)
        times.update({f"{what}@{n}": t for what, t in timed.items()})
        arrays.update({f"{n}/{key}": x for key, x in kept.items()})
    if capture:
        from kvsim import captureset

        cs = captureset.load(capture)
        j = len(cs.lengths) - 1  # the longest length
        for i in range(len(cs.lengths[j].asked)):
            a = cs.view(j, i).attention
            n = int(a.question_pos[0])
            for la in a.layers:
                scores = {"snapkv": torch.as_tensor(la.scores["snapkv"][:, :n])}
                timed, kept = _layer(la, a, n, scores, int(la.layer), repeat, attend=False)
                times[f"capture/q{i}/L{la.layer}"] = timed["analysis"]
                arrays.update({f"capture/q{i}/L{la.layer}/{key}": x for key, x in kept.items()})
    np.savez(out, **arrays)
    out.with_suffix(".json").write_text(json.dumps(times))


def _layer(la, a, n: int, scores: dict, layer: int, repeat: int, attend: bool):
    """One layer's VerKV analysis (and whole attend) timed per KV head, with what it decided."""
    import torch

    from kvsim.attention.dense import logits
    from kvsim.policies import make
    from kvsim.policies.verkv import kvfetch as KF

    f32 = lambda x: torch.as_tensor(np.asarray(x, np.float32))  # noqa: E731
    k, v, qq, qd = f32(la.k), f32(la.v), f32(la.q_question), f32(la.q_decode)
    qpos, dpos = torch.as_tensor(a.question_pos), torch.as_tensor(a.decode_pos)
    pol = make("verkv", {"compression": 16, "eps": 0.05, "sink": 4, "local": 4,
                         "scorer": "snapkv"})
    pol.bind(a.rope, a.head_dim)
    state = pol.compress(k[:, :n], v[:, :n], scores, qq, qpos, torch.Generator().manual_seed(0),
                         layer=layer, obs_k=k[:, n:]).state
    cfg = pol.config()
    passes = [(qq, qpos)] + [(qd[:, j:j + 1], dpos[j:j + 1]) for j in range(qd.shape[1])]

    def analysis():  # as VerKV.attend runs it (a pass of this size is one row chunk)
        got = []
        for q, p in passes:
            chunks = [slice(0, q.shape[1])]
            if hasattr(KF, "pass_shortlist_planned"):  # reuses the shortlist's scores
                short, planned = KF.pass_shortlist_planned(q, p, state, cfg, chunks, keep=1)
                more = {"planned": planned[0]} if planned else {}
            else:
                short, more = KF.pass_shortlist(q, p, state, cfg, chunks), {}
            extra = logits(q, k[:, n:], p, torch.arange(n, k.shape[1]))
            got.append(KF.decide(q, p, state, cfg, extra_logits=extra, short=short, **more))
        return got

    def whole():
        return [pol.attend(state, q, p, k, v) for q, p in passes]

    timed = {}
    for name, fn in (("analysis", analysis), ("attend", whole))[:2 if attend else 1]:
        fn()
        timed[name] = min(_seconds(fn) for _ in range(repeat)) / k.shape[0]
    kept = {}  # what it decided (and attend's outputs), for the comparison of the two sides
    for i, dec in enumerate(analysis()):
        for field in ("k_star", "own_exact", "exact_kv", "shortlisted", "eps_before",
                      "eps_after", "denom_est", "shift"):
            kept[f"decide{i}/{field}"] = getattr(dec, field).numpy()
        kept[f"decide{i}/lam"] = dec.lam(state.factors).numpy()
    for i, (o, st, reads) in enumerate(whole() if attend else []):
        kept[f"attend{i}/out"] = o.numpy()
        kept[f"attend{i}/reads_kv"] = reads.kv.numpy()
        kept[f"attend{i}/reads_k"] = reads.k.numpy()
        for name, val in st.items():
            kept[f"attend{i}/{name}"] = val.numpy()
    return timed, kept


def _seconds(fn) -> float:
    """CPU seconds of this process (one thread: what a shared machine's other jobs inflate
    least)."""
    t = time.process_time()
    fn()
    return time.process_time() - t


def base_tree(base: str, where: Path) -> Path:
    """The base commit's ``kvsim`` package under ``where`` (git archive)."""
    tar = where / "base.tar"
    with open(tar, "wb") as fh:
        subprocess.run(["git", "-C", str(ROOT), "archive", base, "kvsim"], stdout=fh, check=True)
    with tarfile.open(tar) as t:
        t.extractall(where / "base", filter="data")
    return where / "base"


def run_side(root: Path, args, out: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS=str(args.threads),
               MKL_NUM_THREADS=str(args.threads))
    code = (f"import sys, torch; torch.set_num_threads({args.threads}); "
            f"sys.path.insert(0, {str(root)!r}); sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); "
            f"import kvsim; assert kvsim.__file__.startswith({str(root)!r}), kvsim.__file__; "
            f"from pathlib import Path; import bench_verkv_analysis as b; "
            f"b.worker({args.contexts!r}, {args.repeat}, Path({str(out)!r}), {args.capture!r})")
    subprocess.run([sys.executable, "-c", code], env=env, check=True, cwd=str(root))
    return json.loads(out.with_suffix(".json").read_text())


def compare(old: Path, new: Path) -> list[str]:
    a, b = np.load(old), np.load(new)
    bad = sorted(set(a.files) ^ set(b.files))
    bad += [k for k in sorted(set(a.files) & set(b.files))
            if a[k].shape != b[k].shape or not np.array_equal(a[k], b[k], equal_nan=True)]
    return bad


def eval_side(root: Path, args, out: Path) -> float:
    env = dict(os.environ, PYTHONPATH=str(root))
    cmd = [sys.executable, "-m", "kvsim.cli", "eval", *args.eval_args.split(), "--json"]
    t = time.perf_counter()
    r = subprocess.run(cmd, env=env, cwd=str(root), capture_output=True, text=True)
    secs = time.perf_counter() - t
    if r.returncode:
        sys.exit(f"kvsim eval failed in {root}: {r.stderr.strip().splitlines()[-1:]}")
    out.write_text(r.stdout)
    return secs


def flat(x, prefix: str = "") -> dict:
    """{dotted key: value} of a JSON document."""
    if isinstance(x, dict):
        return {k2: v for k, v in x.items() for k2, v in flat(v, f"{prefix}{k}.").items()}
    if isinstance(x, list):
        return {k2: v for i, v in enumerate(x) for k2, v in flat(v, f"{prefix}{i}.").items()}
    return {prefix[:-1]: x}


def strip_timings(x):
    if isinstance(x, dict):
        return {k: strip_timings(v) for k, v in x.items()
                if k not in ("timing", "seconds_per_prompt", "seconds_per_forward", "wall_s")}
    if isinstance(x, list):
        return [strip_timings(v) for v in x]
    return x


def analysis(args, old_root: Path, tmp: Path) -> None:
    best: dict[str, dict] = {"old": {}, "new": {}}
    for _ in range(args.rounds):
        for side, root in (("old", old_root), ("new", ROOT)):
            got = run_side(root, args, tmp / f"{side}.npz")
            for key, t in got.items():
                best[side][key] = min(t, best[side].get(key, float("inf")))
    bad = compare(tmp / "old.npz", tmp / "new.npz")
    print(f"VerKV analysis per layer and KV head, {args.base} (old) vs this tree (new); "
          f"SmolLM2 head shape, float32, {args.threads} thread(s), best of "
          f"{args.rounds} x {args.repeat}; load average {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} cores")
    print(f"{'context':>8} {'what':>9} {'old ms':>10} {'new ms':>10} {'ratio':>7}")
    for n in args.contexts:
        for what in ("analysis", "attend"):
            o, w = best["old"][f"{what}@{n}"], best["new"][f"{what}@{n}"]
            print(f"{n:>8} {what:>9} {o * 1e3:10.1f} {w * 1e3:10.1f} {o / w:6.1f}x")
    layers = sorted(k for k in best["new"] if k.startswith("capture/"))
    if layers:  # the mean per layer and KV head, and the spread of the per-layer ratios
        o, w = (np.mean([best[side][k] for k in layers]) for side in ("old", "new"))
        ratios = [best["old"][k] / best["new"][k] for k in layers]
        print(f"{'captured':>8} {'analysis':>9} {o * 1e3:10.1f} {w * 1e3:10.1f} {o / w:6.1f}x"
              f"   ({len(layers)} layers x questions of {Path(args.capture).name} at its longest "
              f"length; per layer {min(ratios):.1f}x-{max(ratios):.1f}x)")
    print(f"identical decisions, outputs and statistics: {not bad}"
          + (f" (differ: {', '.join(bad[:8])})" if bad else ""))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="6e5e1a5", help="the commit to compare with")
    ap.add_argument("--contexts", default="2048,4096,8192", help="none: only --eval")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2, help="old / new subprocess pairs")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads per side")
    ap.add_argument("--capture", default=str(CAPTURE) if CAPTURE.exists() else "none",
                    help="a capture set (kvsim capture --lengths) whose every captured layer "
                         "and question at its longest length is also timed (none: skip; "
                         f"default {CAPTURE.relative_to(ROOT)})")
    ap.add_argument("--eval", action="store_true", help="also time kvsim eval on both sides")
    ap.add_argument("--eval-args", default="--task niah --context 2048 --n 1 --policy verkv "
                    "--sink 4 --local 4 --max-new-tokens 4 --threads 1 --no-progress")
    args = ap.parse_args()
    args.contexts = [int(c) for c in args.contexts.split(",") if c.strip() not in ("", "none")]
    args.capture = None if args.capture == "none" else str(Path(args.capture).resolve())
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        old_root = base_tree(args.base, tmp)
        if args.contexts or args.capture:
            analysis(args, old_root, tmp)
        if args.eval:
            t_old = eval_side(old_root, args, tmp / "eval-old.json")
            t_new = eval_side(ROOT, args, tmp / "eval-new.json")
            r_old = json.loads((tmp / "eval-old.json").read_text())
            r_new = json.loads((tmp / "eval-new.json").read_text())
            # one policy: its figures are at the top level of the report
            p_old = r_old.get("results", [r_old])[0]["seconds_per_prompt"]
            p_new = r_new.get("results", [r_new])[0]["seconds_per_prompt"]
            a, b = flat(strip_timings(r_old)), flat(strip_timings(r_new))
            differ = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
            print(f"kvsim eval {args.eval_args}: VerKV's generation (its attend in every layer) "
                  f"{p_old:.1f} s old, {p_new:.1f} s new per prompt, ratio {p_old / p_new:.1f}x "
                  f"(wall clock; whole command {t_old:.0f} s / {t_new:.0f} s with model load); "
                  f"same report apart from timings: {not differ}"
                  + "".join(f"\n  {k}: {a.get(k)!r} -> {b.get(k)!r}" for k in differ[:10]))


if __name__ == "__main__":
    main()
