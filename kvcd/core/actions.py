"""The steps a plan is made of. Each describes itself for `--dry-run` and logs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union


@dataclass(frozen=True)
class AcquireImage:
    """Make `tag` exist: load `archive` if given (pinned: nothing else); else pull `pull_ref`
    if given, else (or if that fails) build from `context`."""

    tag: str
    pull_ref: str | None
    context: str | None
    archive: str | None = None

    def describe(self) -> str:
        if self.archive:
            return f"load {self.archive} as {self.tag}"
        if self.pull_ref and self.context:
            return (
                f"pull {self.pull_ref} as {self.tag} (build from {self.context} if the pull fails)"
            )
        if self.pull_ref:
            return f"pull {self.pull_ref} as {self.tag}"
        return f"build {self.tag} from {self.context}"


@dataclass(frozen=True)
class Extract:
    """Copy the module files of `tag` (at path_in_image), and the files under firmware_path
    when it is set, into the store for version/kernel."""

    tag: str
    path_in_image: str
    version: str
    kernel: str
    firmware_path: str = ""

    def describe(self) -> str:
        where = f"({self.version}, {self.kernel})"
        also = f" and the firmware under {self.firmware_path}" if self.firmware_path else ""
        return f"extract {self.path_in_image}{also} of {self.tag} into the store {where}"


@dataclass(frozen=True)
class Activate:
    """Point the module root's extra/<instance> at the stored version and run depmod."""

    version: str
    kernel: str
    # The kernel's own module directory when it is not where the host keeps them (a staged
    # rpm-ostree deployment's, for a kernel prepared ahead); "" = root.system_modules(kernel).
    modules_dir: str = ""

    def describe(self) -> str:
        return (
            f"activate version {self.version} in the module root for {self.kernel} and run depmod"
        )


@dataclass(frozen=True)
class SyncFirmware:
    """Make the node's firmware directory hold exactly the firmware files of the stored
    `version` for the instance (none: what it owned is released), and the kernel's firmware
    search path point at it."""

    version: str
    kernel: str

    def describe(self) -> str:
        return f"install the firmware of version {self.version} into kvcd's firmware directory"


@dataclass(frozen=True)
class Load:
    module: str
    params: tuple[tuple[str, str], ...] = ()

    def describe(self) -> str:
        args = "".join(f" {k}={v}" for k, v in self.params)
        return f"load {self.module}{args} and verify it in /sys/module"


@dataclass(frozen=True)
class Unload:
    module: str

    def describe(self) -> str:
        return f"unload {self.module} and verify it is gone"


@dataclass(frozen=True)
class RemoveInTree:
    """Keep `modules` from loading (a modprobe.d file) and unload those in `loaded`, in order."""

    modules: tuple[str, ...]
    loaded: tuple[str, ...]

    def describe(self) -> str:
        out = f"keep in-tree {', '.join(self.modules)} from loading"
        return out + (f"; unload {', '.join(self.loaded)}" if self.loaded else "")


@dataclass(frozen=True)
class RestoreInTree:
    """Let the in-tree modules load again, and load `load` (those kvcd removed) in that order."""

    load: tuple[str, ...]

    def describe(self) -> str:
        out = "let the in-tree modules load again"
        return out + (f"; load {', '.join(self.load)}" if self.load else "")


@dataclass(frozen=True)
class Hook:
    """Call a function of the instance's KVC <name>-lib.sh (root-owned code) in bash."""

    function: str

    def describe(self) -> str:
        return f"run {self.function} from the instance's KVC library"


@dataclass(frozen=True)
class Verify:
    """Check /sys/module: every module loaded (loaded=True) or none of them (False)."""

    modules: tuple[str, ...]
    loaded: bool

    def describe(self) -> str:
        what = "loaded" if self.loaded else "gone"
        return f"verify {', '.join(self.modules)} {what}"


@dataclass(frozen=True)
class CollectImages:
    keep: int

    def describe(self) -> str:
        return f"remove all but the newest {self.keep} images of this instance"


Action = Union[
    AcquireImage,
    Extract,
    Activate,
    SyncFirmware,
    Load,
    Unload,
    RemoveInTree,
    RestoreInTree,
    Hook,
    Verify,
    CollectImages,
]
