"""dependsOn between instances (the Special Resource Operator's `dependsOn`): order and cycles.

Pure. The graph maps an instance to the instances it depends on (they load first, unload last).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


class DependencyError(Exception):
    """A cycle or a missing instance; `chain` is the path that shows it, first to last."""

    def __init__(self, message: str, chain: Sequence[str]) -> None:
        super().__init__(message)
        self.chain = tuple(chain)


def load_order(graph: Mapping[str, Sequence[str]], roots: Sequence[str] | None = None) -> list[str]:
    """Instances in load order: every dependency before its dependents.

    Deterministic: depth-first from each root in the given order (default: sorted names),
    dependencies in the order they are listed. Raises DependencyError on a cycle (chain
    a -> b -> a) or on a dependency that is not in the graph (chain a -> b -> missing).
    """
    order: list[str] = []
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        if name in done:
            return
        if name in path:
            chain = [*path[path.index(name) :], name]
            raise DependencyError(f"dependency cycle: {' -> '.join(chain)}", chain)
        if name not in graph:
            chain = [*path, name]
            raise DependencyError(
                f"depends on {name!r}, which is not configured (chain {' -> '.join(chain)})",
                chain,
            )
        for dep in graph[name]:
            visit(dep, [*path, name])
        done.add(name)
        order.append(name)

    for root in roots if roots is not None else sorted(graph):
        visit(root, [])
    return order


def unload_order(
    graph: Mapping[str, Sequence[str]], roots: Sequence[str] | None = None
) -> list[str]:
    """The reverse of load_order: dependents before what they depend on."""
    return list(reversed(load_order(graph, roots)))
