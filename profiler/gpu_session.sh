#!/usr/bin/env bash
# The GPU check of issue 5 in one session (about 6-9 minutes on an H100/H200):
#   1. kvsim profile --gpu 0 --model qwen3-4b   (full sweeps, NVML sampled; --quick on a retry)
#   2. kvsim validate --gpu 0 --profile ...     (real decode loops of a 36-layer Qwen3-4B-shaped
#      stack: dense-resident, dense-offload, verkv at 4K/16K/32K x batch 1/4/8; MAPE)
#   3. the CUDA tests (pytest -m gpu), if time is left
# Run from the repository root:   OUT=/path/to/dir bash profiler/gpu_session.sh
# Everything lands in $OUT (at most 7 files): machine.txt, the trace, profile.log,
# validate.json, validate.log, summary.txt, pytest-gpu.log.
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
KV=(python -m kvsim.cli)
SECONDS=0

{
  date -u
  nvidia-smi || true
  nvidia-smi -q -d MEMORY,CLOCK,POWER 2>/dev/null | head -60 || true
  lscpu | head -20
  python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
torch.cuda.get_device_name(0))"
} >"$OUT/machine.txt" 2>&1

python - <<'EOF' || exit 1
import importlib.util, sys
need = ["torch", "numpy", "scipy", "pandas", "simpy", "tqdm"]
lack = [m for m in need if importlib.util.find_spec(m) is None]
if lack:
    sys.exit(f"missing Python packages on this machine: {', '.join(lack)} (pip install them)")
import torch
if not torch.cuda.is_available():
    sys.exit("this torch has no CUDA")
EOF

NVML=()
python -c "import pynvml; pynvml.nvmlInit()" 2>/dev/null || NVML=(--no-nvml)
GPU=$(python -c "import torch; print(torch.cuda.get_device_name(0).lower().replace(' ', '-'))" \
      | tr -cd 'a-z0-9.-' | cut -c1-40)
TRACE="$OUT/${GPU:-gpu}-qwen3-4b.npz"

timeout 300 "${KV[@]}" profile --gpu 0 --model qwen3-4b --out "$TRACE" --force "${NVML[@]}" \
  --no-progress 2>&1 | tee "$OUT/profile.log"
if ! [ -s "$TRACE" ]; then
  echo "full profile failed or timed out after ${SECONDS}s; retrying with --quick" \
    | tee -a "$OUT/profile.log"
  timeout 150 "${KV[@]}" profile --gpu 0 --model qwen3-4b --quick --out "$TRACE" --force \
    "${NVML[@]}" --no-progress 2>&1 | tee -a "$OUT/profile.log"
fi
[ -s "$TRACE" ] || { echo "no profile: see $OUT/profile.log"; exit 1; }
echo "profile done at ${SECONDS}s" | tee -a "$OUT/profile.log"

LEFT=$((540 - SECONDS))
timeout "$((LEFT > 60 ? LEFT - 30 : 30))" "${KV[@]}" validate --gpu 0 --profile "$TRACE" \
  --json >"$OUT/validate.json" 2>"$OUT/validate.log"
echo "validate exit $? at ${SECONDS}s" >>"$OUT/validate.log"

python - "$OUT/validate.json" >"$OUT/summary.txt" 2>&1 <<'EOF'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except Exception as e:  # noqa: BLE001
    sys.exit(f"no validate result ({e}); see validate.log")
print(f"{r['device']}: {r['model']}; profile {r['profile']}")
print(f"{'policy':15s} {'ctx':>6s} {'B':>3s} {'measured':>10s} {'predicted':>10s} {'err%':>7s}")
for c in r["configs"]:
    print(f"{c['policy']:15s} {c['context']:6d} {c['batch']:3d} {c['measured_tpot_ms']:10.3f} "
          f"{c['predicted_tpot_ms']:10.3f} {c['error_pct']:7.2f}")
print(f"MAPE {r['mape']:.2f}% over {r['n_configs']} configurations; by policy "
      + ", ".join(f"{k} {v:.2f}%" for k, v in r["mape_by_policy"].items()))
for n in r["notes"]:
    print("note:", n)
EOF
cat "$OUT/summary.txt"

if [ "$SECONDS" -lt 480 ]; then
  timeout "$((570 - SECONDS))" python -m pytest -q -m gpu tests/test_profiler.py \
    tests/test_validate.py 2>&1 | tee "$OUT/pytest-gpu.log"
else
  echo "skipped: ${SECONDS}s used" >"$OUT/pytest-gpu.log"
fi
echo "done in ${SECONDS}s"
