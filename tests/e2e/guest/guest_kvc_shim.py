"""Guest-side: the KVC compatibility command (kvcd-kvc-compat's /usr/bin/kmods-via-containers)
end to end, against a real kernel, podman and systemd (issue #8).

`kmods-via-containers build|load|unload|reload|wrapper NAME KVER` for the native e2e instance
(e2e-kmod) and the KVC-format one (e2e-kvc: /etc/kvc/e2e-kvc.conf + e2e-kvc-lib.sh), each step
asserted in /proc/modules and in kvcd's recorded state (`kvcd status --json`); then KVC's own
unit, kmods-via-containers@e2e-kvc.service as KVC shipped it, started, reloaded and stopped by
systemd; then a tool wrapper made from packaging/kvc-wrapper.sh. Runs after guest_scenarios.py
in the same pytest session (entry.sh), and starts from "no kvcd unit running": every kvcd@ unit
is stopped first, so it does not depend on how the scenarios before it ended.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
from kvcdguest import (
    BUILD_TIMEOUT,
    DRIVER_DIR,
    INSTANCE,
    MODS,
    containerfile,
    kvcd_status,
    module_version,
    proc_modules,
    set_instance,
    sh,
    wait_for,
)

KVC = "kmods-via-containers"
KVC_NAME = "e2e-kvc"
KVC_UNIT = f"kmods-via-containers@{KVC_NAME}.service"


def kver() -> str:
    return os.uname().release


def loaded() -> set[str]:
    return {m for m in MODS if m in proc_modules()}


def shim(*args: str, check: bool = True) -> str:
    p = sh([KVC, *args], timeout=BUILD_TIMEOUT, check=check)
    return p.stdout


def recorded(instance: str) -> dict[str, object]:
    st = kvcd_status(instance)
    assert st is not None, f"kvcd status --json has no entry for {instance}"
    return st


@pytest.fixture(scope="module", autouse=True)
def no_kvcd_units():  # type: ignore[no-untyped-def]
    """Nothing of the scenarios before is running or loaded: the shim works without a daemon."""
    sh(["systemctl", "stop", "kvcd@*.service"], check=False, timeout=600)
    for m in reversed(MODS):
        if m in proc_modules():
            sh(["modprobe", "-r", m], check=False)
    assert not loaded(), proc_modules()
    yield
    sh(["systemctl", "stop", KVC_UNIT], check=False, timeout=600)
    for name in (INSTANCE, KVC_NAME):
        sh(["kvcd", "unload", name], check=False, timeout=600)


@pytest.fixture(scope="module")
def kvc_instance():  # type: ignore[no-untyped-def]
    """/etc/kvc/e2e-kvc.conf and /usr/lib/kvc/e2e-kvc-lib.sh, as KVC installs an instance."""
    src = DRIVER_DIR / "kvc"
    conf, lib = Path(f"/etc/kvc/{KVC_NAME}.conf"), Path(f"/usr/lib/kvc/{KVC_NAME}-lib.sh")
    conf.parent.mkdir(parents=True, exist_ok=True)
    lib.parent.mkdir(parents=True, exist_ok=True)
    text = (src / f"{KVC_NAME}.conf").read_text()
    conf.write_text(text.replace("=Containerfile\n", f"={containerfile('1.0')}\n"))
    shutil.copy(src / f"{KVC_NAME}-lib.sh", lib)
    return conf


def test_shim_usage_errors() -> None:
    p = sh([KVC, "frobnicate", INSTANCE, kver()], check=False)
    assert p.returncode == 2 and "unknown command" in p.stderr, p
    p = sh([KVC, "load", INSTANCE], check=False)
    assert p.returncode == 2 and "needs NAME and KVER" in p.stderr, p
    p = sh([KVC, "load", "no-such-instance", kver()], check=False, timeout=120)
    assert p.returncode == 2, p
    assert "no-such-instance" in p.stderr, p.stderr
    assert not loaded()


def test_shim_native_build_loads_nothing() -> None:
    set_instance(version="2.0", modules=list(MODS), **{"build.containerfile": containerfile("2.0")})
    shim("build", INSTANCE, kver())
    assert not loaded(), "build loaded modules"
    st = recorded(INSTANCE)
    assert st["state"] == "Done" and st["goal"] == "built", st
    assert st["version"] == "2.0" and st["kernel"] == kver(), st
    # (A build extracts into kvcd's store; the module root switches to it only on a load.)


def test_shim_native_load() -> None:
    shim("load", INSTANCE, kver())
    assert loaded() == set(MODS), proc_modules()
    assert "kvcd_user" in proc_modules()["kvcd_base"]
    assert module_version("kvcd_user") == "2.0"
    st = recorded(INSTANCE)
    assert st["state"] == "Done" and st["goal"] == "loaded" and st["version"] == "2.0", st
    assert all(v["loaded"] for v in st["live"].values()), st  # type: ignore[attr-defined]


def test_shim_native_wrapper_runs_tool_from_driver_image() -> None:
    # Only the tool's output on stdout (scripts parse it): the image's own kvcd_user.ko.
    out = shim("wrapper", INSTANCE, kver(), "modinfo", "-F", "version",
               f"/lib/modules/{kver()}/extra/kvcd_user.ko")  # fmt: skip
    assert out.strip() == "2.0", out


def test_shim_native_reload_swaps_version() -> None:
    set_instance(version="1.0", **{"build.containerfile": containerfile("1.0")})
    shim("reload", INSTANCE, kver())
    assert loaded() == set(MODS), proc_modules()
    assert module_version("kvcd_user") == "1.0" and module_version("kvcd_base") == "1.0"
    st = recorded(INSTANCE)
    assert st["state"] == "Done" and st["goal"] == "loaded" and st["version"] == "1.0", st


def test_shim_native_unload() -> None:
    shim("unload", INSTANCE, kver())
    assert not loaded(), proc_modules()
    st = recorded(INSTANCE)
    assert st["state"] == "Done" and st["goal"] == "unloaded", st
    assert not any(v["loaded"] for v in st["live"].values()), st  # type: ignore[attr-defined]
    assert not st.get("warnings"), st


def test_shim_kvc_instance_build_load_wrapper_unload(kvc_instance: Path) -> None:
    """The KVC-format instance: kvcd calls e2e-kvc-lib.sh's functions, as KVC did."""
    shim("build", KVC_NAME, kver())
    assert not loaded()
    assert recorded(KVC_NAME)["state"] == "Done"
    shim("load", KVC_NAME, kver())
    assert loaded() == set(MODS), proc_modules()
    assert module_version("kvcd_user") == "1.0"
    st = recorded(KVC_NAME)
    assert st["state"] == "Done" and st["goal"] == "loaded", st
    # The library's wrapper(): kvc_c_run --privileged IMAGE "$@".
    out = shim("wrapper", KVC_NAME, kver(), "cat", "/sys/module/kvcd_user/version")
    assert out.strip().splitlines()[-1] == "1.0", out
    shim("unload", KVC_NAME, kver())
    assert not loaded(), proc_modules()
    st = recorded(KVC_NAME)
    assert st["state"] == "Done" and st["goal"] == "unloaded", st


def test_kvc_unit_as_shipped_by_kvc(kvc_instance: Path) -> None:
    """kmods-via-containers@e2e-kvc.service, KVC's unit unchanged: start = build + load,
    reload = KVC reload, stop = unload; each reaches kvcd through the shim."""
    unit_src = DRIVER_DIR / "kvc" / "kmods-via-containers@.service"
    shutil.copy(unit_src, "/etc/systemd/system/kmods-via-containers@.service")
    sh(["systemctl", "daemon-reload"])
    assert not loaded()
    sh(["systemctl", "start", KVC_UNIT], timeout=BUILD_TIMEOUT)
    assert sh(["systemctl", "is-active", KVC_UNIT], check=False).stdout.strip() == "active"
    assert loaded() == set(MODS), proc_modules()
    st = recorded(KVC_NAME)
    assert st["state"] == "Done" and st["goal"] == "loaded" and st["kernel"] == kver(), st
    journal = sh(["journalctl", "-b", "--no-pager", "-u", KVC_UNIT]).stdout
    assert f"KVC: build {KVC_NAME} for {kver()} (kvcd)" in journal, journal[-3000:]
    assert f"KVC: load {KVC_NAME} for {kver()} (kvcd)" in journal, journal[-3000:]
    # KVC's reload: build, unload, load -> the modules are re-initialised (new load).
    inits = sh(["dmesg"]).stdout.count("kvcd_user: loaded")
    sh(["systemctl", "reload", KVC_UNIT], timeout=BUILD_TIMEOUT)
    assert loaded() == set(MODS), proc_modules()
    assert sh(["dmesg"]).stdout.count("kvcd_user: loaded") == inits + 1, "no new kvcd_user init"
    assert recorded(KVC_NAME)["state"] == "Done"
    sh(["systemctl", "stop", KVC_UNIT], timeout=600)
    wait_for(lambda: not loaded(), 120, "the unit's ExecStop to unload the modules")
    st = recorded(KVC_NAME)
    assert st["state"] == "Done" and st["goal"] == "unloaded", st


def test_tool_wrapper_template() -> None:
    """packaging/kvc-wrapper.sh (shipped as a %doc of kvcd-kvc-compat): one copy per instance,
    one symlink per tool, named like the tool; the tool runs from the driver image."""
    docs = sorted(Path("/usr/share/doc").glob("kvcd-kvc-compat*/kvc-wrapper.sh"))
    if not docs:
        pytest.skip("kvcd-kvc-compat's docs are not installed (KVCD_E2E_INSTALL=wheel run)")
    tmp = Path(tempfile.mkdtemp(prefix="kvcd-wrap-"))
    try:
        script = tmp / f"{INSTANCE}-tools"
        text = docs[0].read_text()
        script.write_text(text.replace("\nINSTANCE=simple-kmod\n", f"\nINSTANCE={INSTANCE}\n"))
        script.chmod(0o755)
        (tmp / "modinfo").symlink_to(script.name)
        # The native instance is at 1.0 (after the reload above), unloaded: the wrapper needs
        # only its image.
        p = sh([str(tmp / "modinfo"), "-F", "version", f"/lib/modules/{kver()}/extra/kvcd_user.ko"],
               timeout=600)  # fmt: skip
        assert p.stdout.strip() == "1.0", p.stdout
        p = sh([str(script)], check=False)
        assert p.returncode == 2 and "symlink" in p.stderr, p
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
