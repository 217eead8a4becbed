"""``kvsim validate``: real decode loops on the profiled device vs the simulator's prediction.

For each configuration (policy x context x batch) a model-shaped stack with random weights runs
real decode steps on the device (:mod:`kvsim.validate.loops`), built from the policy's own decode
cost, for any registered policy:

* a policy that moves nothing over the link (``dense-resident``, ``topk``, ...): every layer
  attends over the share of the KV it keeps in device memory;
* an overlapped one (``dense-offload``): every layer's share streams from host memory (pinned on
  CUDA) into two staging buffers, double buffered, one copy per sequence for K and one for V;
* one that decides per step what to fetch (``verkv``, any policy with a decide kernel): per layer
  the policy's real decide kernel for the whole batch in one call (``stack``: synthetic attention
  layers of the model's head shape, one per sequence, as the profile's ``kernel_decide_<policy>``
  table times it), per sequence a
  real gather of its fetched K and V rows from that layer's host KV (a device gather over pinned
  memory on CUDA),
  attention over the resident sample + fetched rows with the policy's reweighting. The shortlisted
  keys the decide step scores are read from device memory here, while the simulator charges them
  to the link (a few percent of the fetched bytes).

Policies that run on attention are analysed on the same synthetic layer (with the profile's
hardware), so the simulator's statistics describe what the loop keeps and fetches. The loop
attends over a fixed context (the new token's K/V is computed but not appended); the simulator is
asked for the same context (``context - output_len / 2`` so its growing context averages to it).
Measured TPOT is the median wall time of a step (synchronised at its end); predicted TPOT is
``run_replay``'s on the same model shape, batch and context, from the profile.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from kvsim import trace as tracefile
from kvsim.errors import KvsimError
from kvsim.hw.catalog import ModelSpec
from kvsim.model.synthetic import synthetic_attention_trace
from kvsim.policies import make, parse
from kvsim.policies.registry import deciding
from kvsim.replay import analyze, configure, run_replay
from kvsim.validate import loops
from profiler.backend import Backend, is_oom, make_backend

BASELINES = ("dense-resident", "dense-offload")  # validated by default, with deciding()
SIM_OUTPUT_LEN = 8
CPU_LAYERS = 12  # default depth of the CPU validation stack
ATTENTION_DEFAULT_MAX_CONTEXT = 16384  # synthetic layer + float64 analysis take minutes beyond
QUESTION_ROWS = 4  # rows of the synthetic layer's question pass (its observation window)


def decide_kernels(names) -> dict:
    """Policy name -> its decide kernel with default options (as :func:`profiler.run.profile`
    takes them), for those of ``names`` that have one."""
    fetching = deciding()
    return {n: make(n).decide_kernel for n in dict.fromkeys(names) if n in fetching}


def default_policies() -> tuple[str, ...]:
    """What validate checks by default: the dense baselines and every fetching policy."""
    return BASELINES + tuple(deciding())


def _loadavg() -> list[float] | None:
    try:
        return [float(x) for x in open("/proc/loadavg").read().split()[:3]]
    except (OSError, ValueError):
        return None


def predict(trace: Path, spec, m: ModelSpec, n: int, B: int, seed: int) -> dict:
    """The simulator's prediction of the loop: its replay's JSON."""
    # the loop decodes a full batch: the simulator's batch prefills whole before it decodes
    # (chunked prefill would put other requests' prompt chunks into the first decode steps)
    cfg = configure(trace=trace, policy=spec, gpu=None, model=m,
                    context=max(n - SIM_OUTPUT_LEN // 2, 1), batch=B, concurrency=B,
                    requests=B, output_len=SIM_OUTPUT_LEN, seed=seed,
                    scheduler="prefill-first")
    return run_replay(cfg).to_json()


@dataclasses.dataclass
class Case:
    """One policy at one context: the trace its prediction reads, its decode cost, and what
    the loop needs (a decide kernel for a policy that decides per step)."""
    spec: object
    n: int
    trace: Path
    cost: object
    kernel: object = None

    @property
    def where(self) -> str:
        return "host" if self.cost.host_frac > 0 else "device"

    def step(self, be, st, stores, B: int):
        c, n = self.cost, self.n
        if self.kernel is not None:
            return loops.decide_step(be, st, stores["host"], B, n, self.kernel)
        if c.host_read_frac == 0:
            return loops.resident_step(be, st, stores["device"], B,
                                       max(1, round(c.hbm_read_frac * n)))
        return loops.offload_step(be, st, stores["host"], B, max(1, round(c.host_read_frac * n)))


def _case(spec, n: int, be: Backend, m: ModelSpec, hw, profile: Path, tmp: Path,
          seed: int) -> Case:
    """The policy's case at context ``n``: analysed by definition on the profile, or on a
    synthetic attention layer of the model's head shape (the one its decide kernel decides on,
    if it has one) saved with the profile's hardware."""
    policy = make(spec.name, spec.options)
    trace, kernel = profile, None
    if policy.needs_attention:
        if spec.name in deciding():
            with torch.inference_mode():
                kernel = policy.decide_kernel(be.device, m, n, seed)
        attn = kernel.trace.attention if kernel is not None else synthetic_attention_trace(
            n_layers=1, n_q=m.q_heads, n_kv=m.kv_heads, d=m.head_dim, context=n,
            question=QUESTION_ROWS, decode=1, seed=seed).attention
        trace = tmp / f"{spec.label.replace(':', '_')}-{n}.npz"
        tracefile.save(tracefile.Trace(
            tracefile.new_meta("kvsim validate", model=m.name, context=n,
                               notes="profile hardware + synthetic attention layer"),
            hardware=hw, attention=attn), trace)
    cost = analyze(trace, policy, seed).cost  # on the synthetic layer of m's head shape
    if (cost.decide_bytes_per_token > 0) != (kernel is not None) or \
            (kernel is None and cost.host_read_frac > 0 and not cost.overlap):
        raise KvsimError(f"validate has no decode loop for policy {spec.name} (its cost and its "
                         "decide kernel do not match a resident, overlapped or deciding loop)")
    return Case(spec, n, trace, cost, kernel)


def default_grid(be: Backend, hw) -> tuple[list[int], list[int]]:
    """Contexts and batches inside the profiled attention table (no extrapolation)."""
    t = hw.tables["kernel_decode_attn"]
    if be.kind == "cuda":
        ctx, bat = [4096, 16384, 32768], [1, 4, 8]
    else:
        ctx, bat = [1024, 4096], [1, 4]
    ok = lambda n, b: (t["context"].min() <= n and n * b <= t["tokens"].max()  # noqa: E731
                       and b <= hw.tables["kernel_gemm"]["batch"].max())
    ctx = [n for n in ctx if any(ok(n, b) for b in bat)]
    bat = [b for b in bat if any(ok(n, b) for n in ctx)]
    return ctx, bat


def validate(profile: str | Path | None = None, gpu: int | None = None,
             device: str | None = None, contexts: list[int] | None = None,
             batches: list[int] | None = None, layers: int | None = None,
             policies: tuple[str, ...] | None = None, steps: int | None = None, warmup: int = 2,
             threads: int | None = None, save_profile: str | Path | None = None,
             seed: int = 0, progress: bool = True, rounds: int | None = None) -> dict:
    t_start = time.perf_counter()
    notes = []
    specs, _ = parse(list(policies or default_policies()))  # checked before any work
    if device == "cpu" and threads is None:
        threads = 1  # as in the CPU profile: one core computes, the copy thread uses another
    with tempfile.TemporaryDirectory(prefix="kvsim-validate-") as tmp:
        shown = profile
        if profile is None:
            from profiler.run import profile as run_profile
            profile = Path(save_profile or Path(tmp) / "profile.npz")
            shown = save_profile or "a temporary file (deleted)"
            run_profile(profile, gpu=gpu, device=device, quick=True, threads=threads,
                        progress=progress, seed=seed, decide=decide_kernels(s.name for s in specs))
            notes.append(f"profiled first (--quick) into {shown}")
        out = _validate(Path(profile), gpu, device, contexts, batches, layers, specs, steps,
                        warmup, threads, seed, progress, notes, rounds, Path(tmp))
    return out | {"profile": str(shown), "wall_s": time.perf_counter() - t_start}


def _device_and_model(profile: Path, gpu, device, threads, layers, notes):
    tr = tracefile.load(profile)
    hw = tr.hardware
    if hw is None:
        raise KvsimError(f"{profile}: no hardware section; make one with kvsim profile")
    be = make_backend(gpu, device, threads)
    if hw.device.get("kind") != be.kind:
        raise KvsimError(f"{profile} was profiled on {hw.device.get('name')!r} "
                         f"({hw.device.get('kind')}); validate it on that device")
    if be.kind == "cpu" and hw.extra.get("threads") not in (None, be.threads):
        notes.append(f"profile measured with {hw.extra.get('threads')} threads, "
                     f"validating with {be.threads}")
    try:
        m = ModelSpec(**hw.extra["model"])
    except (KeyError, TypeError) as e:
        raise KvsimError(f"{profile}: hardware section lacks the profiled model shape ({e})") \
            from None
    if m.dtype_bytes != be.dtype_bytes:
        raise KvsimError(f"{profile}: profiled with {m.dtype_bytes}-byte values, this device "
                         f"runs {be.dtype_bytes}-byte values")
    if layers is None:  # the CPU runs a shorter stack (per-layer costs do not depend on depth)
        layers = m.layers if be.kind == "cuda" else min(m.layers, CPU_LAYERS)
    m = dataclasses.replace(m, name=f"{m.name} (validation stack, {layers} layers)",
                            layers=layers)
    return hw, be, m


def _cases(specs, contexts, explicit: bool, be, m, hw, profile, tmp, seed, notes) -> dict:
    """(policy label, context) -> Case; contexts a policy cannot run at are skipped, with a note."""
    cases = {}
    for spec in specs:
        attention = make(spec.name, spec.options).needs_attention
        for n in contexts:
            if attention and not explicit and n > ATTENTION_DEFAULT_MAX_CONTEXT:
                notes.append(f"{spec.label} skipped at context {n}: policies that run on "
                             f"attention go up to {ATTENTION_DEFAULT_MAX_CONTEXT} by default (the "
                             "synthetic layer and the simulator's analysis take minutes beyond); "
                             "pass --contexts to choose")
                continue
            try:
                cases[spec.label, n] = _case(spec, n, be, m, hw, profile, tmp, seed)
            except KvsimError as e:  # e.g. a context too short for the policy's budget
                notes.append(f"{spec.label} skipped at context {n}: {e}")
    return cases


def _stores(be, m, configs, cases) -> dict:
    max_tok = max(n * b for (_, n), b in configs)
    stores = {}
    for where in dict.fromkeys(cases[c].where for c, _ in configs):
        try:
            with torch.inference_mode():
                stores[where] = loops.KVStore(be, m, max_tok, where)
        except Exception as e:
            if not is_oom(e):
                raise
            be.free()
            raise KvsimError(f"validate: the KV of {max_tok} tokens x {m.layers} layers "
                             f"does not fit in {where} memory; pass smaller --contexts, "
                             "--batches or --layers") from None
    return stores


def _time_loops(be, m, configs, cases, rounds, warmup, steps, seed, progress) -> dict:
    """Measured (seconds, wait) samples per configuration; rounds interleave the
    configurations, so a burst of load from other processes does not land on one only."""
    times: dict = {c: [] for c in configs}
    bar = tqdm(total=len(configs) * rounds, desc=f"validate {be.kind}", unit="cfg",
               disable=None if progress else True, leave=False)
    try:
        with torch.inference_mode():
            st = loops.build_stack(be, m, seed)
        stores = _stores(be, m, configs, cases)
        for _ in range(rounds):
            for key, B in configs:
                bar.set_postfix_str(f"{key[0]} n={key[1]} B={B}")
                with torch.inference_mode():
                    step, close = cases[key].step(be, st, stores, B)
                    try:
                        times[key, B] += loops.measure(be, step, warmup, steps)
                    finally:
                        close()
                bar.update(1)
        del stores
        be.free()
    finally:
        bar.close()
    return times


def _row(case: Case, B: int, samples, pred: dict) -> dict:
    ts = np.array([t for t, _ in samples])
    meas = float(np.median(ts)) * 1e3
    row = {
        "policy": case.spec.label, "context": case.n, "batch": B,
        "measured_tpot_ms": meas,
        "measured_tpot_mean_ms": float(np.mean(ts)) * 1e3,
        "measured_tpot_min_ms": float(np.min(ts)) * 1e3,
        "predicted_tpot_ms": pred["tpot_ms"],
        "error_pct": 100.0 * (pred["tpot_ms"] - meas) / meas,
        "predicted_warnings": pred.get("warnings", []),
    }
    if case.kernel is not None:
        row["loop_fetched_frac"] = case.kernel.fetched_frac
        row["predicted_kv_read_frac"] = pred.get("kv_read_frac")
    waits = [w for _, w in samples if w is not None]
    if len(waits) == len(samples):  # other processes' share of the cores, made visible
        excl = float(np.median(ts - np.array(waits))) * 1e3
        row |= {"runqueue_wait_ms": float(np.median(waits)) * 1e3,
                "measured_excl_wait_ms": excl,
                "error_excl_wait_pct": 100.0 * (pred["tpot_ms"] - excl) / excl}
    return row


def _validate(profile, gpu, device, contexts, batches, layers, specs, steps, warmup, threads,
              seed, progress, notes, rounds, tmp) -> dict:
    hw, be, m = _device_and_model(profile, gpu, device, threads, layers, notes)
    dc, db = default_grid(be, hw)
    explicit = contexts is not None
    contexts, batches = contexts or dc, batches or db
    if not contexts or not batches:
        raise KvsimError(f"{profile}: its attention table is too small for any validation "
                         "configuration; pass --contexts and --batches")
    steps = steps or (6 if be.kind == "cuda" else 3)
    rounds = rounds or (1 if be.kind == "cuda" else 3)
    cases = _cases(specs, contexts, explicit, be, m, hw, profile, tmp, seed, notes)
    configs = [(key, b) for key in cases for b in batches]
    if not configs:
        raise KvsimError("no configuration left to validate")
    times = _time_loops(be, m, configs, cases, rounds, warmup, steps, seed, progress)
    rows = [_row(cases[key], B, samples,
                 predict(cases[key].trace, cases[key].spec, m, key[1], B, seed))
            for (key, B), samples in times.items()]
    mape = float(np.mean([abs(r["error_pct"]) for r in rows]))
    extra = {}
    if all("error_excl_wait_pct" in r for r in rows):
        extra["mape_excl_wait"] = float(np.mean([abs(r["error_excl_wait_pct"]) for r in rows]))
        share = np.mean([r["runqueue_wait_ms"] / r["measured_tpot_ms"] for r in rows])
        extra["runqueue_wait_share"] = float(share)
        if share > 0.05:
            notes.append(f"the main thread waited for a core {share:.0%} of each step on "
                         "average (other processes share this machine); mape_excl_wait "
                         "removes that wait from the measured steps (the copy thread's own "
                         "waits still count)")
    by_policy = {p: float(np.mean([abs(r["error_pct"]) for r in rows if r["policy"] == p]))
                 for p in dict.fromkeys(r["policy"] for r in rows)}
    return {
        "device": hw.device.get("name"), "kind": be.kind,
        "profile_provenance": hw.provenance, "model": m.name,
        "model_shape": {k: getattr(m, k) for k in ("layers", "q_heads", "kv_heads", "head_dim",
                                                    "hidden", "intermediate", "vocab",
                                                    "dtype_bytes")},
        "threads": be.threads, "steps": steps, "warmup": warmup, "rounds": rounds,
        "mape": mape, "mape_by_policy": by_policy, **extra, "n_configs": len(rows),
        "configs": rows, "load_avg": _loadavg(), "notes": notes,
    }
