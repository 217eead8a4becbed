"""NVML (``nvidia-ml-py``): the GPU's static identity, and a background sampler during each sweep.

A field the machine does not support (``NVMLError_NotSupported``, no permission, an old driver
without the call) is left out of the table and named in ``missing``; it never stops a profile.
"""

from __future__ import annotations

import os
import threading
import time

from kvsim.errors import KvsimError

# field -> (function name, extra argument as a pynvml constant name or None, attribute or None)
SAMPLED = {
    "pcie_gen": ("nvmlDeviceGetCurrPcieLinkGeneration", None, None),
    "pcie_gen_max": ("nvmlDeviceGetMaxPcieLinkGeneration", None, None),
    "pcie_width": ("nvmlDeviceGetCurrPcieLinkWidth", None, None),
    "pcie_width_max": ("nvmlDeviceGetMaxPcieLinkWidth", None, None),
    "pcie_tx_kBps": ("nvmlDeviceGetPcieThroughput", "NVML_PCIE_UTIL_TX_BYTES", None),
    "pcie_rx_kBps": ("nvmlDeviceGetPcieThroughput", "NVML_PCIE_UTIL_RX_BYTES", None),
    "clock_sm_MHz": ("nvmlDeviceGetClockInfo", "NVML_CLOCK_SM", None),
    "clock_mem_MHz": ("nvmlDeviceGetClockInfo", "NVML_CLOCK_MEM", None),
    "power_mW": ("nvmlDeviceGetPowerUsage", None, None),
    "mem_used_bytes": ("nvmlDeviceGetMemoryInfo", None, "used"),
    "temp_C": ("nvmlDeviceGetTemperature", "NVML_TEMPERATURE_GPU", None),
    "util_gpu_pct": ("nvmlDeviceGetUtilizationRates", None, "gpu"),
}
UNITS = {"t": "s since the profile started", "sweep": "index into extra.nvml_sweeps",
         "pcie_gen": "generation", "pcie_gen_max": "generation", "pcie_width": "lanes",
         "pcie_width_max": "lanes", "pcie_tx_kBps": "KB/s (NVML 20 ms window)",
         "pcie_rx_kBps": "KB/s (NVML 20 ms window)", "clock_sm_MHz": "MHz",
         "clock_mem_MHz": "MHz", "power_mW": "mW", "mem_used_bytes": "bytes", "temp_C": "C",
         "util_gpu_pct": "%"}


def _text(x) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


class Nvml:
    """An initialised NVML handle for the GPU that torch calls ``cuda:index``."""

    def __init__(self, index: int, torch_uuid: str | None = None, lib=None):
        if lib is None:
            try:
                import pynvml as lib
            except ImportError:
                raise KvsimError("NVML is not available: the nvidia-ml-py package is not "
                                 "installed (pip install nvidia-ml-py), or pass --no-nvml") \
                    from None
        self.lib = lib
        try:
            lib.nvmlInit()
        except Exception as e:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
            raise KvsimError(f"NVML is not available ({_text(e) or type(e).__name__}); "
                             "install the NVIDIA driver's libnvidia-ml, or pass --no-nvml to "
                             "profile without NVML samples") from None
        self.handle = self._find(index, torch_uuid)

    def _find(self, index: int, torch_uuid: str | None):
        lib = self.lib
        n = lib.nvmlDeviceGetCount()
        if torch_uuid:  # CUDA_VISIBLE_DEVICES may renumber devices; the UUID does not change
            want = torch_uuid.lower().removeprefix("gpu-")
            for i in range(n):
                h = lib.nvmlDeviceGetHandleByIndex(i)
                if _text(lib.nvmlDeviceGetUUID(h)).lower().removeprefix("gpu-") == want:
                    return h
        if os.environ.get("CUDA_VISIBLE_DEVICES") or not 0 <= index < n:
            raise KvsimError(f"NVML cannot find the GPU torch calls cuda:{index} "
                             f"(uuid {torch_uuid}); pass --no-nvml to profile without NVML")
        return lib.nvmlDeviceGetHandleByIndex(index)

    def call(self, fname: str, const: str | None = None, attr: str | None = None):
        """One NVML value; raises whatever NVML raises (callers decide what is missing)."""
        fn = getattr(self.lib, fname)  # AttributeError: this pynvml lacks the call
        v = fn(self.handle, getattr(self.lib, const)) if const else fn(self.handle)
        return getattr(v, attr) if attr else v

    def identity(self, missing: list[str]) -> dict:
        """Static facts; each one NVML cannot give goes to ``missing``."""
        out = {}
        facts = {
            "nvml_name": lambda: _text(self.call("nvmlDeviceGetName")),
            "uuid": lambda: _text(self.call("nvmlDeviceGetUUID")),
            "driver_version": lambda: _text(self.lib.nvmlSystemGetDriverVersion()),
            "cuda_driver_version": lambda: _cuda_version(self.lib.nvmlSystemGetCudaDriverVersion()),
            "hbm_bytes_nvml": lambda: int(self.call("nvmlDeviceGetMemoryInfo", None, "total")),
            "pci_bus_id": lambda: _text(self.call("nvmlDeviceGetPciInfo", None, "busId")),
            "pcie_gen_max": lambda: int(self.call("nvmlDeviceGetMaxPcieLinkGeneration")),
            "pcie_gen_gpu_max": lambda: int(self.call("nvmlDeviceGetGpuMaxPcieLinkGeneration")),
            "pcie_width_max": lambda: int(self.call("nvmlDeviceGetMaxPcieLinkWidth")),
            "numa_node": lambda: int(self.call("nvmlDeviceGetNumaNodeId")),
            "power_limit_mW": lambda: int(self.call("nvmlDeviceGetEnforcedPowerLimit")),
        }
        for k, f in facts.items():
            try:
                out[k] = f()
            except Exception as e:
                missing.append(f"identity.{k} (NVML: {_text(e) or type(e).__name__})")
        if "numa_node" not in out and "pci_bus_id" in out:  # sysfs knows it when NVML does not
            node = _sysfs_numa(out["pci_bus_id"])
            if node is not None:
                out["numa_node"] = node
                missing[:] = [m for m in missing if not m.startswith("identity.numa_node")]
        return out

    def shutdown(self) -> None:
        try:
            self.lib.nvmlShutdown()
        except Exception:
            pass


def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{(v % 1000) // 10}"


def _sysfs_numa(bus_id: str) -> int | None:
    dom, rest = bus_id.lower().split(":", 1)
    path = f"/sys/bus/pci/devices/{dom[-4:]}:{rest}/numa_node"
    try:
        return int(open(path).read().strip())
    except (OSError, ValueError):
        return None


class Sampler:
    """Samples every supported field in a background thread while a sweep runs.

    ``with sampler.sweep("link_h2d_pinned"): ...`` tags the samples taken meanwhile. Fields that
    fail on the first probe are missing from the start; a field that fails later is dropped from
    the table (its column would be incomplete) and named in ``missing`` too.
    """

    def __init__(self, nvml: Nvml | None, interval_s: float = 0.1):
        self.nvml, self.interval = nvml, interval_s
        self.t0 = time.perf_counter()
        self.sweeps: list[str] = []
        self.rows: list[dict] = []
        self.missing: dict[str, str] = {}
        self.fields: list[str] = []
        if nvml is not None:
            for name, spec in SAMPLED.items():
                try:
                    float(nvml.call(*spec))
                    self.fields.append(name)
                except Exception as e:
                    self.missing[name] = _text(e) or type(e).__name__
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self, sweep: int) -> None:
        row = {"t": time.perf_counter() - self.t0, "sweep": sweep}
        for name in self.fields:
            if name in self.missing:
                continue
            try:
                row[name] = float(self.nvml.call(*SAMPLED[name]))
            except Exception as e:
                self.missing[name] = f"failed while sampling: {_text(e) or type(e).__name__}"
        self.rows.append(row)

    def _loop(self, sweep: int) -> None:
        while True:
            self._sample(sweep)
            if self._stop.wait(self.interval):
                return

    def sweep(self, name: str):
        sampler = self

        class _Ctx:
            def __enter__(self):
                sampler.sweeps.append(name)
                if sampler.nvml is not None:
                    sampler._stop.clear()
                    sampler._thread = threading.Thread(
                        target=sampler._loop, args=(len(sampler.sweeps) - 1,), daemon=True)
                    sampler._thread.start()

            def __exit__(self, *exc):
                if sampler._thread is not None:
                    sampler._stop.set()
                    sampler._thread.join()
                    sampler._thread = None
                return False

        return _Ctx()

    def table(self) -> tuple[dict | None, dict, list[str]]:
        """The ``nvml`` table (None without samples), its units, and the missing fields."""
        missing = [f"nvml.{k} ({v})" for k, v in self.missing.items()]
        keep = [f for f in self.fields if f not in self.missing]
        if not self.rows:
            return None, {}, missing
        cols = {c: [r[c] for r in self.rows] for c in ["t", "sweep", *keep]}
        return cols, {c: UNITS[c] for c in cols}, missing
