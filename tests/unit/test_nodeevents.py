"""Node Events as tables (kvcd/core/nodeevents.py): which changes are reported, and how the
correlator keeps the stream small (spam filter, similar events, identical events counted)."""

from __future__ import annotations

import re

import pytest

from kvcd.core import nodeevents as ne
from kvcd.core.nodeevents import Published as P

LOADED = P("Done")
UNLOADED = P("Done", goal="unloaded")
DRIFT = P("Degraded", "Drift", "Drift: /etc/x changed")
REMOVED = P("Degraded", "ModuleRemoved", "ModuleRemoved: m")
LOAD_FAILED = P("Degraded", "LoadFailed", "LoadFailed: m: -22")
DRAIN = P("Working", "DrainRequired", "DrainRequired: m in use")
REBOOT = P("Working", "RebootRequired", "RebootRequired: rmmod failed")
DRAIN_TIMEOUT = P("Degraded", "DrainTimeout", "DrainTimeout: no answer")


def nk(p: P, kernel: str, st: str, why: str = "") -> P:
    return P(p.state, p.code, p.reason, p.goal, kernel, st, why)


@pytest.mark.parametrize(
    ("before", "now", "expect"),
    [
        # the first publication of a process: its state
        (None, LOADED, [("ModulesLoaded", "nic: Done", False)]),
        (None, DRIFT, [("Drift", "nic: Degraded: Drift: /etc/x changed", True)]),
        # nothing changed: nothing
        (LOADED, LOADED, []),
        (DRIFT, DRIFT, []),
        # state changes
        (LOADED, UNLOADED, [("ModulesUnloaded", "nic: Done", False)]),
        (LOADED, LOAD_FAILED, [("LoadFailed", "nic: Degraded: LoadFailed: m: -22", True)]),
        # drift detected, then cleared
        (LOADED, DRIFT, [("Drift", "nic: Degraded: Drift: /etc/x changed", True)]),
        (
            DRIFT,
            LOADED,
            [
                ("DriftCleared", "nic: Drift cleared: Done", False),
                ("ModulesLoaded", "nic: Done", False),
            ],
        ),
        (
            REMOVED,
            LOADED,
            [
                ("DriftCleared", "nic: ModuleRemoved cleared: Done", False),
                ("ModulesLoaded", "nic: Done", False),
            ],
        ),
        # from one drift to another, or to another failure: not cleared
        (DRIFT, REMOVED, [("ModuleRemoved", "nic: Degraded: ModuleRemoved: m", True)]),
        (
            DRIFT,
            LOAD_FAILED,
            [
                ("DriftCleared", "nic: Drift cleared: Degraded", False),
                ("LoadFailed", "nic: Degraded: LoadFailed: m: -22", True),
            ],
        ),
        # a drain requested, escalated, released (applied or timed out)
        (LOADED, DRAIN, [("DrainRequired", "nic: Working: DrainRequired: m in use", False)]),
        (DRAIN, REBOOT, [("RebootRequired", "nic: Working: RebootRequired: rmmod failed", False)]),
        (
            DRAIN,
            LOADED,
            [
                ("DrainReleased", "nic: drain claim released: Done", False),
                ("ModulesLoaded", "nic: Done", False),
            ],
        ),
        (
            DRAIN,
            DRAIN_TIMEOUT,
            [
                ("DrainReleased", "nic: drain claim released: Degraded", False),
                ("DrainTimeout", "nic: Degraded: DrainTimeout: no answer", True),
            ],
        ),
        (DRAIN_TIMEOUT, LOADED, [("ModulesLoaded", "nic: Done", False)]),  # released before
        # the next kernel
        (LOADED, nk(LOADED, "6.2", "preparing"), []),
        (
            nk(LOADED, "6.2", "preparing"),
            nk(LOADED, "6.2", "ready"),
            [("NextKernelReady", "nic: ready for kernel 6.2", False)],
        ),
        (
            nk(LOADED, "6.2", "preparing"),
            nk(LOADED, "6.2", "failed", "BuildFailed: exit 2"),
            [("NextKernelFailed", "nic: not ready for kernel 6.2: BuildFailed: exit 2", True)],
        ),
        (nk(LOADED, "6.2", "ready"), nk(LOADED, "6.2", "ready"), []),
        (
            nk(LOADED, "6.2", "ready"),
            nk(LOADED, "6.3", "ready"),
            [("NextKernelReady", "nic: ready for kernel 6.3", False)],
        ),
        (
            None,
            nk(LOADED, "6.2", "ready"),
            [
                ("ModulesLoaded", "nic: Done", False),
                ("NextKernelReady", "nic: ready for kernel 6.2", False),
            ],
        ),
        (nk(LOADED, "6.2", "ready"), LOADED, []),  # booted into it, or it was removed
    ],
)
def test_what_is_reported(before: P | None, now: P, expect: list[tuple[str, str, bool]]) -> None:
    got = [(e.reason, e.message, e.warning) for e in ne.events_for("nic", before, now)]
    assert got == expect


def ev(reason: str = "LoadFailed", message: str = "nic: x", warning: bool = True) -> ne.NodeEvent:
    return ne.NodeEvent(reason, message, warning)


def test_the_same_event_again_is_counted_on_one_object() -> None:
    c = ne.Correlator("node-1")
    first = c.decide(ev(), 0.0)
    again = [c.decide(ev(), float(t)) for t in (1, 2, 3)]
    assert first.what == ne.CREATE and first.count == 1
    assert [(d.what, d.count) for d in again] == [(ne.COUNT, 2), (ne.COUNT, 3), (ne.COUNT, 4)]
    assert {d.name for d in [first, *again]} == {first.name}
    assert first.name.startswith("node-1.kvcd-")


@pytest.mark.parametrize(
    "other",
    [ev(reason="UnloadFailed"), ev(message="nic: y"), ev(warning=False)],
    ids=["reason", "message", "type"],
)
def test_a_different_reason_message_or_type_is_another_event(other: ne.NodeEvent) -> None:
    c = ne.Correlator("n")
    a, b = c.decide(ev(), 0.0), c.decide(other, 1.0)
    assert (a.what, b.what) == (ne.CREATE, ne.CREATE) and a.name != b.name


def test_the_name_is_the_same_in_another_process() -> None:
    """A restarted daemon finds the Event its predecessor created (and counts on it)."""
    assert ne.Correlator("n").decide(ev(), 0.0).name == ne.Correlator("n").decide(ev(), 9.0).name


# An Event's name is a DNS subdomain (at most 253 characters): so is a node's, so a long node name
# leaves no room for ".kvcd-<digest>". Label-shaped 63-character parts, as a real FQDN has.
LABEL63 = "a" * 62 + "b"
LONGEST = ".".join([LABEL63] * 3 + ["c" * 61])  # 253: the longest valid node name
assert len(LONGEST) == 253
DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
NAMES = [
    ("short", "worker-1"),
    ("fits exactly", "n" * 231),
    ("one over", "n" * 232),
    ("the longest node name", LONGEST),
    ("cut at a dot", "x" * 230 + ".y" + "z" * 20),
    ("cut at a dash", "x" * 230 + "-y" + "z" * 20),
    ("cut after dashes", "x" * 228 + "---y" + "z" * 20),
]


@pytest.mark.parametrize("node", [n[1] for n in NAMES], ids=[n[0] for n in NAMES])
def test_event_names_are_dns_subdomains_for_any_node_name(node: str) -> None:
    name = ne.event_name(node, "LoadFailed", "nic: x", True)
    assert len(name) <= 253 and DNS_SUBDOMAIN.fullmatch(name), (len(name), name)
    # One name per node and event, as before: unique among nodes sharing a long prefix, the same
    # in another process, another for another event.
    assert name == ne.event_name(node, "LoadFailed", "nic: x", True)
    assert name != ne.event_name(node + "q", "LoadFailed", "nic: x", True)
    assert name != ne.event_name(node, "LoadFailed", "nic: y", True)
    if len(node) <= 231:  # names that fitted stay what they were (a restarted daemon's count)
        assert name.startswith(f"{node}.kvcd-") and len(name) == len(node) + 22


def test_a_flood_is_cut_by_the_token_bucket_and_refills() -> None:
    c = ne.Correlator("n")
    got = [c.decide(ev(message=f"nic: {i % 3}"), 0.0).what for i in range(ne.BURST + 5)]
    assert got.count(ne.DROP) == 5 and ne.DROP not in got[: ne.BURST]
    assert c.decide(ev(), ne.REFILL_SECONDS - 1).what == ne.DROP  # not a whole token yet
    assert c.decide(ev(), ne.REFILL_SECONDS + 1).what != ne.DROP  # one more after 5 minutes
    assert c.decide(ev(), ne.REFILL_SECONDS + 2).what == ne.DROP


def test_more_than_ten_similar_messages_are_combined() -> None:
    c = ne.Correlator("n")
    ds = [c.decide(ev(message=f"nic: holders: pid {i}"), float(i)) for i in range(13)]
    assert all(not d.message.startswith(ne.COMBINED) for d in ds[: ne.SIMILAR_MAX])
    combined = ds[ne.SIMILAR_MAX :]
    assert [d.message for d in combined] == [
        ne.COMBINED + f"nic: holders: pid {i}" for i in range(ne.SIMILAR_MAX, 13)
    ]
    # one Event for the combined ones, counted
    assert {d.name for d in combined} == {combined[0].name}
    assert [d.count for d in combined] == [1, 2, 3]


def test_similar_messages_outside_the_window_are_not_combined() -> None:
    c = ne.Correlator("n")
    step = ne.SIMILAR_WINDOW / ne.SIMILAR_MAX + 1  # never more than ten in one window
    ds = [c.decide(ev(message=f"nic: {i}"), i * step) for i in range(15)]
    assert not any(d.message.startswith(ne.COMBINED) for d in ds)


def test_the_memory_of_counts_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ne, "CACHE_SIZE", 3)
    monkeypatch.setattr(ne, "BURST", 100)
    c = ne.Correlator("n")
    for r in ("A", "B", "C", "D"):  # different reasons: never similar
        c.decide(ev(reason=r), 0.0)
    assert len(c.counts) == 3
    assert c.decide(ev(reason="A"), 1.0).what == ne.CREATE  # forgotten: created (or found) again
    assert c.decide(ev(reason="D"), 1.0).what == ne.COUNT


def test_the_servers_count_corrects_the_memory() -> None:
    c = ne.Correlator("n")
    d = c.decide(ev(), 0.0)
    c.correct(d.name, 7)  # the Event was already there with count 6, now 7
    assert c.decide(ev(), 1.0).count == 8
