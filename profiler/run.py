"""``kvsim profile``: measure one device for one model shape; write a trace's hardware section."""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from kvsim import trace as tracefile
from kvsim.errors import KvsimError
from kvsim.hw import catalog
from kvsim.hw.catalog import ModelSpec
from kvsim.hw.fit import fit_alpha_beta
from kvsim.io import check_destination
from kvsim.trace import DECIDE_TABLE, decide_tables
from profiler import kernels, link
from profiler.backend import Backend, make_backend
from profiler.identity import device_identity
from profiler.link import GiB, KiB, MiB, sizes
from profiler.nvml import Nvml, Sampler

# tables every profile must hold; each decide kernel handed in adds its kernel_decide_<policy>,
# at the contexts its policy's budget fits
CONSUMED = ("link_h2d_pinned", "link_d2h_pinned", "link_gather_gpu", "kernel_decode_attn",
            "kernel_gemm")


@dataclass(frozen=True)
class Plan:
    """The sweep grid: what sizes, contexts and batches to measure."""
    link_sizes: list
    bidir_sizes: list
    gather_totals: list
    gather_pool: int
    contexts: list
    batches: list
    max_tokens: int
    gemm_batches: list
    head_batches: list
    mem_sizes: list
    mm_sizes: list
    decide_contexts: list = ()
    decide_batches: list = (1,)  # requests decided together in one call (stacked heads)

    def points(self, decide_kernels: int) -> int:
        attn = sum(1 for n in self.contexts for b in self.batches if n * b <= self.max_tokens)
        gathers = len(self.gather_totals) * (len(link.ROW_SIZES) + 1)
        return (4 * len(self.link_sizes) + len(self.bidir_sizes) + 5 + gathers + attn
                + len(self.gemm_batches) + len(self.head_batches) + len(self.mem_sizes)
                + len(self.mm_sizes)
                + decide_kernels * len(self.decide_contexts) * len(self.decide_batches))


def plan_for(kind: str, quick: bool) -> Plan:
    p2 = lambda lo, hi: sizes(lo, hi, 2)  # noqa: E731
    p4 = lambda lo, hi: sizes(lo, hi, 4)  # noqa: E731
    if kind == "cuda":
        if quick:
            return Plan(p4(4 * KiB, 256 * MiB), p4(64 * KiB, 256 * MiB), p4(64 * KiB, 16 * MiB),
                        256 * MiB, p2(1024, 32768), [1, 2, 4, 8, 16], 1 << 20,
                        p2(1, 64), [1, 8, 64], p4(64 * MiB, 1 * GiB), [4096, 8192], [4096, 16384],
                        [1, 2, 4])
        return Plan(p2(4 * KiB, 1 * GiB), p4(64 * KiB, 1 * GiB), p4(64 * KiB, 256 * MiB),
                    1 * GiB, p2(1024, 131072), [1, 2, 4, 8, 16, 32, 64], 1 << 22,
                    p2(1, 512), [1, 4, 16, 64, 256], p4(64 * MiB, 4 * GiB), [4096, 8192],
                    [4096, 8192, 16384, 32768], [1, 2, 4, 8])
    if quick:
        return Plan(p4(4 * KiB, 16 * MiB), p4(64 * KiB, 16 * MiB), p4(64 * KiB, 4 * MiB),
                    16 * MiB, [256, 1024, 4096], [1, 2, 4, 8], 32768, [1, 2, 4, 8],
                    [1, 4], [64 * MiB], [512], [4096, 8192], [1, 2])
    return Plan(p2(4 * KiB, 256 * MiB), p4(64 * KiB, 256 * MiB), p4(64 * KiB, 16 * MiB),
                128 * MiB, p2(256, 16384), [1, 2, 4, 8, 16], 1 << 16, p2(1, 64),
                [1, 4, 16, 64], p4(16 * MiB, 1 * GiB), [512, 1024, 2048], [4096, 8192, 16384],
                [1, 2, 4])


def check_out(path: str | os.PathLike, force: bool) -> Path:
    """Refuse an output path that the final save would refuse, before measuring anything."""
    path = Path(path)
    if path.suffix != ".npz":
        raise KvsimError(f"{path}: a trace file must end in .npz")
    return check_destination(path, force)


CATALOG_NAMES = (("GH200", "gh200"), ("H200", "h200"), ("H100 PCIe", "h100-pcie"),
                 ("H100", "h100-sxm"), ("A100-SXM4-40GB", "a100-40gb"), ("A100", "a100-80gb"))


def _catalog_name(name: str) -> str | None:
    for pat, cat in CATALOG_NAMES:
        if pat.lower() in name.lower():
            return cat
    return None


def profile_model(be: Backend, model: str | ModelSpec) -> ModelSpec:
    """The model shape with the dtype the device runs (bf16 on CUDA, fp32 on the CPU)."""
    m = model if isinstance(model, ModelSpec) else catalog.model(model)
    return dataclasses.replace(m, dtype_bytes=be.dtype_bytes)


def profile(out: str | os.PathLike, gpu: int | None = None, device: str | None = None,
            model: str | ModelSpec | None = None, quick: bool = False, force: bool = False,
            nvml: bool = True, threads: int | None = None, seed: int = 0,
            progress: bool = True, plan: Plan | None = None,
            rounds: int | None = None, decide: dict | None = None) -> tracefile.Trace:
    """Run every sweep and save the trace atomically at ``out``; return it.

    ``decide``: policy name -> its decide kernel ``(device, model, context, seed) -> bench``, each
    timed into the table ``kernel_decide_<policy>`` (``kvsim profile`` gives every fetching
    policy's); without any, no decide table.

    ``rounds``: the kernel and link sweeps run this many times, interleaved, and each point keeps
    its median over rounds (default 3 on the CPU, where other processes share the cores; 1 on a
    GPU, timed by CUDA events)."""
    out = check_out(out, force)
    if device == "cpu" and threads is None:
        threads = 1  # one core runs kernels, another the copy "engine" (the CPU analogue)
    be = make_backend(gpu, device, threads)
    model = model or ("qwen3-4b" if be.kind == "cuda" else "smollm2-135m")
    m = profile_model(be, model)
    missing: list[str] = []
    handle = None
    if be.kind == "cuda" and nvml:
        import torch
        uuid = str(getattr(torch.cuda.get_device_properties(be.index), "uuid", "")) or None
        handle = Nvml(be.index, uuid)
    elif be.kind == "cpu":
        missing.append("nvml (the CPU has no NVML)")
    try:
        ident = device_identity(be, handle, missing)
        sampler = Sampler(handle)
        rounds = rounds or (1 if be.kind == "cuda" else 3)
        tables, extra = _sweeps(be, m, plan or plan_for(be.kind, quick), sampler, missing,
                                progress, seed, rounds, decide)
    finally:
        if handle is not None:
            handle.shutdown()
    nv, nv_units, nv_missing = sampler.table()
    missing += nv_missing
    units = _units(tables)
    if nv is not None:
        tables["nvml"] = {k: np.asarray(v, np.float64) for k, v in nv.items()}
        units["nvml"] = nv_units
    extra["nvml_sweeps"] = sampler.sweeps
    cat = _catalog_name(ident["name"]) if be.kind == "cuda" else None
    if cat:
        ident["catalog_name"] = cat
    extra["hbm_bytes"] = float(ident.get("hbm_bytes_nvml") or ident["hbm_bytes_torch"])
    extra["quick"] = quick
    be.shrunk[:] = list(dict.fromkeys(be.shrunk))  # rounds repeat the same notes
    missing += [f"shrunk: {s}" for s in be.shrunk]
    extra["shrunk"] = list(be.shrunk)
    host = ident["host"]["host"]
    prov = (f"kvsim profile{' --quick' if quick else ''} on {ident['name']} ({be.kind}, "
            f"host {host}), model shape {m.name}, dtype {ident['dtype']}")
    hw = tracefile.Hardware(device=ident, tables=tables, units=units, provenance=prov,
                            missing=missing, extra=extra)
    meta = tracefile.new_meta("kvsim profile", model=m.name,
                              notes=f"hardware profile measured on {ident['name']} ({host})")
    tr = tracefile.Trace(meta, hardware=hw)
    try:
        tracefile.save(tr, out, force=force)
    except OSError as e:
        raise KvsimError(f"{out}: could not write the trace ({e.strerror or e})") from None
    return tr


TIME_COLS = ("seconds", "pack_seconds", "copy_seconds")


def _median_rounds(runs: list[dict]) -> dict:
    """Per table, the median over rounds of the time columns (other columns must agree)."""
    out = {}
    for name, t in runs[0].items():
        same = [r[name] for r in runs if name in r and all(
            len(r[name][c]) == len(t[c]) and (c in TIME_COLS or c == "flops"
                                              or np.array_equal(r[name][c], t[c])) for c in t)]
        t = dict(t)
        for c in TIME_COLS:
            if c in t:
                t[c] = np.median(np.stack([r[c] for r in same]), axis=0)
        if "flops" in t and "n" in t:
            t["flops"] = 2.0 * t["n"].astype(np.float64) ** 3 / t["seconds"]
        out[name] = t
    return out


def _sweeps(be: Backend, m: ModelSpec, plan: Plan, sampler: Sampler, missing: list[str],
            show: bool, seed: int, rounds: int = 1, decide: dict | None = None
            ) -> tuple[dict, dict]:
    decide = decide or {}
    bar = tqdm(total=plan.points(len(decide)) * rounds, desc=f"profile {be.kind}", unit="pt",
               disable=None if show else True, leave=False)
    runs, gmiss, extras, timing = [], [], [], {}
    keep = {} if rounds > 1 else None  # per policy, its decide kernels built once for all rounds
    try:
        for r in range(rounds):
            t, x, gm = _one_round(be, m, plan, sampler, bar, seed, r, timing, decide, keep)
            runs.append(t)
            extras.append(x)
            gmiss = gm
    finally:
        bar.close()
        del keep
    missing += gmiss
    tables = _median_rounds(runs)
    extra = {k: float(np.median([x[k] for x in extras if k in x])) for k in extras[0]}
    extra["rounds"] = rounds
    return _finish(be, m, tables, extra, timing, missing)


def _one_round(be: Backend, m: ModelSpec, plan: Plan, sampler: Sampler, bar, seed: int, r: int,
               timing: dict, decide: dict, keep: dict | None = None
               ) -> tuple[dict, dict, list[str]]:
    """One pass over every sweep; random index sets change with the round ``r``, the synthetic
    layers the decide kernels decide on do not (their fetched_frac column must agree across
    rounds)."""
    tables: dict = {}
    missing: list[str] = []
    step = lambda: bar.update(1)  # noqa: E731

    def run(name, fn):
        with sampler.sweep(name):
            bar.set_postfix_str(name)
            t0 = time.perf_counter()
            res = fn()
            be.sync()
            timing[name] = round(timing.get(name, 0.0) + time.perf_counter() - t0, 3)
        return res
    kv_row = m.head_dim * m.dtype_bytes  # one token of one KV head (K or V)
    buf = link.LinkBuffers(be, max(plan.link_sizes))
    tables |= run("link_copies", lambda: link.sweep_copies(be, buf, plan.link_sizes, step))
    tables |= run("link_bidir", lambda: link.sweep_bidir(be, buf, plan.bidir_sizes, step))
    tables |= run("link_latency", lambda: link.sweep_latency(be, buf, step))
    buf = None  # frees the buffers
    be.free()
    pool = link.GatherPool(be, plan.gather_pool, max(plan.gather_totals))
    g, gmiss = run("link_gather", lambda: link.sweep_gathers(
        be, pool, plan.gather_totals, kv_row, step, seed + r))
    tables |= g
    missing += gmiss
    pool = None
    be.free()
    tables |= run("kernel_decode_attn", lambda: kernels.sweep_attention(
        be, m, plan.contexts, plan.batches, plan.max_tokens, step, seed))
    be.free()
    tables |= run("kernel_gemm", lambda: kernels.sweep_gemm(be, m, plan.gemm_batches, step,
                                                            seed))
    tables |= run("kernel_lm_head", lambda: kernels.sweep_head(be, m, plan.head_batches, step,
                                                               seed))
    be.free()
    roof, extra = run("roofline", lambda: kernels.sweep_roofline(
        be, plan.mem_sizes, plan.mm_sizes, step, seed))
    tables |= roof
    be.free()
    if not decide or not plan.decide_contexts:
        why = "no decide contexts in this sweep plan" if decide else \
            "no decide kernel was given to time"
        missing.append(f"{DECIDE_TABLE.format('<policy>')} ({why})")
        return tables, extra, missing
    for name, bench in decide.items():
        table = DECIDE_TABLE.format(name)
        kept = keep.setdefault(name, {}) if keep is not None else None
        d, dmiss = run(table, lambda: kernels.sweep_decide(
            be, m, plan.decide_contexts, plan.decide_batches, step, bench, table, seed, kept))
        tables |= d
        missing += dmiss
        be.free()
    return tables, extra, missing


def _finish(be: Backend, m: ModelSpec, tables: dict, extra: dict, timing: dict,
            missing: list[str]) -> tuple[dict, dict]:
    kv_row = m.head_dim * m.dtype_bytes
    tables = {k: v for k, v in tables.items() if len(next(iter(v.values()))) > 0}
    lacking = [t for t in CONSUMED if t not in tables]
    if lacking:
        raise KvsimError(f"the profile could not measure {', '.join(lacking)} "
                         f"(shrunk: {'; '.join(be.shrunk) or 'no'})")
    fits = {}

    def fit(name: str, table: dict, sel=slice(None)) -> None:
        """alpha/beta of a link table; a table too noisy to fit is recorded as missing."""
        if len(table["bytes"][sel]) < 2:
            return
        try:
            a, b = fit_alpha_beta(table["bytes"][sel], table["seconds"][sel])
            fits[name] = {"alpha_s": a, "beta_Bps": b}
        except KvsimError as e:
            missing.append(f"fit {name}: {e}")

    for t in ("link_h2d_pinned", "link_d2h_pinned", "link_h2d_pageable", "link_d2h_pageable",
              "link_bidir_pinned", "link_gather_gpu", "link_gather_pack"):
        if t in tables:
            fit(t, tables[t])
    rows = tables.get("link_gather_gpu_rows")
    for rb in np.unique(rows["row_bytes"]) if rows is not None else []:
        fit(f"link_gather_gpu_rows@{int(rb)}B", rows, rows["row_bytes"] == rb)
    # hbm_bw: the weight-streaming bandwidth the LM head reaches at batch 1, i.e. the pattern
    # (and the shape) the simulator charges with hbm_bw; the generic GEMV figure is gemv_bw
    hd = tables["kernel_lm_head"]
    extra["hbm_bw"] = float(m.vocab * m.hidden * m.dtype_bytes / hd["seconds"][hd["batch"] == 1][0])
    lat = tables["link_copy_latency"]
    slope = np.polyfit(lat["copies"].astype(float), lat["seconds"], 1)[0]
    extra |= {"fit": fits, "alpha_direct_s": float(max(slope, 0.0)), "kv_row_bytes": kv_row,
              "model": dataclasses.asdict(m), "sweep_seconds": timing,
              "threads": be.threads}
    return tables, extra


UNIT = {"bytes": "bytes", "seconds": "s", "row_bytes": "bytes", "rows": "rows",
        "pack_seconds": "s", "copy_seconds": "s", "copies": "copies", "context": "tokens",
        "batch": "sequences", "tokens": "KV tokens read over the batch", "n": "matrix side",
        "flops": "FLOP/s", "fetched_frac": "share of context K/V rows the decision fetched"}


def _units(tables: dict) -> dict:
    out = {t: {c: UNIT.get(c, "") for c in cols} for t, cols in tables.items()}
    notes = {"link_bidir_pinned": {"bytes": "bytes per direction",
                                   "seconds": "s until both directions finished"},
             "link_copy_latency": {"seconds": "s for `copies` back-to-back copies"},
             "kernel_decode_attn": {"seconds": "s per layer (whole batch)"},
             "kernel_gemm": {"seconds": "s per layer: norms, QKV, O, gated MLP"},
             "mem_copy": {"bytes": "bytes read + written"},
             "mem_gemv": {"bytes": "matrix bytes read"}}
    for table in decide_tables(tables).values():
        notes[table] = {"batch": "requests decided together in one call (their heads stacked)",
                        "seconds": "s per layer for the whole batch (one decode row per "
                                   "request)",
                        "fetched_frac": "mean share of the context the decision fetched per "
                                        "KV head"}
    for t, cols in notes.items():
        if t in out:
            out[t] |= cols
    return out


def decide_lines(hw) -> list[str]:
    """Each decide table (``kernel_decide_<policy>``, or an older profile's ``kernel_decide``) as
    text: context x batch -> ms per layer for the whole batch (and the fetched share of the
    context); [] when the profile has none. A table without a ``batch`` column (an older
    profile) is batch 1."""
    if hw is None:
        return []
    out = []
    for kernel, name in decide_tables(hw.tables).items():
        t = hw.tables[name]
        if len(t.get("context", ())):
            out += _decide_table_lines(kernel, name, t)
    return out


def _decide_table_lines(kernel: str, name: str, t: dict) -> list[str]:
    ctx = np.asarray(t["context"], np.int64)
    bat = np.asarray(t["batch"], np.int64) if "batch" in t else np.ones_like(ctx)
    sec = np.asarray(t["seconds"], np.float64)
    frac = np.asarray(t["fetched_frac"], np.float64) if "fetched_frac" in t else \
        np.full(len(ctx), np.nan)
    cell = {(int(n), int(b)): (s, f) for n, b, s, f in zip(ctx, bat, sec, frac)}
    bs = sorted(set(bat.tolist()))
    w = 16
    out = [(f"{name}: {kernel}'s decide for one layer and the whole batch, ms (fetched share of "
            "the context)"),
           f"  {'context':>8s}" + "".join(f"{f'B={b}':>{w}s}" for b in bs)]
    for n in sorted(set(ctx.tolist())):
        row = []
        for b in bs:
            if (n, b) in cell:
                s, f = cell[n, b]
                row.append(f"{s * 1e3:.3f} ({100 * f:.1f}%)" if np.isfinite(f) else
                           f"{s * 1e3:.3f}")
            else:
                row.append("-")
        out.append(f"  {n:8d}" + "".join(f"{c:>{w}s}" for c in row))
    return out
