"""The drain handshake: both literal tables row by row, restarts mid-handshake, one request per
node shared by instances, and the whole path through the `kvcd run` loop on a fake host with the
file backend (a test plays the cluster's drain controller by writing drain-current)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from kvcd.config.loader import load_instance, load_settings
from kvcd.core import drain as hs
from kvcd.core import state
from kvcd.core.attempts import RETRY
from kvcd.daemon import extensions
from kvcd.daemon.drain import Drain, LeftOverClaim, mode_of
from kvcd.daemon.events import HOLD, Context, Event
from kvcd.daemon.record import Record
from kvcd.daemon.report import NodeLink, Reporter
from kvcd.daemon.service import Service
from kvcd.host.paths import HostRoot
from kvcd.node.filebackend import FileBackend
from tests import fakehost

K = "6.1.0-56-amd64"
MODS = ["kvcd_base", "kvcd_user"]
BOOT = "0b5e6c4e-0000-4000-8000-000000000001"
CONFIG = (
    'version = "{v}"\nmodules = ["kvcd_base", "kvcd_user"]\ndrain = "{mode}"\n'
    '[build]\ncontext = "/src"\n'
)
T0 = 1_700_000_000.0
TIMEOUT = 600.0


def claim(kind: str = hs.DRAIN_REQUIRED, boot: str = BOOT, since: float = T0) -> hs.Claim:
    return hs.Claim(kind, boot, since)


# The BEFORE table, every row: (claimed, drain-current, expired) -> the step.
BEFORE_TABLE = [
    ((False, hs.IDLE, False), hs.PROCEED),
    ((False, hs.DRAINING, False), hs.PROCEED),
    ((False, hs.DRAIN_COMPLETE, False), hs.PROCEED),
    ((True, hs.IDLE, False), hs.WAIT),
    ((True, hs.DRAINING, False), hs.WAIT),
    ((True, hs.DRAIN_COMPLETE, False), hs.PROCEED),
    ((True, hs.IDLE, True), hs.TIMEOUT),
    ((True, hs.DRAINING, True), hs.TIMEOUT),
    ((True, hs.DRAIN_COMPLETE, True), hs.PROCEED),  # the answer came; late is better than never
]


@pytest.mark.parametrize(("key", "step"), BEFORE_TABLE)
def test_before_table_row(key: tuple[bool, str, bool], step: str) -> None:
    assert hs.BEFORE[key] == step


def test_before_table_is_the_rows() -> None:
    assert dict(BEFORE_TABLE) == hs.BEFORE


def leftover(kind: str = hs.DRAIN_REQUIRED, since: float = T0) -> hs.Claim:
    """A claim made while drain-current still held the answer to an earlier, withdrawn request."""
    return hs.Claim(kind, BOOT, since, seen=hs.DRAIN_COMPLETE)


# claim, drain-current, now -> before(): how the table is entered
BEFORE_ROWS = [
    (None, "", T0, hs.PROCEED),
    (None, hs.DRAIN_COMPLETE, T0, hs.PROCEED),
    (claim(), "", T0 + 1, hs.WAIT),  # just requested, controller has not answered
    (claim(), hs.DRAINING, T0 + 10, hs.WAIT),
    (claim(), "garbage", T0 + 10, hs.WAIT),  # unknown answer counts as Idle
    (claim(), hs.DRAIN_COMPLETE, T0 + 10, hs.PROCEED),
    (claim(), hs.DRAINING, T0 + TIMEOUT + 1, hs.TIMEOUT),
    (claim(), hs.IDLE, T0 + TIMEOUT + 1, hs.TIMEOUT),
    (claim(), hs.DRAIN_COMPLETE, T0 + TIMEOUT + 1, hs.PROCEED),  # late answer still counts
    # restart mid-handshake: the claim is on the node, same boot -> keep waiting
    (claim(since=T0 - 30), hs.DRAINING, T0, hs.WAIT),
    # restart after a reboot: the claim is from another boot -> stale, proceed
    (claim(hs.REBOOT_REQUIRED, boot="old-boot"), hs.DRAINING, T0, hs.PROCEED),
    # a DrainComplete already there when the claim was made answers an earlier request
    (leftover(), hs.DRAIN_COMPLETE, T0 + 1, hs.WAIT),
    (leftover(), hs.DRAIN_COMPLETE, T0 + TIMEOUT + 1, hs.TIMEOUT),
    (leftover(hs.REBOOT_REQUIRED), hs.DRAIN_COMPLETE, T0 + 1, hs.WAIT),
    (leftover(), hs.DRAINING, T0 + 1, hs.WAIT),
]


@pytest.mark.parametrize(("c", "current", "now", "step"), BEFORE_ROWS)
def test_before(c: hs.Claim | None, current: str, now: float, step: str) -> None:
    assert hs.before(c, current, now, TIMEOUT, BOOT) == step


def test_stale() -> None:
    assert hs.stale(claim(boot="old"), BOOT)
    assert not hs.stale(claim(), BOOT)
    assert not hs.stale(None, BOOT)


# The AFTER table, every row: claim kind, drain-current, outcome -> action, state, reason code.
AFTER_TABLE = [
    # No claim yet: a blocked change asks for a drain; an unload that failed asks for a reboot.
    ("", hs.IDLE, hs.BLOCKED, hs.REQUEST_DRAIN, "Working", state.DRAIN_PENDING),
    ("", hs.DRAINING, hs.BLOCKED, hs.REQUEST_DRAIN, "Working", state.DRAIN_PENDING),
    # (a DrainComplete left from an earlier request is recorded in the claim: see new_claim)
    ("", hs.DRAIN_COMPLETE, hs.BLOCKED, hs.REQUEST_DRAIN, "Working", state.DRAIN_PENDING),
    ("", hs.IDLE, hs.UNLOADABLE, hs.REQUEST_REBOOT, "Degraded", state.REBOOT_PENDING),
    ("", hs.DRAINING, hs.UNLOADABLE, hs.REQUEST_REBOOT, "Degraded", state.REBOOT_PENDING),
    ("", hs.DRAIN_COMPLETE, hs.UNLOADABLE, hs.REQUEST_REBOOT, "Degraded", state.REBOOT_PENDING),
    ("", hs.IDLE, hs.APPLIED, hs.NOTHING, "", ""),
    ("", hs.DRAINING, hs.APPLIED, hs.NOTHING, "", ""),
    ("", hs.DRAIN_COMPLETE, hs.APPLIED, hs.NOTHING, "", ""),
    ("", hs.IDLE, hs.FAILED, hs.NOTHING, "", ""),
    ("", hs.DRAINING, hs.FAILED, hs.NOTHING, "", ""),
    ("", hs.DRAIN_COMPLETE, hs.FAILED, hs.NOTHING, "", ""),
    # Drain claimed.
    (hs.DRAIN_REQUIRED, hs.IDLE, hs.BLOCKED, hs.KEEP, "Working", state.DRAIN_PENDING),
    (hs.DRAIN_REQUIRED, hs.DRAINING, hs.BLOCKED, hs.KEEP, "Working", state.DRAIN_PENDING),
    (hs.DRAIN_REQUIRED, hs.DRAIN_COMPLETE, hs.BLOCKED, hs.RELEASE, "Degraded", state.MODULE_IN_USE),
    (hs.DRAIN_REQUIRED, hs.IDLE, hs.APPLIED, hs.RELEASE, "", ""),
    (hs.DRAIN_REQUIRED, hs.DRAINING, hs.APPLIED, hs.RELEASE, "", ""),
    (hs.DRAIN_REQUIRED, hs.DRAIN_COMPLETE, hs.APPLIED, hs.RELEASE, "", ""),
    (hs.DRAIN_REQUIRED, hs.IDLE, hs.FAILED, hs.RELEASE, "", ""),  # e.g. DrainTimeout
    (hs.DRAIN_REQUIRED, hs.DRAINING, hs.FAILED, hs.RELEASE, "", ""),
    (hs.DRAIN_REQUIRED, hs.DRAIN_COMPLETE, hs.FAILED, hs.RELEASE, "", ""),
    (
        hs.DRAIN_REQUIRED,
        hs.IDLE,
        hs.UNLOADABLE,
        hs.REQUEST_REBOOT,
        "Degraded",
        state.REBOOT_PENDING,
    ),
    (
        hs.DRAIN_REQUIRED,
        hs.DRAINING,
        hs.UNLOADABLE,
        hs.REQUEST_REBOOT,
        "Degraded",
        state.REBOOT_PENDING,
    ),
    (
        hs.DRAIN_REQUIRED,
        hs.DRAIN_COMPLETE,
        hs.UNLOADABLE,
        hs.REQUEST_REBOOT,
        "Degraded",
        state.REBOOT_PENDING,
    ),
    # Reboot claimed: kept while the module stays stuck; withdrawn once the change went through,
    # or on any other failure, DrainTimeout included (never left cordoned for kvcd).
    (hs.REBOOT_REQUIRED, hs.IDLE, hs.UNLOADABLE, hs.KEEP, "Degraded", state.REBOOT_PENDING),
    (hs.REBOOT_REQUIRED, hs.DRAINING, hs.UNLOADABLE, hs.KEEP, "Degraded", state.REBOOT_PENDING),
    (
        hs.REBOOT_REQUIRED,
        hs.DRAIN_COMPLETE,
        hs.UNLOADABLE,
        hs.KEEP,
        "Degraded",
        state.REBOOT_PENDING,
    ),
    (hs.REBOOT_REQUIRED, hs.IDLE, hs.BLOCKED, hs.KEEP, "Degraded", state.REBOOT_PENDING),
    (hs.REBOOT_REQUIRED, hs.DRAINING, hs.BLOCKED, hs.KEEP, "Degraded", state.REBOOT_PENDING),
    (hs.REBOOT_REQUIRED, hs.DRAIN_COMPLETE, hs.BLOCKED, hs.KEEP, "Degraded", state.REBOOT_PENDING),
    (hs.REBOOT_REQUIRED, hs.IDLE, hs.APPLIED, hs.RELEASE, "", ""),
    (hs.REBOOT_REQUIRED, hs.DRAINING, hs.APPLIED, hs.RELEASE, "", ""),
    (hs.REBOOT_REQUIRED, hs.DRAIN_COMPLETE, hs.APPLIED, hs.RELEASE, "", ""),
    (hs.REBOOT_REQUIRED, hs.IDLE, hs.FAILED, hs.RELEASE, "", ""),  # DrainTimeout
    (hs.REBOOT_REQUIRED, hs.DRAINING, hs.FAILED, hs.RELEASE, "", ""),
    (hs.REBOOT_REQUIRED, hs.DRAIN_COMPLETE, hs.FAILED, hs.RELEASE, "", ""),
]


@pytest.mark.parametrize(("kind", "current", "outcome", "action", "st", "code"), AFTER_TABLE)
def test_after(kind: str, current: str, outcome: str, action: str, st: str, code: str) -> None:
    assert hs.AFTER[(kind, current, outcome)] == (action, st, code)
    c = claim(kind) if kind else None
    assert hs.after(c, current, outcome) == (action, st, code)


def test_after_table_is_the_rows() -> None:
    assert len(AFTER_TABLE) == 36
    assert {(k, c, o): (a, s, r) for k, c, o, a, s, r in AFTER_TABLE} == hs.AFTER


def test_a_left_over_drain_complete_is_not_the_answer_after_either() -> None:
    # The change ran anyway (a restart, a DrainComplete that came and went unseen) and is still
    # blocked: nothing was drained for this claim, so it waits rather than "still in use after".
    assert hs.after(leftover(), hs.DRAIN_COMPLETE, hs.BLOCKED) == (
        hs.KEEP,
        "Working",
        state.DRAIN_PENDING,
    )


def live(kind: str = hs.DRAIN_REQUIRED, seen: str = "") -> str:
    return hs.Claim(kind, BOOT, T0, seen=seen).encode()


# drain-current, the other claims on the node -> the `seen` of a claim made now
NEW_CLAIM_ROWS = [
    ("", {}, ""),
    (hs.DRAINING, {}, ""),
    (hs.DRAIN_COMPLETE, {}, hs.DRAIN_COMPLETE),  # answers a request withdrawn since
    # answers a request still standing (the node stays drained for it): shared, it counts
    (hs.DRAIN_COMPLETE, {"p.io/a.drain": live()}, ""),
    # ... unless that one is itself waiting for a fresh answer
    (hs.DRAIN_COMPLETE, {"p.io/a.drain": live(seen=hs.DRAIN_COMPLETE)}, hs.DRAIN_COMPLETE),
    # a claim of an earlier boot stands for nothing
    (
        hs.DRAIN_COMPLETE,
        {"p.io/a.drain": hs.Claim(hs.DRAIN_REQUIRED, "old", T0).encode()},
        hs.DRAIN_COMPLETE,
    ),
]


@pytest.mark.parametrize(("current", "others", "seen"), NEW_CLAIM_ROWS)
def test_new_claim_records_a_left_over_answer(
    current: str, others: dict[str, str], seen: str
) -> None:
    c = hs.new_claim(hs.DRAIN_REQUIRED, BOOT, T0, current, others, "p.io")
    assert c == hs.Claim(hs.DRAIN_REQUIRED, BOOT, T0, seen=seen)


def test_the_issue_repro_a_left_over_drain_complete_does_not_answer_a_new_claim() -> None:
    new = hs.new_claim(hs.DRAIN_REQUIRED, BOOT, T0, hs.DRAIN_COMPLETE, {}, "p.io")
    assert hs.before(new, hs.DRAIN_COMPLETE, T0 + 1, TIMEOUT, BOOT) == hs.WAIT


# claim, drain-current, now -> the claim as it should stand on the node
SETTLED_ROWS = [
    (claim(), hs.DRAINING, T0 + 5, claim()),
    (leftover(), hs.DRAIN_COMPLETE, T0 + 5, leftover()),  # not moved yet
    (leftover(), hs.IDLE, T0 + 5, claim()),  # moved: the next DrainComplete is the answer
    (leftover(), hs.DRAINING, T0 + 5, claim()),
    (claim(since=T0 + 30), "", T0, claim(since=T0 + 30)),  # within the slack: as it is
    (claim(since=T0 + 3600), "", T0, claim(since=T0)),  # clock set back: counts from now
    (claim(since=1e300), "", T0, claim(since=T0)),
]


@pytest.mark.parametrize(("c", "current", "now", "settled"), SETTLED_ROWS)
def test_settled(c: hs.Claim, current: str, now: float, settled: hs.Claim) -> None:
    assert hs.settled(c, current, now) == settled


def test_settled_drops_seen_when_the_watch_saw_the_answer_move() -> None:
    """DrainComplete again at the read, but the watch saw it leave between: a fresh answer."""
    assert hs.settled(leftover(), hs.DRAIN_COMPLETE, T0 + 5, moved=True) == claim()
    assert hs.settled(claim(), hs.DRAIN_COMPLETE, T0 + 5, moved=True) == claim()


# since, now -> seconds until the claim expires: finite, within [0, timeout]
@pytest.mark.parametrize(
    ("since", "now", "left"),
    [
        (T0, T0, TIMEOUT),
        (T0, T0 + 100, TIMEOUT - 100),
        (T0, T0 + 10 * TIMEOUT, 0.0),
        (T0 + 3600, T0, TIMEOUT),  # in the future: never more than the timeout
        (1e300, T0, TIMEOUT),
        (float("inf"), T0, TIMEOUT),
        (float("nan"), T0, TIMEOUT),
        (float("-inf"), T0, 0.0),
    ],
)
def test_remaining(since: float, now: float, left: float) -> None:
    assert hs.remaining(claim(since=since), now, TIMEOUT) == left


@pytest.mark.parametrize(
    ("state", "code", "outcome"),
    [
        ("Done", "", hs.APPLIED),
        ("Done", "LabelAbsent", hs.APPLIED),
        ("Degraded", "ModuleInUse", hs.BLOCKED),
        ("Degraded", "UnloadFailed", hs.UNLOADABLE),
        ("Degraded", "LoadFailed", hs.FAILED),
        ("Degraded", "DrainTimeout", hs.FAILED),
        ("Working", "DrainRequired", None),
    ],
)
def test_outcome_of(state: str, code: str, outcome: str | None) -> None:
    assert hs.outcome_of(state, code) == outcome


@pytest.mark.parametrize(
    ("claims", "value"),
    [
        ({}, hs.IDLE),
        ({"p.io/a.drain": claim().encode()}, hs.DRAIN_REQUIRED),
        (
            {"p.io/a.drain": claim().encode(), "p.io/b.drain": claim(hs.REBOOT_REQUIRED).encode()},
            hs.REBOOT_REQUIRED,
        ),
        ({"p.io/a.drain": "garbage", "other.io/b.drain": claim().encode()}, hs.IDLE),
        ({"p.io/drain": hs.DRAIN_REQUIRED}, hs.IDLE),  # the node-wide key is not a claim
        # a claim of an earlier boot asks for nothing any more (the issue's `gone` instance)
        ({"p.io/gone.drain": "Reboot_Required boot=boot-before since=1"}, hs.IDLE),
        (
            {
                "p.io/gone.drain": claim(hs.REBOOT_REQUIRED, boot="boot-before").encode(),
                "p.io/a.drain": claim().encode(),
            },
            hs.DRAIN_REQUIRED,
        ),
        ({"p.io/a.drain": "Drain_Required since=1"}, hs.DRAIN_REQUIRED),  # no boot: counts
    ],
)
def test_node_value_is_the_strongest_claim_of_this_boot(claims: dict[str, str], value: str) -> None:
    assert hs.node_value(claims, "p.io", BOOT) == value


def test_stale_claims_are_those_of_other_boots() -> None:
    claims = {
        "p.io/gone.drain": claim(boot="boot-before").encode(),
        "p.io/a.drain": claim().encode(),
        "p.io/b.drain": "garbage",
        "q.io/c.drain": claim(boot="boot-before").encode(),
    }
    assert hs.stale_claims(claims, "p.io", BOOT) == ["p.io/gone.drain"]


@pytest.mark.parametrize(
    ("text", "decoded"),
    [
        ("", None),
        ("Idle", None),
        ("Drain_Required boot=b since=zz", None),
        ("Drain_Required", hs.Claim(hs.DRAIN_REQUIRED, "", 0.0)),
        # a time that is no time: unreadable (treated as absent, replaced by a fresh claim)
        ("Drain_Required boot=b since=nan", None),
        ("Drain_Required boot=b since=inf", None),
        ("Drain_Required boot=b since=-inf", None),
        ("Drain_Required boot=b since=1e999", None),
        # a far-off time reads as it is; settled() restarts it at now
        ("Drain_Required boot=b since=1e300", hs.Claim(hs.DRAIN_REQUIRED, "b", 1e300)),
        # the claim as older kvcd wrote it, and as this one writes it over a left-over answer
        ("Drain_Required boot=b since=5", hs.Claim(hs.DRAIN_REQUIRED, "b", 5.0)),
        (
            "Drain_Required boot=b since=5 seen=DrainComplete",
            hs.Claim(hs.DRAIN_REQUIRED, "b", 5.0, seen=hs.DRAIN_COMPLETE),
        ),
        ("Drain_Required boot=b since=5 seen=Draining", hs.Claim(hs.DRAIN_REQUIRED, "b", 5.0)),
    ],
)
def test_claim_decode(text: str, decoded: hs.Claim | None) -> None:
    assert hs.Claim.decode(text) == decoded


@pytest.mark.parametrize("c", [claim(), leftover(), claim(hs.REBOOT_REQUIRED)])
def test_claim_round_trip(c: hs.Claim) -> None:
    assert hs.Claim.decode(c.encode()) == c


def test_claim_encoding_is_the_old_one_unless_over_a_left_over_answer() -> None:
    assert claim().encode() == f"Drain_Required boot={BOOT} since={T0:.0f}"
    assert leftover().encode() == f"Drain_Required boot={BOOT} since={T0:.0f} seen=DrainComplete"


# --- the extension through the `kvcd run` loop -----------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def host(tmp_path: Path, fake_commands: Any, monkeypatch: pytest.MonkeyPatch) -> HostRoot:
    monkeypatch.setenv("KVCD_NODE_NAME", "n1")
    return fakehost.instance_host(
        HostRoot(tmp_path / "root"),
        K,
        fake_commands,
        monkeypatch,
        CONFIG.format(v="1.0", mode="cluster"),
        MODS,
    )


def hold(root: HostRoot, module: str, by: str) -> None:
    d = root.sys_module / module
    (d / "holders" / by).mkdir(parents=True)
    (d / "refcnt").write_text("1\n")


def release(root: HostRoot, module: str, by: str) -> None:
    d = root.sys_module / module
    (d / "holders" / by).rmdir()
    (d / "refcnt").write_text("0\n")


def controller(root: HostRoot, answer: str) -> None:
    FileBackend(root, "n1").edit(annotations=lambda _v: {"kvcd.io/drain-current": answer})


def ann(root: HostRoot) -> dict[str, str]:
    return dict(FileBackend(root, "n1").read().annotations)


@pytest.fixture
def service(host: HostRoot, monkeypatch: pytest.MonkeyPatch) -> Any:
    clock = Clock()

    def build(cfg: Any, settings: Any) -> list[Any]:  # as extensions.build has them
        link = NodeLink(settings)
        drain = Drain(link, clock=clock)
        left_over = [LeftOverClaim(drain)] if mode_of(cfg, settings) != "cluster" else []
        return [drain, *left_over, Reporter(link)]

    monkeypatch.setattr(extensions, "build", build)
    made: list[Service] = []

    def make() -> Service:
        svc = Service(host, "e2e", K, fakehost.RecordingNotifier())
        made.append(svc)
        return svc

    make.clock = clock  # type: ignore[attr-defined]
    yield make
    for svc in made:
        svc.stop_extensions()


def test_blocked_change_drains_then_applies_then_idles(host: HostRoot, service: Any) -> None:
    svc = service()
    assert svc.reconcile([Event("start", kind=RETRY)]).state == "Done"
    hold(host, "kvcd_user", "foo")
    fakehost.write_config(host, "e2e", CONFIG.format(v="2.0", mode="cluster"))

    # The swap is blocked (foo holds kvcd_user): the node is asked to drain.
    svc.reconcile([Event("signal", "reload", kind=RETRY)])
    rec = Record.read(host, "e2e")
    assert rec is not None and rec.state == "Working"
    assert rec.reason.startswith("DrainRequired: Drain_Required requested")
    assert "foo" in rec.reason
    a = ann(host)
    assert a["kvcd.io/drain"] == "Drain_Required"
    assert a["kvcd.io/e2e.drain"].startswith(f"Drain_Required boot={BOOT}")
    assert a["kvcd.io/e2e.state"] == "Working"

    # The controller is draining: kvcd holds, changes nothing.
    controller(host, "Draining")
    rec = svc.reconcile([Event("drain", "Draining", kind=RETRY)])
    assert rec is not None and rec.state == "Working" and "now Draining" in rec.reason
    assert (host.sys_module / "kvcd_user" / "holders" / "foo").is_dir()

    # Restart in the middle: a new process re-derives "waiting" from the node.
    svc.stop_extensions()
    svc = service()
    rec = svc.reconcile([Event("start", kind=RETRY)])
    assert rec is not None and rec.state == "Working" and rec.reason.startswith("DrainRequired")

    # Drain complete (the workload is gone): apply the swap, withdraw, node back to Idle.
    release(host, "kvcd_user", "foo")
    controller(host, "DrainComplete")
    rec = svc.reconcile([Event("drain", "DrainComplete", kind=RETRY)])
    assert rec is not None and (rec.state, rec.version) == ("Done", "2.0")
    a = ann(host)
    assert a["kvcd.io/drain"] == "Idle" and "kvcd.io/e2e.drain" not in a
    assert a["kvcd.io/e2e.state"] == "Done"


def test_still_held_after_drain_is_degraded_and_withdrawn(host: HostRoot, service: Any) -> None:
    svc = service()
    svc.reconcile([Event("start", kind=RETRY)])
    hold(host, "kvcd_user", "foo")
    fakehost.write_config(host, "e2e", CONFIG.format(v="2.0", mode="cluster"))
    svc.reconcile([Event("signal", "reload", kind=RETRY)])
    controller(host, "DrainComplete")
    svc.reconcile([Event("drain", "DrainComplete", kind=RETRY)])
    rec = Record.read(host, "e2e")
    assert rec is not None and rec.state == "Degraded"
    assert rec.reason.startswith("ModuleInUse: still in use after the drain completed")
    assert ann(host)["kvcd.io/drain"] == "Idle"
    assert (host.sys_module / "kvcd_user").is_dir()  # never forced out


def test_no_answer_times_out_degraded_and_withdraws(host: HostRoot, service: Any) -> None:
    svc = service()
    svc.reconcile([Event("start", kind=RETRY)])
    hold(host, "kvcd_user", "foo")
    fakehost.write_config(host, "e2e", CONFIG.format(v="2.0", mode="cluster"))
    svc.reconcile([Event("signal", "reload", kind=RETRY)])
    service.clock.now = T0 + 601
    svc.reconcile([Event("drain", "timeout", kind=RETRY)])
    rec = Record.read(host, "e2e")
    assert rec is not None and rec.state == "Degraded"
    assert rec.reason.startswith("DrainTimeout: no DrainComplete within 600s")
    a = ann(host)
    assert a["kvcd.io/drain"] == "Idle" and "kvcd.io/e2e.drain" not in a
    assert a["kvcd.io/e2e.state"] == "Degraded"


def test_one_request_per_node_shared_by_instances(host: HostRoot) -> None:
    settings = load_settings(host)
    cfg = load_instance(host, "e2e")
    exts = {}
    for name in ("a", "b"):
        link = NodeLink(settings, opener=lambda c: FileBackend(c.root, "n1"))
        ctx = Context(host, name, K, settings, cfg, lambda _e: None)
        ext = Drain(link, clock=Clock())
        ext.start(ctx)
        exts[name] = (ext, ctx)
    try:
        blocked = Record("x", "Degraded", "ModuleInUse", "kvcd_user is held by foo (refcnt 1)")
        for name in ("a", "b"):
            ext, ctx = exts[name]
            v = ext.after(ctx, blocked)
            assert v is not None and v.verb == HOLD and v.state == "Working"
        assert ann(host)["kvcd.io/drain"] == "Drain_Required"
        controller(host, "DrainComplete")
        ext, ctx = exts["a"]
        ext.after(ctx, Record("a", "Done"))
        a = ann(host)
        assert "kvcd.io/a.drain" not in a and a["kvcd.io/drain"] == "Drain_Required"  # b waits
        ext, ctx = exts["b"]
        ext.after(ctx, Record("b", "Done"))
        assert ann(host)["kvcd.io/drain"] == "Idle"
    finally:
        for ext, _ctx in exts.values():
            ext.stop()


def test_stale_claim_from_an_earlier_boot_is_withdrawn(host: HostRoot, service: Any) -> None:
    old = hs.Claim(hs.REBOOT_REQUIRED, "another-boot", T0 - 3600).encode()
    FileBackend(host, "n1").edit(
        annotations=lambda _v: {"kvcd.io/e2e.drain": old, "kvcd.io/drain": "Reboot_Required"}
    )
    rec = service().reconcile([Event("start", kind=RETRY)])
    assert rec is not None and rec.state == "Done"
    assert ann(host)["kvcd.io/drain"] == "Idle"


def blocked_and_claimed(host: HostRoot, service: Any) -> Service:
    """Loaded 1.0, foo holds kvcd_user, 2.0 configured and reloaded: the change is blocked."""
    svc: Service = service()
    svc.reconcile([Event("start", kind=RETRY)])
    hold(host, "kvcd_user", "foo")
    fakehost.write_config(host, "e2e", CONFIG.format(v="2.0", mode="cluster"))
    svc.reconcile([Event("signal", "reload", kind=RETRY)])
    return svc


def test_a_left_over_drain_complete_is_not_the_answer(host: HostRoot, service: Any) -> None:
    """The previous handshake ended; the controller has not reset drain-current to Idle yet when
    a new change is blocked. That DrainComplete answered the earlier request: kvcd waits for
    the controller to go through Idle/Draining to a DrainComplete of its own."""
    controller(host, "DrainComplete")
    svc = blocked_and_claimed(host, service)
    a = ann(host)
    assert a["kvcd.io/drain"] == "Drain_Required"
    assert a["kvcd.io/e2e.drain"] == f"Drain_Required boot={BOOT} since={T0:.0f} seen=DrainComplete"

    rec = svc.reconcile([Event("drain", "retry", kind=RETRY)])  # the next cycle
    assert rec is not None and rec.state == "Working", rec.reason
    assert rec.reason.startswith("DrainRequired: Drain_Required requested; waiting for")
    assert "(now DrainComplete, left from an earlier request)" in rec.reason
    assert "kvcd.io/e2e.drain" in ann(host)

    controller(host, "Idle")  # the controller uncordons after the earlier request ...
    rec = svc.reconcile([Event("drain", "Idle", kind=RETRY)])
    assert rec is not None and rec.state == "Working"
    assert ann(host)["kvcd.io/e2e.drain"] == f"Drain_Required boot={BOOT} since={T0:.0f}"
    controller(host, "Draining")  # ... then drains for this one
    release(host, "kvcd_user", "foo")
    controller(host, "DrainComplete")
    rec = svc.reconcile([Event("drain", "DrainComplete", kind=RETRY)])
    assert rec is not None and (rec.state, rec.version) == ("Done", "2.0")
    a = ann(host)
    assert a["kvcd.io/drain"] == "Idle" and "kvcd.io/e2e.drain" not in a


def test_a_drain_complete_of_a_standing_request_is_shared(host: HostRoot) -> None:
    """b is blocked while a's request stands answered (the node is drained and stays so while a
    claim stands): b's claim joins it and proceeds. Once a withdrew, a DrainComplete still there
    answers nobody: c waits for a fresh one."""
    settings = load_settings(host)
    cfg = load_instance(host, "e2e")
    exts = {}
    for name in ("a", "b", "c"):
        link = NodeLink(settings, opener=lambda c: FileBackend(c.root, "n1"))
        ctx = Context(host, name, K, settings, cfg, lambda _e: None)
        ext = Drain(link, clock=Clock())
        ext.start(ctx)
        exts[name] = (ext, ctx)
    blocked = Record("x", "Degraded", "ModuleInUse", "kvcd_user is held by foo (refcnt 1)")
    try:
        ext, ctx = exts["a"]
        assert ext.after(ctx, blocked) is not None
        controller(host, "DrainComplete")
        ext, ctx = exts["b"]
        assert ext.after(ctx, blocked) is not None
        assert "seen=" not in ann(host)["kvcd.io/b.drain"]
        assert ext.verdict(ctx, []) is None  # proceed: the node is drained
        for name in ("a", "b"):
            ext, ctx = exts[name]
            ext.after(ctx, Record(name, "Done"))
        assert ann(host)["kvcd.io/drain"] == "Idle"
        ext, ctx = exts["c"]
        assert ext.after(ctx, blocked) is not None
        assert ann(host)["kvcd.io/c.drain"].endswith(" seen=DrainComplete")
        v = ext.verdict(ctx, [])
        assert v is not None and v.verb == HOLD and v.state == "Working"
    finally:
        for ext, _ctx in exts.values():
            ext.stop()


class Timers:
    """threading.Timer in kvcd.daemon.drain, recording the delays (nothing is started)."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    def __call__(self, delay: float, _fn: Any, _args: Any = ()) -> Any:
        self.delays.append(delay)
        delays = self.delays

        class T:
            daemon = False

            def start(self) -> None:
                assert delays

            def cancel(self) -> None:
                pass

        return T()


@pytest.mark.parametrize("since", ["nan", "inf", "1e300", f"{T0 + 3600:.0f}"])
def test_a_claim_of_no_time_or_a_future_one_still_times_out(
    host: HostRoot, service: Any, monkeypatch: pytest.MonkeyPatch, since: str
) -> None:
    """An unreadable since (nan, inf) is no claim: the blocked change claims afresh. One in the
    future (a clock set back at boot, a hand-written 1e300) counts from now. Either way the
    claim times out after drain_timeout, and the timer never waits longer than that."""
    import kvcd.daemon.drain as daemon_drain

    timers = Timers()
    monkeypatch.setattr(daemon_drain.threading, "Timer", timers)
    svc = service()
    svc.reconcile([Event("start", kind=RETRY)])
    FileBackend(host, "n1").edit(
        annotations=lambda _v: {
            "kvcd.io/e2e.drain": f"Drain_Required boot={BOOT} since={since}",
            "kvcd.io/drain": "Drain_Required",
        }
    )
    hold(host, "kvcd_user", "foo")
    fakehost.write_config(host, "e2e", CONFIG.format(v="2.0", mode="cluster"))
    svc.reconcile([Event("signal", "reload", kind=RETRY)])
    rec = Record.read(host, "e2e")
    assert rec is not None and rec.state == "Working", rec.reason
    assert ann(host)["kvcd.io/e2e.drain"] == f"Drain_Required boot={BOOT} since={T0:.0f}"
    assert timers.delays and all(0 <= d <= TIMEOUT + 1 for d in timers.delays), timers.delays

    service.clock.now = T0 + TIMEOUT + 1
    rec = svc.reconcile([Event("drain", "timeout", kind=RETRY)])
    assert rec is not None and rec.state == "Degraded"
    assert rec.reason.startswith("DrainTimeout: no DrainComplete within 600s")
    a = ann(host)
    assert a["kvcd.io/drain"] == "Idle" and "kvcd.io/e2e.drain" not in a


def test_a_claim_of_an_earlier_boot_does_not_ask_again(host: HostRoot, service: Any) -> None:
    """Another instance (`gone`, whose config was removed) left a Reboot_Required claim before
    the reboot: kvcd's own handshake neither repeats its request nor keeps it on the node."""
    FileBackend(host, "n1").edit(
        annotations=lambda _v: {
            "kvcd.io/gone.drain": "Reboot_Required boot=boot-before since=1",
            "kvcd.io/drain": "Idle",
        }
    )
    svc = blocked_and_claimed(host, service)
    a = ann(host)
    assert a["kvcd.io/drain"] == "Drain_Required"
    assert "kvcd.io/gone.drain" not in a
    release(host, "kvcd_user", "foo")
    controller(host, "DrainComplete")
    rec = svc.reconcile([Event("drain", "DrainComplete", kind=RETRY)])
    assert rec is not None and rec.state == "Done"
    assert ann(host)["kvcd.io/drain"] == "Idle"


def test_a_reboot_claim_is_withdrawn_on_drain_timeout(host: HostRoot, service: Any) -> None:
    """No answer to a Reboot_Required within drain_timeout: Degraded (DrainTimeout) and the claim
    withdrawn, as for Drain_Required: a node is never left cordoned for kvcd."""
    FileBackend(host, "n1").edit(
        annotations=lambda _v: {
            "kvcd.io/e2e.drain": f"Reboot_Required boot={BOOT} since={T0:.0f}",
            "kvcd.io/drain": "Reboot_Required",
        }
    )
    svc = service()
    service.clock.now = T0 + 10000
    rec = svc.reconcile([Event("start", kind=RETRY)])
    assert rec is not None and rec.state == "Degraded", rec.reason
    assert rec.reason.startswith(
        "DrainTimeout: no DrainComplete within 600s of the Reboot_Required request"
    )
    a = ann(host)
    assert a["kvcd.io/drain"] == "Idle" and "kvcd.io/e2e.drain" not in a


def test_drain_none_names_the_holders(host: HostRoot, service: Any) -> None:
    fakehost.write_config(host, "e2e", CONFIG.format(v="1.0", mode="none"))
    svc = service()
    svc.reconcile([Event("start", kind=RETRY)])
    hold(host, "kvcd_user", "foo")
    # A process with the module's device node open: /dev/null stands in for it (no mknod).
    rdev = os.stat("/dev/null").st_rdev
    dev = host(f"/sys/dev/char/{os.major(rdev)}:{os.minor(rdev)}")
    dev.mkdir(parents=True)
    (dev / "uevent").write_text("MAJOR=1\nDEVNAME=kvcd_user\n")
    fd = host("/proc/4242/fd")
    fd.mkdir(parents=True)
    (fd.parent / "comm").write_text("holder-app\n")
    (fd / "3").symlink_to("/dev/null")
    fakehost.write_config(host, "e2e", CONFIG.format(v="2.0", mode="none"))
    svc.reconcile([Event("signal", "reload", kind=RETRY)])
    rec = Record.read(host, "e2e")
    assert rec is not None and rec.state == "Degraded"
    assert rec.reason.startswith("ModuleInUse: cannot replace the loaded version")
    assert "holders: kvcd_user: refcnt 1; used by modules foo; open by holder-app[4242]" in (
        rec.reason
    )
    assert "kvcd.io/drain" not in ann(host)  # no handshake without a cluster


def test_switching_to_drain_none_withdraws_the_claim(host: HostRoot, service: Any) -> None:
    """Mid-handshake, the admin sets drain = "none" and reloads: no controller answer will be
    acted on for this instance any more, so its claim goes and the node goes back to Idle."""
    svc = service()
    svc.reconcile([Event("start", kind=RETRY)])
    hold(host, "kvcd_user", "foo")
    fakehost.write_config(host, "e2e", CONFIG.format(v="2.0", mode="cluster"))
    svc.reconcile([Event("signal", "reload", kind=RETRY)])
    assert ann(host)["kvcd.io/drain"] == "Drain_Required"
    fakehost.write_config(host, "e2e", CONFIG.format(v="2.0", mode="none"))
    svc.reconcile([Event("signal", "reload", kind=RETRY)])  # refused for good: None
    rec = Record.read(host, "e2e")
    assert rec is not None and rec.state == "Degraded" and rec.reason.startswith("ModuleInUse")
    a = ann(host)
    assert a["kvcd.io/drain"] == "Idle" and "kvcd.io/e2e.drain" not in a


# --- stopping: unload_policy (issue #17) -------------------------------------------------------

# policy, how the last step ended, a drain requested during this stop -> the next step
STOP_ROWS = [
    (state.NEVER, hs.STOPPING, False, hs.KEEP_LOADED),
    (state.IF_IDLE, hs.STOPPING, False, hs.UNLOAD),
    (state.IF_IDLE, hs.IN_USE, False, hs.REFUSE),
    (state.UNLOAD_DRAIN, hs.STOPPING, False, hs.UNLOAD),
    (state.UNLOAD_DRAIN, hs.IN_USE, False, hs.REQUEST),
    (state.UNLOAD_DRAIN, hs.DRAINED, True, hs.UNLOAD),
    (state.UNLOAD_DRAIN, hs.IN_USE, True, hs.REFUSE),  # a drain is asked for once per stop
    (state.UNLOAD_DRAIN, hs.NOT_DRAINED, True, hs.REFUSE),
]


@pytest.mark.parametrize(("policy", "last", "requested", "step"), STOP_ROWS)
def test_stop_step(policy: str, last: str, requested: bool, step: str) -> None:
    assert hs.stop_step(policy, last, requested) == step


def test_stop_table_is_the_rows_and_every_policy_starts() -> None:
    assert {(p, last, r) for p, last, r, _ in STOP_ROWS} == set(hs.STOP)
    assert {p for p, last, _r, _s in STOP_ROWS if last == hs.STOPPING} == set(state.UNLOAD_POLICIES)


POLICY_CONFIG = (
    'version = "1.0"\nmodules = ["kvcd_base", "kvcd_user"]\nunload_policy = "{policy}"\n'
    '[build]\ncontext = "/src"\n'
)


def stopping_service(host: HostRoot, service: Any, policy: str) -> Service:
    fakehost.write_config(host, "e2e", POLICY_CONFIG.format(policy=policy))
    svc: Service = service()
    rec = svc.reconcile([Event("start", kind=RETRY)])
    assert rec is not None and rec.state == "Done"
    return svc


def drain_of(svc: Service) -> Drain:
    (drain,) = [e for e in svc.exts if isinstance(e, Drain)]
    return drain


def loaded(root: HostRoot) -> list[str]:
    return [m for m in MODS if (root.sys_module / m).is_dir()]


@pytest.mark.parametrize(
    ("policy", "held", "code", "left"),
    [
        (state.NEVER, False, 0, MODS),
        (state.NEVER, True, 0, MODS),
        (state.IF_IDLE, False, 0, []),
        (state.IF_IDLE, True, 1, MODS),  # refused up front: nothing half-unloaded
    ],
)
def test_stop_without_a_drain(
    host: HostRoot,
    service: Any,
    caplog: pytest.LogCaptureFixture,
    policy: str,
    held: bool,
    code: int,
    left: list[str],
) -> None:
    svc = stopping_service(host, service, policy)
    if held:
        hold(host, "kvcd_user", "foo")
    assert svc.stop() == code
    assert loaded(host) == left
    assert "kvcd.io/drain" not in ann(host) or ann(host)["kvcd.io/drain"] == "Idle"
    if code:
        assert "unload_policy = if-idle" in caplog.text and "holders: kvcd_user" in caplog.text
        rec = Record.read(host, "e2e")
        assert rec is not None and rec.reason.startswith("ModuleInUse")


@pytest.mark.parametrize("how", ["removed", "invalid"])
def test_a_stop_with_a_config_kvcd_cannot_use_keeps_the_modules(
    host: HostRoot, service: Any, how: str
) -> None:
    """README "Stopping": the unload reads the config again; one kvcd cannot use refuses the
    stop (exit 1), the modules stay, and the record says ConfigInvalid."""
    svc = stopping_service(host, service, state.IF_IDLE)
    conf = host("/etc/kvcd/instances/e2e.toml")
    if how == "removed":
        conf.unlink()
    else:
        conf.write_text("no_such_key = 1\n" + conf.read_text())
    assert svc.stop() == 1
    assert loaded(host) == MODS
    rec = Record.read(host, "e2e")
    assert rec is not None and rec.reason.startswith("ConfigInvalid: "), rec


def test_stop_with_drain_waits_for_drain_complete_then_unloads(
    host: HostRoot, service: Any
) -> None:
    svc = stopping_service(host, service, state.UNLOAD_DRAIN)
    hold(host, "kvcd_user", "foo")
    seen: list[dict[str, str]] = []

    def sleep(_seconds: float) -> None:  # the drain controller, between kvcd's looks
        seen.append(ann(host))
        if len(seen) == 2:
            release(host, "kvcd_user", "foo")
            controller(host, "DrainComplete")

    drain_of(svc).sleep = sleep
    assert svc.stop() == 0
    assert loaded(host) == []
    assert seen[0]["kvcd.io/drain"] == "Drain_Required"
    assert seen[0]["kvcd.io/e2e.drain"].startswith(f"Drain_Required boot={BOOT}")
    a = ann(host)
    assert a["kvcd.io/drain"] == "Idle" and "kvcd.io/e2e.drain" not in a
    assert any(s.startswith("EXTEND_TIMEOUT_USEC=") for s in svc.notify.sent)  # type: ignore[attr-defined]


def test_stop_with_drain_does_not_take_a_left_over_drain_complete(
    host: HostRoot, service: Any
) -> None:
    svc = stopping_service(host, service, state.UNLOAD_DRAIN)
    controller(host, "DrainComplete")  # the previous handshake's answer, not reset yet
    hold(host, "kvcd_user", "foo")
    seen: list[dict[str, str]] = []

    def sleep(_seconds: float) -> None:  # the drain controller, between kvcd's looks
        seen.append(ann(host))
        if len(seen) == 1:
            controller(host, "Idle")
        elif len(seen) == 2:
            release(host, "kvcd_user", "foo")
            controller(host, "DrainComplete")

    drain_of(svc).sleep = sleep
    assert svc.stop() == 0
    assert loaded(host) == []
    assert len(seen) == 2
    assert seen[0]["kvcd.io/e2e.drain"].endswith(" seen=DrainComplete")
    a = ann(host)
    assert a["kvcd.io/drain"] == "Idle" and "kvcd.io/e2e.drain" not in a


@pytest.mark.parametrize("answer", ["timeout", "still-held"])
def test_stop_with_drain_refused_keeps_modules_and_withdraws(
    host: HostRoot, service: Any, caplog: pytest.LogCaptureFixture, answer: str
) -> None:
    svc = stopping_service(host, service, state.UNLOAD_DRAIN)
    hold(host, "kvcd_user", "foo")

    def sleep(_seconds: float) -> None:
        if answer == "timeout":
            service.clock.now += 301  # no answer: past drain_timeout after two looks
        else:
            controller(host, "DrainComplete")  # drained, but something no drain removes holds it

    drain_of(svc).sleep = sleep
    assert svc.stop() == 1
    assert loaded(host) == MODS
    a = ann(host)
    assert a["kvcd.io/drain"] == "Idle" and "kvcd.io/e2e.drain" not in a
    expected = (
        "no DrainComplete within 600s" if answer == "timeout" else "still in use after the drain"
    )
    assert expected in caplog.text


def test_stop_with_drain_and_no_node_refuses(
    host: HostRoot, service: Any, caplog: pytest.LogCaptureFixture
) -> None:
    svc = stopping_service(host, service, state.UNLOAD_DRAIN)
    hold(host, "kvcd_user", "foo")
    drain_of(svc).link.writer = None  # the node backend never came up
    assert svc.stop() == 1
    assert loaded(host) == MODS
    assert "cannot request a node drain" in caplog.text


# drain, unload_policy -> whether the node backend is open before the first load (a start that
# does not need the node must not wait for it: a Kubernetes client to import, seconds in a
# slow guest). Through the real extension set, in the order `kvcd run` runs it.
OPEN_ROWS = [
    ("none", "if-idle", False),  # the default: the node hears of the outcome after READY=1
    ("cluster", "if-idle", True),  # the verdict reads the drain answer
    ("none", "drain", True),  # any stop may have to ask for a drain
]


@pytest.mark.parametrize(("mode", "policy", "before_load"), OPEN_ROWS)
def test_the_node_backend_opens_before_the_load_only_when_the_load_needs_it(
    host: HostRoot, monkeypatch: pytest.MonkeyPatch, mode: str, policy: str, before_load: bool
) -> None:
    fakehost.write_config(
        host, "e2e", f'unload_policy = "{policy}"\n' + CONFIG.format(v="1.0", mode=mode)
    )
    opened: list[bool] = []  # at each opening: were the modules loaded already?
    real = NodeLink.__init__

    def seen(self: NodeLink, settings: Any, opener: Any = None) -> None:
        def open_noting(ctx: Context) -> FileBackend:
            opened.append((host.sys_module / "kvcd_user").is_dir())
            return FileBackend(ctx.root, "n1")

        real(self, settings, open_noting)

    monkeypatch.setattr(NodeLink, "__init__", seen)
    svc = Service(host, "e2e", K, fakehost.RecordingNotifier())
    svc.defer_late = True  # as run() does: the late hooks wait for run_late
    try:
        rec = svc.reconcile([Event("start", kind=RETRY)])
        assert rec is not None and rec.state == "Done"
        assert opened == ([False] if before_load else [])
        svc.run_late(rec)  # after READY=1
        assert opened == ([False] if before_load else [True])
        assert ann(host)["kvcd.io/e2e.state"] == "Done"  # the outcome published all the same
    finally:
        svc.stop_extensions()


class HeldWatch(FileBackend):
    """The file backend whose watch delivers only when the test says (deliver)."""

    def watch(self, on_change: Any, on_lost: Any = None) -> None:
        self.on_change = on_change

    def deliver(self) -> None:
        self.on_change(self.read())


def test_an_answer_that_moved_between_two_reads_is_this_claims(host: HostRoot) -> None:
    """A claim made over a left-over DrainComplete; the controller goes Idle, Draining and
    DrainComplete again between two of kvcd's reads (nothing to evict): the watch saw it move,
    so this DrainComplete is the answer, not a wait until DrainTimeout."""
    settings = load_settings(host)
    made: list[HeldWatch] = []

    def opener(c: Context) -> HeldWatch:
        made.append(HeldWatch(c.root, "n1"))
        return made[-1]

    link = NodeLink(settings, opener=opener)
    ctx = Context(host, "e2e", K, settings, load_instance(host, "e2e"), lambda _e: None)
    ext = Drain(link, clock=Clock())
    controller(host, "DrainComplete")  # left from an earlier request
    ext.start(ctx)
    blocked = Record("e2e", "Degraded", "ModuleInUse", "kvcd_user is held by foo (refcnt 1)")
    try:
        assert ext.after(ctx, blocked) is not None
        assert ann(host)["kvcd.io/e2e.drain"].endswith(" seen=DrainComplete")
        for answer in ("Idle", "Draining", "DrainComplete"):
            controller(host, answer)
            made[0].deliver()
        assert ext.verdict(ctx, []) is None  # proceed
        assert "seen=" not in ann(host)["kvcd.io/e2e.drain"]
    finally:
        ext.stop()
