"""systemd/kvcd@.service checked by the real `systemd-analyze verify`, with zero warnings.

verify runs against a throw-away root (``--root``): the unit in ``etc/systemd/system``, a copy of
the host's system units (verify builds a start transaction, so sysinit.target and friends must
exist) and an executable ``usr/bin/kvcd`` (verify checks that ExecStart=/ExecReload= exist).
The unit itself is tested byte for byte; nothing is rewritten.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from kvcd.host.run import Completed, run, which

pytestmark = pytest.mark.integration

UNIT = Path(__file__).resolve().parents[2] / "systemd" / "kvcd@.service"
SYSTEM_UNIT_DIRS = (Path("/usr/lib/systemd/system"), Path("/lib/systemd/system"))


def _system_units() -> Path | None:
    for d in SYSTEM_UNIT_DIRS:
        if (d / "sysinit.target").exists():
            return d
    return None


@pytest.fixture(scope="module")
def analyze() -> str:
    exe = which("systemd-analyze")
    if exe is None:
        pytest.skip("systemd-analyze is not installed (apt-get install systemd)")
    if _system_units() is None:
        pytest.skip("no system unit directory with sysinit.target on this host")
    return exe


def make_root(tmp_path: Path, unit_text: str) -> Path:
    root = tmp_path / "root"
    system = _system_units()
    assert system is not None
    shutil.copytree(system, root / "usr/lib/systemd/system", symlinks=True)
    (root / "etc/systemd/system").mkdir(parents=True)
    (root / "etc/systemd/system/kvcd@.service").write_text(unit_text)
    kvcd = root / "usr/bin/kvcd"
    kvcd.parent.mkdir(parents=True)
    kvcd.write_text("#!/bin/sh\nexit 0\n")
    kvcd.chmod(0o755)
    return root


def verify(analyze: str, root: Path, unit: str) -> Completed:
    return run([analyze, "verify", "--man=no", f"--root={root}", unit], check=False, timeout=60)


@pytest.mark.parametrize("instance", ["test", "simple-kmod", "nvidia_gpu"])
def test_verify_is_clean(analyze: str, tmp_path: Path, instance: str) -> None:
    root = make_root(tmp_path, UNIT.read_text())
    done = verify(analyze, root, f"kvcd@{instance}.service")
    assert (done.rc, done.stdout, done.stderr) == (0, "", "")


def test_verify_would_see_a_mistake(analyze: str, tmp_path: Path) -> None:
    # The harness itself: a bad line must produce output, or the test above proves nothing.
    text = UNIT.read_text().replace("NotifyAccess=main", "NotifyAccess=main\nNotifyAcess=all")
    done = verify(analyze, make_root(tmp_path, text), "kvcd@test.service")
    assert "NotifyAcess" in done.stdout + done.stderr


def test_verify_sees_a_missing_executable(analyze: str, tmp_path: Path) -> None:
    root = make_root(tmp_path, UNIT.read_text())
    (root / "usr/bin/kvcd").unlink()
    done = verify(analyze, root, "kvcd@test.service")
    assert "/usr/bin/kvcd" in done.stdout + done.stderr


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """Sections -> key -> every value (keys may repeat in unit files)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        key, _, value = line.partition("=")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def test_contract_lines() -> None:
    unit = parse_unit(UNIT.read_text())
    svc = unit["Service"]

    def one(section: dict[str, list[str]], key: str) -> str:
        (value,) = section[key]
        return value

    assert one(svc, "Type") == "notify"
    assert one(svc, "NotifyAccess") == "main"
    assert one(svc, "ExecStart") == "/usr/bin/kvcd run %i"
    assert one(svc, "ExecReload") == "/usr/bin/kvcd reload %i"
    assert "ExecStop" not in svc, "stop is the daemon's SIGTERM handling"
    assert one(svc, "KillMode") == "mixed"
    assert one(svc, "StateDirectory") == "kvcd"
    assert one(svc, "RuntimeDirectory") == "kvcd"
    assert one(svc, "RuntimeDirectoryPreserve") == "yes"
    assert "WatchdogSec" in svc
    assert "%i" in one(unit["Unit"], "Description")
    assert "podman.socket" in " ".join(unit["Unit"]["After"])
    assert "kubelet.service" in one(unit["Unit"], "Before")
    assert one(unit["Install"], "WantedBy") == "multi-user.target"
    # Settings that would stop kvcd from doing its job (the hooks and podman run elsewhere).
    for forbidden in (
        "ProtectKernelModules",
        "ProtectKernelLogs",
        "PrivateDevices",
        "ProtectProc",
        "ProcSubset",
        "MemoryDenyWriteExecute",
        "DynamicUser",
        "User",
        # A private UTS namespace freezes the host name at start (early boot): kvcd's default
        # node name would miss a name DHCP or cloud-init sets later (packaging/README.md).
        "ProtectHostname",
    ):
        assert forbidden not in svc, forbidden
    # What it needs inside its sandbox.
    assert "CAP_SYS_MODULE" in one(svc, "CapabilityBoundingSet").split()
    assert "@module" in one(svc, "SystemCallFilter").split()
    assert one(svc, "DeviceAllow") == "/dev/kmsg r"
    assert {"AF_UNIX", "AF_NETLINK"} <= set(one(svc, "RestrictAddressFamilies").split())
    assert one(svc, "ProtectSystem") == "strict"


def test_the_sandbox_scores_at_most_5(analyze: str, tmp_path: Path) -> None:
    """`systemd-analyze security` of the unit as shipped (offline: the file, not a running
    unit; the guest checks the running one)."""
    unit = tmp_path / "kvcd@test.service"
    unit.write_text(UNIT.read_text())
    done = run([analyze, "security", "--offline=true", str(unit)], check=False, timeout=60)
    score = float(done.stdout.split("Overall exposure level for kvcd@test.service:")[1].split()[0])
    assert score <= 5.0, done.stdout


def test_the_documented_score_is_the_measured_one(analyze: str, tmp_path: Path) -> None:
    """README.md and the unit's own comment state the score: both are what systemd measures."""
    unit = tmp_path / "kvcd@test.service"
    unit.write_text(UNIT.read_text())
    done = run([analyze, "security", "--offline=true", str(unit)], check=False, timeout=60)
    score = done.stdout.split("Overall exposure level for kvcd@test.service:")[1].split()[0]

    def prose(text: str) -> str:  # comment markers and line breaks gone
        return " ".join(re.sub(r"^\s*#", "", text, flags=re.M).split())

    readme = prose((UNIT.parents[1] / "README.md").read_text())
    stated = re.findall(r"security kvcd@NAME\.service` scores it (\d+\.\d+) ", readme)
    stated += re.findall(r"scores this unit (\d+\.\d+) ", prose(UNIT.read_text()))
    assert stated == [score, score], (stated, done.stdout)
