"""Helpers of the crash scenarios (scenarios_restart.py: SIGKILL at each fail point;
reboot_reset.py: a hard reset of the guest at some of them): arming a fail point, making a
start pass every point, and what "converged" means.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvcdguest import (
    INSTANCE,
    MODS,
    PAYLOAD,
    UNIT,
    active,
    containerfile,
    kvcd_status,
    not_yet,
    proc_modules,
    set_instance,
    sh,
)

# In /run: gone after a reset, so a point armed before one never fires again after it.
TOKEN = Path("/run/kvcd-e2e-crash-token")
# The point's variables, read by systemd at each start of the unit (EnvironmentFile=): arming
# another point rewrites this file, not a unit file, so it needs no daemon-reload (~3-10 s under
# TCG each). In /run as well: a reset forgets it.
ENV_FILE = Path("/run/kvcd-e2e-failpoint.env")
# The drop-in that reads it: a runtime one, which kvcd's drift monitor does not watch (a drop-in
# under /etc is drift of its unit: Degraded until the force file renews the baseline). A reset
# forgets it too, so reboot_reset writes it again in each boot.
DROPIN = Path(f"/run/systemd/system/{UNIT}.d/70-e2e-crash.conf")
STATE = Path("/var/lib/kvcd")
RUNTIME = Path("/run/kvcd")
# Versions the host compiled for the guest kernel (run-guest.sh): each start-time point
# upgrades from one to the other, so the crash lands in a real upgrade and the version it
# removes first (image, extracted tree) is never the one in use.
VERSIONS = ("2.0", "3.0")
KVER1 = (PAYLOAD / "kver").read_text().strip()


def _dropin_text(action: str) -> str:
    return f"[Service]\nEnvironmentFile=-{ENV_FILE}\nRestartSec=1s\n" + (
        "ProtectKernelTunables=no\n" if action == "reset" else ""
    )


def arm(point: str, delay: float, action: str = "kill") -> None:
    """The environment file names the point; the token (created by the trigger) makes it fire
    once. action "reset": the machine resets there. The drop-in that reads the file is written
    (and systemd reloaded) only when it is not in place yet."""
    TOKEN.unlink(missing_ok=True)
    text = _dropin_text(action)
    ENV_FILE.write_text(
        f"KVCD_FAILPOINT={point}\nKVCD_FAILPOINT_TOKEN={TOKEN}\n"
        f"KVCD_FAILPOINT_DELAY={delay}\nKVCD_FAILPOINT_ACTION={action}\n"
    )
    if not DROPIN.exists() or DROPIN.read_text() != text:
        DROPIN.parent.mkdir(parents=True, exist_ok=True)
        DROPIN.write_text(text)
        sh(["systemctl", "daemon-reload"])
    sh(["systemctl", "reset-failed", UNIT], check=False)


def disarm(reload: bool = True) -> None:
    """Without the token, or the environment file, the point never fires (failpoint.hit), so
    between points the drop-in stays (reload=False); the scenario's teardown removes it and
    reloads once."""
    TOKEN.unlink(missing_ok=True)
    ENV_FILE.unlink(missing_ok=True)
    if reload and DROPIN.exists():
        DROPIN.unlink()
        sh(["systemctl", "daemon-reload"])
    sh(["systemctl", "reset-failed", UNIT], check=False)


def upgrade_from_scratch(current: str, *, build: bool = False) -> str:
    """Stopped, configured for the other version, whose extracted tree is gone: the next start
    extracts, runs depmod and loads, passing every start-time point after the build. build:
    its image is gone too, and the start builds it first (the build point). Returns the
    version it is configured for now."""
    target = VERSIONS[0] if current == VERSIONS[1] else VERSIONS[1]
    sh(["systemctl", "stop", UNIT], timeout=600)
    if build:
        sh(["podman", "rmi", "--force", f"localhost/kvcd/{INSTANCE}/{target}:{KVER1}"], check=False)
    for tree in (STATE / "store" / INSTANCE / target).glob("*"):
        sh(["rm", "-rf", str(tree)])
    set_instance(version=target, **{"build.containerfile": containerfile(target)})
    return target


def both_live() -> bool:
    mods = proc_modules()
    return all(m in mods for m in MODS) and all(
        Path(f"/sys/module/{m}/initstate").read_text().strip() == "live" for m in MODS
    )


def settled() -> dict[str, Any] | None:
    if not_yet(state=("Done", "Degraded")):
        return None
    st = kvcd_status()
    if not st or not active():
        return None
    if st.get("state") == "Done" and st.get("goal") == "loaded" and both_live():
        return st
    return st if st.get("state") == "Degraded" else None


def _writing(tmp: Path) -> bool:
    """A temporary file of a write under way (`.<name>.<pid>.<12 hex>.tmp`, kvcd.host.files,
    its writer alive): the converged daemon may be reporting right now. A dead writer's is
    what a crash left behind."""
    parts = tmp.name.split(".")
    return len(parts) >= 4 and parts[-3].isdigit() and Path(f"/proc/{parts[-3]}").exists()


def problems_on_disk() -> list[str]:
    """What a crash must never leave behind, once kvcd converged."""
    out = []
    for base in (STATE, RUNTIME):
        for path in base.rglob("*.json"):
            if path.is_file() and ".damaged-" not in path.name:
                try:
                    json.loads(path.read_text())
                except ValueError as exc:
                    out.append(f"{path}: {exc}")
        out += [f"stray temporary file {p}" for p in base.rglob("*.tmp") if not _writing(p)]
    for tree in (STATE / "store").glob("*/*/*"):
        if tree.is_dir() and not (tree / ".kvcd-manifest.json").is_file():
            out.append(f"extracted tree without a manifest: {tree}")
    return out
