#!/usr/bin/env bash
# Fetch, on a machine with network, the pure-Python wheels that profiler/gpu_session.sh installs
# on a device machine that lacks them (it has its own Python 3.12, torch, numpy, scipy, pandas,
# tqdm, nvidia-ml-py and matplotlib, and no network):
#   simpy                               kvsim's simulator (kvsim validate's predictions)
#   pytest pluggy iniconfig packaging pygments   the session's CUDA tests (its last, optional step)
# Everything else on the profile + validate path is the standard library or already there.
#
#   bash profiler/fetch_wheels.sh                 -> wheels/ (ignored by git)
#   bash profiler/fetch_wheels.sh simpy           only the packages named
#   WHEELS=dir PYVER=3.12 bash profiler/fetch_wheels.sh
#
# Each package is `pip download --no-deps --only-binary=:all: --python-version $PYVER`; one that
# cannot be downloaded (no network) is repacked from this machine's installation when that is a
# pure-Python one (py3-none-any), else the script fails naming it. Then carry the folder to the
# device machine: run(command="OUT=$OUT bash profiler/gpu_session.sh", carry=["wheels"]).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WHEELS=${WHEELS:-$ROOT/wheels}
PYVER=${PYVER:-3.12}
PY=${PYTHON:-$(command -v python3 || command -v python)}
# versions kvsim was tested with (pyproject: simpy>=4.1, pytest>=8)
DEFAULT=(simpy==4.1.2 pytest==9.0.3 pluggy==1.6.0 iniconfig==2.3.0 packaging==26.2
         pygments==2.20.0)
PKGS=("$@")
[ ${#PKGS[@]} -gt 0 ] || PKGS=("${DEFAULT[@]}")
mkdir -p "$WHEELS"

repack() {  # a locally installed pure-Python distribution -> a wheel in $WHEELS
  "$PY" - "$1" "$WHEELS" <<'EOF'
import base64, hashlib, importlib.metadata as md, re, sys, zipfile
from pathlib import Path
req, out = sys.argv[1], Path(sys.argv[2])
name = re.split(r"[=<>!~ \[]", req, maxsplit=1)[0]
try:
    dist = md.distribution(name)
except md.PackageNotFoundError:
    sys.exit(f"fetch_wheels: {name}: no network and not installed here")
wheel_meta = dist.read_text("WHEEL") or ""
if "Root-Is-Purelib: true" not in wheel_meta or "py3-none-any" not in wheel_meta:
    sys.exit(f"fetch_wheels: {name}: no network, and the local install is not pure Python")
norm = re.sub(r"[-_.]+", "_", dist.metadata["Name"])
whl = out / f"{norm}-{dist.version}-py3-none-any.whl"
info = f"{norm}-{dist.version}.dist-info"
records = []
with zipfile.ZipFile(whl, "w", zipfile.ZIP_DEFLATED) as z:
    for f in dist.files or []:
        src = Path(dist.locate_file(f))
        parts = Path(f).parts
        if ".." in parts or "__pycache__" in parts or not src.is_file() or f.name == "RECORD":
            continue
        arc = "/".join((info,) + parts[1:]) if parts[0].endswith(".dist-info") else f.as_posix()
        if parts[0].endswith(".dist-info") and parts[-1] in ("INSTALLER", "REQUESTED",
                                                             "direct_url.json"):
            continue
        data = src.read_bytes()
        z.writestr(arc, data)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        records.append(f"{arc},sha256={digest},{len(data)}")
    records.append(f"{info}/RECORD,,")
    z.writestr(f"{info}/RECORD", "\n".join(records) + "\n")
print(f"repacked {dist.metadata['Name']} {dist.version} from this machine's install: {whl.name}")
EOF
}

for p in "${PKGS[@]}"; do
  if ! "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PYVER" \
       --dest "$WHEELS" "$p" 2>"$WHEELS/.pip-error"; then
    echo "fetch_wheels: pip download $p failed ($(tail -1 "$WHEELS/.pip-error")); repacking" >&2
    repack "$p"
  fi
done
rm -f "$WHEELS/.pip-error"
echo "wheels in $WHEELS:"
ls -1 "$WHEELS"
