"""Signatures through `kvcd run` and `kvcd check-config` on the fake host: a kernel that loads
only signed modules gets none of kvcd's unsigned ones (refused before the load, with the
enrolment hint); kvcd.toml's signing settings are refused at check-config and at start, naming
the file and line. Signing itself, with the real tools: tests/integration/test_modsign.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvcd.cli import main
from kvcd.core.attempts import RETRY
from kvcd.daemon.events import Event
from kvcd.daemon.record import Record
from kvcd.daemon.service import Service
from kvcd.host import modsign
from kvcd.host.paths import HostRoot
from tests import fakehost

K = "6.1.0-56-amd64"
MODS = ["kvcd_base", "kvcd_user"]
CONFIG = 'version = "1.0"\nmodules = ["kvcd_base", "kvcd_user"]\n[build]\ncontext = "/src"\n'


@pytest.fixture
def host(tmp_path: Path, fake_commands: Any, monkeypatch: pytest.MonkeyPatch) -> HostRoot:
    return fakehost.instance_host(
        HostRoot(tmp_path / "root"), K, fake_commands, monkeypatch, CONFIG, MODS, ("1.0",)
    )


@pytest.mark.parametrize(("enforce", "state"), [("N", "Done"), ("Y", "Degraded")])
def test_unsigned_modules_are_refused_before_the_load(
    host: HostRoot, enforce: str, state: str
) -> None:
    fakehost.write(host(modsign.SIG_ENFORCE), enforce + "\n")
    svc = Service(host, "e2e", K, fakehost.RecordingNotifier())
    try:
        svc.reconcile([Event("start", kind=RETRY)])
    finally:
        svc.stop_extensions()
    rec = Record.read(host, "e2e")
    assert rec is not None and rec.state == state
    if state == "Degraded":
        assert rec.reason.startswith(
            "SignatureRequired: kvcd_base: kvcd_base.ko is not signed, and this kernel loads only "
            "signed modules (module.sig_enforce=1): set sign_key and sign_cert in kvcd.toml, "
            "enrol the certificate with `mokutil --import <certificate in DER form>` and reboot"
        )
        assert not (host.sys_module / "kvcd_base").exists()  # never handed to the kernel


@pytest.mark.parametrize(
    ("lines", "where", "error"),
    [
        (['sign_key = "/etc/kvcd/k.pem"'], 1, "sign_key and sign_cert go together"),
        (['sign_key = "k.pem"'], 1, "'sign_key' must be an absolute path\n"),  # its value unsaid
        (['sign_hash = "md5"'], 1, "'sign_hash' must be one of 'sha256', 'sha384', 'sha512'"),
    ],
)
def test_signing_settings_are_refused_at_check_config(
    host: HostRoot, capsys: pytest.CaptureFixture[str], lines: list[str], where: int, error: str
) -> None:
    fakehost.write(host.main_config, "\n".join(lines) + "\n")
    assert main(["--root", str(host.root), "check-config", "--all"]) == 2
    err = capsys.readouterr().err
    assert f"{host.main_config}:{where}: " in err and error in err, err


def test_status_shows_signers_and_taint(host: HostRoot, capsys: pytest.CaptureFixture[str]) -> None:
    svc = Service(host, "e2e", K, fakehost.RecordingNotifier())
    try:
        svc.reconcile([Event("start", kind=RETRY)])
    finally:
        svc.stop_extensions()
    manifest = host.store("e2e") / "1.0" / K / ".kvcd-manifest.json"
    data = json.loads(manifest.read_text())
    data["modules"]["kvcd_base"].update(signer="kvcd key", sig_key="3A:8E", sig_hash="sha256")
    data["modules"]["kvcd_user"]["signer"] = ""  # recorded unsigned
    manifest.write_text(json.dumps(data))
    (host.sys_module / "kvcd_base" / "taint").write_text("OE\n")
    fakehost.write(host("/proc/sys/kernel/tainted"), "12288\n")
    assert main(["--root", str(host.root), "status"]) == 0
    out = capsys.readouterr().out
    assert "  kvcd_base: loaded (refcnt 0, taint OE)\n" in out, out
    assert "    signed by kvcd key (key 3A:8E, sha256)\n" in out
    assert "  kvcd_user: loaded (refcnt 0)\n    unsigned\n" in out
    assert out.endswith(
        "kernel: taint O (out-of-tree module), E (unsigned module); module signatures not "
        "enforced (sig_enforce off, lockdown absent, Secure Boot unknown)\n"
    )
