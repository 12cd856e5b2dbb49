"""Node capability discovery and device enumeration from a fake sysfs/efivars/os-release tree."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvcd import cli
from kvcd.host import devices, discover
from kvcd.host.paths import HostRoot
from tests.fakehost import doc, write

SB_VAR = "sys/firmware/efi/efivars/SecureBoot-8be4df61-93ca-11d2-aa0d-00e098032b8c"
RHEL_OS = doc(
    'NAME="Red Hat Enterprise Linux"', 'ID="rhel"', 'ID_LIKE="fedora"', 'VERSION_ID="9.4"'
)
CPUINFO = doc(
    "processor\t: 0",
    "flags\t\t: fpu vme sse4_2 avx2 avx",
    "",
    "processor\t: 1",
    "flags\t\t: fpu vme sse4_2 avx2 avx",
)
VIRTIO_NET_PCI = "pci:v00001AF4d00001000sv00001AF4sd00000001bc02sc00i00"


def pci(root: HostRoot, slot: str, vendor: str, device: str, modalias: str) -> None:
    d = root(f"/sys/devices/pci0000:00/{slot}")
    write(d / "vendor", vendor + "\n")
    write(d / "device", device + "\n")
    write(d / "modalias", modalias + "\n")
    link = root(f"/sys/bus/pci/devices/{slot}")
    link.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(os.path.relpath(d, link.parent), link)


def usb(root: HostRoot, name: str, vendor: str, product: str) -> None:
    d = root(f"/sys/devices/usb1/{name}")
    write(d / "idVendor", vendor + "\n")
    write(d / "idProduct", product + "\n")
    write(d / "uevent", f"MODALIAS=usb:v{vendor.upper()}p{product.upper()}d0601dc09\n")
    link = root(f"/sys/bus/usb/devices/{name}")
    link.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(os.path.relpath(d, link.parent), link)


def node(root: HostRoot, *, release: str, secure_boot: int | None) -> None:
    write(root("/proc/sys/kernel/arch"), "aarch64\n")
    write(root.osrelease, release + "\n")
    write(root("/etc/os-release"), RHEL_OS)
    write(root("/proc/cpuinfo"), CPUINFO)
    if secure_boot is not None:
        path = root("/" + SB_VAR)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"\x06\x00\x00\x00" + bytes([secure_boot]))
    pci(root, "0000:00:03.0", "0x1af4", "0x1000", VIRTIO_NET_PCI)
    pci(root, "0000:00:04.0", "0x8086", "0x1521", "pci:v00008086d00001521sv0sd0bc02sc00i00")
    usb(root, "1-1", "1d6b", "0002")


def test_discovers_every_capability_from_the_tree(root: HostRoot) -> None:
    node(root, release="5.14.0-427.13.1.el9_4.aarch64+64k", secure_boot=1)
    caps = discover.discover(root)
    assert caps == {
        "architecture": ("arm64",),
        "kernel_release": ("5.14.0-427.13.1.el9_4.aarch64+64k",),
        "kernel_version": ("5.14",),
        "kernel_flavor": ("64k",),
        "os_id": ("rhel",),
        "os_version": ("9.4", "9"),
        "boot_mode": ("uefi",),
        "secure_boot": ("enabled",),
        "cpu_flags": ("avx", "avx2", "fpu", "sse4_2", "vme"),
        "pci_devices": ("1af4:1000", "8086:1521"),
        "usb_devices": ("1d6b:0002",),
    }


@pytest.mark.parametrize(
    ("value", "efi", "expected"),
    [
        (1, True, ("uefi", "enabled")),
        (0, True, ("uefi", "disabled")),
        (None, True, ("uefi", "disabled")),
        (None, False, ("bios", "disabled")),
    ],
)
def test_secure_boot_from_efivars(
    root: HostRoot, value: int | None, efi: bool, expected: tuple[str, str]
) -> None:
    if efi:
        root("/sys/firmware/efi/efivars").mkdir(parents=True)
    if value is not None:
        root("/" + SB_VAR).write_bytes(b"\x06\x00\x00\x00" + bytes([value]))
    assert discover.secure_boot(root) == expected


def test_pins_replace_discovered_values(root: HostRoot) -> None:
    node(root, release="6.1.0-18-amd64", secure_boot=None)
    caps = discover.discover(root, (("kernel_flavor", ("rt",)), ("gpu", ("a100", "h100"))))
    assert caps["kernel_flavor"] == ("rt",)
    assert caps["gpu"] == ("a100", "h100")
    assert caps["boot_mode"] == ("bios",)


def test_an_empty_root_reports_what_it_can(root: HostRoot) -> None:
    caps = discover.discover(root)
    # No uname fallback under a prefix: the tree is the whole node.
    assert "architecture" not in caps and "kernel_release" not in caps
    assert caps["secure_boot"] == ("disabled",)
    assert caps["pci_devices"] == ()


@pytest.mark.parametrize(
    ("release", "flavor"),
    [
        ("5.14.0-427.13.1.el9_4.x86_64", "generic"),
        ("5.14.0-427.13.1.el9_4.x86_64+rt", "rt"),
        ("5.14.0-427.13.1.el9_4.aarch64+64k", "64k"),
        ("5.14.0-427.13.1.el9_4.x86_64+debug", "debug"),
        ("4.18.0-477.10.1.rt7.274.el8_8.x86_64", "rt"),
        ("6.5.6-300.fc39.x86_64", "generic"),
        ("6.1.0-18-amd64", "generic"),
        ("6.1.0-18-rt-amd64", "rt"),
        ("6.1.0-18-cloud-amd64", "cloud"),
        ("6.1.0-18-arm64", "generic"),
        ("5.15.0-91-generic", "generic"),
        ("5.15.0-91-lowlatency", "lowlatency"),
        ("5.15.0-1050-aws", "aws"),
        ("6.18.44-custom", "generic"),
    ],
)
def test_kernel_flavor(release: str, flavor: str) -> None:
    assert discover.kernel_flavor(release) == flavor


@pytest.mark.parametrize(
    ("machine", "arch"),
    [("x86_64", "amd64"), ("aarch64", "arm64"), ("ppc64le", "ppc64le"), ("s390x", "s390x")],
)
def test_architecture_names(machine: str, arch: str) -> None:
    assert discover.architecture(machine) == arch


def test_os_release_quotes_and_comments() -> None:
    text = doc("# comment", "ID=fedora", "VERSION_ID='39'", 'PRETTY_NAME="Fedora = 39"', "")
    assert discover.parse_os_release(text) == {
        "ID": "fedora",
        "VERSION_ID": "39",
        "PRETTY_NAME": "Fedora = 39",
    }


def test_arm_cpuinfo_features() -> None:
    assert discover.cpu_flags("processor : 0\nFeatures : fp asimd aes\n") == ("aes", "asimd", "fp")


def test_scan_sysfs_finds_devices_with_ids(root: HostRoot) -> None:
    node(root, release="6.1.0-18-amd64", secure_boot=None)
    # A virtio device: a modalias and no vendor:device ids.
    vdev = root("/sys/devices/pci0000:00/0000:00:03.0/virtio0")
    write(vdev / "modalias", "virtio:d00000001v00001AF4\n")
    link = root("/sys/bus/virtio/devices/virtio0")
    link.parent.mkdir(parents=True)
    os.symlink(os.path.relpath(vdev, link.parent), link)
    # Class devices without a modalias are skipped.
    write(root("/sys/class/net/eth0/address"), "52:54:00:12:34:56\n")
    found = {(d.modalias, d.vendor_device, d.subsystem) for d in devices.scan_sysfs(root)}
    assert found == {
        (VIRTIO_NET_PCI, "1af4:1000", "pci"),
        ("pci:v00008086d00001521sv0sd0bc02sc00i00", "8086:1521", "pci"),
        ("usb:v1D6Bp0002d0601dc09", "1d6b:0002", "usb"),
        ("virtio:d00000001v00001AF4", None, "virtio"),
    }
    assert devices.present(root) == devices.scan_sysfs(root)  # under a prefix: sysfs


@pytest.mark.parametrize(
    ("modalias", "ids"),
    [
        (VIRTIO_NET_PCI, "1af4:1000"),
        ("usb:v1D6Bp0002d0601dc09dsc00dp03ic09isc00ip00in00", "1d6b:0002"),
        ("virtio:d00000001v00001AF4", None),
        ("pci:short", None),
    ],
)
def test_ids_from_modalias(modalias: str, ids: str | None) -> None:
    assert devices.ids_from_modalias(modalias) == ids


def test_cli_capabilities_json_and_text(root: HostRoot, capsys: pytest.CaptureFixture[str]) -> None:
    node(root, release="6.1.0-18-rt-amd64", secure_boot=0)
    write(root.main_config, doc("[node_capabilities]", 'os_version = ["9.2"]'))
    assert cli.main(["--root", str(root.root), "capabilities", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["capabilities"]["kernel_flavor"] == ["rt"]
    assert out["capabilities"]["os_version"] == ["9.2"]
    assert out["pinned"] == ["os_version"]
    assert cli.main(["--root", str(root.root), "capabilities"]) == 0
    text = capsys.readouterr().out
    assert "kernel_flavor: rt\n" in text
    assert "os_version: 9.2  (pinned)\n" in text
    assert "pci_devices: 1af4:1000 8086:1521\n" in text


def test_cli_explain(root: HostRoot, capsys: pytest.CaptureFixture[str]) -> None:
    node(root, release="6.1.0-18-rt-amd64", secure_boot=0)
    write(
        root("/etc/kvcd/instances/nic.toml"),
        doc(
            'version = "1.0"',
            'modules = ["nic"]',
            "[capabilities]",
            'kernel_flavor = ["rt", "generic"]',
            "[variants.generic]",
            'image = "reg.example/nic:generic"',
            'capabilities = { kernel_flavor = ["generic"] }',
            "[variants.rt]",
            'image = "reg.example/nic:rt"',
            'capabilities = { kernel_flavor = ["rt"] }',
            "[variants.gpu]",
            'image = "reg.example/nic:gpu"',
            'capabilities = { pci_devices = ["10de:20b0"] }',
        ),
    )
    assert cli.main(["--root", str(root.root), "capabilities", "--explain", "nic"]) == 0
    text = capsys.readouterr().out
    assert "  generic: excluded, kernel_flavor: wants [generic], node has [rt]\n" in text
    assert "  rt: PICKED (kernel_flavor=rt)\n" in text
    assert (
        "  gpu: excluded, pci_devices: wants [10de:20b0], node has [1af4:1000, 8086:1521]" in text
    )
    assert "picked: rt" in text
    assert cli.main(["--root", str(root.root), "capabilities", "--explain", "nic", "--json"]) == 0
    doc_ = json.loads(capsys.readouterr().out)
    assert doc_["picked"] == "rt"
    assert [c["fits"] for c in doc_["candidates"]] == [False, True, False]
    # The node changes flavor (pin): now generic wins, and no fit exits 1 with the reasons.
    write(root.main_config, doc("[node_capabilities]", 'kernel_flavor = ["64k"]'))
    assert cli.main(["--root", str(root.root), "capabilities", "--explain", "nic"]) == 1
    text = capsys.readouterr().out
    assert "no image variant fits this node: generic (kernel_flavor: wants [generic]" in text


def test_cli_explain_bad_instance_is_exit_2(
    root: HostRoot, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["--root", str(root.root), "capabilities", "--explain", "nope"]) == 2
    assert "no configuration for instance 'nope'" in capsys.readouterr().err


def test_sysfs_paths_resolve_through_relative_symlinks(tmp_path: Path) -> None:
    # pci()/usb() link through relative symlinks, as sysfs does; resolve() stays in the tree.
    r = HostRoot(tmp_path)
    pci(r, "0000:00:05.0", "0x1af4", "0x1041", "pci:v00001AF4d00001041sv0sd0bc02sc00i00")
    (dev,) = devices.scan_sysfs(r)
    assert dev.path == "devices/pci0000:00/0000:00:05.0"


NIC_VARIANTS = doc(
    'version = "1.0"',
    'modules = ["nic"]',
    "[capabilities]",
    'kernel_flavor = ["rt", "generic"]',
    "[variants.rt]",
    'image = "reg.example/nic:rt"',
    'capabilities = { kernel_flavor = ["rt"] }',
)


@pytest.mark.parametrize(
    ("release", "rc", "out"),
    [
        ("6.1.0-18-rt-amd64", 0, "image variant for this node: rt"),
        ("6.1.0-18-amd64", 2, "nic: NO PLAN: no image variant fits this node: rt"),
    ],
)
def test_cli_check_config_names_the_variant(
    root: HostRoot,
    capsys: pytest.CaptureFixture[str],
    release: str,
    rc: int,
    out: str,
) -> None:
    node(root, release=release, secure_boot=None)
    write(root("/etc/kvcd/instances/nic.toml"), NIC_VARIANTS)
    assert cli.main(["--root", str(root.root), "check-config", "nic"]) == rc
    assert out in capsys.readouterr().out


def test_cli_dry_run_without_a_fitting_variant_fails(
    root: HostRoot, capsys: pytest.CaptureFixture[str]
) -> None:
    node(root, release="6.1.0-18-amd64", secure_boot=None)
    write(root("/etc/kvcd/instances/nic.toml"), NIC_VARIANTS)
    assert cli.main(["--root", str(root.root), "load", "nic", "--dry-run"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kvcd: nic: NoVariant: no image variant fits this node: rt (")
