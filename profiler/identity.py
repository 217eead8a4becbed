"""Who was measured: the device (torch and NVML) and the host (CPU, memory, NUMA)."""

from __future__ import annotations

import os
import platform

import torch

from profiler.backend import Backend


def host_identity() -> dict:
    cpu = platform.processor() or platform.machine()
    mem = None
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
                break
    except OSError:
        pass
    numa = None
    try:
        numa = len([d for d in os.listdir("/sys/devices/system/node") if d.startswith("node")])
    except OSError:
        pass
    return {"host": platform.node(), "platform": platform.platform(), "cpu": cpu,
            "cpu_count": os.cpu_count(), "host_mem_bytes": mem, "numa_nodes": numa,
            "python": platform.python_version()}


def device_identity(be: Backend, nvml=None, missing: list[str] | None = None) -> dict:
    """The ``device`` dict of the hardware section."""
    missing = missing if missing is not None else []
    host = host_identity()
    ident = {"kind": be.kind, "torch_version": torch.__version__,
             "dtype": str(be.dtype).removeprefix("torch."), "host": host}
    if be.kind == "cpu":
        ident.update(name=f"cpu: {host['cpu']}", threads=be.threads,
                     hbm_bytes_torch=host["host_mem_bytes"])
        return ident
    p = torch.cuda.get_device_properties(be.index)
    ident.update(name=p.name, index=be.index, torch_uuid=str(getattr(p, "uuid", "")) or None,
                 cuda_runtime_version=torch.version.cuda,
                 compute_capability=f"{p.major}.{p.minor}", sm_count=p.multi_processor_count,
                 hbm_bytes_torch=int(p.total_memory))
    if nvml is not None:
        ident.update(nvml.identity(missing))
    else:
        missing.append("identity.nvml (profiled with --no-nvml)")
    return ident
