"""The OS-update gate (issue #18): may this node boot into the kernel it will boot next?

Each instance publishes `<p>/<stem>.next-kernel` = "<kernel> ready" | "<kernel> preparing" |
"<kernel> failed: <reason>" (kvcd/daemon/report.py). From all of them, node-wide:
- label `<p>/upgradeable` = "false" while any instance failed to prepare for its next kernel,
  or is still preparing for it, else "true": what an orchestrator selects on before it reboots
  a node (SRO's Upgradeable=False in cluster form). A reboot mid-preparation would boot a kernel
  the driver is not ready for, and a retry after a failure must not open the gate while it runs;
- annotation `<p>/upgradeable-reason`: which instances, for which kernel, and why (absent when
  upgradeable).
Computed from the node's own annotations, so every instance's daemon reaches the same answer,
and the last writer's view includes every other writer's key. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping

GATE = "upgradeable"
GATE_REASON = "upgradeable-reason"
SUFFIX = ".next-kernel"
# The reason annotation stays readable (as every annotation value, kvcd/node/backend.py).
MAX_REASON = 1024


def not_ready(annotations: Mapping[str, str], prefix: str) -> list[str]:
    """'<stem>: <kernel> failed: <reason>' or '<stem>: <kernel> preparing' for each instance
    whose next kernel is not ready, sorted."""
    out = []
    head = prefix + "/"
    for key, value in annotations.items():
        if not (key.startswith(head) and key.endswith(SUFFIX)):
            continue
        kernel, _, rest = value.partition(" ")
        if kernel and (rest.startswith("failed") or rest == "preparing"):
            out.append(f"{key[len(head) : -len(SUFFIX)]}: {value}")
    return sorted(out)


def node_keys(annotations: Mapping[str, str], prefix: str) -> tuple[str, str | None]:
    """(the label's value, the reason annotation's value; None removes it)."""
    bad = not_ready(annotations, prefix)
    if not bad:
        return "true", None
    reason = "; ".join(bad)
    if len(reason) > MAX_REASON:
        reason = reason[: MAX_REASON - 1] + "…"
    return "false", reason


def annotation_patch(annotations: Mapping[str, str], prefix: str) -> dict[str, str | None]:
    """The reason annotation as `annotations` (the node's, as they will be) make it."""
    return {f"{prefix}/{GATE_REASON}": node_keys(annotations, prefix)[1]}


def label_patch(annotations: Mapping[str, str], prefix: str) -> dict[str, str | None]:
    """The gate label as `annotations` make it."""
    return {f"{prefix}/{GATE}": node_keys(annotations, prefix)[0]}
