"""The shape of kvcd/ that the layer contracts (import-linter, in CI) cannot state: no import
loop between any two of its modules, counting imports inside functions and under
TYPE_CHECKING too (a loop hidden in a function is still a loop), and no room over 500 lines
(a room that grows past it holds more than one job: split it along them)."""

from __future__ import annotations

import ast
from pathlib import Path

KVCD = Path(__file__).resolve().parents[2] / "kvcd"


def _modules() -> dict[str, Path]:
    out = {}
    for path in KVCD.rglob("*.py"):
        parts = path.relative_to(KVCD.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the kvcd modules it imports, anywhere in its body."""
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    targets.append(sub if sub in mods else node.module)
            elif isinstance(node, ast.Import):
                targets.extend(alias.name for alias in node.names)
            graph[name].update(t for t in targets if t in mods and t not in (name, "kvcd"))
    return graph


def loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_loop_finder_finds_a_loop() -> None:
    assert loops({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert loops({"a": {"b"}, "b": set()}) == []


def test_no_import_loop_in_kvcd() -> None:
    graph = import_graph()
    # The walk sees top-level and function-local imports (cli imports the loader in a verb).
    assert "kvcd.core.attempts" in graph["kvcd.daemon.service"]
    assert "kvcd.config.loader" in graph["kvcd.cli"]
    assert loops(graph) == []


MAX_LINES = 500


def test_no_room_over_500_lines() -> None:
    sizes = {
        str(p.relative_to(KVCD.parent)): len(p.read_text().splitlines()) for p in KVCD.rglob("*.py")
    }
    assert len(sizes) > 50  # the walk works
    assert {p: n for p, n in sizes.items() if n > MAX_LINES} == {}
