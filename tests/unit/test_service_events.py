"""The `kvcd run` loop with extensions: events wake it, verdicts redirect it, after-hooks amend.

The Service runs in this process's main thread with real signals, a real selector and real
threads posting events; modprobe/rmmod/depmod are the fake-host stand-ins, the instance's
versions are already in the store (so no podman), and a recording Notifier stands in for the
sd_notify socket.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import signal
import threading
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvcd.config.model import InstanceConfig, Settings
from kvcd.core import state
from kvcd.core.attempts import RETRY
from kvcd.core.state import Backoff, StepFailed
from kvcd.daemon import extensions
from kvcd.daemon.events import HOLD, LOAD, SKIP, UNLOAD, Context, Event, Extension, Verdict
from kvcd.daemon.record import Record
from kvcd.daemon.service import Service
from kvcd.host import files, heap, journal
from kvcd.host.paths import HostRoot
from tests import fakehost

K = "6.1.0-56-amd64"
MODS = ["kvcd_base", "kvcd_user"]
CONFIG = 'version = "{v}"\nmodules = ["kvcd_base", "kvcd_user"]\n[build]\ncontext = "/src"\n'


@pytest.fixture
def host(tmp_path: Path, fake_commands: Any, monkeypatch: pytest.MonkeyPatch) -> HostRoot:
    return fakehost.instance_host(
        HostRoot(tmp_path / "root"), K, fake_commands, monkeypatch, CONFIG.format(v="1.0"), MODS
    )


def loaded(root: HostRoot) -> list[str]:
    return sorted(p.name for p in root.sys_module.iterdir()) if root.sys_module.is_dir() else []


class Scripted(Extension):
    """An extension driven by a test: verdicts and amendments from lists, a log of its calls."""

    name = "scripted"

    def __init__(
        self,
        verdicts: list[Verdict | None] | None = None,
        amends: list[Verdict | None] | None = None,
        every: float | None = None,
        on_verdict: Callable[[int, list[Event]], None] = lambda _n, _e: None,
    ) -> None:
        self.verdicts = list(verdicts or [])
        self.amends = list(amends or [])
        self.every = every
        self.on_verdict = on_verdict
        self.seen: list[list[Event]] = []
        self.records: list[tuple[str, str]] = []
        self.started = 0
        self.stopped = 0
        self.ctx: Context | None = None

    def start(self, ctx: Context) -> None:
        self.started += 1
        self.ctx = ctx

    def stop(self) -> None:
        self.stopped += 1

    def interval(self) -> float | None:
        return self.every

    def verdict(self, ctx: Context, events: list[Event]) -> Verdict | None:
        self.seen.append(list(events))
        self.on_verdict(len(self.seen), events)
        return self.verdicts.pop(0) if self.verdicts else None

    def after(self, ctx: Context, record: Record) -> Verdict | None:
        self.records.append((record.state, record.reason))
        return self.amends.pop(0) if self.amends else None


def use(monkeypatch: pytest.MonkeyPatch, *exts: Extension) -> None:
    sets = iter([list(exts)])
    monkeypatch.setattr(extensions, "build", lambda cfg, settings: next(sets, []))


def full_disk(monkeypatch: pytest.MonkeyPatch, writes: int = 1 << 30) -> dict[str, int]:
    """Record.write fails with ENOSPC (naming the record) for the next `writes` writes; set the
    returned ["left"] to 0 to give the disk room again."""
    import errno

    real = Record.write
    left = {"left": writes}

    def write(self: Record, root: HostRoot) -> None:
        if left["left"]:
            left["left"] -= 1
            raise OSError(errno.ENOSPC, "No space left on device", str(root.state_file("e2e")))
        real(self, root)

    monkeypatch.setattr(Record, "write", write)
    return left


def service(root: HostRoot) -> tuple[Service, fakehost.RecordingNotifier]:
    n = fakehost.RecordingNotifier()
    return Service(root, "e2e", K, n), n


def sigterm() -> None:
    os.kill(os.getpid(), signal.SIGTERM)


# verdict of the first reconcile -> what is loaded, the record, and whether READY=1 went out
VERDICT_TABLE = [
    pytest.param(None, MODS, state.DONE, "", True, id="no-verdict-loads"),
    pytest.param(
        Verdict(HOLD, state.DEGRADED, "drift: /x content differs"),
        [],
        state.DEGRADED,
        "drift: /x content differs",
        True,
        id="hold-degraded-changes-nothing",
    ),
    pytest.param(
        Verdict(HOLD, state.DONE, "no device"), [], state.DONE, "no device", True, id="hold-done"
    ),
    pytest.param(
        Verdict(UNLOAD, state.DONE, "version label absent"),
        [],
        state.DONE,
        "version label absent",
        True,
        id="unload-with-reason",
    ),
]


@pytest.mark.parametrize(("verdict", "mods", "st", "reason", "ready"), VERDICT_TABLE)
def test_first_verdict_decides_the_start(
    host: HostRoot,
    monkeypatch: pytest.MonkeyPatch,
    verdict: Verdict | None,
    mods: list[str],
    st: str,
    reason: str,
    ready: bool,
) -> None:
    ext = Scripted([verdict])
    use(monkeypatch, ext)
    svc, n = service(host)
    rec = svc.reconcile([Event("start", kind=RETRY)])
    assert rec is not None
    assert loaded(host) == mods
    saved = Record.read(host, "e2e")
    assert saved is not None and (saved.state, saved.reason) == (st, reason)
    assert ext.records == [(st, reason)]
    assert svc._announce(rec, ready=False) is ready
    assert any(a == "READY=1" for a in n.sent) is ready
    svc.stop_extensions()
    assert ext.stopped == 1


def test_working_amendment_withholds_ready_until_settled(
    host: HostRoot, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An after-hook saying "waiting for links" keeps READY=1 back; the next event settles it."""
    ext = Scripted(amends=[Verdict(LOAD, state.WORKING, "waiting for links: eth9")])
    use(monkeypatch, ext)
    svc, n = service(host)
    rec = svc.reconcile([Event("start", kind=RETRY)])
    assert rec is not None and (rec.state, rec.reason) == (
        state.WORKING,
        "waiting for links: eth9",
    )
    assert loaded(host) == MODS
    assert svc._announce(rec, ready=False) is False
    assert "READY=1" not in n.sent
    rec = svc.reconcile([Event("links", "eth9 up")])
    assert rec is not None and rec.state == state.DONE and rec.reason == ""
    assert svc._announce(rec, ready=False) is True
    assert "READY=1" in n.sent


def test_events_from_threads_wake_the_loop_and_batch(
    host: HostRoot, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three events posted from a watcher thread arrive in one reconcile; SIGTERM unloads."""

    def second(n: int, events: list[Event]) -> None:
        if n == 2:
            sigterm()

    ext = Scripted(on_verdict=second)

    class Poster(Extension):
        name = "poster"

        def start(self, ctx: Context) -> None:
            def go() -> None:
                for i in range(3):
                    ctx.post(Event("poster", f"change {i}"))

            # Posted (from another thread) before the loop sleeps: the mailbox byte must still
            # wake it, and all three must arrive in one batch.
            t = threading.Thread(target=go)
            t.start()
            t.join()

    use(monkeypatch, Poster(), ext)
    svc, n = service(host)
    assert svc.run() == 0
    start, batch = ext.seen
    assert start == [Event("start", kind=RETRY)]
    assert sorted(e.what for e in batch if e.source == "poster") == [
        "change 0",
        "change 1",
        "change 2",
    ]
    assert loaded(host) == []  # stop unloaded
    assert ext.stopped == 1
    assert "STOPPING=1" in n.sent


def test_idle_work_runs_after_ready_when_no_event_waits(
    host: HostRoot, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Next-kernel preparation is idle work: never before READY=1, never while an event waits;
    what it posts is the next cycle."""
    n = fakehost.RecordingNotifier()

    class Chore(Extension):
        name = "chore"

        def __init__(self) -> None:
            self.todo = True
            self.saw_ready: list[bool] = []

        def wants_idle(self) -> bool:
            return self.todo

        def idle(self, ctx: Context) -> None:
            self.todo = False
            self.saw_ready.append(any(s.startswith("READY=1") for s in n.sent))
            ctx.post(Event("chore", "done"))

    def second(count: int, events: list[Event]) -> None:
        if count == 2:
            sigterm()

    chore, ext = Chore(), Scripted(on_verdict=second)
    use(monkeypatch, chore, ext)
    svc = Service(host, "e2e", K, n)
    assert svc.run() == 0
    assert chore.saw_ready == [True]
    assert ext.seen == [[Event("start", kind=RETRY)], [Event("chore", "done")]]


def test_the_journal_fields_follow_the_configured_version(
    host: HostRoot, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every journal line of the instance carries its kernel and configured version (README:
    KVCD_VERSION on every record), from the config that was read, again after a reload."""
    stamped: list[dict[str, str]] = []
    monkeypatch.setattr(journal, "stamp", lambda **f: stamped.append(f))
    use(monkeypatch)
    svc, _ = service(host)
    svc.reconcile([Event("start", kind=RETRY)])
    fakehost.write_config(host, "e2e", CONFIG.format(v="2.0"))
    svc.reconcile([Event("signal", "reload", kind=RETRY)])
    assert stamped == [
        {"KVCD_KERNEL": K, "KVCD_VERSION": "1.0"},
        {"KVCD_KERNEL": K, "KVCD_VERSION": "2.0"},
    ]


def test_the_heap_is_trimmed_when_the_loop_sleeps_never_inside_a_cycle(
    host: HostRoot, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a cycle freed goes back to the kernel (#20, steady RSS) once its work and the idle
    work are done, just before the loop sleeps: not in the middle of a reconcile."""
    calls: list[str] = []

    class Chore(Extension):
        name = "chore"
        todo = True

        def wants_idle(self) -> bool:
            return self.todo

        def idle(self, ctx: Context) -> None:
            self.todo = False
            calls.append("idle")
            ctx.post(Event("chore", "done"))

    def cycle(count: int, events: list[Event]) -> None:
        calls.append("cycle")
        if count == 2:
            sigterm()

    monkeypatch.setattr(heap, "trim", lambda: bool(calls.append("trim")) or True)
    use(monkeypatch, Chore(), Scripted(on_verdict=cycle))
    svc, _ = service(host)
    assert svc.run() == 0
    assert calls == ["cycle", "idle", "trim", "cycle", "trim"]


def test_late_after_hooks_run_after_ready_and_outcome_hooks_before(
    host: HostRoot, monkeypatch: pytest.MonkeyPatch
) -> None:
    """READY=1 goes out as soon as the outcome is settled: the hooks that only report or take a
    baseline (Extension.late: the node, drift, the next kernel) run after it, in their order;
    what a late hook amends is announced too (STATUS=)."""
    n = fakehost.RecordingNotifier()
    seen: list[tuple[str, bool]] = []

    class Hook(Scripted):
        def __init__(self, name: str, late: bool, amend: Verdict | None = None) -> None:
            super().__init__(amends=[amend] if amend else [], on_verdict=self.first)
            self.name, self.late = name, late

        def first(self, count: int, _events: list[Event]) -> None:
            if count == 2:
                sigterm()

        def after(self, ctx: Context, record: Record) -> Verdict | None:
            seen.append((self.name, any(s.startswith("READY=1") for s in n.sent)))
            return super().after(ctx, record)

    lost = Verdict(HOLD, state.DEGRADED, state.STATE_DAMAGED, "drift record taken again")
    hooks = [Hook("drift", True, lost), Hook("links", False), Hook("node", True)]
    use(monkeypatch, *hooks)

    def wake_once() -> None:  # a second cycle, then SIGTERM from its verdict
        time.sleep(0.2)
        assert hooks[0].ctx is not None
        hooks[0].ctx.post(Event("poke"))

    threading.Thread(target=wake_once, daemon=True).start()
    svc = Service(host, "e2e", K, n)
    assert svc.run() == 0
    assert seen[:3] == [("links", False), ("drift", True), ("node", True)]
    assert hooks[2].records[0][0] == state.DEGRADED  # the node got the late amendment
    assert any(s.startswith(f"STATUS={state.DEGRADED}: ") for s in n.sent)
    # a reconcile called on its own runs every hook, in order
    seen.clear()
    svc.defer_late = False
    use(monkeypatch, *hooks)
    svc.ctx = None
    svc.reconcile([Event("poke")])
    assert [name for name, _ in seen] == ["drift", "links", "node"]


def test_timer_events_come_at_the_interval_and_only_when_asked(
    host: HostRoot, monkeypatch: pytest.MonkeyPatch
) -> None:
    def third(n: int, events: list[Event]) -> None:
        if n == 3:
            sigterm()

    ext = Scripted(every=0.01, on_verdict=third)
    use(monkeypatch, ext)
    svc, _ = service(host)
    assert svc.run() == 0
    assert ext.seen[1:] == [[Event("scripted", "timer")], [Event("scripted", "timer")]]


def test_reload_with_a_changed_config_rebuilds_the_extensions(
    host: HostRoot, monkeypatch: pytest.MonkeyPatch
) -> None:
    built: list[Scripted] = []

    def build(cfg: InstanceConfig, settings: Settings) -> list[Extension]:
        built.append(Scripted())
        return [built[-1]]

    monkeypatch.setattr(extensions, "build", build)
    svc, _ = service(host)
    svc.reconcile([Event("start", kind=RETRY)])
    svc.reconcile([Event("signal", "reload", kind=RETRY)])  # same config: same set
    assert len(built) == 1
    fakehost.write_config(host, "e2e", CONFIG.format(v="2.0"))
    svc.reconcile([Event("signal", "reload", kind=RETRY)])
    assert len(built) == 2
    assert (built[0].stopped, built[1].started) == (1, 1)
    assert built[1].ctx is not None and built[1].ctx.cfg.version == "2.0"
    svc.stop_extensions()


def test_an_extension_that_fails_to_start_is_left_out(
    host: HostRoot, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Broken(Extension):
        name = "broken"

        def start(self, ctx: Context) -> None:
            raise OSError(28, "inotify watch limit reached")

    ok = Scripted()
    use(monkeypatch, Broken(), ok)
    svc, _ = service(host)
    rec = svc.reconcile([Event("start", kind=RETRY)])
    assert rec is not None and rec.state == state.DONE
    assert [e.name for e in svc.exts] == ["scripted"]
    svc.stop_extensions()


def modprobes(fakes: Any) -> list[list[str]]:
    return [c for c in fakes.calls() if c[0] == "modprobe" and "--show-depends" not in c]


def test_a_permanent_failure_is_retried_on_reload_not_on_every_event(
    host: HostRoot, monkeypatch: pytest.MonkeyPatch, fake_commands: Any
) -> None:
    use(monkeypatch, Scripted())
    svc, _ = service(host)
    assert svc.reconcile([Event("start", kind=RETRY)]) is not None
    fakehost.write_config(host, "e2e", CONFIG.format(v="2.0"))
    (host.root / "fail-load").write_text("kvcd_user\n")
    assert (
        svc.reconcile([Event("signal", "reload", kind=RETRY)]) is None
    )  # rolled back to 1.0, Degraded
    tried = len(modprobes(fake_commands))
    rec = svc.reconcile([Event("scripted", "timer"), Event("node", "annotation changed")])
    assert rec is not None and rec.state == state.DEGRADED
    assert len(modprobes(fake_commands)) == tried  # nothing re-applied
    (host.root / "fail-load").unlink()
    rec = svc.reconcile([Event("signal", "reload", kind=RETRY)])
    assert rec is not None and rec.state == state.DONE and rec.version == "2.0"
    svc.stop_extensions()


class _Pinging(fakehost.RecordingNotifier):
    """A notifier whose watchdog wants a ping every 20 ms, and counts them."""

    pings = 0

    def watchdog_interval(self) -> float | None:
        return 0.02

    def watchdog(self) -> None:
        self.pings += 1


class _SlowAfter(Scripted):
    def after(self, ctx: Context, record: Record) -> Verdict | None:
        time.sleep(0.3)  # a next-kernel build ahead in a cycle of its own
        return super().after(ctx, record)


@pytest.mark.parametrize("verdict", [None, Verdict(SKIP)], ids=["applied", "skipped"])
def test_the_watchdog_is_fed_through_long_after_hooks(
    host: HostRoot, monkeypatch: pytest.MonkeyPatch, verdict: Verdict | None
) -> None:
    """A skipped cycle's after-hooks run as long as an applied one's (next-kernel prepares in
    a cycle of its own events, which changes nothing): systemd's watchdog must not kill it."""
    use(monkeypatch, _SlowAfter(verdicts=[None, verdict]))
    n = _Pinging()
    svc = Service(host, "e2e", K, n)
    assert svc.reconcile([Event("start", kind=RETRY)]) is not None
    n.pings = 0
    svc.reconcile([Event("scripted", "next kernel")])
    assert n.pings >= 5  # 300 ms at 20 ms, with room for a slow machine
    svc.stop_extensions()


def test_the_ledger_outlives_a_restart_and_status_shows_it(
    host: HostRoot, monkeypatch: pytest.MonkeyPatch, fake_commands: Any
) -> None:
    """A failure for good is in the record's ledger: a new daemon (a restart) does not redo it on
    a mere event either, `kvcd status` says so, and a start or reload tries again."""
    from kvcd.daemon import status

    use(monkeypatch, Scripted())
    svc, _ = service(host)
    assert svc.reconcile([Event("start", kind=RETRY)]) is not None
    fakehost.write_config(host, "e2e", CONFIG.format(v="2.0"))
    (host.root / "fail-load").write_text("kvcd_user\n")
    assert svc.reconcile([Event("signal", "reload", kind=RETRY)]) is None
    svc.stop_extensions()
    rec = Record.load(host, "e2e")
    assert rec is not None and (rec.attempt.outcome, rec.attempt.code) == (
        "permanent",
        state.LOAD_FAILED,
    )
    assert "last attempt: LoadFailed, 1 try; tried again on reload" in status.render(
        status.collect(host, "e2e")
    )
    again, _ = service(host)  # the daemon restarted
    tried = len(modprobes(fake_commands))
    again.reconcile([Event("scripted", "timer")])
    assert len(modprobes(fake_commands)) == tried  # nothing re-applied
    (host.root / "fail-load").unlink()
    rec = again.reconcile([Event("signal", "reload", kind=RETRY)])
    assert rec is not None and rec.state == state.DONE and rec.attempt.outcome == "ok"
    assert "last attempt" not in status.render(status.collect(host, "e2e"))
    again.stop_extensions()


def test_a_backoff_is_a_loop_timer_that_serves_events_meanwhile(
    host: HostRoot, monkeypatch: pytest.MonkeyPatch
) -> None:
    """During a back-off the loop still hands over events at once (drift keeps watching); with
    none, it sleeps until the back-off ends (one select, no spin) and posts the retry."""
    use(monkeypatch)
    svc, _ = service(host)
    svc._install()
    try:
        calls = 0
        real = svc._sel.select

        def counting(timeout: float | None = None) -> Any:
            nonlocal calls
            calls += 1
            return real(timeout)

        monkeypatch.setattr(svc._sel, "select", counting)
        svc.retry_at = time.time() + 0.3
        svc.mail.post(Event("drift", "/x"))
        assert svc._wait(None) == [Event("drift", "/x")]
        assert svc.retry_at is not None  # still backing off
        calls = 0
        assert svc._wait(None) == [Event("backoff", "retry")]
        assert calls <= 2  # one sleep (plus one for a rounding remainder), not a spin
        assert svc.retry_at is None
    finally:
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGHUP, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)


def test_reload_waits_for_the_answer_to_its_own_request(
    host: HostRoot, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A reconcile that was already running for another event (it bumps the record to Done)
    must not be taken for the reload; only the daemon's answer with this request's number is."""
    from kvcd.daemon import control

    fakehost.pretend_daemon(host, "e2e", monkeypatch)
    control.answer_reload(host, "e2e", 0, Record("e2e", state.DONE, version="1.0"))

    def daemon_side() -> None:
        # First the unrelated reconcile ends Done (new generation), then the reload's own.
        Record("e2e", state.DONE, version="1.0", generation=99).write(host)
        seq = control.reload_requested(host, "e2e")
        Record("e2e", state.DEGRADED, "LoadFailed", "x", version="2.0", generation=100).write(host)
        control.answer_reload(host, "e2e", seq, None)

    def on_hup(_sig: int, _frame: Any) -> None:
        threading.Timer(0.2, daemon_side).start()

    old = signal.signal(signal.SIGHUP, on_hup)
    try:
        assert control.request_reload(host, "e2e", timeout=30, poll=0.05) == 1
        assert "Degraded: LoadFailed: x" in capsys.readouterr().err
        assert control.reload_requested(host, "e2e") == 1
        assert control.request_reload(host, "e2e", timeout=30, poll=0.05) == 1
        assert control.reload_requested(host, "e2e") == 2
    finally:
        signal.signal(signal.SIGHUP, old)


@pytest.mark.parametrize(
    ("answer", "code", "out", "err"),
    [
        (Record("e2e", state.DONE, version="2.0"), 0, "e2e: Done (version 2.0)", ""),
        (
            Record(
                "e2e", state.WORKING, "DrainRequired", "Drain_Required requested", version="2.0"
            ),
            0,
            "e2e: Working: DrainRequired: Drain_Required requested",
            "",
        ),
        (
            Record("e2e", state.DEGRADED, "ModuleInUse", "kvcd_base is held", version="2.0"),
            1,
            "",
            "e2e: Degraded: ModuleInUse: kvcd_base is held",
        ),
    ],
    ids=["done", "working-waits-outside", "degraded"],
)
def test_reload_exit_code_by_answer(
    host: HostRoot,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    answer: Record,
    code: int,
    out: str,
    err: str,
) -> None:
    """`systemctl reload` fails only when the change failed (Degraded): a reload that was taken
    and now waits on the cluster or the links is not a failed reload."""
    from kvcd.daemon import control

    fakehost.pretend_daemon(host, "e2e", monkeypatch)

    def on_hup(_sig: int, _frame: Any) -> None:
        seq = control.reload_requested(host, "e2e")
        threading.Timer(0.05, control.answer_reload, (host, "e2e", seq, answer)).start()

    old = signal.signal(signal.SIGHUP, on_hup)
    try:
        assert control.request_reload(host, "e2e", timeout=30, poll=0.02) == code
    finally:
        signal.signal(signal.SIGHUP, old)
    got = capsys.readouterr()
    assert got.out.strip() == out and got.err.strip() == err


# --- kvcd.toml module_tree: chosen once, at start --------------------------------------------


def test_module_tree_system_installs_into_lib_modules(
    host: HostRoot, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    use(monkeypatch)
    fakehost.write(host.main_config, 'module_tree = "system"\n')
    svc, _n = service(host)
    rec = svc.reconcile([Event("start", kind=RETRY)])
    assert rec is not None and rec.state == state.DONE
    copy = host.system_modules(K) / "extra" / "e2e"
    assert (copy / ".kvcd-store").is_file() and not copy.is_symlink()
    assert not (host.state / "modules" / "lib").exists()  # kvcd's own tree is not used
    # A reload that switches back only says when it takes effect; the tree stays.
    fakehost.write(host.main_config, 'module_tree = "kvcd"\n')
    caplog.set_level(logging.WARNING)
    assert svc.reconcile([Event("signal", kind=RETRY)]) is not None
    assert svc.root.system_tree
    assert (
        "module_tree = 'kvcd' in" in caplog.text
        and "takes effect when kvcd@e2e restarts" in caplog.text
    )


def test_module_tree_system_is_refused_on_rpm_ostree(host: HostRoot) -> None:
    fakehost.write(host.main_config, 'module_tree = "system"\n')
    fakehost.write(host("/run/ostree-booted"), "")
    svc, _n = service(host)
    assert svc.reconcile([Event("start", kind=RETRY)]) is None
    rec = Record.read(host, "e2e")
    assert rec is not None and rec.state == state.DEGRADED
    assert rec.reason.startswith(f'ConfigInvalid: {host.main_config}: module_tree = "system"')
    assert "rpm-ostree host" in rec.reason


class Unreadable(Scripted):
    """An extension that reads something kvcd cannot act on (observe's StepFailed)."""

    def verdict(self, ctx: Context, events: list[Event]) -> Verdict | None:
        raise StepFailed(state.INSTALL_FAILED, "/lib/modules/k/extra/e2e was not installed by kvcd")


class HostRefused(Scripted):
    """An extension whose read the host refused (an OSError no layer below turned into a
    StepFailed): the daemon exited 1 of it, with no reason written."""

    def verdict(self, ctx: Context, events: list[Event]) -> Verdict | None:
        raise OSError(errno.EIO, os.strerror(errno.EIO), "/sys/module/kvcd_user/refcnt")


@pytest.mark.parametrize(
    ("ext", "reason"),
    [
        (Unreadable, "InstallFailed: /lib/modules/k/extra/e2e was not installed by kvcd"),
        (HostRefused, "HostError: /sys/module/kvcd_user/refcnt: Input/output error"),
    ],
)
def test_a_verdict_that_cannot_be_reached_holds_degraded(
    host: HostRoot, monkeypatch: pytest.MonkeyPatch, ext: type[Scripted], reason: str
) -> None:
    use(monkeypatch, ext([]))
    svc, _n = service(host)
    rec = svc.reconcile([Event("start", kind=RETRY)])
    assert rec is not None and rec.state == state.DEGRADED
    assert rec.reason == reason
    assert not (host.sys_module / "kvcd_base").exists()  # held: nothing loaded


def test_a_reload_with_a_bad_config_says_the_reason_in_status(host: HostRoot) -> None:
    """`systemctl status` shows the reason a reload failed, not only that it did."""
    svc, n = service(host)
    rec = svc.reconcile([Event("start", kind=RETRY)])
    assert rec is not None and svc._announce(rec, ready=False)
    cfg = host("/etc/kvcd/instances/e2e.toml")
    cfg.write_text("no_such_key = 1\n" + cfg.read_text())
    assert svc.reconcile([Event("signal", "reload", kind=RETRY)]) is None
    svc._announce(None, ready=True)
    (status,) = [s for s in n.sent[-1:] if s.startswith("STATUS=")]
    assert status.startswith(f"STATUS=Degraded: ConfigInvalid: {cfg}"), status
    assert "no_such_key" in status


def test_a_start_that_claims_another_instances_module_exits_2_and_touches_nothing(
    host: HostRoot, fake_commands: Any
) -> None:
    """kvcd@e2e must not take kvcd_base from instance a: Degraded ModuleOwned, exit status 2
    (RestartPreventExitStatus=2: no restart loop), and not one module command run."""
    (host.sys_module / "kvcd_base").mkdir(parents=True)
    Record(instance="a", state=state.DONE, goal="loaded", modules=["kvcd_base"]).write(host)
    svc, n = service(host)
    before = len(fake_commands.calls())
    assert svc.reconcile([Event("start", kind=RETRY)]) is None
    assert svc.config_invalid, "ModuleOwned must end kvcd run with exit status 2"
    assert len(fake_commands.calls()) == before
    rec = Record.read(host, "e2e")
    assert rec is not None and rec.reason.startswith(
        "ModuleOwned: kvcd_base is owned by instance a"
    )
    svc._announce(None, ready=False)
    assert n.sent[-1].startswith("STATUS=Degraded: ModuleOwned: kvcd_base is owned by instance a")


def test_a_full_disk_is_retried_with_backoff_not_a_crash(
    host: HostRoot, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ENOSPC writing the record: the daemon stays up, says HostError with the path in STATUS=,
    retries with backoff, and converges once the disk has room again."""

    use(monkeypatch)
    full_disk(monkeypatch, writes=2)
    n = fakehost.RecordingNotifier()
    svc = Service(host, "e2e", K, n, backoff=Backoff(first=0.01, cap=0.01))
    svc._install()
    try:
        rec = svc.reconcile([Event("start", kind=RETRY)])
        tries = 1
        while rec is None:  # the loop: the back-off timer's event is the next try
            assert svc.retry_at is not None and svc.ledger is not None
            assert svc.ledger.tries == tries and svc.ledger.code == state.HOST_ERROR
            assert svc._wait(None) == [Event("backoff", "retry")]
            rec = svc.reconcile([Event("backoff", "retry")])
            tries += 1
    finally:
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGHUP, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
    # The first try's two writes fail (Working, then the Degraded record of the failure).
    assert rec is not None and rec.state == state.DONE and tries == 2
    assert rec.attempt.outcome == "ok" and svc.retry_at is None


def test_a_first_start_backing_off_sends_ready_only_once_settled(
    host: HostRoot, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A transient failure at the first start: the late hooks run after it (the node hears
    of it), but READY=1 waits for the back-off's try and goes out with the settled outcome."""

    class Late(Scripted):
        late = True

    def stop_when_done(count: int, _events: list[Event]) -> None:
        if count == 3:
            sigterm()

    late = Late(on_verdict=stop_when_done)
    use(monkeypatch, late)
    full_disk(monkeypatch, writes=1)  # the Working record; the failure's Degraded one is written
    n = fakehost.RecordingNotifier()
    svc = Service(host, "e2e", K, n, backoff=Backoff(first=0.2, cap=0.2))

    def poke() -> None:  # a third cycle after Done, whose verdict stops the loop
        time.sleep(1.0)
        assert late.ctx is not None
        late.ctx.post(Event("poke"))

    threading.Thread(target=poke, daemon=True).start()
    assert svc.run() == 0
    assert late.records[0][0] == state.DEGRADED  # the failure reached the late hooks
    at = n.sent.index("READY=1")
    assert n.sent[at + 1].startswith("STATUS=Done"), n.sent


def test_a_full_state_directory_keeps_the_truth_in_run_until_it_has_room(
    host: HostRoot, monkeypatch: pytest.MonkeyPatch
) -> None:
    """/var full (every write of the state file refused): the daemon stays up, `kvcd status`
    says Degraded: HostError naming the file, from the copy kept in /run, with a warning that
    it is not saved; once there is room the record is written again and the copy removed."""
    import errno

    from kvcd.daemon import status
    from kvcd.host import files

    use(monkeypatch)
    real = files.write_json
    full = {"on": True}

    def write_json(path: Path, obj: Any, mode: int = 0o644) -> None:
        if full["on"] and path.is_relative_to(host.state):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(path, obj, mode)

    monkeypatch.setattr(files, "write_json", write_json)
    n = fakehost.RecordingNotifier()
    svc = Service(host, "e2e", K, n, backoff=Backoff(first=30.0, cap=30.0))
    try:
        assert svc.reconcile([Event("start", kind=RETRY)]) is None
        assert not host.state_file("e2e").exists()
        [entry] = status.collect(host, "e2e")
        assert entry["state"] == state.DEGRADED and entry["code"] == state.HOST_ERROR
        assert entry["detail"] == f"{host.state_file('e2e')}: No space left on device"
        assert entry["warnings"] == [
            f"state not saved: {host.state_file('e2e')}: No space left on device; kept in "
            f"{host.unsaved_record('e2e')} until it can be"
        ]
        full["on"] = False
        svc.ledger = dataclasses.replace(svc.ledger, not_before=0.0)  # the back-off has ended
        rec = svc.reconcile([Event("backoff", "retry")])
    finally:
        svc.stop_extensions()
        signal.set_wakeup_fd(-1)
    assert rec is not None and rec.state == state.DONE
    assert not host.unsaved_record("e2e").exists()
    [entry] = status.collect(host, "e2e")
    assert entry["state"] == state.DONE and entry["warnings"] == []
    assert Record.load(host, "e2e") == rec


def test_events_during_a_backoff_neither_retry_early_nor_lose_the_timer(
    host: HostRoot, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A transient failure: mere events wait for the back-off (nothing applied), an extension's
    SKIP leaves it armed, and its end applies again."""

    ext = Scripted(verdicts=[None, None, Verdict(SKIP), None])
    use(monkeypatch, ext)
    disk = full_disk(monkeypatch)
    n = fakehost.RecordingNotifier()
    svc = Service(host, "e2e", K, n, backoff=Backoff(first=30.0, cap=30.0))
    assert svc.reconcile([Event("start", kind=RETRY)]) is None
    armed = svc.retry_at
    assert armed is not None and svc.ledger is not None and svc.ledger.tries == 1
    assert svc.reconcile([Event("scripted", "udev")]) is None  # waits: not a try
    assert svc.ledger.tries == 1 and svc.retry_at == armed
    assert svc.reconcile([Event("scripted", "file")]) is None  # SKIP: the timer stays
    assert svc.retry_at == armed
    disk["left"] = 0
    svc.ledger = dataclasses.replace(svc.ledger, not_before=0.0)  # the back-off has ended
    rec = svc.reconcile([Event("backoff", "retry")])
    assert rec is not None and rec.state == state.DONE and svc.retry_at is None
    svc.stop_extensions()
    said = [s for s in n.sent if s.startswith("STATUS=HostError:")]
    assert said and f"{host.state_file('e2e')}: No space left on device" in said[0], n.sent
    svc.stop_extensions()


class FailingStart(Extension):
    name = "drift"

    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    def start(self, ctx: Context) -> None:
        raise self.exc


@pytest.mark.parametrize(
    ("exc", "message", "traceback"),
    [
        (
            files.Refused(Path("/var/lib/kvcd/drift/foo.json"), "is a FIFO"),
            "extension drift did not start: /var/lib/kvcd/drift/foo.json: is a FIFO",
            False,
        ),
        (
            files.Damaged(Path("/var/lib/kvcd/drift/foo.json"), "not JSON"),
            "extension drift did not start: /var/lib/kvcd/drift/foo.json: not JSON",
            False,
        ),
        (KeyError("bug"), "extension drift did not start", True),  # a bug keeps its traceback
    ],
)
def test_an_extension_that_does_not_start_is_left_out(
    exc: Exception, message: str, traceback: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """An expected refusal (kvcd's own file is a FIFO, a symlink, garbage) is one line naming
    the path; the other extensions start all the same."""
    ctx: Any = types.SimpleNamespace(fields={"KVCD_INSTANCE": "foo"})
    other = Extension()
    assert extensions.start([FailingStart(exc), other], ctx) == [other]
    (rec,) = [r for r in caplog.records if "did not start" in r.getMessage()]
    assert rec.getMessage() == message
    assert (rec.exc_info is not None) is traceback


class Told(Extension):
    """Writes what it is told, in order, into a shared list; `fail` raises in that hook."""

    def __init__(self, name: str, said: list[str], fail: str = "") -> None:
        self.name, self._said, self._fail = name, said, fail

    def _tell(self, what: str) -> None:
        self._said.append(f"{what} {self.name}")
        if what == self._fail:
            raise KeyError("bug")

    def stop(self) -> None:
        self._tell("stop")

    def at_exit(self, ctx: Context, record: Record | None) -> None:
        self._tell(f"exit {record.state if record else None}")


@pytest.mark.parametrize(
    ("exiting", "fail", "said"),
    [
        # a reload's rebuild: stopped, no last word
        (False, "", ["stop b", "stop a"]),
        # the daemon exits: each has its last word (in start order, with the record on disk,
        # while what it reports through is open), then all stop (the last started first)
        (True, "", ["exit Done a", "exit Done b", "stop b", "stop a"]),
        # one that fails is logged; the others still have their last word and still stop
        (True, "stop", ["exit Done a", "exit Done b", "stop b", "stop a"]),
        (True, "exit Done", ["exit Done a", "exit Done b", "stop b", "stop a"]),
    ],
)
def test_stopping_the_extensions_and_their_last_word(
    exiting: bool, fail: str, said: list[str], caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    got: list[str] = []
    root = HostRoot(tmp_path)
    Record("foo", "Done", goal="unloaded").write(root)
    ctx: Any = types.SimpleNamespace(fields={"KVCD_INSTANCE": "foo"}, root=root, name="foo")
    exts: list[Extension] = [Told("a", got, fail), Told("b", got)]
    extensions.stop(exts, ctx.fields, ctx if exiting else None)
    assert got == said
    failed = [r.getMessage() for r in caplog.records if r.exc_info]
    assert (
        failed
        == {
            "": [],
            "stop": ["extension a did not stop cleanly"],
            "exit Done": ["extension a: its last report failed"],
        }[fail]
    )


def test_a_late_hook_the_host_refuses_does_not_silence_the_hooks_after_it(
    host: HostRoot, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """One late after-hook's OSError (a baseline the host will not let kvcd read) is said with the
    extension's name; the hooks after it (the node report) still see the cycle's record."""

    class Refused(Scripted):
        name, late = "drift", True

        def after(self, ctx: Context, record: Record) -> Verdict | None:
            raise PermissionError(errno.EACCES, "Permission denied", "/etc/kvcd/x")

    class Node(Scripted):
        name, late = "node", True

    node = Node(on_verdict=lambda count, _e: sigterm() if count == 2 else None)
    use(monkeypatch, Refused(), node)

    def wake_once() -> None:
        time.sleep(0.2)
        assert node.ctx is not None
        node.ctx.post(Event("poke"))

    threading.Thread(target=wake_once, daemon=True).start()
    with caplog.at_level(logging.WARNING):
        assert Service(host, "e2e", K, fakehost.RecordingNotifier()).run() == 0
    assert node.records and node.records[0][0] == state.DONE
    assert "drift: /etc/kvcd/x: Permission denied" in caplog.text
