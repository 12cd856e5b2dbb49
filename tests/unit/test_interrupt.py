"""kvcd.host.interrupt: a stop cuts into a wait for podman, and nowhere else."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvcd.core import state
from kvcd.daemon.instance import held_modules
from kvcd.daemon.record import Record
from kvcd.host import interrupt
from kvcd.host.interrupt import Interrupted
from kvcd.host.paths import HostRoot
from tests.unit.test_instance import FakePodman, instance, instance_host


@pytest.fixture
def host(tmp_path: Path, fake_commands: Any, monkeypatch: pytest.MonkeyPatch) -> HostRoot:
    return instance_host(tmp_path, fake_commands, monkeypatch)


@pytest.fixture(autouse=True)
def clean() -> Iterator[None]:
    interrupt.reset()
    yield
    interrupt.reset()


def test_a_stop_asked_for_inside_a_wait_cuts_into_it() -> None:
    with pytest.raises(Interrupted), interrupt.allowed():
        interrupt.request()  # as the signal handler does, during the wait
        pytest.fail("not cut into")
    interrupt.request()  # outside: marked, not raised (the loop takes it after the cycle)


def test_a_stop_asked_for_outside_any_wait_is_raised_by_the_next_one() -> None:
    interrupt.request()
    with pytest.raises(Interrupted), interrupt.allowed():
        pytest.fail("entered after a stop was asked for")
    interrupt.reset()
    with interrupt.allowed():
        pass


def test_raised_in_the_waits_own_clean_up_it_does_not_stay_inside() -> None:
    with pytest.raises(Interrupted), interrupt.allowed():
        interrupt.request()
    interrupt.reset()
    interrupt.request()  # had `inside` stayed set, this would raise here, outside any wait


def test_off_the_main_thread_a_wait_is_never_cut_into() -> None:
    interrupt.request()
    entered: list[bool] = []

    def wait() -> None:
        with interrupt.allowed():
            entered.append(True)

    t = threading.Thread(target=wait)
    t.start()
    t.join()
    assert entered == [True]


class StoppedBuild(FakePodman):
    def build(self, spec: object, on_line: object) -> object:
        raise Interrupted


class CtrlC(FakePodman):
    def build(self, spec: object, on_line: object) -> object:
        raise KeyboardInterrupt


def test_a_reload_stopped_during_its_build_keeps_what_is_loaded_and_says_so(
    host: HostRoot,
) -> None:
    """1.0 is loaded; the reload to 2.0 is stopped while podman builds 2.0: 1.0 stays loaded
    and held, and the record says Degraded, Stopped (not Working, not a failed build)."""
    assert instance(host, FakePodman(host, "6.1.0-56-amd64")).apply("load").state == "Done"
    with pytest.raises(Interrupted):
        instance(host, StoppedBuild(host, "6.1.0-56-amd64"), "2.0").apply("load")
    rec = Record.read(host, "e2e")
    assert rec is not None and (rec.state, rec.code) == (state.DEGRADED, state.STOPPED)
    assert rec.detail == "stopped before this load finished"
    assert held_modules(host) == {"e2e": ["kvcd_base", "kvcd_user"]}
    assert (host.sys_module / "kvcd_user").is_dir()


def test_a_first_start_stopped_during_its_build_holds_nothing(host: HostRoot) -> None:
    with pytest.raises(Interrupted):
        instance(host, StoppedBuild(host, "6.1.0-56-amd64")).apply("load")
    rec = Record.read(host, "e2e")
    assert rec is not None and rec.code == state.STOPPED and rec.held == []
    assert held_modules(host) == {}


def test_a_one_shot_verb_interrupted_with_ctrl_c_leaves_no_working_claim(host: HostRoot) -> None:
    """`kvcd load` (no daemon, no handler) and ^C during its build: the record says Stopped,
    not Working, which would claim its modules for the rest of the boot."""
    with pytest.raises(KeyboardInterrupt):
        instance(host, CtrlC(host, "6.1.0-56-amd64")).apply("load")
    rec = Record.read(host, "e2e")
    assert rec is not None and (rec.state, rec.code) == (state.DEGRADED, state.STOPPED)
    assert held_modules(host) == {}
