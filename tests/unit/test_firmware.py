"""Firmware files (issue #17, KMM's firmwarePath): one node-wide directory, an owners table,
conflicts refused before anything changes, the kernel's search path taken only when free."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pytest

from kvcd.core import state
from kvcd.core.state import StepFailed
from kvcd.daemon import firmware, purge, status, store
from kvcd.host import files, kmod
from kvcd.host.paths import HostRoot
from tests import fakehost
from tests.unit.test_instance import FakePodman, K, instance, instance_host

FW = "/var/lib/kvcd/firmware"


@pytest.fixture
def root(tmp_path: Path) -> HostRoot:  # a bare host: the firmware directory and /sys
    r = HostRoot(tmp_path / "root")
    r.firmware_search_path.parent.mkdir(parents=True)
    r.firmware_search_path.write_text("\n")  # as the kernel shows an unset path
    return r


def tree(root: HostRoot, instance: str, blobs: dict[str, bytes]) -> tuple[Path, dict[str, str]]:
    """A store tree with these firmware files; (its path, name -> sha256)."""
    t = store.tree(root, instance, "1.0", "6.1.0")
    for name, data in blobs.items():
        path = t / store.FIRMWARE / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return t, {n: hashlib.sha256(d).hexdigest() for n, d in blobs.items()}


def everyone(_name: str) -> bool:
    return True


def installed(root: HostRoot) -> dict[str, bytes]:
    base = root.firmware_dir
    return {
        p.relative_to(base).as_posix(): p.read_bytes()
        for p in sorted(base.rglob("*"))
        if p.is_file()
    }


def owners(root: HostRoot) -> dict[str, list[str]]:
    data = json.loads(root.firmware_owners.read_text())
    return {n: e["owners"] for n, e in data["files"].items()}


def test_install_sets_the_search_path_and_records_the_owner(root: HostRoot) -> None:
    t, want = tree(root, "a", {"vendor/fw.bin": b"AAAA", "top.bin": b"T"})
    assert not firmware.current(root, "a", want)
    firmware.sync(root, "a", t, want, everyone)
    assert installed(root) == {"top.bin": b"T", "vendor/fw.bin": b"AAAA"}
    assert root.firmware_search_path.read_text() == FW
    assert owners(root) == {"top.bin": ["a"], "vendor/fw.bin": ["a"]}
    assert oct(os.stat(root.firmware_dir / "top.bin").st_mode & 0o777) == "0o644"
    assert firmware.current(root, "a", want)


def test_the_same_file_with_the_same_content_is_shared(root: HostRoot) -> None:
    ta, want = tree(root, "a", {"fw.bin": b"same"})
    tb, _ = tree(root, "b", {"fw.bin": b"same"})
    firmware.sync(root, "a", ta, want, everyone)
    firmware.sync(root, "b", tb, want, everyone)
    assert owners(root) == {"fw.bin": ["a", "b"]}
    assert firmware.sync(root, "a", None, {}, everyone) == []  # b still ships it
    assert installed(root) == {"fw.bin": b"same"} and owners(root) == {"fw.bin": ["b"]}
    assert firmware.sync(root, "b", None, {}, everyone) == ["fw.bin"]
    assert installed(root) == {} and owners(root) == {}


def test_the_same_name_with_other_content_is_refused_before_anything_changes(
    root: HostRoot,
) -> None:
    ta, want_a = tree(root, "a", {"fw.bin": b"from a"})
    tb, want_b = tree(root, "b", {"fw.bin": b"from b", "b-only.bin": b"B"})
    firmware.sync(root, "a", ta, want_a, everyone)
    with pytest.raises(StepFailed) as exc:
        firmware.sync(root, "b", tb, want_b, everyone)
    assert exc.value.code == state.FIRMWARE_CONFLICT
    sha_a, sha_b = want_a["fw.bin"][:12], want_b["fw.bin"][:12]
    assert str(exc.value) == (
        f"FirmwareConflict: fw.bin: a ships it with sha256 {sha_a}, b with {sha_b}: one file "
        f"name, one content, in {root.firmware_dir}"
    )
    assert installed(root) == {"fw.bin": b"from a"} and owners(root) == {"fw.bin": ["a"]}


def test_a_file_kvcd_did_not_put_there_is_refused(root: HostRoot) -> None:
    t, want = tree(root, "a", {"fw.bin": b"ours"})
    root.firmware_dir.mkdir(parents=True)
    (root.firmware_dir / "fw.bin").write_bytes(b"someone's")
    with pytest.raises(StepFailed) as exc:
        firmware.sync(root, "a", t, want, everyone)
    assert exc.value.code == state.FIRMWARE_CONFLICT
    assert f"{root.firmware_dir}/fw.bin is not kvcd's" in str(exc.value)
    assert (root.firmware_dir / "fw.bin").read_bytes() == b"someone's"


def test_a_name_in_the_way_of_another_instances_directory_is_refused(root: HostRoot) -> None:
    ta, want_a = tree(root, "a", {"vendor/fw.bin": b"A"})
    tb, want_b = tree(root, "b", {"vendor": b"B"})
    firmware.sync(root, "a", ta, want_a, everyone)
    with pytest.raises(StepFailed) as exc:
        firmware.sync(root, "b", tb, want_b, everyone)
    assert "vendor: a's vendor/fw.bin is in its way" in str(exc.value)


def test_a_new_version_replaces_and_releases_what_the_old_one_shipped(root: HostRoot) -> None:
    t1, want1 = tree(root, "a", {"old.bin": b"1", "kept.bin": b"k", "sub/x.bin": b"x"})
    firmware.sync(root, "a", t1, want1, everyone)
    t2 = store.tree(root, "a", "2.0", "6.1.0")
    for name, data in {"kept.bin": b"k2", "new.bin": b"2"}.items():
        (t2 / store.FIRMWARE).mkdir(parents=True, exist_ok=True)
        (t2 / store.FIRMWARE / name).write_bytes(data)
    want2 = {
        n: hashlib.sha256(d).hexdigest() for n, d in {"kept.bin": b"k2", "new.bin": b"2"}.items()
    }
    assert firmware.sync(root, "a", t2, want2, everyone) == ["old.bin", "sub/x.bin"]
    assert installed(root) == {"kept.bin": b"k2", "new.bin": b"2"}
    assert not (root.firmware_dir / "sub").exists()  # the directory it left empty went too


def test_an_instance_no_longer_configured_loses_its_files(root: HostRoot) -> None:
    ta, want_a = tree(root, "a", {"a.bin": b"A", "shared.bin": b"S"})
    tb, want_b = tree(root, "b", {"shared.bin": b"S"})
    firmware.sync(root, "a", ta, want_a, everyone)
    firmware.sync(root, "b", tb, want_b, everyone)
    released = firmware.sync(root, "b", tb, want_b, lambda name: name != "a")
    assert released == ["a.bin"]
    assert installed(root) == {"shared.bin": b"S"} and owners(root) == {"shared.bin": ["b"]}


@pytest.mark.parametrize(
    ("value", "written", "problem"),
    [
        pytest.param("\n", FW, None, id="unset: kvcd sets it"),
        pytest.param(FW + "\n", FW + "\n", None, id="already kvcd's (kernel argument)"),
        pytest.param(
            "/var/lib/firmware\n",
            "/var/lib/firmware\n",
            "FirmwarePath: the kernel's firmware search path (firmware_class.path) is "
            f"/var/lib/firmware, not {FW}: kvcd does not take it over; boot with "
            f"firmware_class.path={FW}, or move what /var/lib/firmware holds there",
            id="another directory: refused",
        ),
        pytest.param(
            None,
            None,
            "FirmwarePath: this kernel has no firmware search path",
            id="no firmware_class: refused",
        ),
    ],
)
def test_the_kernel_search_path_is_taken_only_when_free(
    root: HostRoot, value: str | None, written: str | None, problem: str | None
) -> None:
    if value is None:
        root.firmware_search_path.unlink()
    else:
        root.firmware_search_path.write_text(value)
    t, want = tree(root, "a", {"fw.bin": b"F"})
    if problem is None:
        firmware.sync(root, "a", t, want, everyone)
        assert installed(root) == {"fw.bin": b"F"}
    else:
        with pytest.raises(StepFailed) as exc:
            firmware.sync(root, "a", t, want, everyone)
        assert str(exc.value).startswith(problem)
        assert not root.firmware_dir.exists() and not root.firmware_owners.exists()
    if written is not None:
        assert root.firmware_search_path.read_text() == written


def test_a_search_path_the_sandbox_will_not_let_kvcd_write_is_said(
    root: HostRoot, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_open = open

    def read_only(path: Any, mode: str = "r", *a: Any, **kw: Any) -> Any:
        if Path(path) == root.firmware_search_path and "w" in mode:
            raise OSError(30, "Read-only file system", str(path))
        return real_open(path, mode, *a, **kw)

    monkeypatch.setattr("builtins.open", read_only)
    t, want = tree(root, "a", {"fw.bin": b"F"})
    with pytest.raises(StepFailed) as exc:
        firmware.sync(root, "a", t, want, everyone)
    assert str(exc.value) == (
        f"FirmwarePath: cannot set the kernel's firmware search path "
        f"{root.firmware_search_path} to {FW}: Read-only file system"
    )


def test_a_store_file_that_changed_is_not_installed(root: HostRoot) -> None:
    t, want = tree(root, "a", {"fw.bin": b"good"})
    (t / store.FIRMWARE / "fw.bin").write_bytes(b"evil")
    with pytest.raises(StepFailed) as exc:
        firmware.sync(root, "a", t, want, everyone)
    assert exc.value.code == state.DRIFT
    assert not (root.firmware_dir / "fw.bin").exists()
    assert [p.name for p in root.firmware_dir.iterdir()] == []  # no temporary file left


def test_a_symlink_in_the_firmware_directory_is_refused_not_followed(
    root: HostRoot, tmp_path: Path
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    root.firmware_dir.mkdir(parents=True)
    (root.firmware_dir / "vendor").symlink_to(outside)
    t, want = tree(root, "a", {"vendor/fw.bin": b"F"})
    with pytest.raises(files.Refused):
        firmware.sync(root, "a", t, want, everyone)
    assert list(outside.iterdir()) == []
    # The same content already there, behind the link: not taken as installed either.
    (outside / "fw.bin").write_bytes(b"F")
    with pytest.raises(files.Refused):
        firmware.sync(root, "a", t, want, everyone)


@pytest.mark.parametrize(
    "text",
    [
        "not json",
        '{"files": []}',
        '{"files": {"../x": {"sha256": "0", "size": 1, "owners": ["a"]}}}',
        '{"files": {"x": {"sha256": "0", "size": 1, "owners": ["../a"]}}}',
        '{"files": {"x": {"sha256": "0", "size": true, "owners": ["a"]}}}',
    ],
)
def test_a_damaged_owners_table_is_said_and_kept(root: HostRoot, text: str) -> None:
    root.firmware_owners.parent.mkdir(parents=True)
    root.firmware_owners.write_text(text)
    t, want = tree(root, "a", {"fw.bin": b"F"})
    for call in (
        lambda: firmware.current(root, "a", want),
        lambda: firmware.sync(root, "a", t, want, everyone),
    ):
        with pytest.raises(StepFailed) as exc:
            call()
        assert exc.value.code == state.STATE_DAMAGED
        assert str(root.firmware_owners) in str(exc.value)
    assert root.firmware_owners.read_text() == text


@pytest.mark.parametrize(
    ("name", "ok"),
    [
        ("fw.bin", True),
        ("vendor/sub/fw-1.2.bin", True),
        ("", False),
        ("/abs", False),
        ("a/../b", False),
        ("a//b", False),
        ("./a", False),
        ("a\nb", False),
        ("x" * 256, False),
    ],
)
def test_firmware_names_are_what_the_kernel_can_ask_for(name: str, ok: bool) -> None:
    assert store.tree_name(name) is ok


# --- through the instance: extracted with the modules, installed before they load ------------


class FirmwarePodman(FakePodman):
    """FakePodman whose images ship firmware under /firmware: version -> files."""

    shipped: dict[str, dict[str, bytes]] = {}  # noqa: RUF012 (set per test)

    def extract(self, ref: str, path: str, dest: Path, patterns: Any = (), **kw: Any) -> list[Path]:
        if tuple(patterns) != ("*",):
            return super().extract(ref, path, dest, patterns)
        self.calls.append(("extract-firmware", (ref, path)))
        blobs = self.shipped[ref.split(":", 1)[0].rsplit("/", 1)[-1]]
        out = []
        for name, data in blobs.items():
            p = dest / name
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(data)
            out.append(p)
        return out


@pytest.fixture
def host(tmp_path: Path, fake_commands: Any, monkeypatch: pytest.MonkeyPatch) -> HostRoot:
    root = instance_host(tmp_path, fake_commands, monkeypatch)
    root.firmware_search_path.parent.mkdir(parents=True)
    root.firmware_search_path.write_text("\n")
    fakehost.write_config(root, "e2e", 'version = "1.0"\nmodules = ["kvcd_base"]\nimage = "x"\n')
    return root


def test_an_instance_installs_its_firmware_before_its_modules_load(
    host: HostRoot, fake_commands: Any
) -> None:
    pod = FirmwarePodman(host, K)
    pod.shipped = {"1.0": {"vendor/fw.bin": b"v1"}}
    seen: list[bool] = []
    real = kmod.load

    def load(*a: Any, **kw: Any) -> Any:  # what the module would find at its init
        seen.append((host.firmware_dir / "vendor/fw.bin").is_file())
        return real(*a, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kmod, "load", load)
        rec = instance(host, pod, "1.0", firmware_path="/firmware").apply("load")
    assert rec.state == state.DONE and seen == [True, True]
    assert ("extract-firmware", (f"localhost/kvcd/e2e/1.0:{K}", "/firmware")) in pod.calls
    manifest = store.read_manifest(store.tree(host, "e2e", "1.0", K))
    assert manifest is not None
    assert manifest.firmware == {"vendor/fw.bin": hashlib.sha256(b"v1").hexdigest()}
    assert installed(host) == {"vendor/fw.bin": b"v1"}
    assert host.firmware_search_path.read_text() == FW
    # A second start finds it all in place: nothing to do.
    plan = instance(host, pod, "1.0", firmware_path="/firmware").plan("load")
    assert plan.describe() == ["verify kvcd_base, kvcd_user loaded"]
    entry = status.collect(host, "e2e")[0]
    assert entry["firmware"] == {"dir": FW, "files": ["vendor/fw.bin"], "search_path": FW}
    assert f"  firmware: 1 file(s) in {FW} (the kernel searches it)" in status.render([entry])


def test_a_failed_upgrade_puts_the_previous_versions_firmware_back(host: HostRoot) -> None:
    pod = FirmwarePodman(host, K)
    pod.shipped = {"1.0": {"fw.bin": b"v1"}, "2.0": {"fw.bin": b"v2", "new.bin": b"n"}}
    instance(host, pod, "1.0", firmware_path="/firmware").apply("load")
    (host.root / "fail-load").write_text("kvcd_user\n")
    with pytest.raises(StepFailed) as err:
        instance(host, pod, "2.0", firmware_path="/firmware").apply("load")
    assert "firmware restored" in err.value.detail
    assert installed(host) == {"fw.bin": b"v1"}
    assert owners(host) == {"fw.bin": ["e2e"]}


def test_dropping_firmware_path_releases_the_files_and_purge_removes_them(
    host: HostRoot,
) -> None:
    pod = FirmwarePodman(host, K)
    pod.shipped = {"1.0": {"fw.bin": b"v1"}}
    instance(host, pod, "1.0", firmware_path="/firmware").apply("load")
    assert instance(host, pod, "1.0").apply("load").state == state.DONE
    assert installed(host) == {} and owners(host) == {}
    instance(host, pod, "1.0", firmware_path="/firmware").apply("load")
    assert purge.purge(host, "e2e", podman=lambda: pod) == []
    assert installed(host) == {} and owners(host) == {}


def test_a_version_extracted_before_firmware_path_was_set_is_extracted_again(
    host: HostRoot,
) -> None:
    pod = FirmwarePodman(host, K)
    pod.shipped = {"1.0": {"fw.bin": b"v1"}}
    instance(host, pod, "1.0").apply("load")
    steps = instance(host, pod, "1.0", firmware_path="/firmware").plan("load").describe()
    assert any(s.startswith("extract ") and "the firmware under /firmware" in s for s in steps), (
        steps
    )
    # and its modules go out and in again, to find their firmware when they initialise
    assert "unload kvcd_user and verify it is gone" in steps
    assert instance(host, pod, "1.0", firmware_path="/firmware").apply("load").state == state.DONE
    assert installed(host) == {"fw.bin": b"v1"}
