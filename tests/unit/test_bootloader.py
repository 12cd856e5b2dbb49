"""Next-kernel detection from fake boot configurations under a tmp HostRoot: BLS entries,
grubenv, grubby (a fake command), Debian's vmlinuz links, and rpm-ostree's CLI output (a fake
`rpm-ostree status --json`; the D-Bus path is tests/integration/test_rpmostree_dbus.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvcd.host import bootloader, rpmostree
from kvcd.host.paths import HostRoot

K1, K2, K3 = "5.14.0-362.8.1.el9_3.x86_64", "5.14.0-362.13.1.el9_3.x86_64", "5.14.0-70.el9.x86_64"
MID = "8a4f2c1e9d0b4f6a8c3e5d7b9a1c2e3f"


def entry(kernel: str, title: str | None = None, **extra: str) -> str:
    lines = [
        f"title {title or f'Red Hat Enterprise Linux ({kernel}) 9.3 (Plow)'}",
        f"version {kernel}",
        f"linux /vmlinuz-{kernel}",
        f"initrd /initramfs-{kernel}.img $tuned_initrd",
        "options root=/dev/mapper/rhel-root ro",
        "grub_users $grub_users",
        "id rhel-20231101000000-" + kernel,
    ]
    lines += [f"{k.replace('_', '-')} {v}" for k, v in extra.items()]
    return "\n".join(lines) + "\n"


def grubenv(**variables: str) -> str:
    head = "# GRUB Environment Block\n" + "".join(f"{k}={v}\n" for k, v in variables.items())
    return head + "#" * (1024 - len(head))


ENTRIES = {
    f"/boot/loader/entries/{MID}-{K1}.conf": entry(K1),
    f"/boot/loader/entries/{MID}-{K2}.conf": entry(K2),
    f"/boot/loader/entries/{MID}-{K3}.conf": entry(K3),
    f"/boot/loader/entries/{MID}-0-rescue.conf": (
        "title Rescue\nversion 0-rescue\nlinux /vmlinuz-0-rescue-" + MID + "\n"
    ),
}

ROWS: list[tuple[str, dict[str, str], dict[str, str], str | None, str]] = [
    # (case, files, symlinks, next kernel, source)
    ("saved-entry-id", {**ENTRIES, "/boot/grub2/grubenv": grubenv(saved_entry=f"{MID}-{K1}")},
     {}, K1, "grubenv"),
    ("next-entry-wins", {**ENTRIES, "/boot/grub2/grubenv":
     grubenv(saved_entry=f"{MID}-{K1}", next_entry=f"{MID}-{K3}")}, {}, K3, "grubenv"),
    ("saved-entry-title", {**ENTRIES, "/boot/grub2/grubenv":
     grubenv(saved_entry=f"Red Hat Enterprise Linux ({K3}) 9.3 (Plow)")}, {}, K3, "grubenv"),
    ("saved-entry-index", {**ENTRIES, "/boot/grub2/grubenv": grubenv(saved_entry="1")},
     {}, K1, "grubenv"),
    ("debian-grubenv-path", {**ENTRIES, "/boot/grub/grubenv": grubenv(saved_entry=f"{MID}-{K3}")},
     {}, K3, "grubenv"),
    ("saved-entry-stale", {**ENTRIES, "/boot/grub2/grubenv": grubenv(saved_entry="gone")},
     {}, K2, "bls"),
    ("no-grubenv-newest-first", ENTRIES, {}, K2, "bls"),
    ("sort-key-first", {**ENTRIES, f"/boot/loader/entries/{MID}-{K3}.conf":
     entry(K3, sort_key="aaa")}, {}, K3, "bls"),
    ("numeric-not-lexical", {"/boot/loader/entries/a.conf": entry("6.1.0-9-amd64"),
     "/boot/loader/entries/b.conf": entry("6.1.0-56-amd64")}, {}, "6.1.0-56-amd64", "bls"),
    ("ostree-entry", {"/boot/loader/entries/ostree-1-fedora.conf":
     "title Fedora CoreOS 39\nversion 2\nlinux /ostree/fedora-" + "c" * 64
     + "/vmlinuz-6.5.6-300.fc39.x86_64\n"}, {}, "6.5.6-300.fc39.x86_64", "bls"),
    ("entries-without-kernel", {"/boot/loader/entries/x.conf": "title X\nversion 7\n"},
     {}, None, "unknown"),
    ("debian-vmlinuz", {"/boot/vmlinuz-6.1.0-56-amd64": ""},
     {"/vmlinuz": "boot/vmlinuz-6.1.0-56-amd64"}, "6.1.0-56-amd64", "vmlinuz"),
    ("debian-boot-vmlinuz", {}, {"/boot/vmlinuz": "vmlinuz-6.1.0-50-amd64"},
     "6.1.0-50-amd64", "vmlinuz"),
    ("nothing", {}, {}, None, "unknown"),
]  # fmt: skip


def make(root: HostRoot, files: dict[str, str], links: dict[str, str]) -> None:
    for path, text in files.items():
        root(path).parent.mkdir(parents=True, exist_ok=True)
        root(path).write_text(text)
    for path, target in links.items():
        root(path).parent.mkdir(parents=True, exist_ok=True)
        root(path).symlink_to(target)


@pytest.mark.parametrize(
    ("case", "files", "links", "kernel", "source"), ROWS, ids=[r[0] for r in ROWS]
)
def test_next_boot(
    root: HostRoot,
    case: str,
    files: dict[str, str],
    links: dict[str, str],
    kernel: str | None,
    source: str,
) -> None:
    make(root, files, links)
    nb = bootloader.next_boot(root)  # tmp root: grubby is never asked (the guard would fail)
    assert (nb.kernel, nb.source) == (kernel, source), nb
    if kernel is None:
        assert nb.modules_dir is None and nb.detail
    else:
        assert nb.modules_dir == root.system_modules(kernel)


def test_unknown_says_where_it_looked(root: HostRoot) -> None:
    nb = bootloader.next_boot(root)
    assert nb.detail == (
        f"no boot entries in {root('/boot/loader/entries')} and no /vmlinuz or /boot/vmlinuz link"
    )


def test_grubby_answers_when_grubenv_does_not(root: HostRoot, fake_commands: Any) -> None:
    make(root, ENTRIES, {})
    fake_commands.add("grubby", f"echo /boot/vmlinuz-{K3}\n")
    nb = bootloader.next_boot(root, use_grubby=True)
    assert (nb.kernel, nb.source, nb.detail) == (K3, "grubby", "grubby --default-kernel")
    assert fake_commands.calls() == [["grubby", "--default-kernel"]]
    # grubenv's saved_entry is read first; grubby is not asked then.
    make(root, {"/boot/grub2/grubenv": grubenv(saved_entry=f"{MID}-{K1}")}, {})
    assert bootloader.next_boot(root, use_grubby=True).kernel == K1
    assert len(fake_commands.calls()) == 1
    # A failing grubby falls through to the BLS order.
    fake_commands.add("grubby", "echo 'grubby fatal error' >&2; exit 1\n")
    root("/boot/grub2/grubenv").unlink()
    assert bootloader.next_boot(root, use_grubby=True).source == "bls"


PARSE_ROWS = [
    # (case, entry text, kernel)
    ("rhel", entry(K1), K1),
    ("version-only", "title x\nversion 6.1.0-56-amd64\n", "6.1.0-56-amd64"),
    ("ostree-serial-version", "version 3\nlinux /ostree/x/vmlinuz-6.5.6-300.fc39.x86_64\n",
     "6.5.6-300.fc39.x86_64"),
    ("checksum-image", "version 3\nlinux /ostree/x/vmlinuz-" + "d" * 64 + "\n", None),
    ("comments-and-blank", "# generated\n\ntitle t\nlinux /vmlinuz-6.1.0-50-amd64\n",
     "6.1.0-50-amd64"),
    ("path-in-version", "version ../../etc\n", None),
]  # fmt: skip


@pytest.mark.parametrize(("case", "text", "kernel"), PARSE_ROWS, ids=[r[0] for r in PARSE_ROWS])
def test_parse_entry(case: str, text: str, kernel: str | None) -> None:
    e = bootloader.parse_entry(Path("/boot/loader/entries/x.conf"), text)
    assert e.id == "x" and e.kernel == kernel


def test_watch_dirs(root: HostRoot) -> None:
    assert bootloader.watch_dirs(root) == [
        root("/boot/loader/entries"),
        root("/boot/grub2"),
        root("/boot/grub"),
        root("/boot"),
        root("/"),
    ]


# --- rpm-ostree through its CLI -----------------------------------------------------------

STATUS = {
    "deployments": [
        {
            "id": "rhcos-1.0",
            "osname": "rhcos",
            "checksum": "e" * 64,
            "serial": 0,
            "booted": False,
            "staged": True,
            "version": "415.92.202311",
            "base-commit-meta": {"ostree.linux": "5.14.0-284.40.1.el9_2.x86_64"},
        },
        {
            "id": "rhcos-0.0",
            "osname": "rhcos",
            "checksum": "f" * 64,
            "serial": 0,
            "booted": True,
            "staged": False,
            "base-commit-meta": {"ostree.linux": "5.14.0-284.30.1.el9_2.x86_64"},
        },
    ],
    "transaction": None,
}


@pytest.fixture
def ostree(root: HostRoot, monkeypatch: pytest.MonkeyPatch) -> HostRoot:
    root("/run").mkdir()
    root("/run/ostree-booted").write_text("")

    def no_dbus(address: str | None = None) -> list[dict[str, Any]]:
        raise rpmostree.RpmOstreeError("D-Bus org.projectatomic.rpmostree1: not on this bus")

    monkeypatch.setattr(rpmostree, "deployments_dbus", no_dbus)
    return root


CLI_ROWS = [
    # (case, fake output, exit code, next kernel, detail contains)
    ("staged", json.dumps(STATUS), 0, "5.14.0-284.40.1.el9_2.x86_64",
     "staged deployment rhcos-1.0 (415.92.202311)"),
    ("booted-only", json.dumps({"deployments": STATUS["deployments"][1:]}), 0,  # type: ignore[index]
     "5.14.0-284.30.1.el9_2.x86_64", "booted deployment rhcos-0.0"),
    ("not-json", "State: idle", 0, None, "not JSON"),
    ("no-deployments", "{}", 0, None, "no 'deployments' list"),
    ("fails", "", 1, None, "rpm-ostree status --json: rpm-ostree exited 1"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("case", "output", "rc", "kernel", "says"), CLI_ROWS, ids=[r[0] for r in CLI_ROWS]
)
def test_rpm_ostree_cli_fallback(
    ostree: HostRoot,
    fake_commands: Any,
    case: str,
    output: str,
    rc: int,
    kernel: str | None,
    says: str,
) -> None:
    fake_commands.add("rpm-ostree", f"cat <<'EOF'\n{output}\nEOF\nexit {rc}\n")
    nb = rpmostree.next_boot(ostree)
    assert nb is not None
    assert nb.kernel == kernel
    assert says in nb.detail, nb.detail
    assert nb.source == ("rpm-ostree" if kernel else "unknown")
    assert fake_commands.calls() == [["rpm-ostree", "status", "--json"]]
    if kernel is None:
        assert "not on this bus" in nb.detail  # both reasons, when neither answered


def test_not_an_ostree_host(root: HostRoot) -> None:
    assert rpmostree.next_boot(root) is None  # no /run/ostree-booted: the boot loader decides
