"""profiler/gpu_session.sh's dry run (DRY_RUN=1: --device cpu --quick, a small validate) in a
Python that lacks simpy, as the device machine does: a real venv whose only packages are this
interpreter's minus simpy. The session must install simpy from the wheels folder (built here by
profiler/fetch_wheels.sh) into its own target dir and end with summary.txt holding the profile,
the validation table and a decide-kernel table per fetching policy; without the wheels it must
stop at once with one line naming simpy."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import site
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

from kvsim import trace as tracefile
from kvsim.policies.registry import deciding
from kvsim.validate import default_policies

ROOT = Path(__file__).resolve().parents[1]
SESSION = ROOT / "profiler" / "gpu_session.sh"
FETCH = ROOT / "profiler" / "fetch_wheels.sh"
DROP = {"simpy"}  # what the device machine lacks

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or not sys.platform.startswith(
    "linux"), reason="the session script is a bash script for Linux machines")


def _site_dirs() -> list[Path]:
    dirs = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    dirs += site.getsitepackages() if hasattr(site, "getsitepackages") else []
    return [Path(d) for d in dict.fromkeys(dirs) if Path(d).is_dir()]


def _dist_name(entry: str) -> str:
    return re.split(r"[-.]", entry, maxsplit=1)[0].lower()


@pytest.fixture(scope="module")
def env_without_simpy(tmp_path_factory):
    """A venv (no system site packages) that sees every package of this interpreter but simpy:
    its site-packages holds one .pth naming a folder of links to them."""
    if importlib.util.find_spec("simpy") is None:
        pytest.skip("simpy is not installed here: nothing to hide, and no wheel to repack")
    tmp = tmp_path_factory.mktemp("venv")
    venv.create(tmp / "venv", with_pip=False, symlinks=True, system_site_packages=False)
    py = tmp / "venv" / "bin" / "python"
    farm = tmp / "packages"
    farm.mkdir()
    for d in _site_dirs():
        for e in os.scandir(d):
            if (_dist_name(e.name) in DROP or e.name.endswith(".pth")
                    or e.name.startswith(("__editable__", "__pycache__"))
                    or (farm / e.name).exists()):
                continue
            (farm / e.name).symlink_to(e.path)
    purelib = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()"
                              "['purelib'])"], capture_output=True, text=True, check=True)
    (Path(purelib.stdout.strip()) / "kvsim-test-packages.pth").write_text(f"{farm}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env |= {"PATH": f"{py.parent}{os.pathsep}{env.get('PATH', '')}", "PYTHON": str(py)}
    probe = subprocess.run([py, "-c", "import importlib.util as u, torch, numpy, scipy, pandas, "
                            "tqdm; print(u.find_spec('simpy'))"], capture_output=True,
                           text=True, env=env, cwd=tmp)
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.strip() == "None"  # the venv really lacks simpy
    return env, py


@pytest.fixture(scope="module")
def wheels(tmp_path_factory):
    """The wheels folder, built as on a machine with network (repacked from the local install
    where pip cannot download)."""
    out = tmp_path_factory.mktemp("wheels")
    r = subprocess.run(["bash", str(FETCH), "simpy"], capture_output=True, text=True,
                       env=dict(os.environ, WHEELS=str(out), PYTHON=sys.executable))
    found = sorted(out.glob("simpy-*.whl"))
    if r.returncode != 0 or not found:
        pytest.skip(f"no simpy wheel could be downloaded or repacked: {r.stderr.strip()[-300:]}")
    return out


def _session(env, out: Path, wheels: Path, site_dir: Path):
    return subprocess.run(["bash", str(SESSION)], capture_output=True, text=True, cwd=ROOT,
                          env=env | {"DRY_RUN": "1", "OUT": str(out), "WHEELS": str(wheels),
                                     "SITE_DIR": str(site_dir)})


@pytest.mark.slow
def test_dry_run_installs_simpy_from_the_wheels_and_ends_with_the_three_tables(
        env_without_simpy, wheels, tmp_path):
    env, py = env_without_simpy
    out, site_dir = tmp_path / "out", tmp_path / "site"
    r = _session(env, out, wheels, site_dir)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    setup = (out / "setup.log").read_text()
    assert "this Python lacks: simpy" in setup
    assert re.search(r"installing from .* simpy-[0-9.]+-py3-none-any\.whl", setup), setup
    assert "simpy 4" in setup and f"from {site_dir}/simpy/__init__.py" in setup, setup
    assert (site_dir / "simpy" / "__init__.py").is_file()
    assert str(py.parent) in (out / "machine.txt").read_text()  # the venv's Python ran it

    summary = (out / "summary.txt").read_text()
    parts = summary.split("\n== ")
    assert [p.split("\n")[0] for p in parts] == [
        "== profile: " + str(out / "cpu-dry.npz"), "validation (kvsim validate)",
        "decide kernels (profile tables kernel_decide_<policy>)"]
    # the validation table: every default policy (the dense baselines and every fetching
    # policy) at the small grid, and the MAPE line
    policies = default_policies()
    val = parts[1]
    rows = [line.split() for line in val.splitlines() if line.split()[:1] and
            line.split()[0] in policies]
    assert {(r[0], r[1], r[2]) for r in rows} == {(p, "4096", b) for p in policies for b in "12"}
    assert re.search(rf"MAPE [0-9.]+% over {2 * len(policies)} configurations", val)
    # a decide table per fetching policy: context x batch -> ms per layer, as in the trace
    tables = tracefile.load(out / "cpu-dry.npz").hardware.tables
    lines = parts[2].splitlines()
    assert deciding()
    for kernel in deciding():
        dec = tables[f"kernel_decide_{kernel}"]
        head = next(i for i, line in enumerate(lines)
                    if line.startswith(f"kernel_decide_{kernel}:"))
        assert lines[head + 1].split() == ["context", "B=1", "B=2"]
        for n, row in zip([4096, 8192], lines[head + 2:head + 4], strict=True):
            cells = row.split()
            assert cells[0] == str(n)
            for b, ms in zip([1, 2], cells[1::2], strict=True):
                sel = (dec["context"] == n) & (dec["batch"] == b)
                assert float(ms) == pytest.approx(dec["seconds"][sel][0] * 1e3, abs=1e-3)
    assert summary.rstrip().splitlines()[-1].startswith("session done in")
    assert r.stdout.rstrip().endswith(summary.rstrip())  # printed last


def test_without_wheels_the_session_stops_at_once_naming_simpy(env_without_simpy, tmp_path):
    env, _ = env_without_simpy
    empty = tmp_path / "no-wheels"
    empty.mkdir()
    r = _session(env, tmp_path / "out", empty, tmp_path / "site")
    assert r.returncode == 1
    last = r.stdout.strip().splitlines()[-1]
    assert last.startswith("gpu_session: missing Python packages: simpy ")
    assert "fetch_wheels.sh" in last
    assert not (tmp_path / "out" / "profile.log").exists()  # nothing was measured
