"""dependsOn between instances (the Special Resource Operator's `dependsOn`): order and cycles.

Pure. The graph maps an instance to the instances it depends on (they load first, unload last).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence


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
    # Depth first without recursion: a chain deeper than Python's recursion limit works, and no
    # step copies or scans the path (#20: no step may cost the chain's depth per name).
    for root in roots if roots is not None else sorted(graph):
        path: list[str] = []  # the names being visited, outermost first
        on_path: set[str] = set()
        pending: list[Iterator[str]] = []  # per name on the path: its dependencies to visit
        name: str | None = None if root in done else root
        while name is not None or pending:
            if name is not None:
                if name in on_path:
                    chain = [*path[path.index(name) :], name]
                    raise DependencyError(f"dependency cycle: {' -> '.join(chain)}", chain)
                if name not in graph:
                    chain = [*path, name]
                    raise DependencyError(
                        f"depends on {name!r}, which is not configured "
                        f"(chain {' -> '.join(chain)})",
                        chain,
                    )
                path.append(name)
                on_path.add(name)
                pending.append(iter(graph[name]))
                name = None
            for dep in pending[-1]:
                if dep not in done:
                    name = dep
                    break
            else:  # every dependency is in the order: this one goes next
                pending.pop()
                finished = path.pop()
                on_path.remove(finished)
                done.add(finished)
                order.append(finished)
    return order


def unload_order(
    graph: Mapping[str, Sequence[str]], roots: Sequence[str] | None = None
) -> list[str]:
    """The reverse of load_order: dependents before what they depend on."""
    return list(reversed(load_order(graph, roots)))
