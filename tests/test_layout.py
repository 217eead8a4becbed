"""The house: what imports what. The simulator and the planner take a torch-free contract; data
flows one way (profiler -> policies -> measure -> sim -> replay/validate -> plan -> commands).

The import graph (:func:`import_graph`) counts every import of a module of ``kvsim/`` or
``profiler/``, at module level or inside a function: no two packages import each other, and no
module imports one that imports it back, directly or through a chain. README.md's "How data
flows" and CONTRIBUTING.md's "One-way imports" state what these tests hold, no more."""

import ast
import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]

# what may not be imported by what, as (importer prefix, forbidden prefixes): each entry is a
# step of the design's data flow that must not reach downstream
UPSTREAM_ONLY = [
    ("profiler", ("kvsim.policies", "kvsim.measure", "kvsim.sim", "kvsim.replay",
                  "kvsim.validate", "kvsim.plan", "kvsim.commands", "kvsim.hw.costs")),
    ("kvsim.attention", ("kvsim.policies", "kvsim.measure", "kvsim.sim", "kvsim.replay",
                         "kvsim.plan", "kvsim.model")),
    ("kvsim.policies", ("kvsim.measure", "kvsim.sim", "kvsim.replay", "kvsim.validate",
                        "kvsim.plan", "kvsim.commands", "profiler")),
    ("kvsim.measure", ("kvsim.sim", "kvsim.replay", "kvsim.validate", "kvsim.plan",
                       "kvsim.commands", "profiler")),
    ("kvsim.sim", ("kvsim.policies", "kvsim.measure", "kvsim.replay", "kvsim.validate",
                   "kvsim.plan", "kvsim.commands", "profiler", "kvsim.model", "torch")),
    ("kvsim.replay", ("kvsim.validate", "kvsim.plan", "kvsim.commands", "profiler")),
    ("kvsim.fit", ("kvsim.validate", "kvsim.plan", "kvsim.commands", "profiler", "torch")),
    ("kvsim.hw", ("kvsim.policies", "kvsim.measure", "kvsim.sim", "kvsim.replay", "kvsim.fit",
                  "kvsim.validate", "kvsim.plan", "kvsim.commands", "profiler", "torch")),
    ("kvsim.plan", ("kvsim.validate", "kvsim.commands", "profiler", "torch")),
    ("kvsim.contract", ("kvsim.", "torch")),
    ("kvsim.captureset", ("kvsim.policies", "kvsim.measure", "kvsim.sim", "kvsim.replay",
                          "kvsim.plan", "kvsim.model", "kvsim.commands", "torch")),
    ("kvsim.policy_profile", ("kvsim.sim", "kvsim.replay", "kvsim.validate", "kvsim.plan",
                              "kvsim.commands", "profiler", "kvsim.model")),
    # the model routes attention; the harness (kvsim.measure) runs policies in it and counts
    ("kvsim.model", ("kvsim.measure", "kvsim.policies", "kvsim.sim", "kvsim.replay",
                     "kvsim.validate", "kvsim.plan", "kvsim.commands", "profiler")),
    ("kvsim.sim", ("kvsim._torch", "matplotlib")),
    ("kvsim.plan", ("kvsim._torch",)),
]

# The imports that close the module cycles known today, in files outside the change that added
# this test (issue #42): (importer, imported). Being fixed: empty this list as the fixes land,
# never add to it.


def imported_names(source: str, module: str, is_package: bool) -> list[tuple[str, int, bool]]:
    """What a file imports anywhere (module level, functions, ``if TYPE_CHECKING``), as
    (name, line, whether it runs on import: outside every function): ``import a.b`` names
    ``a.b``, ``from a import b`` names ``a.b`` (a module, or a name in ``a``); relative imports
    are resolved against ``module``; ``importlib.import_module("a.b")`` with a constant counts."""
    tree = ast.parse(source)
    lazy = {id(n) for f in ast.walk(tree)
            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            for n in ast.walk(f)}
    here = module.split(".") if is_package else module.split(".")[:-1]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(here[:len(here) - node.level + 1] + ([base] if base else []))
            names = [base if a.name == "*" else f"{base}.{a.name}".lstrip(".")
                     for a in node.names]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module" \
                and node.args and isinstance(node.args[0], ast.Constant):
            names = [node.args[0].value]
        else:
            continue
        out += [(n, node.lineno, id(node) not in lazy) for n in names if n]
    return out


def _imports(path: pathlib.Path) -> set[str]:
    """Modules a file imports anywhere (module level or inside functions)."""
    return {n for n, _, _ in imported_names(path.read_text(), _module(path),
                                            path.name == "__init__.py")}


def _module(path: pathlib.Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def source_files() -> dict[str, pathlib.Path]:
    """Every module of kvsim/ and profiler/ (a package's ``__init__`` is the package's name)."""
    return {_module(p): p for top in ("kvsim", "profiler")
            for p in sorted((ROOT / top).rglob("*.py"))}


def import_edges(files: dict[str, pathlib.Path]) -> list[tuple[str, str, int, bool]]:
    """Every import of one module of ``files`` by another: (importer, imported, line, whether it
    runs on import). A name counts as the longest module it starts with (``from kvsim.x import
    y`` imports ``kvsim.x.y`` when y is a module, else ``kvsim.x``); the parent packages that
    Python runs first do not count."""
    out = []
    for mod, path in files.items():
        for name, line, eager in imported_names(path.read_text(), mod,
                                                path.name == "__init__.py"):
            parts = name.split(".")
            target = next((".".join(parts[:k]) for k in range(len(parts), 0, -1)
                           if ".".join(parts[:k]) in files), None)
            if target is not None and target != mod:
                out.append((mod, target, line, eager))
    return out


def import_graph(files: dict[str, pathlib.Path] | None = None) -> dict[str, dict[str, int]]:
    """module -> {module of kvsim/ or profiler/ it imports, lazily or not: the first line}."""
    files = source_files() if files is None else files
    g: dict[str, dict[str, int]] = {m: {} for m in files}
    for a, b, line, _ in import_edges(files):
        g[a][b] = min(line, g[a].get(b, line))
    return g


def package(module: str) -> str:
    """The package a module belongs to: kvsim/<name>/ or kvsim/<name>.py, or profiler."""
    parts = module.split(".")
    return "profiler" if parts[0] == "profiler" else ".".join(parts[:2])


def strong_components(g: dict) -> list[set[str]]:
    """The strongly connected components of ``g`` that hold a cycle (more than one node, or one
    node that imports itself), by Tarjan's algorithm."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    comps: list[set[str]] = []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = {stack.pop()}
            while v not in comp:
                comp.add(stack.pop())
            if len(comp) > 1 or v in g.get(v, ()):
                comps.append(comp)

    for v in sorted(g):
        if v not in index:
            visit(v)
    return sorted(comps, key=sorted)


def cycle_in(g: dict, comp: set[str]) -> list[str]:
    """A shortest cycle through the first node of a strongly connected ``comp``, first node
    repeated at the end (breadth first within ``comp``)."""
    start = min(comp)
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(g.get(v, ())):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return path[::-1] + [start]
                if w in comp and w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{start} is on no cycle")


def described(g: dict, comp: set[str]) -> str:
    """A cycle of ``comp`` with the import lines that form it, then every import within it."""
    c = cycle_in(g, comp)
    inner = sorted(f"{a}:{g[a][b]} -> {b}" for a in comp for b in g[a] if b in comp)
    return (" -> ".join(f"{a} (line {g[a][b]})" for a, b in zip(c, c[1:])) + f" -> {c[-1]}"
            + f"; all imports within: {inner}")


def test_no_module_imports_downstream():
    bad = []
    for path in sorted((ROOT / "kvsim").rglob("*.py")) + sorted((ROOT / "profiler").rglob("*.py")):
        mod = _module(path)
        for importer, forbidden in UPSTREAM_ONLY:
            if mod == importer or mod.startswith(importer + "."):
                bad += [f"{mod} imports {m}" for m in _imports(path)
                        if any(m == f or m.startswith(f.rstrip(".") + ".") or
                               (f.endswith(".") and m.startswith(f)) for f in forbidden)]
    assert not bad, bad


def test_simulator_and_planner_load_no_torch_or_matplotlib():
    code = ("import sys, kvsim.sim.engine, kvsim.sim.timeline, kvsim.sim.workload, "
            "kvsim.plan.sweep, kvsim.plan.planner, kvsim.plan.slo, kvsim.plan.executors, "
            "kvsim.replay, kvsim.contract, kvsim.policies, kvsim.cli, kvsim.policy_profile, "
            "kvsim.policy_profile.fit, kvsim.captureset; "
            "print(sorted(m for m in ('torch', 'matplotlib') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]"


def test_help_loads_no_command_and_no_heavy_library():
    code = ("import sys; from kvsim.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in ('torch', 'matplotlib', 'pandas', 'simpy') "
            "if m in sys.modules), file=sys.stderr)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert p.stderr.strip() == "[]" and "replay" in p.stdout and "validate" in p.stdout


def test_no_function_over_60_statements():
    """The bound on size is per function (ruff's PLR0915 in CI says the same): a module may grow
    by adding small functions, not by growing one."""
    import ast
    long = []
    for p in list(ROOT.glob("kvsim/**/*.py")) + list(ROOT.glob("profiler/*.py")):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = sum(isinstance(x, ast.stmt) for x in ast.walk(node)) - 1
                if n > 60:
                    long.append(f"{p.relative_to(ROOT)}:{node.lineno} {node.name} ({n})")
    assert not long, long


def test_no_policy_name_decides_behaviour_outside_the_policies():
    """Outside ``kvsim/policies`` no code names a policy to decide what to do (docstrings and
    help text may mention one); the one exception reads an older profile's single decide table
    as VerKV's, which is what that table timed."""
    import ast

    from kvsim.policies import load_all
    names = set(load_all()) - {"dense-resident", "dense-offload"}  # the baselines by name
    allowed = {("kvsim/trace.py", "verkv")}
    found = []
    for p in list(ROOT.glob("kvsim/**/*.py")) + list(ROOT.glob("profiler/*.py")):
        rel = str(p.relative_to(ROOT))
        if rel.startswith("kvsim/policies/"):
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Constant) and node.value in names \
                    and (rel, node.value) not in allowed:
                found.append(f"{rel}:{node.lineno} {node.value!r}")
    assert not found, found


def test_the_import_parser_sees_every_kind_of_import():
    src = ("import kvsim.sim.engine\nfrom kvsim.policies import verkv, make\n"
           "from . import rope\nfrom ..errors import KvsimError\n"
           "if TYPE_CHECKING:\n    from kvsim.hw import catalog\n"
           "class C:\n    import numpy\n"
           "def f():\n    from kvsim.plan import plots\n    importlib.import_module('kvsim.fit')\n")
    got = set(imported_names(src, "kvsim.attention.dense", is_package=False))
    assert got == {("kvsim.sim.engine", 1, True), ("kvsim.policies.verkv", 2, True),
                   ("kvsim.policies.make", 2, True), ("kvsim.attention.rope", 3, True),
                   ("kvsim.errors.KvsimError", 4, True), ("kvsim.hw.catalog", 6, True),
                   ("numpy", 8, True), ("kvsim.plan.plots", 10, False), ("kvsim.fit", 11, False)}
    assert ("kvsim.x.y", 1, True) in imported_names("from . import y", "kvsim.x", is_package=True)


def test_an_import_counts_as_the_module_it_names(tmp_path):
    """``from kvsim.x import b`` (b a module) imports kvsim.x.b, not kvsim.x; ``from kvsim.x
    import name`` imports kvsim.x; a lazy import is an arrow like any other."""
    src = {"x/__init__.py": "from kvsim.x.a import A\n",
           "x/a.py": "from kvsim.x import b\nA = 1\n",
           "x/b.py": "def f():\n    from kvsim.x import A\n",
           "y.py": "import kvsim.x.b\n"}
    files = {}
    for rel, text in src.items():
        (tmp_path / rel).parent.mkdir(exist_ok=True)
        (tmp_path / rel).write_text(text)
        files["kvsim." + rel.removesuffix(".py").removesuffix("/__init__").replace("/", ".")] = \
            tmp_path / rel
    g = import_graph(files)
    assert g == {"kvsim.x": {"kvsim.x.a": 1}, "kvsim.x.a": {"kvsim.x.b": 1},
                 "kvsim.x.b": {"kvsim.x": 2}, "kvsim.y": {"kvsim.x.b": 1}}
    assert strong_components(g) == [{"kvsim.x", "kvsim.x.a", "kvsim.x.b"}]
    assert cycle_in(g, strong_components(g)[0]) == ["kvsim.x", "kvsim.x.a", "kvsim.x.b",
                                                    "kvsim.x"]


def test_the_cycle_finder_finds_every_cycle():
    g = {"a": {"b": 1}, "b": {"c": 1, "d": 1}, "c": {"a": 1}, "d": {}, "e": {"e": 1},
         "f": {"g": 1}, "g": {"f": 1, "a": 1}}
    assert strong_components(g) == [{"a", "b", "c"}, {"e"}, {"f", "g"}]
    assert cycle_in(g, {"a", "b", "c"}) == ["a", "b", "c", "a"]
    assert strong_components({"a": {"b": 1}, "b": {"c": 1}, "c": {}}) == []


def package_graph(g: dict[str, dict[str, int]]) -> dict[str, dict[str, str]]:
    """package -> {package it imports: the first import that does, "module:line -> module"}."""
    pg: dict[str, dict[str, str]] = {}
    for a in sorted(g):
        pg.setdefault(package(a), {})
        for b, line in sorted(g[a].items()):
            if package(a) != package(b):
                pg[package(a)].setdefault(package(b), f"{a}:{line} -> {b}")
    return pg


def test_no_two_packages_import_each_other():
    """Package A imports package B when any module of A imports any module of B, lazily or not
    (a package: kvsim/<name>/, kvsim/<name>.py, profiler/). The package graph has no cycle at
    all, so no two packages import each other."""
    pg = package_graph(import_graph())
    assert {"profiler", "kvsim.model", "kvsim.measure", "kvsim.trace", "kvsim.sim"} <= set(pg)
    bad = [" ; ".join(pg[a][b] for a, b in zip(c, c[1:]))
           for c in (cycle_in(pg, comp) for comp in strong_components(pg))]
    assert not bad, bad
    assert "kvsim.model" in pg["kvsim.measure"]  # the harness runs policies in the model


def test_no_module_imports_itself_through_a_chain():
    """No module imports one that imports it back, directly or through a chain (imports inside
    functions included; a package's ``__init__`` is a module)."""
    g = import_graph()
    bad = [described(g, comp) for comp in strong_components(g)]
    assert not bad, bad


def test_the_archived_analyses_live_outside_data_and_the_package():
    """Scripts are not data: no Python file under data/; the archived analyses
    (scripts/analyses/) are imported or run by nothing in kvsim/ or profiler/."""
    assert not sorted((ROOT / "data").rglob("*.py"))
    assert (ROOT / "scripts" / "analyses" / "published-2026-12-05" / "report.md").is_file()
    bad = [f"{m}:{line} {n}" for m, p in source_files().items()
           for n, line, _ in imported_names(p.read_text(), m, p.name == "__init__.py")
           if n.split(".")[0] == "scripts"]
    bad += [str(p) for p in source_files().values() if "scripts/analyses" in p.read_text()]
    assert not bad, bad


PLOTS = {"kvsim.plan.plots", "kvsim.plan.axes"}  # the planner's figures: matplotlib lives here


def test_matplotlib_only_in_the_plots_which_the_planner_imports_to_draw():
    """Only kvsim/plan/plots.py and axes.py import matplotlib; every other module imports them
    inside the functions that draw figures or write the report, never on import."""
    files = source_files()
    users = {m for m, p in files.items() for n, _, _ in imported_names(
        p.read_text(), m, p.name == "__init__.py") if n.split(".")[0] == "matplotlib"}
    assert users == PLOTS
    eager = [f"{a}:{line} -> {b}" for a, b, line, on_import in import_edges(files)
             if b in PLOTS and a not in PLOTS and on_import]
    assert not eager, eager
    assert any(b in PLOTS and a == "kvsim.plan.planner" for a, b, _, _ in import_edges(files))


def _loads(modules: list[str]) -> list[str]:
    """Which of torch and matplotlib importing ``modules`` loads, in a fresh interpreter."""
    code = (f"import importlib, json, sys\nfor m in {modules!r}:\n    importlib.import_module(m)\n"
            "print(json.dumps(sorted(m for m in ('torch', 'matplotlib') if m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout
    return json.loads(out)


def test_the_simulator_and_the_planner_load_neither_torch_nor_matplotlib():
    """Importing every module of the simulator and of the planner (but its plots) loads neither;
    the plots load matplotlib and no torch. (That no module of either imports torch, nor one of
    the simulator's matplotlib, lazily or not, is UPSTREAM_ONLY's.)"""
    files = source_files()
    mods = sorted(m for m in files if package(m) in ("kvsim.sim", "kvsim.plan")
                  and m not in PLOTS)
    assert "kvsim.sim.engine" in mods and "kvsim.plan.planner" in mods
    assert _loads(mods) == []
    assert _loads(sorted(PLOTS)) == ["matplotlib"]


def test_the_docs_name_the_tables_this_file_holds():
    """README.md's "How data flows" and CONTRIBUTING.md's "One-way imports" cite this file's
    tables by name: each name they cite is one here."""
    import re
    for doc in ("README.md", "CONTRIBUTING.md"):
        text = (ROOT / doc).read_text()
        assert "tests/test_layout.py" in text
        cited = set(re.findall(r"`([A-Z][A-Z_]+)`", text))
        assert "UPSTREAM_ONLY" in cited, doc
        assert cited <= set(globals()), (doc, cited - set(globals()))

