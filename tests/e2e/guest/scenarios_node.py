"""Guest-side scenarios for node state (issue #6), run by pytest inside the VM guest, in order.

(n1) Ordered upgrade driven by `kvcd label` (the file backend, /var/lib/kvcd/node.json): no label
     -> nothing loaded; label 1.0 -> 1.0 loaded and `<p>/<instance>.ready = 1.0`; config moved to
     2.0 and reloaded -> 1.0 stays (UpgradePending); restarted there (the stop unloads) -> 1.0
     loaded again from the store; label 2.0 -> 1.0 out, 2.0 in; label removed -> unloaded.
     Every step checks /proc/modules, `kvcd status` and the node annotations.
(n2) A module held by something kvcd does not own -> the unload is refused (ModuleInUse), the
     holder is named in the reason, in `kvcd status` and in the journal (KVCD_HOLDERS), and the
     module stays loaded. The test modules register no device node, so the holder here is a
     module loaded by hand (kvcd_user holding kvcd_base); a process holding a device node is
     covered on the host (tests/unit/test_node_procs.py, test_drain.py).
(n2b) The same held module, with the label back: a reload of a config kvcd cannot use changes
     nothing and the node says Degraded / ConfigInvalid (no `.ready`) until it is fixed; then
     `systemctl stop` is refused (if-idle), the unit fails, and the node says Degraded /
     ModuleInUse with no `.ready` (the daemon's last word).
(n3) drain = "cluster": the same blocked unload becomes a node drain request (`kvcd.io/drain =
     Drain_Required`); `kvcd annotate kvcd.io/drain-current=DrainComplete` plays the drain
     controller after the holder is gone; the change is applied and the request goes back to Idle.
(n4) unload_policy = "never" (issue #17): `systemctl stop` leaves the module loaded, the unit
     inactive (not failed), and `kvcd status` says the policy; a restart finds it in place.
(n5) unload_policy = "drain": `systemctl stop` with the module held claims a node drain and
     waits (the unit is deactivating); the holder goes, `kvcd annotate` answers DrainComplete,
     the module is unloaded, the claim withdrawn, and the unit stops cleanly.
(n6) in_tree_modules_to_remove (issue #17) with the guest kernel's own modules: 8021q (holding
     garp) and dummy, loaded by hand. A list that would take garp out from under 8021q is
     refused (ModuleInUse, 8021q named) with nothing unloaded; the right order unloads them
     before the instance loads, /run/modprobe.d/kvcd-e2e-node.conf keeps them from loading
     (`modprobe dummy` fails), and `systemctl stop` loads them back.

Uses its own instance (e2e-node) with the e2e driver's modules, so e2e-kmod is taken off the node
(stopped, its file moved aside) while it runs.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
from kvcdguest import (
    BUILD_TIMEOUT,
    DRIVER_DIR,
    MODS,
    containerfile,
    core_instance_aside,
    diagnose,
    kvcd_status,
    module_version,
    not_yet,
    proc_modules,
    sh,
    state_is,
    unit_prop,
    wait_for,
)

NAME = "e2e-node"
UNIT = f"kvcd@{NAME}.service"
CONF = Path(f"/etc/kvcd/instances/{NAME}.toml")
NODE = Path("/var/lib/kvcd/node.json")
LABEL = f"kvcd.io/version.{NAME}"


def write_instance(
    version: str,
    modules: tuple[str, ...] = MODS,
    drain: str = "none",
    unload: str = "if-idle",
    remove: tuple[str, ...] = (),
) -> None:
    mods = ", ".join(json.dumps(m) for m in modules)
    CONF.write_text(
        f'version = "{version}"\nmodules = [{mods}]\nordered_upgrade = true\ndrain = "{drain}"\n'
        f'unload_policy = "{unload}"\n'
        f"in_tree_modules_to_remove = {json.dumps(list(remove))}\n"
        f'[build]\ncontext = "{DRIVER_DIR}"\ncontainerfile = "{containerfile(version)}"\n'
        # Parameters only for a module the instance has: kvcd refuses the others (ConfigInvalid).
        + ('[params.kvcd_user]\ngreeting = "node"\n' if "kvcd_user" in modules else "")
    )
    CONF.chmod(0o644)
    print(CONF.read_text())


def annotations() -> dict[str, str]:
    data = json.loads(NODE.read_text()) if NODE.exists() else {}
    return dict(data.get("annotations") or {})


def ann(suffix: str) -> str | None:
    return annotations().get(f"kvcd.io/{NAME}.{suffix}")


def loaded() -> dict[str, list[str]]:
    return {m: u for m, u in proc_modules().items() if m in MODS}


def until(pred: Any, timeout: float, what: str) -> Any:
    """wait_for, but an instance that goes Degraded meanwhile fails now, with its reason and
    the journal (diagnose), instead of after the whole timeout."""

    def check() -> Any:
        got = pred()
        if got:
            return got
        if not_yet(NAME, state="Degraded"):
            return None  # the record is not Degraded: no `kvcd status` (seconds under TCG)
        st = kvcd_status(NAME)
        if st and st.get("state") == "Degraded":
            diagnose()
            raise AssertionError(f"{NAME} Degraded while waiting for {what}: {st.get('reason')}")
        return None

    return wait_for(check, timeout, what)


def settle(*states: str) -> dict[str, Any]:
    return wait_for(state_is(*states, instance=NAME), BUILD_TIMEOUT, f"{NAME} in {states}")


@pytest.fixture(scope="module", autouse=True)
def node_instance() -> Any:
    # e2e-kmod ships the same modules: one owner per module, so it is off the node meanwhile.
    with core_instance_aside():
        sh(["kvcd", "label", f"{LABEL}-"])
        write_instance("1.0")
        yield
        sh(["systemctl", "stop", UNIT], check=False, timeout=600)
        sh(["rmmod", "kvcd_user"], check=False)
        sh(["rmmod", "kvcd_base"], check=False)
        CONF.unlink(missing_ok=True)


def test_n1_label_drives_ordered_upgrade() -> None:
    sh(["systemctl", "start", UNIT], timeout=BUILD_TIMEOUT)
    st = settle("Done", "Degraded")
    assert st["state"] == "Done" and st["goal"] == "unloaded", st
    assert st["reason"].startswith("LabelAbsent"), st
    assert not loaded()
    # The node is told right after READY=1 (the reporter is a late hook): wait for it.
    wait_for(lambda: ann("state") == "Done", 60, "node state Done")
    assert ann("ready") is None

    sh(["kvcd", "label", f"{LABEL}=1.0"])
    until(lambda: set(loaded()) == set(MODS), BUILD_TIMEOUT, "1.0 loaded by the label")
    assert module_version("kvcd_user") == "1.0"
    wait_for(lambda: ann("ready") == "1.0", 60, "ready annotation 1.0")
    assert ann("version") == "1.0" and ann("kernel") == os.uname().release
    assert ann("boot-id") == Path("/proc/sys/kernel/random/boot_id").read_text().strip()

    # Config first (KMM step 2): 1.0 stays loaded while the label still says 1.0.
    write_instance("2.0")
    sh(["systemctl", "reload", UNIT], timeout=BUILD_TIMEOUT)
    st = settle("Done")
    assert st["reason"].startswith("UpgradePending"), st
    assert module_version("kvcd_user") == "1.0"

    # A restart there (unload_policy if-idle: the stop unloads): the label still says 1.0, which
    # the store has, so 1.0 is loaded again (never built from the 2.0 config).
    sh(["systemctl", "restart", UNIT], timeout=BUILD_TIMEOUT)
    st = settle("Done", "Degraded")
    assert st["state"] == "Done" and st["goal"] == "loaded", st
    assert st["reason"].startswith("UpgradePending") and st["version"] == "1.0", st
    assert module_version("kvcd_user") == "1.0"
    wait_for(lambda: ann("version") == "1.0" and ann("ready") == "1.0", 60, "node says 1.0")

    # The label moves: 1.0 out, 2.0 in.
    sh(["kvcd", "label", f"{LABEL}=2.0"])
    until(lambda: module_version("kvcd_user") == "2.0", BUILD_TIMEOUT, "2.0 loaded")
    wait_for(lambda: ann("ready") == "2.0", 60, "ready annotation 2.0")
    journal = sh(["journalctl", "-u", UNIT, "-o", "cat", "--no-pager"]).stdout
    assert re.search(r"ordered upgrade: LabelAbsent", journal), journal[-2000:]

    sh(["kvcd", "label", f"{LABEL}-"])
    wait_for(lambda: not loaded(), 120, "unloaded after the label was removed")
    wait_for(lambda: ann("ready") is None, 60, "ready annotation removed")


def test_n2_held_module_refused_with_holder_named() -> None:
    # The instance owns only kvcd_base; kvcd_user, loaded by hand from kvcd's module root,
    # holds it (a holder kvcd does not own).
    write_instance("2.0", modules=("kvcd_base",))
    sh(["systemctl", "reload", UNIT], timeout=BUILD_TIMEOUT)
    sh(["kvcd", "label", f"{LABEL}=2.0"])
    wait_for(lambda: "kvcd_base" in loaded(), BUILD_TIMEOUT, "kvcd_base loaded")
    sh(["modprobe", "-d", "/var/lib/kvcd/modules", "kvcd_user"])
    assert "kvcd_user" in loaded()["kvcd_base"]

    sh(["kvcd", "label", f"{LABEL}-"])
    st = settle("Degraded")
    assert st["reason"].startswith("ModuleInUse: kvcd_base is held by kvcd_user"), st
    assert "holders: kvcd_base: refcnt 1; used by modules kvcd_user" in st["reason"], st
    assert "kvcd_base" in loaded()  # never forced out
    text = sh(["kvcd", "status", NAME]).stdout
    assert "held by kvcd_user" in text, text
    wait_for(lambda: ann("state") == "Degraded", 60, "node state Degraded")
    assert "kvcd_user" in (ann("reason") or "")
    j = sh(["journalctl", "-u", UNIT, "-o", "json", "--no-pager"]).stdout
    assert any("kvcd_user" in json.loads(line).get("KVCD_HOLDERS", "") for line in j.splitlines())


def test_n2b_a_refused_stop_is_said_on_the_node() -> None:
    # Still held by kvcd_user (n2). The label back at 2.0: Done, and `.ready` says 2.0.
    sh(["kvcd", "label", f"{LABEL}=2.0"])
    wait_for(lambda: ann("ready") == "2.0" and ann("state") == "Done", 120, "ready = 2.0, Done")
    # A config kvcd cannot use, reloaded: nothing on the host changes, and the node says so.
    good = CONF.read_text()
    CONF.write_text("no_such_key = 1\n" + good)
    sh(["systemctl", "reload", UNIT], check=False, timeout=BUILD_TIMEOUT)
    wait_for(lambda: ann("state") == "Degraded", 60, "node state Degraded (ConfigInvalid)")
    assert (ann("reason") or "").startswith("ConfigInvalid: "), ann("reason")
    assert ann("ready") is None and "kvcd_base" in loaded(), annotations()
    CONF.write_text(good)
    sh(["systemctl", "reload", UNIT], timeout=BUILD_TIMEOUT)
    wait_for(lambda: ann("ready") == "2.0" and ann("state") == "Done", 120, "ready = 2.0 again")
    # The stop is refused (if-idle, in use): the unit fails, the module stays, and the node is
    # told as the daemon exits, not left at the Done of the last cycle.
    sh(["systemctl", "stop", UNIT], check=False, timeout=600)
    assert unit_prop("ActiveState", UNIT) == "failed", unit_prop("ActiveState", UNIT)
    assert "kvcd_base" in loaded()
    assert ann("state") == "Degraded", annotations()
    assert (ann("reason") or "").startswith("ModuleInUse: kvcd_base is held by kvcd_user"), ann(
        "reason"
    )
    assert ann("ready") is None, annotations()  # KMM's readiness: not while kvcd is gone
    # Back to where n2 left it, for n3: running, the label removed, the unload refused (a start
    # with the label removed would fail for good before READY=1: the same refusal).
    sh(["systemctl", "reset-failed", UNIT])
    sh(["systemctl", "start", UNIT], timeout=BUILD_TIMEOUT)
    settle("Done")
    sh(["kvcd", "label", f"{LABEL}-"])
    st = settle("Degraded")
    assert st["reason"].startswith("ModuleInUse: kvcd_base is held by kvcd_user"), st


def test_n3_cluster_drain_handshake() -> None:
    write_instance("2.0", modules=("kvcd_base",), drain="cluster")
    sh(["systemctl", "reload", UNIT], timeout=BUILD_TIMEOUT)
    st = settle("Working")
    assert st["reason"].startswith("DrainRequired: Drain_Required requested"), st
    assert annotations()["kvcd.io/drain"] == "Drain_Required"
    # The drain controller: the workload (here: the hand-loaded kvcd_user) goes, then it answers.
    sh(["rmmod", "kvcd_user"])
    sh(["kvcd", "annotate", "kvcd.io/drain-current=DrainComplete"])
    wait_for(lambda: "kvcd_base" not in loaded(), 120, "kvcd_base unloaded after the drain")
    wait_for(lambda: annotations().get("kvcd.io/drain") == "Idle", 60, "drain back to Idle")
    assert f"kvcd.io/{NAME}.drain" not in annotations()
    st = settle("Done")
    assert st["goal"] == "unloaded", st
    sh(["kvcd", "annotate", "kvcd.io/drain-current-"])


def test_n4_unload_policy_never_keeps_the_module_loaded() -> None:
    write_instance("2.0", modules=("kvcd_base",), unload="never")
    sh(["kvcd", "label", f"{LABEL}=2.0"])
    sh(["systemctl", "restart", UNIT], timeout=BUILD_TIMEOUT)
    until(lambda: "kvcd_base" in loaded(), BUILD_TIMEOUT, "kvcd_base loaded")
    text = sh(["kvcd", "status", NAME]).stdout
    assert "on stop: unload_policy = never (modules stay loaded)" in text, text

    sh(["systemctl", "stop", UNIT], timeout=600)
    state = unit_prop("ActiveState", UNIT)
    assert state == "inactive", state  # stopped cleanly, not failed
    assert "kvcd_base" in loaded()  # kept
    j = sh(["journalctl", "-u", UNIT, "-n", "30", "--no-pager"]).stdout
    assert "modules stay loaded (unload_policy = never)" in j, j

    sh(["systemctl", "start", UNIT], timeout=BUILD_TIMEOUT)  # finds it in place
    st = settle("Done")
    assert st["goal"] == "loaded" and "kvcd_base" in loaded(), st


def test_n5_unload_policy_drain_waits_for_drain_complete_on_stop() -> None:
    write_instance("2.0", modules=("kvcd_base",), unload="drain")
    sh(["systemctl", "reload", UNIT], timeout=BUILD_TIMEOUT)
    settle("Done")
    sh(["modprobe", "-d", "/var/lib/kvcd/modules", "kvcd_user"])  # the workload holding it
    assert "kvcd_user" in loaded()["kvcd_base"]

    sh(["systemctl", "stop", "--no-block", UNIT])
    wait_for(lambda: annotations().get("kvcd.io/drain") == "Drain_Required", 120, "drain requested")
    assert (annotations().get(f"kvcd.io/{NAME}.drain") or "").startswith("Drain_Required boot=")
    assert unit_prop("ActiveState", UNIT) == "deactivating", unit_prop("ActiveState", UNIT)
    assert "kvcd_base" in loaded()  # nothing unloaded before the drain completed

    # The drain controller: the workload goes, then it answers.
    sh(["rmmod", "kvcd_user"])
    sh(["kvcd", "annotate", "kvcd.io/drain-current=DrainComplete"])
    wait_for(lambda: unit_prop("ActiveState", UNIT) == "inactive", 120, f"{UNIT} stopped")
    assert "kvcd_base" not in loaded()
    a = annotations()
    assert a.get("kvcd.io/drain") == "Idle" and f"kvcd.io/{NAME}.drain" not in a, a
    # What the stop left, on the node: Done, and no `.ready` for a version no longer loaded.
    assert a.get(f"kvcd.io/{NAME}.state") == "Done" and f"kvcd.io/{NAME}.ready" not in a, a
    sh(["kvcd", "annotate", "kvcd.io/drain-current-"])


IN_TREE = ("8021q", "garp", "dummy")


def test_n6_in_tree_modules_to_remove() -> None:
    sh(["modprobe", "8021q"])
    sh(["modprobe", "dummy"])
    assert "8021q" in proc_modules()["garp"]  # 8021q holds garp
    keep_out = Path(f"/run/modprobe.d/kvcd-{NAME}.conf")

    # garp alone: 8021q holds it, and 8021q is not on the list.
    write_instance("2.0", modules=("kvcd_base",), remove=("garp",))
    sh(["systemctl", "restart", UNIT], check=False, timeout=BUILD_TIMEOUT)
    st = settle("Degraded")
    assert st["reason"].startswith(
        "ModuleInUse: in-tree modules to remove are in use: garp is held by 8021q (refcnt 1)"
    ), st
    assert {"8021q", "garp", "dummy"} <= set(proc_modules())  # nothing unloaded
    assert not keep_out.exists()

    write_instance("2.0", modules=("kvcd_base",), remove=IN_TREE)
    sh(["systemctl", "restart", UNIT], timeout=BUILD_TIMEOUT)  # it failed: restart, not reload
    st = settle("Done")
    mods = proc_modules()
    assert "kvcd_base" in mods and not set(IN_TREE) & set(mods), sorted(mods)
    text = keep_out.read_text()
    for name in IN_TREE:
        assert f"blacklist {name}\ninstall {name} /bin/false\n" in text, text
    assert sh(["modprobe", "dummy"], check=False).returncode != 0  # kept out
    assert "dummy" not in proc_modules()
    out = sh(["kvcd", "status", NAME]).stdout
    assert "in-tree modules kept out: 8021q, garp, dummy; unloaded by kvcd: 8021q, garp, dummy" in (
        out
    ), out

    sh(["systemctl", "stop", UNIT], timeout=600)
    mods = proc_modules()
    assert "kvcd_base" not in mods and set(IN_TREE) <= set(mods), sorted(mods)
    assert not keep_out.exists()
    sh(["modprobe", "-r", "dummy"], check=False)
    sh(["rmmod", "8021q"], check=False)
