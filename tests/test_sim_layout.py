"""The simulator's rooms: its modules import one way (records <- run pieces <- topologies <-
the front), so the package's import graph has no cycle and the records import none of it."""

import ast
import pathlib

SIM = pathlib.Path(__file__).resolve().parents[1] / "kvsim" / "sim"


def sim_imports(path: pathlib.Path) -> set[str]:
    """The kvsim.sim modules a file imports, anywhere in it (module level or in functions)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        out |= {n.split(".")[2] for n in names if n.startswith("kvsim.sim.")}
    return out


def graph() -> dict[str, set[str]]:
    mods = {p.stem for p in SIM.glob("*.py") if p.stem != "__init__"}
    return {p.stem: sim_imports(p) & mods for p in SIM.glob("*.py") if p.stem != "__init__"}


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    """A cycle of the directed graph ``g`` as the list of its nodes, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(n, path):
        state[n] = 1
        for m in sorted(g.get(n, ())):
            if state.get(m) == 1:
                return path[path.index(m):] + [m]
            if m not in state and (found := visit(m, path + [m])):
                return found
        state[n] = 2
        return None

    for n in sorted(g):
        if n not in state and (found := visit(n, [n])):
            return found
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"a"}}) == ["a", "a"]


def test_the_simulator_imports_one_way():
    g = graph()
    assert "records" in g and "engine" in g
    assert find_cycle(g) is None, find_cycle(g)
    assert g["records"] == set(), "records is the leaf"
    assert not any("engine" in deps for mod, deps in g.items() if mod != "timeline"), \
        "only the timeline (which reads a run's result) sits above the front"
