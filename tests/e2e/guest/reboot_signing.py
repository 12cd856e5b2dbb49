"""Guest-side: module signing and a kernel that loads only signed modules (issue #17), across two
boots. A reboot file because `module.sig_enforce` can be switched on while the kernel runs but
never off again: the second boot gives the rest of the run its ordinary kernel back.

Boot 1, with the core instance (e2e-kmod) and its cached image, so nothing is built:
(s1) kvcd.toml names a key and certificate made here with openssl; the instance moves to its
     other prebuilt version with that version's extracted tree removed, so the start extracts
     and signs. modinfo reads the signer and key id back
     from the stored module; `kvcd status` shows them; the journal never names the key's path.
(s2) `echo 1 > /sys/module/module/parameters/sig_enforce`, as `module.sig_enforce=1` on the
     command line would have it. Signed by kvcd's key, which the kernel does not hold: refused
     before the load (UntrustedSigner) when /proc/keys lists the kernel's keys, else the
     kernel's own refusal (LoadFailed, "Key was rejected"). Signing off and the first version
     extracted again: unsigned, refused before the load (SignatureRequired) with the enrolment hint.
     Nothing of the instance is loaded. Then the guest reboots.
Boot 2: enforcement is off again and the instance, started at boot, is Done.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from crashkit import upgrade_from_scratch
from kvcdguest import (
    BUILD_TIMEOUT,
    INSTANCE,
    MODS,
    STATE_DIR,
    UNIT,
    configured_version,
    kvcd_status,
    proc_modules,
    request_reboot,
    sh,
    state_is,
    wait_for,
)

PHASE = STATE_DIR / "signing-phase"
KEYS = Path("/etc/kvcd/keys")
KEY, CERT = KEYS / "signing.key", KEYS / "signing.crt"
SIGNER = "kvcd e2e signing key"
SETTINGS = Path("/etc/kvcd/kvcd.toml")
SAVED = STATE_DIR / "kvcd.toml.before-signing"
ENFORCE = Path("/sys/module/module/parameters/sig_enforce")
STORE = Path("/var/lib/kvcd/store") / INSTANCE
KVER = Path("/proc/sys/kernel/osrelease").read_text().strip()


def phase() -> str:
    return PHASE.read_text().strip() if PHASE.exists() else "boot1"


def serial() -> str:
    out = sh(["openssl", "x509", "-in", str(CERT), "-noout", "-serial"]).stdout
    hexed = out.strip().split("=", 1)[1].lstrip("0")
    hexed = hexed if len(hexed) % 2 == 0 else "0" + hexed
    return ":".join(hexed[i : i + 2] for i in range(0, len(hexed), 2)).upper()


def settings(signing: bool) -> None:
    """kvcd.toml as it was, with sign_key and sign_cert set (or as they were)."""
    text = SAVED.read_text() if SAVED.exists() else ""
    if signing:
        for key, value in (("sign_key", KEY), ("sign_cert", CERT)):
            line = f'{key} = "{value}"'
            text, n = re.subn(rf"^{key}\s*=.*$", line, text, flags=re.M)
            text = text if n else f"{line}\n{text}"  # top-level: before any [table]
    SETTINGS.parent.mkdir(parents=True, exist_ok=True)
    SETTINGS.write_text(text)
    SETTINGS.chmod(0o644)


def switch_version() -> str:
    """Stopped, moved to the other prebuilt version with its extracted trees removed, so the next
    start extracts (from the cached image, or a quick build of prebuilt modules): the only way to
    a fresh extraction that is not drift (kvcd keeps the active tree as it left it)."""
    target = upgrade_from_scratch(configured_version())
    sh(["systemctl", "reset-failed", UNIT], check=False)
    return target


def stored_module(name: str) -> Path:
    (path,) = (STORE / configured_version() / KVER).rglob(f"{name}.ko")
    return path


def modinfo(field: str, path: Path) -> str:
    return sh(["modinfo", "-F", field, str(path)]).stdout.strip()


def start_refused(*codes: str) -> dict[str, object]:
    """Started, refused with one of `codes` (the record before says something else)."""
    sh(["systemctl", "start", UNIT], check=False, timeout=BUILD_TIMEOUT)

    seen: list[object] = []

    def refused() -> dict[str, object] | None:
        st = kvcd_status()
        seen[:] = [st]
        return st if st and st.get("state") == "Degraded" and st.get("code") in codes else None

    try:
        st = wait_for(refused, 300, f"{INSTANCE} refused with {codes}")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; last status: {seen}") from None
    sh(["systemctl", "stop", UNIT], check=False, timeout=600)  # no restarts meanwhile
    assert not set(MODS) & set(proc_modules()), proc_modules()  # nothing handed to the kernel
    return st


@pytest.mark.skipif(phase() != "boot1", reason="boot 1 of the signing scenario is done")
def test_s1_kvcd_signs_what_it_extracts() -> None:
    SAVED.write_text(SETTINGS.read_text() if SETTINGS.exists() else "")
    KEYS.mkdir(mode=0o700, exist_ok=True)
    argv = ["openssl", "req", "-new", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "30"]
    argv += ["-keyout", str(KEY), "-out", str(CERT), "-subj", f"/CN={SIGNER}/"]
    argv += [
        "-addext",
        "basicConstraints=critical,CA:FALSE",
        "-addext",
        "keyUsage=digitalSignature",
    ]
    sh(argv)
    KEY.chmod(0o600)

    switch_version()
    settings(signing=True)
    sh(["kvcd", "check-config", INSTANCE])  # accepts the key, the certificate, openssl
    sh(["systemctl", "start", UNIT], timeout=BUILD_TIMEOUT)
    st = wait_for(state_is("Done", "Degraded"), BUILD_TIMEOUT, f"{INSTANCE} settled")
    assert st["state"] == "Done", st
    for mod in MODS:
        path = stored_module(mod)
        assert modinfo("signer", path) == SIGNER, path
        assert modinfo("sig_key", path) == serial(), path
        assert modinfo("sig_hashalgo", path) == "sha256", path
    text = sh(["kvcd", "status", INSTANCE]).stdout
    assert f"signed by {SIGNER} (key {serial()}, sha256)" in text, text
    assert "module signatures not enforced" in text, text
    journal = sh(["journalctl", "-u", UNIT, "--no-pager", "-o", "json"]).stdout
    assert str(KEY) not in journal
    said = [json.loads(x).get("MESSAGE", "") for x in journal.splitlines()]
    assert any(re.fullmatch(rf"signed \d+ modules with {CERT}", m) for m in said), said[-20:]


@pytest.mark.skipif(phase() != "boot1", reason="boot 1 of the signing scenario is done")
def test_s2_enforcing_kernel_refuses_before_the_load() -> None:
    sh(["systemctl", "stop", UNIT], timeout=600)
    ENFORCE.write_text("1\n")
    assert ENFORCE.read_text().strip() == "Y"
    text = sh(["kvcd", "status", INSTANCE]).stdout
    assert "module signatures enforced (module.sig_enforce=1" in text, text

    # Signed by kvcd's own key, which this kernel does not hold.
    st = start_refused("UntrustedSigner", "LoadFailed")
    keys = Path("/proc/keys").read_text()
    print(keys)
    if " asymmetri " in keys:
        assert str(st["reason"]).startswith(
            f"UntrustedSigner: kvcd_base: kvcd_base.ko is signed by '{SIGNER}' (key {serial()}), "
            "a key this kernel does not trust"
        ), st
        assert f"mokutil --import <{CERT} in DER form>" in str(st["reason"]), st
    else:  # kvcd cannot see the kernel's keys: the kernel judges, and kvcd reports it
        assert str(st["reason"]).startswith("LoadFailed: kvcd_base:"), st
        assert "rejected" in str(st["reason"]).lower(), st

    # Signing off, the other version extracted: unsigned.
    switch_version()
    settings(signing=False)
    st = start_refused("SignatureRequired")
    assert str(st["reason"]).startswith(
        "SignatureRequired: kvcd_base: kvcd_base.ko is not signed, and this kernel loads only "
        "signed modules (module.sig_enforce=1): set sign_key and sign_cert in kvcd.toml"
    ), st
    assert modinfo("signer", stored_module("kvcd_base")) == ""

    PHASE.write_text("rebooted\n")
    request_reboot()


@pytest.mark.skipif(phase() != "rebooted", reason="runs after the reboot")
def test_s3_after_the_reboot_the_instance_loads_again() -> None:
    assert ENFORCE.read_text().strip() == "N"
    sh(["systemctl", "reset-failed", UNIT], check=False)
    sh(["systemctl", "start", UNIT], check=False, timeout=BUILD_TIMEOUT)
    st = wait_for(state_is("Done"), BUILD_TIMEOUT, f"{INSTANCE} Done after the reboot")
    assert st["goal"] == "loaded" and set(MODS) <= set(proc_modules()), st
    subprocess.run(["rm", "-rf", str(KEYS)], check=False)
    PHASE.write_text("done\n")
