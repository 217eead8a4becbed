#!/usr/bin/env bash
# The GPU check of issues 5 and 11 in one session, under 9 minutes on an H100/H200:
#   1. kvsim profile --gpu 0 --model qwen3-4b   (full sweeps, NVML sampled; --quick on a retry);
#      its kernel_decide_<policy> tables time every fetching policy's decide (VerKV's, Quest's,
#      ...) at contexts 4K..32K x batches 1, 2, 4, 8
#   2. kvsim validate --gpu 0 --profile ...     (real decode loops of a 36-layer Qwen3-4B-shaped
#      stack: dense-resident, dense-offload and every fetching policy at 4K/16K/32K x batch
#      1/4/8; MAPE; a smaller grid of 2 contexts x 2 batches when the profile left less time)
#   3. the CUDA tests (pytest -m gpu), if time is left and pytest is there
#   4. summary.txt, printed last: the profile, the validation table, the decide-kernel tables
#
# How to run it on the device machine (its own Python 3.12 + CUDA torch, no network, no simpy):
#   here, once (network):   bash profiler/fetch_wheels.sh      (simpy + pytest wheels -> wheels/)
#   there, from the repository root, carrying the ignored wheels/ folder along:
#       run(command="OUT=$OUT bash profiler/gpu_session.sh", carry=["wheels"], timeout_s=600)
#   The wheels a machine lacks are installed with pip --no-index --no-deps --target into a
#   folder under /tmp (SITE_DIR to choose it) that goes first on PYTHONPATH; nothing is
#   installed into the machine's Python. A required package missing both from the machine and
#   from wheels/ stops the session at once with one line naming it.
# Dry run, on a machine without a GPU: the same steps with --device cpu --quick and a small
# validate (about 25-30 s on a 2-core VM), to exercise the plumbing end to end:
#       DRY_RUN=1 OUT=/tmp/gpu-dry bash profiler/gpu_session.sh      (or: ... gpu_session.sh --dry-run)
# Everything lands in $OUT (at most 8 files): machine.txt, setup.log, the trace, profile.log,
# validate.json, validate.log, pytest-gpu.log, summary.txt.
# Environment: OUT, WHEELS (default wheels/), SITE_DIR, PYTHON (default python3), BUDGET_S (525:
# the steps' share of the 9 minutes; each step's timeout is what is left of it).
set -uo pipefail
DRY=${DRY_RUN:-0}
[ "${1:-}" = "--dry-run" ] && DRY=1
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 1
OUT=${OUT:-gpu-out}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd) || exit 1
PY=${PYTHON:-$(command -v python3 || command -v python)}
WHEELS=${WHEELS:-$ROOT/wheels}
if [ -n "${SITE_DIR:-}" ]; then
  SITE=$SITE_DIR
else
  SITE=$(mktemp -d "${TMPDIR:-/tmp}/kvsim-site.XXXXXX") && trap 'rm -rf "$SITE"' EXIT
fi
BUDGET=${BUDGET_S:-525}  # seconds for steps 1-3; setup and the summary fit in the rest of 540
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
KV=("$PY" -m kvsim.cli)
SECONDS=0
left() { echo $((BUDGET - SECONDS)); }
say() { echo "$*" | tee -a "$OUT/setup.log"; }
: >"$OUT/setup.log"
[ "$DRY" = 1 ] && say "gpu_session: DRY RUN (--device cpu --quick, small validate)"

{
  date -u
  nvidia-smi || true
  nvidia-smi -q -d MEMORY,CLOCK,POWER 2>/dev/null | head -60 || true
  lscpu | head -20
  "$PY" -c "import sys; print('python', sys.version.split()[0], sys.executable)"
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA device')"
} >"$OUT/machine.txt" 2>&1

# ---- Python packages: the machine's own, plus the wheels it lacks from $WHEELS -------------
REQUIRED="torch numpy scipy pandas simpy tqdm"
missing() {  # the modules of "$@" this Python cannot import
  "$PY" - "$@" <<'EOF'
import importlib.util, sys
print(" ".join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))
EOF
}
wanted_wheels() {  # the wheels in $WHEELS that bring a top-level module this Python lacks
  "$PY" - "$WHEELS" <<'EOF'
import importlib.util, sys, zipfile
from pathlib import Path
for whl in sorted(Path(sys.argv[1]).glob("*.whl")):
    try:
        names = zipfile.ZipFile(whl).namelist()
    except (OSError, zipfile.BadZipFile):
        continue
    tops = {n.split("/")[0].removesuffix(".py") for n in names
            if not n.split("/")[0].endswith((".dist-info", ".data"))}
    tops = {t for t in tops if t.isidentifier()}
    dist = whl.name.split("-")[0].lower()  # decide on the module named like the distribution
    tops = {dist} if dist in tops else tops
    if tops and all(importlib.util.find_spec(t) is None for t in tops):
        print(whl)
EOF
}
LACK=$(missing $REQUIRED pytest pynvml)
if [ -n "$LACK" ]; then
  say "this Python lacks: $LACK"
  if [ -d "$WHEELS" ]; then
    mapfile -t WANT < <(wanted_wheels)
    if [ ${#WANT[@]} -gt 0 ]; then
      mkdir -p "$SITE"
      say "installing from $WHEELS into $SITE: $(for w in "${WANT[@]}"; do basename "$w"; done \
        | tr '\n' ' ')"
      if "$PY" -m pip --version >/dev/null 2>&1; then
        "$PY" -m pip install --quiet --no-index --no-deps --target "$SITE" "${WANT[@]}" \
          >>"$OUT/setup.log" 2>&1 || say "pip install failed (see above)"
      else  # no pip: a pure-Python wheel is a zip laid out as its installed files
        "$PY" -c "import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) \
for w in sys.argv[2:]]" "$SITE" "${WANT[@]}" >>"$OUT/setup.log" 2>&1 \
          || say "unpacking the wheels failed (see above)"
        say "(no pip on this Python: the wheels were unpacked)"
      fi
      export PYTHONPATH="$ROOT:$SITE${PYTHONPATH#"$ROOT"}"
    fi
  fi
  LACK=$(missing $REQUIRED)
  if [ -n "$LACK" ]; then
    say "gpu_session: missing Python packages: $LACK (not on this machine, not in $WHEELS;" \
        "run 'bash profiler/fetch_wheels.sh' where there is network and carry wheels/)"
    exit 1
  fi
fi
"$PY" - 2>&1 <<'EOF' | tee -a "$OUT/setup.log"
import importlib
for name in ("simpy", "tqdm", "scipy", "pandas", "numpy", "torch"):
    m = importlib.import_module(name)
    print(f"{name} {getattr(m, '__version__', '?')} from {m.__file__}")
import kvsim.cli, profiler.run, kvsim.validate  # noqa: F401  the whole profile + validate path
print("kvsim imports from", kvsim.cli.__file__)
EOF
[ "${PIPESTATUS[0]}" = 0 ] || { say "gpu_session: kvsim does not import (see above)"; exit 1; }

if [ "$DRY" = 1 ]; then
  DEV=(--device cpu) MODEL=() QUICK=(--quick --rounds 1) NVML=() NAME=cpu-dry
  VAL_GRID=(--contexts 4096 --batches 1,2 --layers 2 --steps 2 --warmup 1 --rounds 1)
  VAL_SMALL=("${VAL_GRID[@]}")
else
  "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
    || { say "gpu_session: this torch has no CUDA (run with DRY_RUN=1 to test without a GPU)"; \
         exit 1; }
  DEV=(--gpu 0) MODEL=(--model qwen3-4b) QUICK=() VAL_GRID=()
  VAL_SMALL=(--contexts 4096,16384 --batches 1,8)  # 4 configurations per policy
  NVML=()
  "$PY" -c "import pynvml; pynvml.nvmlInit()" 2>/dev/null || NVML=(--no-nvml)
  NAME=$("$PY" -c "import torch; print(torch.cuda.get_device_name(0).lower().replace(' ', '-'))" \
         | tr -cd 'a-z0-9.-' | cut -c1-40)
fi
TRACE="$OUT/${NAME:-gpu}-qwen3-4b.npz"
[ "$DRY" = 1 ] && TRACE="$OUT/cpu-dry.npz"

# ---- 1. profile ----------------------------------------------------------------------------
T1=$(( $(left) - 220 ))  # leave the validation (and a retry) at least 3.5 minutes
[ "$T1" -gt 300 ] && T1=300
timeout "$T1" "${KV[@]}" profile "${DEV[@]}" "${MODEL[@]}" "${QUICK[@]}" --out "$TRACE" --force \
  "${NVML[@]}" --no-progress >"$OUT/profile.log" 2>&1
RC=$?
cat "$OUT/profile.log"
if [ $RC -ne 0 ] && [ "$DRY" != 1 ]; then
  echo "full profile failed (exit $RC) or timed out after ${SECONDS}s; retrying with --quick" \
    | tee -a "$OUT/profile.log"
  T2=$(( $(left) - 150 ))  # the validation then runs its smaller grid
  [ "$T2" -gt 150 ] && T2=150
  [ "$T2" -gt 30 ] && timeout "$T2" "${KV[@]}" profile "${DEV[@]}" "${MODEL[@]}" --quick \
    --out "$TRACE" --force "${NVML[@]}" --no-progress 2>&1 | tee -a "$OUT/profile.log"
fi
[ -s "$TRACE" ] || { echo "no profile: see $OUT/profile.log"; exit 1; }
echo "profile done at ${SECONDS}s" | tee -a "$OUT/profile.log"

# ---- 2. validate ---------------------------------------------------------------------------
T3=$(( $(left) - 30 ))
GRID=("${VAL_GRID[@]}")
[ "$DRY" != 1 ] && [ "$T3" -lt 240 ] && GRID=("${VAL_SMALL[@]}") \
  && echo "validate: ${T3}s left, the smaller grid ${GRID[*]}" >>"$OUT/validate.log"
[ "$T3" -lt 30 ] && T3=30
timeout "$T3" "${KV[@]}" validate "${DEV[@]}" --profile "$TRACE" "${GRID[@]}" --json \
  >"$OUT/validate.json" 2>>"$OUT/validate.log"
echo "validate exit $? at ${SECONDS}s" | tee -a "$OUT/validate.log"

# ---- 3. CUDA tests -------------------------------------------------------------------------
T4=$(( $(left) - 15 ))
if ! "$PY" -c "import pytest" 2>/dev/null; then
  echo "skipped: no pytest on this machine (bash profiler/fetch_wheels.sh brings it)" \
    | tee "$OUT/pytest-gpu.log"
elif [ "$T4" -ge 45 ]; then
  timeout "$T4" "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/test_profiler.py \
    tests/test_validate.py 2>&1 | tail -30 >"$OUT/pytest-gpu.log"
  tail -3 "$OUT/pytest-gpu.log"
else
  echo "skipped: ${SECONDS}s used" | tee "$OUT/pytest-gpu.log"
fi

# ---- 4. summary: the profile, the validation table, the decide-kernel tables ---------------
"$PY" - "$TRACE" "$OUT/validate.json" >"$OUT/summary.txt" 2>&1 <<'EOF'
import json, sys
from kvsim import trace as tracefile
from profiler.run import decide_lines
tr = tracefile.load(sys.argv[1])
hw = tr.hardware
fit = hw.extra.get("fit", {}).get("link_h2d_pinned", {})
print(f"== profile: {sys.argv[1]}")
print(f"{tr.describe()}")
print(f"H2D pinned: alpha {fit.get('alpha_s', float('nan')) * 1e6:.2f} us, beta "
      f"{fit.get('beta_Bps', float('nan')) / 1e9:.2f} GB/s; memory bw "
      f"{hw.extra['hbm_bw'] / 1e9:.1f} GB/s; matmul {hw.extra['flops'] / 1e12:.3f} TFLOP/s")
print("sweep seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in
                                    hw.extra.get("sweep_seconds", {}).items()))
if hw.missing:
    print(f"missing ({len(hw.missing)}): " + "; ".join(hw.missing))
print()
print("== validation (kvsim validate)")
try:
    r = json.load(open(sys.argv[2]))
except Exception as e:  # noqa: BLE001
    print(f"no validate result ({e}); see validate.log")
else:
    print(f"{r['device']}: {r['model']}; profile {r['profile']}")
    print(f"{'policy':15s} {'ctx':>6s} {'B':>3s} {'measured':>10s} {'predicted':>10s} "
          f"{'err%':>7s}")
    for c in r["configs"]:
        print(f"{c['policy']:15s} {c['context']:6d} {c['batch']:3d} "
              f"{c['measured_tpot_ms']:10.3f} {c['predicted_tpot_ms']:10.3f} "
              f"{c['error_pct']:7.2f}")
    print(f"MAPE {r['mape']:.2f}% over {r['n_configs']} configurations; by policy "
          + ", ".join(f"{k} {v:.2f}%" for k, v in r["mape_by_policy"].items()))
    for n in r["notes"]:
        print("note:", n)
print()
print("== decide kernels (profile tables kernel_decide_<policy>)")
print("\n".join(decide_lines(hw)) or "no decide table in the profile")
EOF
echo "session done in ${SECONDS}s" >>"$OUT/summary.txt"
echo "==================== summary.txt ===================="
cat "$OUT/summary.txt"
