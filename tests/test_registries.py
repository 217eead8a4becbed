"""The registries a contributor extends (the GPU records, the scheduling rules) are checked by
the properties of every member, never by an exact list: a new GPU is one record and works in
``replay`` and ``plan`` with nothing else filled in; a new rule is one registered class and runs.
And the hardware modules import one way (no module of ``kvsim/hw`` imports one that imports it
back, lazily or not)."""

import ast
import dataclasses
import json
import math
import pathlib
import re

import numpy as np
import pandas as pd
import pytest
from conftest import run_cli

from kvsim.contract import DecodeCost
from kvsim.errors import KvsimError
from kvsim.hw import catalog
from kvsim.hw.costs import CostModel, costs_for
from kvsim.hw.gpus import GPUSpec
from kvsim.sim.engine import Memory, Simulator
from kvsim.sim.rules import RULES, ArrivalOrder, Scheduling
from kvsim.sim.workload import Workload

ROOT = pathlib.Path(__file__).resolve().parents[1]
M = catalog.model("qwen3-4b")
SOURCES = ("source", "rates_source", "mma_source", "price_source")


# ----------------------------------------------------------------------------- GPU records
@pytest.mark.parametrize("name", list(catalog.GPUS))
def test_every_gpu_record_is_complete_and_consistent(name):
    g = catalog.GPUS[name]
    assert isinstance(g, GPUSpec) and g.name == name == name.strip().lower()
    assert catalog.gpu(name.upper()) is g
    for f in SOURCES:
        assert getattr(g, f).strip(), f"{name}: {f} is empty"
    for f in ("hbm_gib", "hbm_gbps", "bf16_tflops", "link_theoretical_gbps", "h2d_gbps"):
        assert getattr(g, f) > 0, f
    assert g.h2d_gbps <= g.link_theoretical_gbps and g.copy_alpha_us >= 0
    rates = g.rates()
    assert rates["bf16"] == g.bf16_tflops and all(v > 0 for v in rates.values())
    assert all(v >= g.bf16_tflops for k, v in rates.items() if k in ("fp8", "int8"))
    assert (g.peer == "") == (g.peer_gbps == 0)
    assert g.mma_rows >= 0 and isinstance(g.mma_rows, int)
    if g.usd_per_hour is None:
        assert "no public price" in g.price_source
    else:
        assert g.usd_per_hour > 0 and math.isfinite(g.usd_per_hour)
        assert re.search(r"\b20\d\d\b", g.price_source), "a dated public listing"
    with pytest.raises(dataclasses.FrozenInstanceError):
        g.hbm_gib = 1.0  # records are frozen: a what-if is an override, not an edit
    c = CostModel.from_spec(g)
    assert c.hbm_bytes > 0 and c.hbm_bw > 0 and c.flops > 0 and c.gpu_name == name


def _record(**change) -> GPUSpec:
    """A made-up GPU (numbers of the MI325X's sheet), every field named."""
    fields = dict(
        name="test-mi325x", hbm_gib=250.0, hbm_gbps=6000, bf16_tflops=1307,
        link="PCIe Gen5 x16", link_theoretical_gbps=63.0, h2d_gbps=52.0, copy_alpha_us=5.0,
        source="test record (AMD Instinct MI325X sheet: 256 GB HBM3E, 6 TB/s)",
        peer="Infinity Fabric 4", peer_gbps=448.0,
        fp8_tflops=2615, int8_tops=2615, int4_tops=0.0, rates_source="test record",
        mma_rows=16, mma_source="test record (CDNA3 MFMA)",
        usd_per_hour=2.25, price_source="test record, 2026-12-07", vendor="amd")
    return GPUSpec(**{**fields, **change})


def test_a_record_must_name_every_field_and_be_consistent():
    every = dataclasses.asdict(_record())
    for f in every:
        with pytest.raises(TypeError, match=f):
            GPUSpec(**{k: v for k, v in every.items() if k != f})
    for bad, what in (({"price_source": ""}, "price_source"), ({"rates_source": " "},
                      "rates_source"), ({"usd_per_hour": 0}, "usd_per_hour"),
                      ({"usd_per_hour": math.nan}, "usd_per_hour"), ({"hbm_gbps": 0}, "hbm_gbps"),
                      ({"fp8_tflops": -1}, "fp8_tflops"), ({"mma_rows": 1.5}, "mma_rows"),
                      ({"name": "MI325X"}, "name")):
        with pytest.raises(KvsimError, match=what):
            _record(**bad)
    assert _record(usd_per_hour=None, price_source="no public price found").usd_per_hour is None


def test_a_gpu_registered_at_runtime_replays_and_plans_with_only_its_record(monkeypatch,
                                                                          tmp_path):
    """The record alone: no price table, no rate table, no link or token-budget table of its
    name (its peer link has no published all-reduce measurement: the stated fallback)."""
    g = _record()
    monkeypatch.setitem(catalog.GPUS, g.name, g)
    code, out, err = run_cli("replay", "--policy", "dense-offload", "--gpu", g.name, "--model",
                             "qwen3-4b", "--context", "8192", "--requests", "16", "--batch", "4",
                             "--json")
    assert code == 0, err
    assert json.loads(out) and f'"{g.name}"' in out  # the report names the GPU
    assert g.source in out and f"{g.hbm_gib} GiB" in out  # and quotes the record as its source
    code, out, err = run_cli(
        "plan", "--gpu", f"{g.name},h100-sxm", "--model", "qwen3-4b", "--context", "4096",
        "--policy", "dense-resident", "--batch", "4", "--output-len", "16", "--requests", "16",
        "--tp", "1,2", "--jobs", "1", "--out", tmp_path / "plan", "--json")  # (in this process:
    assert code == 0, err  # a worker process would not see the record registered here)
    df = pd.read_csv(tmp_path / "plan" / "results.csv")
    mine = df[df.gpu == g.name]
    assert len(mine) == 2 and (mine.status == "ok").all()
    assert (mine.price_usd_per_gpu_hour == g.usd_per_hour).all()
    assert set(mine.price_source) == {g.price_source}
    assert (mine.usd_per_hour == mine.gpus * g.usd_per_hour).all() and set(mine.gpus) == {1, 2}
    assert "Infinity Fabric 4: no published all-reduce measurement" in \
        mine.provenance.str.cat()  # TP 2 over a link no table lists: the stated fallback


# ------------------------------------------------------------------------- scheduling rules
def _field(kind: str) -> str:
    return "admission_order" if kind == "order" else kind


HBM = M.weight_bytes + 2 * 2**30 + 20_000 * M.kv_bytes_per_token


def _tight_run(scheduling: Scheduling):
    """16 requests arriving together into HBM with room for about 20K tokens of KV: grow
    admission must preempt."""
    costs, _ = costs_for("h100-sxm", None, "roofline")
    mem = Memory(HBM, 512 * 2**30, M.weight_bytes, 2 * 2**30)
    sim = Simulator(M, costs, DecodeCost(1.0, 1.0, 0.0, 0.0, False), mem, 16, scheduling)
    rng = np.random.default_rng(0)
    work = Workload(np.zeros(16), rng.integers(1000, 3000, 16), np.full(16, 600), None, "")
    return sim.run(work)


@pytest.mark.parametrize("kind,name", [(k, n) for k in RULES for n in RULES[k]])
def test_every_registered_rule_is_a_flag_choice_and_runs(kind, name):
    f = next(f for f in dataclasses.fields(Scheduling) if f.name == _field(kind))
    assert name in f.metadata["choices"]
    extra = {"admission": "grow"} if kind == "preemption" else {}
    s = Scheduling(**{_field(kind): name, **extra})
    s.check()
    res = _tight_run(s)
    assert res.requests.count == 16  # every request finishes
    assert res.peak_hbm_bytes <= HBM + 1e-6  # within the GPU's memory
    if kind == "preemption":
        assert res.preemptions > 0  # the rule was exercised


class _LongestPromptFirst:
    """A new admission order, as a contributor would add it: the longest prompt first."""

    def __init__(self, run):
        self.prompt, self.queue = run.prompt, []

    def append(self, slot):
        self.queue.append(slot)
        self.queue.sort(key=lambda s: -self.prompt[s])

    def appendleft(self, slot):
        self.queue.insert(0, slot)

    def popleft(self):
        return self.queue.pop(0)

    def __getitem__(self, i):
        return self.queue[i]

    def __len__(self):
        return len(self.queue)


def test_a_new_admission_order_registered_at_runtime_is_a_choice_and_runs(monkeypatch):
    monkeypatch.setitem(RULES["order"], "longest-prompt-first", _LongestPromptFirst)
    assert _tight_run(Scheduling(admission_order="longest-prompt-first")).requests.count == 16
    assert RULES["order"]["arrival"] is ArrivalOrder  # nothing else had to change
    code, out, err = run_cli("replay", "--policy", "dense-resident", "--gpu", "h100-sxm",
                             "--model", "qwen3-4b", "--context", "4096", "--requests", "16",
                             "--batch", "4", "--admission-order", "longest-prompt-first",
                             "--json")
    assert code == 0, err
    assert '"longest-prompt-first"' in out  # the report names the order it ran


# ------------------------------------------------------------------------- imports of hw
def _kvsim_imports(path: pathlib.Path, modules: set[str]) -> set[str]:
    """The kvsim modules a file imports anywhere (module level or inside functions):
    ``from kvsim.hw import catalog`` is an import of ``kvsim.hw.catalog``."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out & modules


def test_no_hw_module_imports_one_that_imports_it_back():
    paths = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
             for p in (ROOT / "kvsim").rglob("*.py")}
    graph = {m: _kvsim_imports(p, set(paths)) - {m} for m, p in paths.items()}

    def reaches(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for n in graph[todo.pop()] - seen:
                seen.add(n)
                todo.append(n)
        return seen

    cycles = sorted(m for m in graph if m.startswith("kvsim.hw.") and m in reaches(m))
    assert not cycles, f"modules of kvsim/hw on an import cycle: {cycles}"
