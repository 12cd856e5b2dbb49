"""Helpers for the guest-side e2e scripts (run by pytest inside the VM guest, as root).

Only the standard library and what the guest image has (pytest, podman-py, pyelftools).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

PAYLOAD = Path(os.environ.get("KVCD_E2E_PAYLOAD", "/mnt/e2e"))
RESULTS = Path(os.environ.get("KVCD_E2E_RESULTS", "/mnt/e2e/results"))
DRIVER_DIR = Path("/var/lib/kvcd-e2e/driver")
INSTANCE = "e2e-kmod"
INSTANCE_FILE = Path("/etc/kvcd/instances/e2e-kmod.toml")
UNIT = f"kvcd@{INSTANCE}.service"
MODS = ("kvcd_base", "kvcd_user")  # the e2e driver's modules, in load order
# Seconds a start that builds in the guest may take.
BUILD_TIMEOUT = float(os.environ.get("KVCD_E2E_BUILD_TIMEOUT", "1200"))
BASE_IMAGE = "localhost/kvcd-e2e-base:latest"
PODMAN_SOCK = "unix:///run/podman/podman.sock"


def sh(
    argv: Sequence[str], *, check: bool = True, timeout: float = 600, input: str | None = None
) -> subprocess.CompletedProcess[str]:
    """Run argv, log it (pytest shows it on failure), return the completed process."""
    t0 = time.monotonic()
    try:
        p = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=timeout, input=input, check=False
        )
    except subprocess.TimeoutExpired as exc:
        # Killed after `timeout`: rc 124 as timeout(1) says, so check=False callers go on.
        out, err = (
            s.decode(errors="replace") if isinstance(s, bytes) else (s or "")
            for s in (exc.stdout, exc.stderr)
        )
        err += f"\n(timed out after {timeout}s)"
        p = subprocess.CompletedProcess(list(argv), 124, out, err)
    dt = time.monotonic() - t0
    print(f"$ {' '.join(argv)}  [rc={p.returncode}, {dt:.1f}s]")
    if p.stdout.strip():
        print(p.stdout.rstrip()[-4000:])
    if p.stderr.strip():
        print("stderr:", p.stderr.rstrip()[-4000:])
    if check and p.returncode != 0:
        raise AssertionError(f"{argv!r} failed rc={p.returncode}: {p.stderr.strip()[-2000:]}")
    return p


def unit_prop(name: str, unit: str) -> str:
    """A property of a unit (`systemctl show -P`); "" when systemctl cannot say. The unit has
    no default: a scenario file with its own instance must not read e2e-kmod's by accident."""
    return sh(["systemctl", "show", "-P", name, unit], check=False).stdout.strip()


def active(unit: str = UNIT) -> bool:
    return sh(["systemctl", "is-active", unit], check=False).stdout.strip() == "active"


def proc_modules() -> dict[str, list[str]]:
    """Loaded modules -> the modules that use them (/proc/modules 'used by' column)."""
    out: dict[str, list[str]] = {}
    for line in Path("/proc/modules").read_text().splitlines():
        f = line.split()
        out[f[0]] = [u for u in f[3].split(",") if u and u != "-"]
    return out


def module_version(name: str) -> str | None:
    p = Path(f"/sys/module/{name}/version")
    return p.read_text().strip() if p.exists() else None


def wait_for(pred: Callable[[], Any], timeout: float, what: str, interval: float = 2.0) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = pred()
        if last:
            return last
        time.sleep(interval)
    diagnose()
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")


def diagnose() -> None:
    """Print what kvcd is doing (pytest keeps it in the junit file the host shows)."""
    for argv in (
        ["kvcd", "status"],
        ["systemctl", "status", "--no-pager", "--full", "-n", "0", "kvcd@*"],
        ["journalctl", "-b", "--no-pager", "-n", "150", "-u", "kvcd@*", "-u", "podman.service"],
        ["ps", "-eo", "pid,etimes,args", "--sort=start_time"],
    ):
        try:
            sh(argv, check=False, timeout=60)
        except Exception as exc:  # diagnostics must not hide the real failure
            print(f"diagnose: {argv[0]}: {exc}")


def kvcd_status(instance: str = INSTANCE) -> dict[str, Any] | None:
    """This instance's entry of `kvcd status --json`, tolerant of the exact JSON nesting."""
    p = sh(["kvcd", "status", "--json"], check=False, timeout=60)
    if p.returncode not in (0, 1) or not p.stdout.strip():
        return None
    try:
        doc = json.loads(p.stdout)
    except ValueError:
        return None
    return _find_instance(doc, instance)


def _find_instance(doc: Any, instance: str) -> dict[str, Any] | None:
    if isinstance(doc, dict):
        if "instances" in doc:
            return _find_instance(doc["instances"], instance)
        if isinstance(doc.get(instance), dict):
            return {"name": instance, **doc[instance]}
        if doc.get("name") == instance or doc.get("instance") == instance:
            return doc
    if isinstance(doc, list):
        for item in doc:
            if isinstance(item, dict) and instance in (item.get("name"), item.get("instance")):
                return item
    return None


RECORDS = Path("/var/lib/kvcd/instances")  # kvcd's state directory's records
UNSAVED = Path("/run/kvcd")  # <instance>.unsaved.json while /var refuses writes


def recorded(instance: str = INSTANCE) -> dict[str, Any] | None:
    """The instance's record as kvcd wrote it in its state directory: a cheap "not yet" while
    waiting (`kvcd status` costs seconds under TCG, and the poll slows what it waits for).
    None when the record cannot tell: there is none, it does not parse, or kvcd keeps the
    newer one in /run while /var refuses writes (then only `kvcd status` knows)."""
    if (UNSAVED / f"{instance}.unsaved.json").exists():
        return None
    try:
        data = json.loads((RECORDS / f"{instance}.json").read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def never_recorded(instance: str = INSTANCE) -> bool:
    """No record at all, neither in the state directory nor kept in /run: `kvcd status` then
    shows the instance as Unknown, "never started" (kvcd/daemon/status.py, _unknown)."""
    return (
        not (UNSAVED / f"{instance}.unsaved.json").exists()
        and not (RECORDS / f"{instance}.json").exists()
    )


def noted(kind: str, instance: str = INSTANCE) -> dict[str, Any]:
    """A note the daemon keeps beside its record for `kvcd status` (/run/kvcd/<instance>.<kind>
    .json: drift, links, node), read as `recorded` reads the record: a cheap "not yet" while
    waiting. {} when there is none or it does not parse."""
    try:
        data = json.loads((UNSAVED / f"{instance}.{kind}.json").read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


# What `kvcd status --json` says of an instance without a record (kvcd/daemon/status.py).
NEVER_STARTED = {"state": "Unknown", "code": "", "detail": "never started"}


def not_yet(instance: str = INSTANCE, **want: Any) -> bool:
    """The record says the instance is not there yet: some field differs from `want` (a tuple
    means any of these values). Only then is `kvcd status` not asked. No record yet is what
    `kvcd status` shows as Unknown, "never started": a newly configured instance is polled
    from its file until kvcd writes one (a pull that retries for a minute writes none)."""
    rec = recorded(instance)
    if rec is None:
        if not never_recorded(instance):
            return False
        rec = NEVER_STARTED
    for key, value in want.items():
        values = value if isinstance(value, tuple) else (value,)
        if rec.get(key) not in values:
            return True
    return False


def state_is(*states: str, instance: str = INSTANCE) -> Callable[[], dict[str, Any] | None]:
    def pred() -> dict[str, Any] | None:
        if not_yet(instance, state=states):
            return None
        st = kvcd_status(instance)
        return st if st and st.get("state") in states else None

    return pred


def running_and_done(timeout: float, instance: str = INSTANCE) -> dict[str, Any]:
    """The unit active and its instance Done with its modules loaded; restarted when it is not.
    The record is asked first, so the usual case costs one `kvcd status` (seconds of the
    guest's one vCPU under TCG), which then confirms it."""
    unit = f"kvcd@{instance}.service"
    if active(unit) and not not_yet(instance, state="Done", goal="loaded"):
        st = kvcd_status(instance)
        if st and (st.get("state"), st.get("goal")) == ("Done", "loaded"):
            return st
    sh(["systemctl", "reset-failed", unit], check=False)
    sh(["systemctl", "restart", unit], timeout=timeout)
    return wait_for(state_is("Done", instance=instance), timeout, f"{instance} Done")


def wait_idle(unit: str = UNIT, timeout: float = 120) -> None:
    """Until the unit's daemon waits for events: its main thread in epoll_wait (kvcd's loop,
    Service._wait), not in a cycle or in the work that follows READY=1 (the drift baseline,
    the node report). An event that comes meanwhile waits for that work to end, which takes
    seconds under TCG: a test that times kvcd's answer to one starts from an idle daemon."""
    wchan = Path(f"/proc/{unit_prop('MainPID', unit)}/wchan")

    def idle() -> bool:
        try:
            return wchan.read_text().strip() == "do_epoll_wait"
        except OSError:
            return False

    wait_for(idle, timeout, f"{unit} idle (waiting for events)", interval=0.2)


def record_or_status(instance: str = INSTANCE) -> dict[str, Any] | None:
    """What the record says, or `kvcd status` when the record cannot tell (recorded)."""
    return recorded(instance) or kvcd_status(instance)


def set_instance(path: Path = INSTANCE_FILE, **values: Any) -> None:
    """Rewrite top-level `key = value` lines (TOML) in the instance file; tables too via
    'table.key' names, e.g. set_instance(**{"params.kvcd_user.greeting": "x"})."""
    text = path.read_text()
    for key, value in values.items():
        table, _, k = key.rpartition(".")
        rendered = json.dumps(value)
        pat = re.compile(rf"^(\s*{re.escape(k)}\s*=\s*).*$", re.M)
        if table:
            hdr = re.search(rf"^\[{re.escape(table)}\]\s*$", text, re.M)
            assert hdr, f"no [{table}] in {path}"
            nxt = re.search(r"^\[", text[hdr.end() :], re.M)
            end = hdr.end() + (nxt.start() if nxt else len(text) - hdr.end())
            section = text[hdr.end() : end]
            section, n = pat.subn(lambda m, r=rendered: m.group(1) + r, section, count=1)
            assert n, f"no {k} in [{table}] of {path}"
            text = text[: hdr.end()] + section + text[end:]
        else:
            first_table = re.search(r"^\[", text, re.M)
            head_end = first_table.start() if first_table else len(text)
            head, n = pat.subn(lambda m, r=rendered: m.group(1) + r, text[:head_end], count=1)
            assert n, f"no top-level {k} in {path}"
            text = head + text[head_end:]
    path.write_text(text)
    print(f"{path}:\n{text}")


def configured_version(path: Path = INSTANCE_FILE) -> str:
    """The instance file's `version` (what kvcd should have loaded)."""
    import tomllib

    version: str = tomllib.loads(path.read_text())["version"]
    return version


def containerfile(version: str, kernel: str | None = None) -> str:
    """The prebuilt-modules Containerfile when run-guest.sh compiled `version` for `kernel`
    (default: the running one) on the host, else the one that compiles in the guest."""
    k = kernel or os.uname().release
    if (DRIVER_DIR / "prebuilt" / k / version / "kvcd_user.ko").exists():
        return "Containerfile.prebuilt"
    return "Containerfile"


STATE_DIR = Path(os.environ.get("KVCD_E2E_STATE_DIR", "/var/lib/kvcd-e2e"))  # entry.sh's


def boot_number() -> int:
    """Which boot of this run the guest is in (1, then 2 after a reboot; entry.sh counts)."""
    return int(os.environ.get("KVCD_E2E_BOOT", "1"))


def request_reboot(kernel: str | None = None) -> None:
    """Ask entry.sh to reboot the guest (into `kernel`, a release with /boot/vmlinuz-<it> and
    /boot/initrd.img-<it>; default the running one) once this pytest session ends. Tests that
    run after the reboot carry @pytest.mark.boot(N) (see conftest.py)."""
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    (STATE_DIR / "reboot-request").write_text((kernel or os.uname().release) + "\n")
    print(f"reboot requested into {kernel or os.uname().release} after boot {boot_number()}")


def request_reset(trigger: Sequence[str], kernel: str | None = None) -> None:
    """Ask entry.sh for a hard reset once this pytest session ends: it syncs, runs `trigger`
    (which makes kvcd reach a fail point armed with KVCD_FAILPOINT_ACTION=reset) and waits for
    the kernel to reset the guest; the host boots it again with the running kernel and the
    interrupted step runs again. Without a reset within KVCD_E2E_RESET_WAIT seconds the run
    fails."""
    import shlex

    STATE_DIR.mkdir(parents=True, exist_ok=True)
    (STATE_DIR / "reset-trigger").write_text(shlex.join(trigger) + "\n")
    request_reboot(kernel)


@contextmanager
def core_instance_aside() -> Iterator[None]:
    """Take the core scenarios' instance (e2e-kmod) off the node while a scenario file configures
    another instance that ships modules of the same names: one owner per module, so e2e-kmod is
    stopped, unloaded and its file moved aside (as an admin removes an instance), and put back
    afterwards; kvcd removes a deconfigured instance's links from its module root itself.
    Put back, an instance that was running is started again and must reach Done: kvcd's own
    removal of its links is not drift."""
    aside = STATE_DIR / "aside" / INSTANCE_FILE.name
    was_active = active()
    sh(["systemctl", "stop", UNIT], check=False, timeout=600)
    for mod in reversed(MODS):
        if mod in proc_modules():
            sh(["modprobe", "-r", mod], check=False)
    aside.parent.mkdir(parents=True, exist_ok=True)
    os.replace(INSTANCE_FILE, aside)
    try:
        yield
    finally:
        os.replace(aside, INSTANCE_FILE)
    if was_active:
        sh(["systemctl", "start", UNIT], timeout=BUILD_TIMEOUT)
        st = wait_for(state_is("Done", "Degraded"), BUILD_TIMEOUT, f"{INSTANCE} put back")
        assert st["state"] == "Done" and st["goal"] == "loaded", f"{INSTANCE} put back: {st}"


def image_ids() -> set[str]:
    p = sh(["podman", "images", "--all", "--format", "{{.ID}}"], timeout=120)
    return set(p.stdout.split())


def record_timing(name: str, seconds: float) -> None:
    with (RESULTS / "timings.txt").open("a") as f:
        f.write(f"{name} {seconds:.1f}\n")


ENTRIES = Path("/boot/loader/entries")


def machine_id() -> str:
    return Path("/etc/machine-id").read_text().strip() or "kvcde2e"


def bls_entry(kver: str) -> str:
    """What a RHEL-like kernel install writes (kernel-install): one BLS entry per kernel."""
    path = ENTRIES / f"{machine_id()}-{kver}.conf"
    path.write_text(
        f"title Debian GNU/Linux 12 ({kver})\n"
        f"version {kver}\n"
        f"linux /vmlinuz-{kver}\n"
        f"initrd /initrd.img-{kver}\n"
        "options root=/dev/vda rw console=ttyS0\n"
    )
    return path.stem


def set_grub_default(entry_id: str) -> None:
    """grubenv's saved_entry (grub2-set-default): the 1024-byte environment block."""
    head = f"# GRUB Environment Block\nsaved_entry={entry_id}\n"
    block = head + "#" * (1024 - len(head))
    for d in (Path("/boot/grub2"), Path("/boot/grub")):
        d.mkdir(parents=True, exist_ok=True)
        (d / "grubenv").write_text(block)


def pids_running(cmdline: str) -> list[str]:
    """The pids whose command line is `cmdline` (the guest has no pgrep)."""
    want = cmdline.replace(" ", "\0").encode() + b"\0"
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and (proc / "cmdline").read_bytes() == want:
                found.append(proc.name)
        except OSError:  # gone meanwhile
            continue
    return found


def stop_during(unit: str, step: str, timing: str, timeout: float) -> None:
    """Start `unit`, wait (at most `timeout` s) until a process runs the command line `step` (a
    build step), then `systemctl stop` it: the stop's time is recorded as `timing`, and the unit
    must end inactive, not failed."""
    sh(["systemctl", "start", "--no-block", unit])
    wait_for(lambda: pids_running(step), timeout, f"{step!r} to run under {unit}")
    t0 = time.monotonic()
    sh(["systemctl", "stop", unit], timeout=600)
    record_timing(timing, time.monotonic() - t0)
    assert unit_prop("ActiveState", unit) == "inactive", unit_prop("Result", unit)
