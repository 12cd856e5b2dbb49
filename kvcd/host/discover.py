"""discover: the node's capabilities (GEP-33 capability set), read from files under the HostRoot.

It may touch: /proc/sys/kernel/{arch,osrelease}, /etc/os-release (or /usr/lib/os-release),
/sys/firmware/efi (Secure Boot from efivars), /proc/cpuinfo, and the PCI/USB device directories
of sysfs. Everything is read under `root`, so a fake tree under a tmp directory is a whole node;
only the architecture falls back to uname(2), and only when the root is the real "/".

Capability names (values are lists, GEP-33 style, most of them one value):

    architecture     amd64 | arm64 | ppc64le | s390x | … (GEP-33 names, not uname's)
    kernel_release   the running kernel release, e.g. 5.14.0-427.13.1.el9_4.x86_64+rt
    kernel_version   major.minor of it, e.g. 5.14
    kernel_flavor    generic | rt | 64k | debug | cloud | … (see kernel_flavor())
    os_id            ID of os-release (rhel, fedora, debian, …)
    os_version       VERSION_ID and its major part (9.4 and 9), so variants may pin either
    boot_mode        uefi | bios
    secure_boot      enabled | disabled
    cpu_flags        the flags of /proc/cpuinfo (x86 "flags", arm "Features")
    pci_devices      vendor:device of every PCI device, lower-case hex
    usb_devices      vendor:product of every USB device, lower-case hex

Pins from the admin (Settings.node_capabilities) replace a discovered capability whole.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path

from kvcd.host import files
from kvcd.host.paths import HostRoot

# EFI global variable GUID; SecureBoot is 4 bytes of attributes then one byte of value.
_SECURE_BOOT = "SecureBoot-8be4df61-93ca-11d2-aa0d-00e098032b8c"
_ARCH = {
    "x86_64": "amd64",
    "amd64": "amd64",
    "aarch64": "arm64",
    "arm64": "arm64",
    "ppc64le": "ppc64le",
    "s390x": "s390x",
    "i686": "386",
    "i386": "386",
    "riscv64": "riscv64",
}
_DEB_ARCH = ("amd64", "arm64", "armmp", "armmp-lpae", "686", "686-pae", "powerpc64le", "s390x")
_DEB_ABI = re.compile(r"^\d+\.\d+(?:\.\d+)?-\d+-(.+)$")
_RHEL_RT = re.compile(r"\.rt\d")

Capabilities = dict[str, tuple[str, ...]]


def architecture(machine: str) -> str:
    return _ARCH.get(machine, machine)


def kernel_flavor(release: str) -> str:
    """The kernel's flavor from its release string.

    RHEL/Fedora: the part after '+' (5.14.0-427.el9.x86_64+rt -> rt, +64k, +debug); RHEL 8's
    real-time kernels carry '.rtN' (4.18.0-477.rt7.2.el8_8.x86_64 -> rt).
    Debian/Ubuntu: what follows <version>-<abi>- without the architecture
    (6.1.0-18-rt-amd64 -> rt, 6.1.0-18-cloud-amd64 -> cloud, 5.15.0-91-lowlatency -> lowlatency).
    Otherwise: generic.
    """
    if "+" in release:
        return release.rsplit("+", 1)[1] or "generic"
    if _RHEL_RT.search(release):
        return "rt"
    m = _DEB_ABI.match(release)
    if m:
        rest = m.group(1)
        for arch in _DEB_ARCH:
            if rest == arch:
                return "generic"
            if rest.endswith("-" + arch):
                rest = rest[: -len(arch) - 1]
                break
        return rest or "generic"
    return "generic"


def parse_os_release(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        key, _, value = line.partition("=")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            value = value[1:-1]
        out[key.strip()] = value
    return out


def cpu_flags(cpuinfo: str) -> tuple[str, ...]:
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("flags", "Features"):
            return tuple(sorted(set(value.split())))
    return ()


def _ids(directory: Path, vendor: str, device: str) -> tuple[str, ...]:
    found: set[str] = set()
    try:
        entries = list(directory.iterdir())
    except OSError:
        return ()
    for entry in entries:
        v = files.read_host_text(entry / vendor)
        d = files.read_host_text(entry / device)
        if v and d:
            found.add(f"{_hex4(v)}:{_hex4(d)}")
    return tuple(sorted(found))


def _hex4(text: str) -> str:
    text = text.strip().lower()
    return text[2:] if text.startswith("0x") else text


def secure_boot(root: HostRoot) -> tuple[str, str]:
    """(boot_mode, secure_boot) from /sys/firmware/efi and its SecureBoot variable."""
    efi = root("/sys/firmware/efi")
    if not efi.is_dir():
        return "bios", "disabled"
    try:
        data = (efi / "efivars" / _SECURE_BOOT).read_bytes()
    except OSError:
        return "uefi", "disabled"
    return "uefi", "enabled" if len(data) >= 5 and data[4] == 1 else "disabled"


def discover(
    root: HostRoot,
    pins: Iterable[tuple[str, Iterable[str]]] = (),
    kernel: str | None = None,
) -> Capabilities:
    """The node's capability set: discovered, then the admin's pins on top.

    `kernel`: describe that kernel release instead of the running one (preparing the kernel
    that boots next picks the variant for it)."""
    caps: Capabilities = {}
    arch = files.read_host_text(root("/proc/sys/kernel/arch"))
    if arch and arch.strip():
        caps["architecture"] = (architecture(arch.strip()),)
    elif root.root == Path("/"):
        caps["architecture"] = (architecture(os.uname().machine),)
    release = kernel or files.read_host_text(root.osrelease)
    if release and release.strip():
        rel = release.strip()
        caps["kernel_release"] = (rel,)
        m = re.match(r"(\d+)\.(\d+)", rel)
        if m:
            caps["kernel_version"] = (f"{m.group(1)}.{m.group(2)}",)
        caps["kernel_flavor"] = (kernel_flavor(rel),)
    os_text = files.read_host_text(root("/etc/os-release")) or files.read_host_text(
        root("/usr/lib/os-release")
    )
    if os_text:
        osr = parse_os_release(os_text)
        if osr.get("ID"):
            caps["os_id"] = (osr["ID"],)
        version = osr.get("VERSION_ID")
        if version:
            major = version.split(".")[0]
            caps["os_version"] = (version,) if major == version else (version, major)
    boot_mode, sb = secure_boot(root)
    caps["boot_mode"] = (boot_mode,)
    caps["secure_boot"] = (sb,)
    cpuinfo = files.read_host_text(root("/proc/cpuinfo"))
    if cpuinfo:
        flags = cpu_flags(cpuinfo)
        if flags:
            caps["cpu_flags"] = flags
    caps["pci_devices"] = _ids(root("/sys/bus/pci/devices"), "vendor", "device")
    caps["usb_devices"] = _ids(root("/sys/bus/usb/devices"), "idVendor", "idProduct")
    for name, values in pins:
        caps[name] = tuple(values)
    return caps
