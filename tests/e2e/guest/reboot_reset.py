"""Guest-side: the whole guest hard-reset (sysrq "b": no sync, no unmount, a power cut as far as
the file systems know) in the middle of a start of kvcd@e2e-kmod, at one point per boot (issue
#16, "crash at every step", the hard-reset variant of scenarios_restart.py's SIGKILLs).

Each boot: the instance, enabled and so started by systemd at boot, must converge as after a
SIGKILL: Done with both modules live at the configured version, or Degraded with the reason;
every JSON file in kvcd's directories whole; no temporary file, no extracted tree without its
manifest. Then the next point is armed (a runtime drop-in with KVCD_FAILPOINT_ACTION=reset),
the instance moved to the other prebuilt version with its extracted tree removed (so the start
extracts, runs depmod and loads), and entry.sh starts it and waits for the reset.

Runs last in its guest (entry.sh runs reboot_* files after every scenarios_* step), one phase
per boot: the phase is kept in /var/lib/kvcd-e2e/reset-phase (synced by entry.sh before the
reset). The table (point, what kvcd said after the boot, seconds from the unit's start at boot
to convergence) goes to results/reset-table.md.
"""

from __future__ import annotations

import json
import time

from crashkit import (
    TOKEN,
    VERSIONS,
    arm,
    both_live,
    disarm,
    problems_on_disk,
    settled,
    upgrade_from_scratch,
)
from kvcdguest import (
    BUILD_TIMEOUT,
    INSTANCE_FILE,
    RESULTS,
    STATE_DIR,
    UNIT,
    configured_version,
    module_version,
    record_timing,
    request_reset,
    sh,
    unit_prop,
    wait_for,
)

# (point, delay after reaching it): mid-extraction, depmod running, between the two loads,
# inside the atomic replacement of the node-state file.
POINTS = [("extract", 0.0), ("depmod", 0.3), ("after:Load", 0.0), ("write:node.json", 0.0)]
PHASE = STATE_DIR / "reset-phase"
ROWS = STATE_DIR / "reset-rows.json"
ORIGINAL = STATE_DIR / "reset-original.toml"


def started_at() -> float:
    """CLOCK_MONOTONIC seconds when the unit left "inactive" in this boot."""
    us = unit_prop("InactiveExitTimestampMonotonic", UNIT)
    return int(us or 0) / 1e6


def write_table(rows: list[list[str]]) -> None:
    lines = [
        "| point | after the reset and the boot | converged after the unit's start |",
        "|---|---|---|",
        *(f"| `{p}` | {said} | {secs} s |" for p, said, secs in rows),
    ]
    (RESULTS / "reset-table.md").write_text("\n".join(lines) + "\n")


def test_reset_at_each_point_converges() -> None:
    phase = int(PHASE.read_text()) if PHASE.exists() else 0
    rows: list[list[str]] = json.loads(ROWS.read_text()) if ROWS.exists() else []
    if phase == 0:
        ORIGINAL.write_text(INSTANCE_FILE.read_text())
        sh(["systemctl", "enable", UNIT])
        disarm()
        sh(["systemctl", "restart", UNIT], timeout=BUILD_TIMEOUT)
        wait_for(settled, BUILD_TIMEOUT, "settled before the first reset")
    else:
        point = POINTS[phase - 1][0]
        st = wait_for(settled, BUILD_TIMEOUT, f"convergence after the reset at {point}", 1)
        seconds = time.monotonic() - started_at()
        record_timing(f"reset_{point}", seconds)
        said = f"{st['state']} ({st.get('code') or st.get('goal')})"
        rows.append([point, said, f"{seconds:.1f}"])
        ROWS.write_text(json.dumps(rows))
        write_table(rows)
        assert st["state"] == "Done", f"after the reset at {point}: {st}"
        assert both_live() and module_version("kvcd_user") == configured_version()
        assert problems_on_disk() == []
    if phase == len(POINTS):  # every point done: the instance goes back as it was found
        sh(["systemctl", "disable", UNIT])
        INSTANCE_FILE.write_text(ORIGINAL.read_text())
        sh(["systemctl", "restart", UNIT], timeout=BUILD_TIMEOUT)
        st = wait_for(settled, BUILD_TIMEOUT, "settled at the original version")
        assert st["state"] == "Done", st
        return
    point, delay = POINTS[phase]
    current = configured_version()
    upgrade_from_scratch(current if current in VERSIONS else VERSIONS[1])
    arm(point, delay, action="reset")
    TOKEN.touch()
    PHASE.write_text(f"{phase + 1}\n")
    request_reset(["systemctl", "start", "--no-block", UNIT])
