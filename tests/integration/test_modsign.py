"""Module signatures with the real tools: kvcd signs a real module with openssl, the bytes are
what the kernel's own scripts/sign-file makes, modinfo(8) reads the signer and key back; the
kernel's enforcement, its trusted keys and the refusal before a load, read from files laid out
as the kernel shows them; and what kvcd refuses in kvcd.toml's signing settings."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from kvcd.host import files, modsign
from kvcd.host.paths import HostRoot
from tests.integration import kmods

SIGNER = "kvcd test signing key"


@pytest.fixture(scope="module")
def keypair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("keys")
    key, cert = d / "signing.key", d / "signing.crt"
    argv = ["openssl", "req", "-new", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "30"]
    argv += ["-keyout", str(key), "-out", str(cert), "-subj", f"/CN={SIGNER}/"]
    argv += [
        "-addext",
        "basicConstraints=critical,CA:FALSE",
        "-addext",
        "keyUsage=digitalSignature",
    ]
    subprocess.run(
        argv,
        check=True,
        capture_output=True,
    )
    key.chmod(0o600)
    return key, cert


def serial(cert: Path) -> str:
    out = subprocess.run(
        ["openssl", "x509", "-in", str(cert), "-noout", "-serial"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    hexed = out.strip().split("=", 1)[1].lstrip("0") or "0"
    hexed = hexed if len(hexed) % 2 == 0 else "0" + hexed
    return ":".join(hexed[i : i + 2] for i in range(0, len(hexed), 2)).upper()


@pytest.fixture
def module(tmp_path: Path) -> Path:
    built = kmods.compiled_kmods_or_skip("sign a real module")
    dest = tmp_path / "kvcd_base.ko"
    shutil.copy(built.base, dest)
    return dest


def test_signed_module_reads_back_and_matches_the_kernels_sign_file(
    module: Path, keypair: tuple[Path, Path], tmp_path: Path
) -> None:
    key, cert = keypair
    assert not modsign.is_signed(module) and modsign.signature(module) is None
    reference = tmp_path / "reference.ko"
    shutil.copy(module, reference)

    modsign.sign(module, key, cert)
    sig = modsign.signature(module)
    assert sig == modsign.Signature(SIGNER, serial(cert), "sha256")
    assert modsign.is_signed(module)

    # The kernel's own tool (linux-kbuild / kernel-devel), on the same input: the same bytes.
    tools = sorted(glob.glob("/usr/lib/linux-kbuild-*/scripts/sign-file"))
    kmods.require("compare with sign-file", [] if tools else ["sign-file"], "linux-kbuild")
    subprocess.run([tools[-1], "sha256", str(key), str(cert), str(reference)], check=True)
    assert module.read_bytes() == reference.read_bytes()

    # Signing again replaces the signature (not a second trailer).
    modsign.sign(module, key, cert, "sha512")
    assert module.stat().st_size == reference.stat().st_size
    resigned = modsign.signature(module)
    assert resigned is not None and resigned.hash == "sha512"


def test_openssl_errors_never_name_the_key(module: Path, tmp_path: Path) -> None:
    key = tmp_path / "secret-path" / "broken.key"
    key.parent.mkdir()
    key.write_text("not a key\n")
    with pytest.raises(modsign.SignError) as exc:
        modsign.sign(module, key, key)
    assert "secret-path" not in str(exc.value)
    assert str(exc.value).startswith("kvcd_base.ko: openssl cms: ")
    assert not modsign.is_signed(module)  # the file is left as it was


def test_compressed_modules_are_refused(tmp_path: Path, keypair: tuple[Path, Path]) -> None:
    path = tmp_path / "x.ko.xz"
    path.write_bytes(b"\xfd7zXZ")
    with pytest.raises(modsign.SignError, match=r"x\.ko\.xz: kvcd signs uncompressed \.ko"):
        modsign.sign(path, *keypair)


# --- the kernel's side, laid out under a fake root ---------------------------------------------

DEBIAN_CA = (
    "3b3a7a5f I------     1 perm 1f010000     0     0 asymmetri Debian Secure Boot CA: "
    "6ccece7e4c6c0d1f6149f3dd27dfcc5cbb419ea1: X509.rsa 4a7a7a6b []"
)
OTHER_KEYS = "1e8a2732 I------     1 perm 0f0b0000     0     0 keyring   .blacklist: empty"


def kernel(
    root: HostRoot,
    *,
    enforce: str = "N",
    lockdown: str | None = None,
    sb: int | None = None,
    keys: str = "",
) -> None:
    p = root(modsign.SIG_ENFORCE)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(enforce + "\n")
    if lockdown is not None:
        root(modsign.LOCKDOWN).parent.mkdir(parents=True, exist_ok=True)
        root(modsign.LOCKDOWN).write_text(lockdown + "\n")
    if sb is not None:
        root(modsign.SECURE_BOOT).parent.mkdir(parents=True, exist_ok=True)
        root(modsign.SECURE_BOOT).write_bytes(b"\x06\x00\x00\x00" + bytes([sb]))
    root(modsign.KEYS).parent.mkdir(parents=True, exist_ok=True)
    root(modsign.KEYS).write_text(keys)


@pytest.mark.parametrize(
    ("enforce", "lockdown", "sb", "enforced", "text"),
    [
        (
            "N",
            None,
            None,
            False,
            "not enforced (sig_enforce off, lockdown absent, Secure Boot unknown)",
        ),
        ("Y", None, None, True, "enforced (module.sig_enforce=1)"),
        (
            "N",
            "[none] integrity confidentiality",
            0,
            False,
            "not enforced (sig_enforce off, lockdown none, Secure Boot off)",
        ),
        (
            "N",
            "none [integrity] confidentiality",
            1,
            True,
            "enforced (kernel lockdown=integrity, Secure Boot on)",
        ),
        (
            "N",
            "none integrity [confidentiality]",
            None,
            True,
            "enforced (kernel lockdown=confidentiality)",
        ),
    ],
)
def test_enforcement(
    tmp_path: Path, enforce: str, lockdown: str | None, sb: int | None, enforced: bool, text: str
) -> None:
    root = HostRoot(tmp_path)
    kernel(root, enforce=enforce, lockdown=lockdown, sb=sb)
    rules = modsign.enforcement(root)
    assert (rules.enforced, rules.describe()) == (enforced, text)


def test_refusal_before_the_load(tmp_path: Path, module: Path, keypair: tuple[Path, Path]) -> None:
    root = HostRoot(tmp_path / "root")
    kernel(root, enforce="Y", keys=f"{OTHER_KEYS}\n{DEBIAN_CA}\n")
    rules = modsign.enforcement(root)
    assert modsign.trusted_signers(root) == {"Debian Secure Boot CA"}

    refused = modsign.refusal(root, rules, module, "/etc/kvcd/keys/signing.crt")
    assert refused is not None and refused[0] == "SignatureRequired"
    assert refused[1] == (
        "kvcd_base.ko is not signed, and this kernel loads only signed modules "
        "(module.sig_enforce=1): mokutil --import </etc/kvcd/keys/signing.crt in DER form> and "
        "reboot to enrol it"
    )
    modsign.sign(module, *keypair)
    refused = modsign.refusal(root, rules, module)
    assert refused is not None and refused[0] == "UntrustedSigner"
    assert refused[1].startswith(
        f"kvcd_base.ko is signed by '{SIGNER}' (key {serial(keypair[1])}), a key this kernel "
        "does not trust (Debian Secure Boot CA): set sign_key and sign_cert in kvcd.toml"
    )
    # Enrolled: the kernel lists the key by its subject.
    kernel(root, enforce="Y", keys=DEBIAN_CA.replace("Debian Secure Boot CA", SIGNER))
    assert modsign.refusal(root, rules, module) is None
    # Enforcement off: nothing to say before the load.
    assert modsign.refusal(root, modsign.Enforcement(None, None, False), module) is None


def test_signing_settings_are_checked(tmp_path: Path, keypair: tuple[Path, Path]) -> None:
    key, cert = keypair
    assert modsign.signing_problem("", "") is None
    assert modsign.signing_problem(str(key), str(cert)) is None
    assert modsign.signing_problem(str(key), "") == (
        "sign_key",
        "sign_key and sign_cert go together: set both, or neither",
    )
    missing = str(tmp_path / "nope.key")
    # The key's path is never in the text (it reaches the journal and the record): the
    # ConfigError around it names kvcd.toml's line instead.
    assert modsign.signing_problem(missing, str(cert)) == (
        "sign_key",
        "sign_key: No such file or directory",
    )
    assert modsign.signing_problem(str(tmp_path), str(cert)) == (
        "sign_key",
        "sign_key is not a regular file",
    )
    assert modsign.signing_problem(str(key), missing) == (
        "sign_cert",
        f"sign_cert = {missing!r}: No such file or directory",
    )
    open_key = tmp_path / "open.key"
    open_key.write_bytes(key.read_bytes())
    open_key.chmod(0o644)
    assert modsign.signing_problem(str(open_key), str(cert)) == (
        "sign_key",
        "sign_key can be read by others (mode 644): chmod 600 it",
    )
    if os.geteuid() == 0:  # CI's case: kvcd runs as root, and root may hand a file away
        theirs = tmp_path / "theirs.key"
        theirs.write_bytes(key.read_bytes())
        theirs.chmod(0o600)
        os.chown(theirs, 1000, 1000)
        assert modsign.signing_problem(str(theirs), str(cert)) == (
            "sign_key",
            "sign_key is owned by uid 1000, not by root: chown root it",
        )


@pytest.mark.parametrize("name", ["m.ko", "m.ko.xz"])
def test_a_fifo_in_the_store_is_refused_before_any_read_waits_on_it(
    tmp_path: Path, name: str
) -> None:
    """The check before each load reads the module's signature: a FIFO planted in the store is
    refused (files.Refused, an OSError the step reports) instead of hanging the daemon, and
    modinfo is never handed it."""
    tree = HostRoot(tmp_path).store("e2e") / "1.0" / "6.1.0"
    tree.mkdir(parents=True)
    os.mkfifo(tree / name)
    with pytest.raises(files.Refused, match=f"{name}: is a FIFO"):
        modsign.signature(tree / name)
