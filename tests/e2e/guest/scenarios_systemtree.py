"""Guest-side scenarios for kvcd.toml ``module_tree = "system"`` (issue #4): the instance's
modules installed into the system's own /lib/modules, on a real kernel, under the real unit.

(s1) With the unit as shipped (ProtectSystem=strict: /usr, and so Debian's merged /lib, is
     read-only for kvcd) the install is refused, and the reason says which drop-in fixes it.
(s2) With that drop-in (ReadWritePaths=/usr/lib/modules), accepted the documented way (the
     force file renews the unit baseline the drift monitor keeps): Done; the modules are a copy
     in /lib/modules/<k>/extra/<instance>/, indexed by the system's own depmod (so plain
     `modinfo` finds them there) and loaded from there; kvcd's own module root is not used.
     Debian has no weak-modules: the weak-updates path is tested on the host.
(s3) An edit of the installed copy is drift; putting it back is Done again, by itself.
(s4) Stop unloads; the copy stays installed, as a package's files would.

Uses its own instance (e2e-sys) with the e2e driver's modules, so it stops kvcd@e2e-kmod first,
and puts kvcd.toml back as it was at the end.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from kvcdguest import (
    BUILD_TIMEOUT,
    DRIVER_DIR,
    MODS,
    containerfile,
    proc_modules,
    sh,
    state_is,
    wait_for,
)

NAME = "e2e-sys"
UNIT = f"kvcd@{NAME}.service"
CONF = Path(f"/etc/kvcd/instances/{NAME}.toml")
SETTINGS = Path("/etc/kvcd/kvcd.toml")
DROPIN = Path(f"/etc/systemd/system/kvcd@{NAME}.service.d/50-system-tree.conf")
KVER = os.uname().release
INSTALLED = Path(f"/lib/modules/{KVER}/extra/{NAME}")


def settle(*states: str) -> dict[str, Any]:
    return wait_for(state_is(*states, instance=NAME), BUILD_TIMEOUT, f"{NAME} in {states}")


def installed(module: str) -> Path:
    """The installed copy of a module, wherever the image put it under the modules path (the
    copy keeps the store's layout: the e2e image has them in extra/)."""
    found = sorted(INSTALLED.rglob(f"{module}.ko"))
    assert len(found) == 1, found
    return found[0]


def loaded() -> set[str]:
    return {m for m in proc_modules() if m in MODS}


@pytest.fixture(scope="module", autouse=True)
def system_tree_instance() -> Any:
    sh(["systemctl", "stop", "kvcd@e2e-kmod.service"], check=False, timeout=600)
    wait_for(lambda: not loaded(), 120, "e2e-kmod's modules to be unloaded")
    saved = SETTINGS.read_text() if SETTINGS.exists() else None
    SETTINGS.parent.mkdir(parents=True, exist_ok=True)
    SETTINGS.write_text('module_tree = "system"\n')
    SETTINGS.chmod(0o644)
    CONF.write_text(
        f'version = "2.0"\nmodules = ["kvcd_base", "kvcd_user"]\n'
        f'[build]\ncontext = "{DRIVER_DIR}"\ncontainerfile = "{containerfile("2.0")}"\n'
    )
    CONF.chmod(0o644)
    yield
    sh(["systemctl", "stop", UNIT], check=False, timeout=600)
    for m in reversed(MODS):
        sh(["rmmod", m], check=False)
    DROPIN.unlink(missing_ok=True)
    sh(["systemctl", "daemon-reload"])
    CONF.unlink(missing_ok=True)
    sh(["rm", "-rf", str(INSTALLED)])
    sh(["depmod", KVER])
    if saved is None:
        SETTINGS.unlink()
    else:
        SETTINGS.write_text(saved)


def test_s1_read_only_lib_modules_names_the_fix() -> None:
    sh(["systemctl", "start", "--no-block", UNIT])
    st = settle("Degraded")
    # /lib/modules/<k>/extra itself, or /lib/modules where the copy is staged
    assert st["reason"].startswith("InstallFailed: cannot write /lib/modules"), st
    assert "Read-only file system" in st["reason"], st
    assert "ReadWritePaths=/usr/lib/modules" in st["reason"], st
    assert not loaded() and not INSTALLED.exists()


def test_s2_with_the_drop_in_modules_load_from_lib_modules() -> None:
    sh(["systemctl", "stop", UNIT], timeout=600)
    DROPIN.parent.mkdir(parents=True, exist_ok=True)
    DROPIN.write_text("[Service]\nReadWritePaths=/usr/lib/modules\n")
    sh(["systemctl", "daemon-reload"])
    Path(f"/run/kvcd/{NAME}.force").write_text("")  # accept the new drop-in (drift baseline)
    sh(["systemctl", "start", UNIT], timeout=BUILD_TIMEOUT)
    st = settle("Done", "Degraded")
    assert st["state"] == "Done", st
    assert loaded() == set(MODS)
    assert (INSTALLED / ".kvcd-store").is_file() and not INSTALLED.is_symlink()
    for m in MODS:
        assert not installed(m).is_symlink()
        # The system's own index: plain modinfo (no -b) finds the installed copy.
        path = sh(["modinfo", "-n", m]).stdout.strip()
        assert path == str(installed(m)), path
    assert not Path(f"/var/lib/kvcd/modules/lib/modules/{KVER}/extra/{NAME}").exists()


def test_s3_edit_of_the_installed_copy_is_drift_and_recovers() -> None:
    target = installed("kvcd_user")
    original = target.read_bytes()
    target.write_bytes(original + b"\0")
    st = settle("Degraded")
    assert st["reason"].startswith(f"Drift: {target}: content"), st
    target.write_bytes(original)
    st = settle("Done")
    assert loaded() == set(MODS)


def test_s4_stop_unloads_and_leaves_the_copy_installed() -> None:
    sh(["systemctl", "stop", UNIT], timeout=600)
    wait_for(lambda: not loaded(), 120, "unloaded on stop")
    assert installed("kvcd_user").is_file()
