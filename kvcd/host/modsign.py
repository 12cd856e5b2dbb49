"""Module signatures: whether this kernel loads only signed modules, who signed a module, which
signers the kernel trusts, and signing with the key and certificate kvcd.toml names.

- Enforcement: `module.sig_enforce` (/sys/module/module/parameters/sig_enforce), the kernel's
  lockdown (/sys/kernel/security/lockdown: integrity or confidentiality refuse unsigned modules),
  and Secure Boot (the SecureBoot EFI variable; distribution kernels lock down under it).
- A module's signature: the `~Module signature appended~` trailer (kernel ABI, scripts/sign-file)
  read back with modinfo(8): signer, key id (the certificate's serial number), hash.
- Trusted signers: the X.509 keys in /proc/keys (the kernel's builtin, secondary, platform and
  machine keyrings; MOK-enrolled keys land in the last two), by name.
- Signing: `openssl cms` makes the detached PKCS#7 signature (no attributes, no certificates,
  issuer and serial, as sign-file does), and kvcd appends it with `struct module_signature` and
  the magic. The key's path is never logged: openssl's errors are told with it replaced.
"""

from __future__ import annotations

import os
import re
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

from kvcd.core.state import SIGNATURE_REQUIRED, UNTRUSTED_SIGNER
from kvcd.host import files
from kvcd.host.paths import HostRoot

# kvcd.host.run and tempfile are imported where a process runs: `kvcd status` reads files only.

SECURE_BOOT = "/sys/firmware/efi/efivars/SecureBoot-8be4df61-93ca-11d2-aa0d-00e098032b8c"
LOCKDOWN = "/sys/kernel/security/lockdown"
SIG_ENFORCE = "/sys/module/module/parameters/sig_enforce"
KEYS = "/proc/keys"
MAGIC = b"~Module signature appended~\n"
PKEY_ID_PKCS7 = 2


@dataclass(frozen=True)
class Enforcement:
    secure_boot: bool | None  # None: not booted with EFI, or the variable is unreadable
    lockdown: str | None  # "none" | "integrity" | "confidentiality"; None: no lockdown LSM
    sig_enforce: bool

    @property
    def enforced(self) -> bool:
        return self.sig_enforce or self.lockdown in ("integrity", "confidentiality")

    def describe(self) -> str:
        why = []
        if self.sig_enforce:
            why.append("module.sig_enforce=1")
        if self.lockdown in ("integrity", "confidentiality"):
            why.append(f"kernel lockdown={self.lockdown}")
        if self.secure_boot:
            why.append("Secure Boot on")
        if self.enforced:
            return "enforced (" + ", ".join(why) + ")"
        sb = {True: "on", False: "off", None: "unknown"}[self.secure_boot]
        lockdown = self.lockdown or "absent"
        return f"not enforced (sig_enforce off, lockdown {lockdown}, Secure Boot {sb})"


def _read(path: Path, size: int = 4096) -> bytes | None:
    """A kernel file (efivarfs, securityfs, sysfs, procfs); None when absent or unreadable."""
    try:
        with open(path, "rb") as f:
            return f.read(size)
    except OSError:
        return None


def enforcement(root: HostRoot) -> Enforcement:
    raw = _read(root(SECURE_BOOT))
    secure = raw[4] == 1 if raw is not None and len(raw) >= 5 else None  # 4 attribute bytes
    text = (_read(root(LOCKDOWN)) or b"").decode(errors="replace")
    found = re.search(r"\[(\w+)\]", text)
    lockdown = found.group(1) if found else None
    enforce = (_read(root(SIG_ENFORCE)) or b"").strip() in (b"Y", b"1")
    return Enforcement(secure, lockdown, enforce)


@dataclass(frozen=True)
class Signature:
    signer: str
    key: str  # as modinfo prints sig_key: colon-separated hex
    hash: str


def is_signed(path: Path) -> bool:
    """The trailer is there (an uncompressed .ko; compressed ones: modinfo says)."""
    if not path.name.endswith(".ko"):
        return signature(path) is not None
    return _has_trailer(path)


def _has_trailer(path: Path) -> bool:
    with files.open_module(path) as f:  # a regular file (in the store, no link), no FIFO wait
        f.seek(0, os.SEEK_END)
        if f.tell() < len(MAGIC):
            return False
        f.seek(-len(MAGIC), os.SEEK_END)
        return f.read() == MAGIC


def signature(path: Path) -> Signature | None:
    """Who signed the module file, read back by modinfo(8); None when it is not signed (an
    uncompressed .ko without the trailer: known without running modinfo)."""
    from kvcd.host.run import CommandError, run

    if path.name.endswith(".ko"):
        if not _has_trailer(path):
            return None
    else:
        files.open_module(path).close()  # modinfo is not led to a FIFO or a link in the store
    try:
        out = run(["modinfo", "--", str(path)]).stdout
    except CommandError:
        return None
    fields: dict[str, str] = {}
    for line in out.splitlines():
        key, sep, value = line.partition(":")
        if sep and key in ("signer", "sig_key", "sig_hashalgo") and key not in fields:
            fields[key] = value.strip()
    if not fields.get("signer") and not fields.get("sig_key"):
        return None
    return Signature(
        fields.get("signer", ""), fields.get("sig_key", ""), fields.get("sig_hashalgo", "")
    )


# "<id> <flags> <usage> <timeout> <perm> <uid> <gid> asymmetri <name>: <skid hex>: X509.<alg> …"
_KEY_LINE = re.compile(
    r"^\S+\s+\S+\s+\d+\s+\S+\s+\S+\s+\d+\s+\d+\s+asymmetri\s+(.*?): [0-9a-f]+: X509\."
)


def trusted_signers(root: HostRoot) -> frozenset[str]:
    """The names of the X.509 keys the kernel holds (empty when /proc/keys lists none)."""
    text = (_read(root(KEYS), -1) or b"").decode(errors="replace")
    return frozenset(m.group(1) for m in map(_KEY_LINE.match, text.splitlines()) if m)


def refusal(
    root: HostRoot, rules: Enforcement, path: Path, cert: str = ""
) -> tuple[str, str] | None:
    """(reason code, why) this kernel would refuse the module file, said before the load;
    None when it would not (or when kvcd cannot tell: the kernel then judges, and says why)."""
    if not rules.enforced:
        return None
    enrol = (
        f"mokutil --import <{cert} in DER form> and reboot to enrol it"
        if cert
        else "set sign_key and sign_cert in kvcd.toml, enrol the certificate with "
        "`mokutil --import <certificate in DER form>` and reboot"
    )
    sig = signature(path)
    if sig is None:
        return SIGNATURE_REQUIRED, (
            f"{path.name} is not signed, and this kernel loads only signed modules "
            f"({rules.describe().removeprefix('enforced (').rstrip(')')}): {enrol}"
        )
    trusted = trusted_signers(root)
    if not trusted or sig.signer in trusted:
        return None
    return UNTRUSTED_SIGNER, (
        f"{path.name} is signed by {sig.signer!r} (key {sig.key}), a key this kernel does not "
        f"trust ({', '.join(sorted(trusted))}): {enrol}"
    )


def sign(path: Path, key: Path, cert: Path, hash_name: str = "sha256") -> None:
    """Sign the module file in place (an existing signature is replaced). Raises SignError."""
    import tempfile

    from kvcd.host.run import CommandError, run

    if not path.name.endswith(".ko"):
        raise SignError(f"{path.name}: kvcd signs uncompressed .ko files only")
    data = path.read_bytes()
    body = _unsigned(data)
    with tempfile.TemporaryDirectory(prefix="kvcd-sign-") as tmp:
        unsigned, sig_file = Path(tmp) / "module", Path(tmp) / "sig"
        unsigned.write_bytes(body)
        argv = ["openssl", "cms", "-sign", "-binary", "-noattr", "-nocerts", "-nosmimecap"]
        argv += ["-md", hash_name, "-outform", "DER", "-signer", str(cert), "-inkey", str(key)]
        argv += ["-in", str(unsigned), "-out", str(sig_file)]
        try:
            run(argv)
        except CommandError as exc:
            said = exc.stderr.replace(str(key), "<sign_key>").strip().splitlines()
            raise SignError(f"{path.name}: openssl cms: {said[-1] if said else exc}") from None
        sig = sig_file.read_bytes()
    trailer = struct.pack(">BBBBB3xI", 0, 0, PKEY_ID_PKCS7, 0, 0, len(sig))
    files.atomic_write(path, body + sig + trailer + MAGIC, path.stat().st_mode & 0o7777)


def _unsigned(data: bytes) -> bytes:
    """The module without its signature trailer, if it has one."""
    if not data.endswith(MAGIC) or len(data) < len(MAGIC) + 12:
        return data
    info = data[-len(MAGIC) - 12 : -len(MAGIC)]
    sig_len = struct.unpack(">I", info[8:])[0]
    end = len(data) - len(MAGIC) - 12 - sig_len
    return data[:end] if end > 0 else data


# The kernel's taint flags, bit by bit (Documentation/admin-guide/tainted-kernels.rst).
TAINTS = (
    ("P", "proprietary module"),
    ("F", "module force-loaded"),
    ("S", "kernel out of specification"),
    ("R", "module force-unloaded"),
    ("M", "machine check"),
    ("B", "bad page"),
    ("U", "taint requested by user"),
    ("D", "kernel died recently"),
    ("A", "ACPI table overridden"),
    ("W", "kernel warning"),
    ("C", "staging driver"),
    ("I", "firmware workaround"),
    ("O", "out-of-tree module"),
    ("E", "unsigned module"),
    ("L", "soft lockup"),
    ("K", "live patched"),
    ("X", "auxiliary taint"),
    ("T", "randstruct plugin"),
    ("N", "test module"),
)


def kernel_taint(root: HostRoot) -> list[tuple[str, str]]:
    """(letter, meaning) of each taint flag /proc/sys/kernel/tainted has set."""
    raw = (_read(root("/proc/sys/kernel/tainted")) or b"0").strip()
    value = int(raw) if raw.isdigit() else 0
    return [flag for bit, flag in enumerate(TAINTS) if value >> bit & 1]


class SignError(Exception):
    pass


def signing_problem(key: str, cert: str) -> tuple[str, str] | None:
    """(setting, why) kvcd cannot sign with these files; None when it can."""
    if bool(key) != bool(cert):  # named by the one that is set: its line in kvcd.toml
        return ("sign_key" if key else "sign_cert"), (
            "sign_key and sign_cert go together: set both, or neither"
        )
    if not key:
        return None
    for setting, value in (("sign_key", key), ("sign_cert", cert)):
        # The key's path is not said (the journal and the record get this text): the error
        # names kvcd.toml's line that holds it.
        named = setting if setting == "sign_key" else f"{setting} = {value!r}"
        try:
            st = os.stat(value)
        except OSError as exc:
            return setting, f"{named}: {exc.strerror}"
        if not stat.S_ISREG(st.st_mode):
            return setting, f"{named} is not a regular file"
        if setting != "sign_key":
            continue
        if st.st_uid not in (0, os.geteuid()):
            return setting, f"sign_key is owned by uid {st.st_uid}, not by root: chown root it"
        if st.st_mode & 0o077:
            return setting, (
                f"sign_key can be read by others (mode {st.st_mode & 0o777:o}): chmod 600 it"
            )
    from kvcd.host.run import which

    if which("openssl") is None:
        return "sign_key", "signing modules needs openssl (RPM openssl, Debian openssl)"
    return None
