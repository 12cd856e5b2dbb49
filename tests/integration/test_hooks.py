"""KVC library hooks in a transient unit of their own (systemd-run), as kvcd@NAME runs them:
what the library sees, what it does not, and how a failure comes back. systemd-run is a fake
here that does what the real one does with these options (the guest runs the real one)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kvcd.host import hooks, interrupt, procs
from kvcd.host.run import CommandError

pytestmark = pytest.mark.integration

LIB = r"""
load_kmods() {
    echo "load $KVC_SOFTWARE_NAME $KVC_KVER arg1=$1 names=$KMOD_NAMES"
    echo "daemon-only=${KVCD_DAEMON_ONLY:-unset} notify=${NOTIFY_SOCKET:-unset}"
}
unload_kmods() { echo "cannot unload" >&2; return 3; }
"""

# systemd-run --wait --pipe: the command runs with systemd's environment plus --setenv, its
# output on our pipes, systemd-run's exit status its own; at RuntimeMaxSec= the unit is stopped
# (SIGTERM, SIGKILL TimeoutStopSec= later). Options are logged for the test. With FAKE_WEDGED
# set it never comes back (a manager that does not answer). The unit's processes are a session
# of their own, which `systemctl stop UNIT` ends (as systemd ends a unit's cgroup); systemctl
# logs what it is asked.
FAKE_SYSTEMD_RUN = r"""#!/bin/bash
set -eu
vars=()
limit=()
stop=90
unit=
while [ $# -gt 0 ]; do
    case "$1" in
        --unit=*) unit="${1#--unit=}" ;;
        --setenv=*) vars+=("${1#--setenv=}") ;;
        --property=TimeoutStopSec=*) stop="${1#--property=TimeoutStopSec=}" ;;
        --property=RuntimeMaxSec=*) max="${1#--property=RuntimeMaxSec=}"
                                    limit=(timeout --kill-after="$stop" "$max") ;;
        --*) ;;
        *) break ;;
    esac
    echo "$1" >> "$RUN_LOG"
    shift
done
echo $$ > "$RUN_LOG.$unit"  # not a group leader: setsid keeps this pid, the session's id
if [ -n "${FAKE_WEDGED:-}" ]; then exec setsid sleep 60; fi
exec setsid "${limit[@]}" env -i PATH="$PATH" "${vars[@]}" "$@"
"""
FAKE_SYSTEMCTL = r"""#!/bin/bash
echo "systemctl $*" >> "$RUN_LOG"
if [ "$1" = stop ]; then
    session=$(cat "$RUN_LOG.${*: -1}")
    kill -TERM -- "-$session" 2>/dev/null || exit 0
    for _ in $(seq 50); do kill -0 -- "-$session" 2>/dev/null || exit 0; sleep 0.1; done
    kill -KILL -- "-$session" 2>/dev/null
fi
exit 0
"""


@pytest.fixture
def lib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name, body in (("systemd-run", FAKE_SYSTEMD_RUN), ("systemctl", FAKE_SYSTEMCTL)):
        fake = bindir / name
        fake.write_text(body)
        fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    monkeypatch.setenv("RUN_LOG", str(tmp_path / "run.log"))
    monkeypatch.setenv("KVCD_DAEMON_ONLY", "secret")
    monkeypatch.setenv("NOTIFY_SOCKET", "/run/systemd/notify")
    path = tmp_path / "drv-lib.sh"
    path.write_text(LIB)
    return path


def variables() -> dict[str, str]:
    return hooks.hook_vars("drv", "6.1.0-56-amd64", (("KMOD_NAMES", "a b"),))


def test_in_a_unit_the_library_sees_its_variables_and_nothing_of_the_daemon(
    lib: Path, tmp_path: Path
) -> None:
    done = hooks.call(lib, "load_kmods", variables(), timeout=90, unit="kvcd-hook-drv-1.service")
    assert done.stdout.splitlines() == [
        "load drv 6.1.0-56-amd64 arg1=6.1.0-56-amd64 names=a b",
        "daemon-only=unset notify=unset",
    ]
    opts = (tmp_path / "run.log").read_text().splitlines()
    assert opts[:6] == [
        "--quiet",
        "--wait",
        "--pipe",
        "--collect",
        "--service-type=exec",
        "--unit=kvcd-hook-drv-1.service",
    ]
    assert "--property=RuntimeMaxSec=90" in opts
    assert "--setenv=KVC_KVER=6.1.0-56-amd64" in opts


def test_inline_the_library_gets_the_daemon_environment_too(lib: Path, tmp_path: Path) -> None:
    done = hooks.call(lib, "load_kmods", variables())
    assert "daemon-only=secret" in done.stdout
    assert not (tmp_path / "run.log").exists()


def test_a_failing_function_in_a_unit_is_a_command_error_with_its_output(lib: Path) -> None:
    with pytest.raises(CommandError) as err:
        hooks.call(lib, "unload_kmods", variables(), unit="kvcd-hook-drv-2.service")
    assert err.value.rc == 3 and "cannot unload" in str(err.value)


HUNG = "load_kmods() { echo started; sleep 60; }\n"


@pytest.mark.parametrize("unit", [None, "kvcd-hook-drv-3.service"], ids=["inline", "unit"])
def test_a_function_past_its_timeout_is_stopped(
    lib: Path, tmp_path: Path, unit: str | None
) -> None:
    lib.write_text(HUNG)
    t0 = time.monotonic()
    with pytest.raises(hooks.TimedOut) as err:
        hooks.call(lib, "load_kmods", variables(), timeout=1, unit=unit)
    assert time.monotonic() - t0 < 30  # not the 60 s of the sleep
    assert err.value.rc == 124 and "timed out after 1s" in str(err.value)
    if unit is not None:
        opts = (tmp_path / "run.log").read_text().splitlines()
        assert {"--property=RuntimeMaxSec=1", "--property=TimeoutStopSec=10"} <= set(opts)


def test_a_manager_that_does_not_stop_the_unit_in_time_has_kvcd_stop_it(
    lib: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """systemd-run waits for the unit; if it is still waiting well past RuntimeMaxSec= and the
    unit's stop, kvcd stops waiting and asks systemd to stop the unit (no hook left behind)."""
    lib.write_text(HUNG)
    monkeypatch.setenv("FAKE_WEDGED", "1")
    monkeypatch.setattr(hooks, "_BACKSTOP", 0.5)
    monkeypatch.setattr(hooks, "LEFTOVER_GRACE", 0.5)
    with pytest.raises(hooks.TimedOut):
        hooks.call(lib, "load_kmods", variables(), timeout=1, unit="kvcd-hook-drv-4.service")
    log = (tmp_path / "run.log").read_text().splitlines()
    assert log[-1] == "systemctl stop --no-block kvcd-hook-drv-4.service"


@contextmanager
def stop_requested_after(seconds: float) -> Iterator[None]:
    """As `systemctl stop` does to the daemon, `seconds` from now: its SIGTERM handler asks for
    the stop (kvcd.daemon.service), on the main thread."""
    signal.signal(signal.SIGALRM, lambda *_: interrupt.request())
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        interrupt.reset()


def test_a_stop_cuts_into_build_kmods_and_stops_its_unit(lib: Path, tmp_path: Path) -> None:
    """A KVC library's build can take as long as a podman build: a stop does not wait for it
    (it did, up to the unit's TimeoutStopSec=, and left the hook's unit building), and the
    function's unit, named by this call, is stopped with what it started."""
    lib.write_text("build_kmods() { echo started; sleep 60.5; }\n")
    t0 = time.monotonic()
    with stop_requested_after(0.5), pytest.raises(interrupt.Interrupted):
        hooks.call(lib, "build_kmods", variables(), timeout=100, unit="kvcd-hook-drv-5.service")
    assert time.monotonic() - t0 < 30  # not the 60 s of the sleep
    log = (tmp_path / "run.log").read_text().splitlines()
    assert log[-1] == "systemctl stop kvcd-hook-drv-5.service"
    assert subprocess.run(["pgrep", "-fx", "sleep 60.5"], check=False).returncode == 1


@pytest.mark.parametrize("function", ["load_kmods", "unload_kmods"])
def test_a_stop_never_cuts_into_a_load_or_an_unload(
    lib: Path, tmp_path: Path, function: str
) -> None:
    """A load or unload half done is worse than a wait: the stop is taken after it, and the
    unload a stop runs (the requested stop still marked) runs whole."""
    lib.write_text(f"{function}() {{ sleep 1; echo finished; }}\n")
    with stop_requested_after(0.2):
        done = hooks.call(lib, function, variables(), timeout=100, unit="kvcd-hook-drv-6.service")
        assert done.stdout == "finished\n"
        done = hooks.call(lib, function, variables(), timeout=100, unit="kvcd-hook-drv-7.service")
        assert done.stdout == "finished\n"
    assert "systemctl" not in (tmp_path / "run.log").read_text()


@pytest.mark.parametrize(
    ("cgroup", "unit"),
    [
        ("0::/system.slice/system-kvcd.slice/kvcd@drv.service\n", "kvcd@drv.service"),
        ("12:pids:/x\n0::/user.slice/user-0.slice/session-3.scope\n", None),
        ("0::/system.slice/a.service/sub\n", "a.service"),
        ("", None),
    ],
)
def test_own_unit_is_read_from_the_unified_cgroup(
    tmp_path: Path, cgroup: str, unit: str | None
) -> None:
    path = tmp_path / "cgroup"
    path.write_text(cgroup)
    assert procs.own_unit(path) == unit
    assert procs.own_unit(tmp_path / "absent") is None


# A conf as KVC had it: sourced without `set -a`, its variables were the library's shell
# variables; a program the library runs saw only what the conf exported.
CONF = """\
KMOD_CONTAINER_BUILD_CONTEXT="https://example.invalid/simple-kmod.git"
KMOD_SOFTWARE_VERSION=dd1a7d4
KMOD_NAMES="simple-kmod"
GIT_CONFIG_COUNT=1
GIT_CONFIG_KEY_0=protocol.ext.allow
GIT_CONFIG_VALUE_0=always
NOTE="a note"
export SHOWN=shown
LATER=later
export LATER
"""

SEEN = r"""
load_kmods() {
    echo "library: NOTE=$NOTE KMOD_NAMES=$KMOD_NAMES"
    echo "git: $(git config --get protocol.ext.allow || echo unset)"
    sh -c 'echo "child: NOTE=${NOTE-unset} KMOD_NAMES=${KMOD_NAMES-unset} SHOWN=${SHOWN-unset}"'
    sh -c 'echo "child: LATER=${LATER-unset} KVC_KVER=${KVC_KVER-unset}"'
}
"""

# Library functions that leave children behind: build_kmods one that escaped into a session of its
# own (and still holds the function's output) and one in the function's process group, load_kmods
# only the latter. pid files name them.
LEFT_BEHIND = r"""
build_kmods() {
    # It names itself once it has left the group (before, the group's end could still take it).
    setsid sh -c 'echo $$ > "$PIDS/e.new"; mv "$PIDS/e.new" "$PIDS/escaped"; exec sleep 20' &
    while [ ! -e "$PIDS/escaped" ]; do sleep 0.01; done
    sleep 20 </dev/null >/dev/null 2>&1 &
    echo $! > "$PIDS/in-group"
    echo "build_kmods returned"
}
load_kmods() {
    sleep 20 </dev/null >/dev/null 2>&1 &
    echo $! > "$PIDS/in-group"
}
"""


@pytest.mark.parametrize("unit", [None, "kvcd-hook-drv-3.service"], ids=["inline", "unit"])
def test_a_conf_variable_reaches_the_library_and_a_program_only_when_exported(
    lib: Path, tmp_path: Path, unit: str | None
) -> None:
    from kvcd.config.loader import parse_kvc_conf

    cfg = parse_kvc_conf("drv", tmp_path / "drv.conf", CONF)
    assert cfg.kvc_exported == ("LATER", "SHOWN")
    lib.write_text(SEEN)
    variables = hooks.hook_vars("drv", "6.1.0-56-amd64", cfg.kvc_vars(), cfg.kvc_exported)
    done = hooks.call(lib, "load_kmods", variables, unit=unit)
    assert done.stdout.splitlines() == [
        "library: NOTE=a note KMOD_NAMES=simple-kmod",
        "git: unset",  # exported, GIT_CONFIG_* would have let a clone run `ext::` commands
        "child: NOTE=unset KMOD_NAMES=unset SHOWN=shown",
        "child: LATER=later KVC_KVER=6.1.0-56-amd64",
    ]


def alive(pid: int) -> bool:
    """Running, not a zombie waiting for its new parent to reap it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


@pytest.fixture
def left_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PIDS", str(tmp_path))
    path = tmp_path / "drv-lib.sh"
    path.write_text(LEFT_BEHIND)
    return path


def test_inline_the_call_ends_with_bash_not_with_a_child_that_holds_its_output(
    left_behind: Path, tmp_path: Path
) -> None:
    done = hooks.call(left_behind, "build_kmods", variables())
    escaped = int((tmp_path / "escaped").read_text())
    try:
        assert done.stdout == "build_kmods returned\n"
        assert alive(escaped), "kvcd waited for the background child"
    finally:
        os.kill(escaped, 9)


def test_inline_what_the_function_left_in_its_process_group_is_stopped(
    left_behind: Path, tmp_path: Path
) -> None:
    hooks.call(left_behind, "load_kmods", variables())
    assert not alive(int((tmp_path / "in-group").read_text()))
