"""kvcd.host.rpmostree against a real (private) dbus-daemon and a small fake rpm-ostree daemon.

The fake service is a separate Python process that publishes, with pydbus, the part of the real
API kvcd reads: ``org.projectatomic.rpmostree1`` at ``/org/projectatomic/rpmostree1/Sysroot``,
interface ``org.projectatomic.rpmostree1.Sysroot``, property ``Deployments`` (``aa{sv}``, the
dictionaries rpm-ostreed builds: id, osname, checksum, serial, booted, staged, version,
base-commit-meta). kvcd talks to it exactly as it would to the system bus, by address.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvcd.host import rpmostree
from kvcd.host.paths import HostRoot

pytestmark = pytest.mark.integration

HINT = (
    "apt-get install -y dbus-daemon libgirepository1.0-dev libcairo2-dev pkg-config; "
    ".venv/bin/pip install 'pygobject<3.51' pydbus (scripts/setup.sh does both)"
)

SERVICE = r'''
import json, sys
from gi.repository import GLib
import pydbus

address, data_file = sys.argv[1], sys.argv[2]

def variant(value):
    if isinstance(value, bool):
        return GLib.Variant("b", value)
    if isinstance(value, int):
        return GLib.Variant("i", value)
    if isinstance(value, dict):
        return GLib.Variant("a{sv}", {k: variant(v) for k, v in value.items()})
    return GLib.Variant("s", str(value))

class Sysroot:
    """
    <node>
      <interface name="org.projectatomic.rpmostree1.Sysroot">
        <property name="Booted" type="o" access="read"/>
        <property name="Deployments" type="aa{sv}" access="read"/>
      </interface>
    </node>
    """

    @property
    def Booted(self):
        return "/org/projectatomic/rpmostree1/fedora"

    @property
    def Deployments(self):
        with open(data_file) as f:
            deps = json.load(f)
        return [{k: variant(v) for k, v in d.items()} for d in deps]

bus = pydbus.connect(address)
bus.publish("org.projectatomic.rpmostree1", ("/org/projectatomic/rpmostree1/Sysroot", Sysroot()))
print("ready", flush=True)
GLib.MainLoop().run()
'''

BUS_CONFIG = """<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <type>session</type>
  <listen>unix:path={socket}</listen>
  <auth>EXTERNAL</auth>
  <policy context="default">
    <allow send_destination="*" eavesdrop="true"/>
    <allow eavesdrop="true"/>
    <allow own="*"/>
  </policy>
</busconfig>
"""

BOOTED = {
    "id": "fedora-aaaa.0",
    "osname": "fedora",
    "checksum": "a" * 64,
    "serial": 0,
    "booted": True,
    "staged": False,
    "version": "39.20231101.3.0",
    "base-commit-meta": {"ostree.linux": "6.5.6-300.fc39.x86_64", "ostree.bootable": True},
}
STAGED = {
    "id": "fedora-bbbb.0",
    "osname": "fedora",
    "checksum": "b" * 64,
    "serial": 0,
    "booted": False,
    "staged": True,
    "version": "39.20231115.3.0",
    "base-commit-meta": {"ostree.linux": "6.5.11-300.fc39.x86_64", "ostree.bootable": True},
}


def _require() -> None:
    missing = []
    if shutil.which("dbus-daemon") is None:
        missing.append("dbus-daemon")
    try:
        import pydbus  # noqa: F401
        from gi.repository import GLib  # noqa: F401
    except ImportError as exc:
        missing.append(f"pydbus/PyGObject ({exc})")
    if missing:
        why = f"cannot run the D-Bus tests, missing {', '.join(missing)} ({HINT})"
        if os.environ.get("CI"):
            pytest.fail(why + ", and CI is set")
        pytest.skip(why)


@pytest.fixture
def bus(tmp_path: Path) -> Iterator[str]:
    """A private dbus-daemon; yields its address."""
    _require()
    conf = tmp_path / "bus.conf"
    conf.write_text(BUS_CONFIG.format(socket=tmp_path / "bus.sock"))
    proc = subprocess.Popen(
        ["dbus-daemon", f"--config-file={conf}", "--nofork", "--print-address"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        address = proc.stdout.readline().strip()
        assert address.startswith("unix:"), address
        yield address
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture
def fake_rpmostree(bus: str, tmp_path: Path) -> Iterator[Path]:
    """The fake rpm-ostree daemon on `bus`; write the deployments into the returned file."""
    data = tmp_path / "deployments.json"
    data.write_text(json.dumps([BOOTED]))
    with fake_service(tmp_path / "fake_rpmostreed.py", SERVICE, bus, str(data)):
        yield data


@contextlib.contextmanager
def fake_service(script: Path, text: str, *args: str) -> Iterator[subprocess.Popen[str]]:
    """A fake D-Bus service: `text` run as a Python script with `args`; it says "ready" once it
    owns its name, and its stdout is the test's to read after that."""
    script.write_text(text)
    proc = subprocess.Popen([sys.executable, str(script), *args], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        yield proc
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def ostree_root(tmp_path: Path) -> HostRoot:
    root = HostRoot(tmp_path / "host")
    root("/run").mkdir(parents=True)
    root("/run/ostree-booted").write_text("")
    return root


def test_deployments_over_dbus(fake_rpmostree: Path, bus: str) -> None:
    fake_rpmostree.write_text(json.dumps([STAGED, BOOTED]))
    raw = rpmostree.deployments_dbus(bus)
    assert [d["id"] for d in raw] == ["fedora-bbbb.0", "fedora-aaaa.0"]
    assert raw[0]["staged"] is True and raw[0]["serial"] == 0
    assert raw[0]["base-commit-meta"]["ostree.linux"] == "6.5.11-300.fc39.x86_64"


CASES: list[tuple[str, list[dict[str, Any]], str | None, str]] = [
    # (case, deployments the daemon lists, next kernel, source)
    ("only-booted", [BOOTED], "6.5.6-300.fc39.x86_64", "rpm-ostree"),
    ("staged", [STAGED, BOOTED], "6.5.11-300.fc39.x86_64", "rpm-ostree"),
    ("staged-listed-last", [BOOTED, STAGED], "6.5.11-300.fc39.x86_64", "rpm-ostree"),
    (
        "pending-default",
        [{**STAGED, "staged": False}, BOOTED],
        "6.5.11-300.fc39.x86_64",
        "rpm-ostree",
    ),
    ("no-kernel-metadata", [{**STAGED, "base-commit-meta": {}}, BOOTED], None, "unknown"),
    ("empty", [], None, "unknown"),
]


@pytest.mark.parametrize(("case", "deps", "kernel", "source"), CASES, ids=[c[0] for c in CASES])
def test_next_boot_over_dbus(
    tmp_path: Path,
    fake_rpmostree: Path,
    bus: str,
    case: str,
    deps: list[dict[str, Any]],
    kernel: str | None,
    source: str,
) -> None:
    root = ostree_root(tmp_path)
    fake_rpmostree.write_text(json.dumps(deps))
    nb = rpmostree.next_boot(root, bus)
    assert nb is not None
    assert (nb.kernel, nb.source) == (kernel, source), nb
    if kernel is not None:
        assert nb.modules_dir == root.system_modules(kernel)


def test_deployment_tree_kernel_wins_over_commit_metadata(
    tmp_path: Path, fake_rpmostree: Path, bus: str
) -> None:
    """A kernel replaced with `rpm-ostree override replace` shows in the deployment tree only."""
    root = ostree_root(tmp_path)
    fake_rpmostree.write_text(json.dumps([STAGED, BOOTED]))
    tree = rpmostree.deployment_dir(root, "fedora", "b" * 64, 0)
    mods = tree / "usr/lib/modules/6.5.12-100.override.fc39.x86_64"
    mods.mkdir(parents=True)
    (mods / "vmlinuz").write_bytes(b"")
    nb = rpmostree.next_boot(root, bus)
    assert nb is not None
    assert nb.kernel == "6.5.12-100.override.fc39.x86_64"
    assert nb.modules_dir == mods
    assert "staged deployment fedora-bbbb.0 (39.20231115.3.0)" in nb.detail


def test_no_daemon_on_the_bus_falls_back_to_the_cli(
    tmp_path: Path, bus: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nobody owns the name: D-Bus fails, `rpm-ostree status --json` (a fake on PATH) answers."""
    _require()
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "rpm-ostree"
    fake.write_text(
        "#!/bin/sh\ncat <<'EOF'\n" + json.dumps({"deployments": [STAGED, BOOTED]}) + "\nEOF\n"
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    root = ostree_root(tmp_path)
    nb = rpmostree.next_boot(root, bus)
    assert nb is not None and nb.kernel == "6.5.11-300.fc39.x86_64"
    # Neither answers: unknown, with both reasons.
    fake.write_text("#!/bin/sh\necho 'error: Loading sysroot: not booted' >&2\nexit 1\n")
    nb = rpmostree.next_boot(root, bus)
    assert nb is not None and nb.kernel is None and nb.source == "unknown"
    assert "D-Bus org.projectatomic.rpmostree1" in nb.detail
    assert "not booted" in nb.detail
