"""The module store: one tree of extracted module files per instance, version and kernel
(`/var/lib/kvcd/modules/<instance>/<version>/<kernel>/`, DESIGN.md "Module root"), each with its
manifest `.kvcd-manifest.json`. The one room that knows this layout and the manifest's fields;
everyone else reads a typed Manifest.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvcd.host import files
from kvcd.host.paths import HostRoot

if TYPE_CHECKING:  # typing.TypeGuard: Python 3.10
    from typing import TypeGuard

log = logging.getLogger(__name__)

MANIFEST = ".kvcd-manifest.json"
# The firmware files an image ships (firmware_path), beside its modules in the tree: linked
# for a next kernel with them and watched for drift with them. depmod reads only .ko files.
FIRMWARE = ".kvcd-firmware"


@dataclass(frozen=True)
class StoredModule:
    """One module file of a tree, as extracted (or hard-linked there from another kernel's)."""

    file: str  # relative to the tree
    sha256: str | None = None
    mode: int | None = None
    srcversion: str | None = None
    version: str | None = None
    vermagic: str | None = None
    # Who signed the file as extracted (or signed by kvcd), as modinfo reads it back.
    signer: str | None = None
    sig_key: str | None = None
    sig_hash: str | None = None


@dataclass(frozen=True)
class Manifest:
    version: str
    kernel: str
    image: str = ""
    modules: dict[str, StoredModule] = field(default_factory=dict)  # kernel name -> file
    # The running kernel whose extraction was hard-linked here because it passed the kABI
    # check for this one ("": extracted for this kernel).
    weak_updates_from: str = ""
    # Firmware files, relative to the tree's FIRMWARE directory (the name the kernel asks
    # for) -> sha256.
    firmware: dict[str, str] = field(default_factory=dict)

    def files(self, tree: Path) -> list[Path]:
        """The tree's module files, in module-name order."""
        return [tree / m.file for _, m in sorted(self.modules.items())]

    def firmware_files(self, tree: Path) -> list[Path]:
        return [tree / FIRMWARE / rel for rel in sorted(self.firmware)]

    def entries(self) -> dict[str, dict[str, Any]]:
        """What drift expects of the tree: relative path -> {sha256, mode}."""
        out = {m.file: {"sha256": m.sha256, "mode": m.mode} for m in self.modules.values()}
        for rel, sha in self.firmware.items():
            out[f"{FIRMWARE}/{rel}"] = {"sha256": sha, "mode": 0o644}
        return out

    def srcversions(self) -> dict[str, str]:
        return {name: m.srcversion for name, m in self.modules.items() if m.srcversion}

    def modversions(self) -> dict[str, str]:
        return {name: m.version for name, m in self.modules.items() if m.version}

    def linked_for(self, kernel: str, running: str) -> Manifest:
        """This manifest for a tree of `kernel` made of hard links to this one's files."""
        return replace(self, kernel=kernel, weak_updates_from=running)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        if not self.weak_updates_from:
            del data["weak_updates_from"]
        if not self.firmware:
            del data["firmware"]
        return data

    @classmethod
    def from_json(cls, data: object) -> Manifest | None:
        """The manifest in `data`; None when it is not one (a field missing or of the wrong
        type: the tree is treated as incomplete and extracted again)."""
        if not isinstance(data, dict):
            return None
        head = (data.get("version"), data.get("kernel"), data.get("image", ""))
        weak = data.get("weak_updates_from", "")
        mods = data.get("modules", {})
        if not all(isinstance(v, str) for v in (*head, weak)) or not isinstance(mods, dict):
            return None
        firmware = data.get("firmware", {})
        if not isinstance(firmware, dict) or not all(
            tree_name(k) and isinstance(v, str) for k, v in firmware.items()
        ):
            return None
        modules = {}
        for name, info in mods.items():
            module = _module(info)
            if module is None:
                return None
            modules[str(name)] = module
        version, kernel, image = head
        return cls(version, kernel, image, modules, weak, firmware)  # type: ignore[arg-type]


def tree_name(name: object) -> TypeGuard[str]:
    """A file's name in a store tree (a module file) or under the firmware directory (as the
    kernel asks for it): relative, no '.' or '..' part, no control character (a path under
    the tree, and a journal field)."""
    if not isinstance(name, str) or not name or name.startswith("/") or len(name) > 255:
        return False
    parts = name.split("/")
    return all(p not in ("", ".", "..") for p in parts) and all(ord(c) >= 32 for c in name)


_OPTIONAL_STR = ("sha256", "srcversion", "version", "vermagic", "signer", "sig_key", "sig_hash")


def _module(info: object) -> StoredModule | None:
    # Once per module file on every parse: a plain loop, not a generator, and no keywords.
    if not isinstance(info, dict):
        return None
    get = info.get
    file = get("file")
    if not tree_name(file):  # never a path out of the tree (absolute, '..'): a damaged manifest
        return None
    for k in _OPTIONAL_STR:
        v = get(k)
        if v is not None and not isinstance(v, str):
            return None
    mode = get("mode")
    if mode is not None and (not isinstance(mode, int) or isinstance(mode, bool)):
        return None
    return StoredModule(  # by position, in the fields' order (test_store checks each field)
        file,
        get("sha256"),
        mode,
        get("srcversion"),
        get("version"),
        get("vermagic"),
        get("signer"),
        get("sig_key"),
        get("sig_hash"),
    )


def digest(path: Path) -> str:
    """The sha256 of a module file kvcd extracted (never a FIFO: files.open_regular)."""
    return files.sha256_regular(str(path), bytearray(1 << 16))[0]


def tree(root: HostRoot, instance: str, version: str, kernel: str) -> Path:
    """The store tree of `instance`'s `version` for `kernel`."""
    return root.store(instance) / _version_dir(version) / kernel


def _version_dir(version: str) -> str:
    """A version's directory name: lower case, '+' and '~' as '_' (the image tag's rule when
    the store was made; kept so existing trees are found). Versions this folds together share
    a directory; its manifest names the one extracted there, and the plan compares it."""
    return "".join("_" if c in "+~" else c for c in version).lower()


def trees(root: HostRoot, instance: str) -> list[Path]:
    """Every tree of the instance (complete or not; not the staging directories, whose names
    start with a dot), sorted."""
    base = root.store(instance)
    found: list[Path] = []
    with contextlib.suppress(FileNotFoundError):
        for vdir in sorted(p for p in base.iterdir() if p.is_dir()):
            found.extend(
                k for k in sorted(vdir.iterdir()) if k.is_dir() and not k.name.startswith(".")
            )
    return found


# Manifests parsed, by tree: the bytes each was parsed from, and the parse.
Parsed = dict[Path, tuple[bytes, Manifest]]


def read_manifest(directory: Path, known: Parsed | None = None) -> Manifest | None:
    """The manifest of the tree `directory`; None when there is none or it is not whole (the
    plan then extracts the tree again). With `known`, the file is still read every time, but
    parsed only when its bytes are not those of the manifest remembered there."""
    path = directory / MANIFEST
    try:
        raw = files.read_bytes(path)
        if raw is None:
            return None
        hit = known.get(directory) if known is not None else None
        if hit is not None and hit[0] == raw:
            return hit[1]
        data = files.parse_json(path, raw)
    except files.Damaged as exc:
        log.warning("%s", exc)
        return None
    manifest = Manifest.from_json(data)
    if manifest is None:
        log.warning("%s: not a store manifest; the tree is extracted again", path)
    elif known is not None:
        known[directory] = (raw, manifest)
    return manifest


def write_manifest(directory: Path, manifest: Manifest) -> None:
    files.write_json(directory / MANIFEST, manifest.to_json())


def stored_versions(root: HostRoot, instance: str, kernel: str) -> dict[str, Manifest]:
    """version -> manifest, for every complete extraction of this instance for `kernel`."""
    out: dict[str, Manifest] = {}
    base = root.store(instance)
    if not base.is_dir():
        return out
    for vdir in sorted(base.iterdir()):
        manifest = read_manifest(vdir / kernel)
        if manifest is not None:
            out[manifest.version] = manifest
    return out


def newest_manifests(root: HostRoot, instance: str) -> Iterator[tuple[Path, Manifest]]:
    """Every tree of the instance with its manifest, the most recently written first (read
    one at a time: a caller that wants the newest reads one)."""
    base = root.store(instance)
    found = sorted(
        (path.stat().st_mtime_ns, path) for path in base.glob(f"*/*/{MANIFEST}") if path.is_file()
    )
    for _, path in reversed(found):
        manifest = read_manifest(path.parent)
        if manifest is not None:
            yield path.parent, manifest
