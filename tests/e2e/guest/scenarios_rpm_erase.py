"""Guest-side: erasing kvcd's RPMs leaves nothing of kvcd but the admin's configuration (issue
#18, part 5). The last scenario file of its guest (name order), and it puts kvcd back.

The guest is Debian and has no rpm: run-guest.sh took the payload, the file lists and the
scriptlets out of the RPMs on the host, and rpmpayload.py erases as `rpm -e kvcd-kvc-compat
kvcd` does: each package's %preun with $1 = 0 (the header's own text: stop every kvcd@,
disable the enabled ones, `kvcd purge --all`), its files (a changed %config file kept as
.rpmsave), its %postun with $1 = 0 (kvcd's directories), then systemd's daemon-reload.

(e1) kvcd@e2e-kmod enabled, running and Done (modules loaded, its image, node annotations,
     metrics), then erased: no kvcd@ unit active or enabled, none of its modules loaded, no image
     labelled io.kvcd.instance, /var/lib/kvcd and /run/kvcd gone, no file of either package
     left, and nothing with "kvcd" in its path under /usr, /etc, /var or /run except the
     admin's (files in /etc, unit drop-ins) and the test harness's own. That scan includes
     podman's storage: a driver image kvcd pulled or loaded from an archive (no kvcd label;
     scenarios_registry leaves e2e-reg's) must be gone too.
(e2) Installed again from the same payload: e2e-kmod starts and is Done (the reboot scenarios
     after this file run on it).
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from kvcdguest import (
    BUILD_TIMEOUT,
    INSTANCE,
    MODS,
    PAYLOAD,
    UNIT,
    proc_modules,
    sh,
    state_is,
    wait_for,
)
from rpmpayload import entries

RPM = PAYLOAD / "rpm"
TOOL = PAYLOAD / "guest" / "rpmpayload.py"
PACKAGES = ("kvcd", "kvcd-kvc-compat")
SCANNED = (Path("/usr"), Path("/etc"), Path("/var"), Path("/run"))
# Not kvcd's: the harness's own files and disks (labels kvcdroot, kvcde2e: udev's and systemd's
# entries for them under /run), and what the scenarios pushed into the guest's registry.
NOT_KVCDS = ("kvcd-e2e", "kvcde2e", "kvcdroot", "/var/lib/docker-registry/", "/var/log/journal/")


def package_files() -> dict[str, tuple[int, str]]:
    """path -> (mode, flags) of every entry of both packages."""
    out = {}
    for name in PACKAGES:
        for path, mode, _digest, flags in entries(RPM / f"{name}.files.tsv"):
            out[path] = (mode, flags)
    return out


def with_kvcd_in_path() -> set[str]:
    found = set()
    for top in SCANNED:
        for dirpath, dirnames, filenames in os.walk(top):
            if dirpath.startswith(("/proc", "/sys")):
                continue
            for entry in (*dirnames, *filenames):
                path = os.path.join(dirpath, entry)
                if "kvcd" in path and not any(n in path for n in NOT_KVCDS):
                    found.add(path)
    return found


def kvcd_images() -> list[str]:
    out = sh(["podman", "images", "-a", "-q", "--filter", "label=io.kvcd.instance"]).stdout
    return out.split()


def test_e1_erase_leaves_only_the_admins_configuration() -> None:
    assert (RPM / "kvcd.preun").is_file(), "run-guest.sh took no %preun out of the RPM"
    sh(["systemctl", "enable", "--now", UNIT], timeout=BUILD_TIMEOUT)
    wait_for(state_is("Done"), BUILD_TIMEOUT, f"{INSTANCE} Done")
    assert all(m in proc_modules() for m in MODS)
    assert kvcd_images()
    node = json.loads(Path("/var/lib/kvcd/node.json").read_text())
    assert f"kvcd.io/{INSTANCE}.state" in node["annotations"], node
    owned = package_files()
    # The admin's: what is under /etc and not the packages' (instance configs, credentials,
    # unit drop-ins), and runtime drop-ins under /run/systemd/system (systemctl --runtime, the
    # harness's crash points), but not an enabled instance's symlink (the erase disables it).
    admins = {
        p
        for p in with_kvcd_in_path()
        if p.startswith(("/etc/", "/run/systemd/system/")) and p not in owned and ".wants/" not in p
    }
    assert "/etc/kvcd/instances/e2e-kmod.toml" in admins, sorted(admins)

    out = sh(["python3", str(TOOL), "erase", str(RPM)], timeout=900)
    print(out.stdout, out.stderr)

    active = sh(["systemctl", "list-units", "kvcd@*", "--state=active", "--no-legend"]).stdout
    assert active.strip() == "", active
    assert sh(["systemctl", "is-enabled", UNIT], check=False).stdout.strip() != "enabled"
    assert not [m for m in MODS if m in proc_modules()]
    assert kvcd_images() == []
    assert not Path("/var/lib/kvcd").exists() and not Path("/run/kvcd").exists()
    left = [
        p
        for p, (mode, flags) in owned.items()
        if not stat.S_ISDIR(mode) and "g" not in flags and os.path.lexists(p)
    ]
    assert left == [], left
    after = with_kvcd_in_path()  # one walk of the file system (tens of seconds under TCG)
    saved = {p for p in after if p.endswith(".rpmsave")}
    remains = after - admins - saved
    # Directories that hold the admin's files stay, as rpm leaves a non-empty directory.
    remains = {p for p in remains if not any(a.startswith(p + "/") for a in admins | saved)}
    assert remains == set(), sorted(remains)


def test_e2_installed_again_the_instance_runs() -> None:
    sh(["python3", str(TOOL), "install", str(RPM)], timeout=900)
    sh(["systemctl", "daemon-reload"])
    sh(["systemctl", "start", UNIT], timeout=BUILD_TIMEOUT)
    st = wait_for(state_is("Done", "Degraded"), BUILD_TIMEOUT, f"{INSTANCE} after reinstall")
    assert st["state"] == "Done", st
    assert all(m in proc_modules() for m in MODS)
