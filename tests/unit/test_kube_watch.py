"""The Kubernetes backend's watch loop against a watch that keeps failing in ways a proxy or a
wrong server can make it fail: it backs off, says so once at WARNING, tells the writer its
views cannot be trusted (on_lost), and re-lists after an answer that is not this Node."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import kubernetes.watch
import pytest

from kvcd.node.backend import NodeView
from kvcd.node.kube import WATCH_WARN_AFTER, KubeBackend

NODE = "worker-1"
STATUS = {"kind": "Status", "apiVersion": "v1", "metadata": {"resourceVersion": "101"}}

# (case, what each watch stream yields)
STREAMS: list[tuple[str, list[dict[str, Any]]]] = [
    ("an object that is not this Node, every time", [{"type": "MODIFIED", "raw_object": STATUS}]),
    ("an event that is not an object", [{"type": "MODIFIED", "raw_object": ["x"]}]),
    ("an empty answer at once", []),
]


@pytest.mark.parametrize(("case", "events"), STREAMS, ids=[s[0] for s in STREAMS])
def test_a_watch_that_keeps_failing_backs_off_and_is_said_once(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    case: str,
    events: list[dict[str, Any]],
) -> None:
    be = KubeBackend(NODE, kubeconfig=None)
    monkeypatch.setattr(be, "api", type("Api", (), {"list_node": None}))  # be.api() -> one
    reads: list[int] = []

    def read() -> NodeView:
        reads.append(1)
        return NodeView(NODE, {}, {}, "100")

    class Watch:
        def stream(self, *_a: Any, **_k: Any) -> Iterator[dict[str, Any]]:
            yield from events

        def stop(self) -> None:
            pass

    monkeypatch.setattr(be, "read", read)
    monkeypatch.setattr(kubernetes.watch, "Watch", Watch)
    waits: list[float] = []

    def wait(delay: float | None = None) -> bool:
        waits.append(float(delay or 0))
        if len(waits) >= 6:
            be._stop.set()
        return be._stop.is_set()

    monkeypatch.setattr(be._stop, "wait", wait)
    lost: list[int] = []
    caplog.set_level(logging.DEBUG, "kvcd.node.kube")
    be._watch_loop(lambda _v: None, lambda: lost.append(1))

    assert waits == sorted(waits) and waits[-1] > waits[0], waits  # backs off
    assert len(lost) == len(waits)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith("node watch: "), warnings
    assert len([w for w in waits if w]) >= WATCH_WARN_AFTER
    if events and events[0]["raw_object"] is STATUS:
        assert len(reads) == len(waits)  # re-listed each time, never resumed past it
