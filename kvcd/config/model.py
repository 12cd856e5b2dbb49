"""The validated shape of an instance. Everything downstream takes these, never raw dicts."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvcd.core.types import ModuleSpec

__all__ = ["BuildSource", "ConfigError", "InstanceConfig", "ModuleSpec", "Settings", "tag_safe"]


class ConfigError(Exception):
    """A config file is wrong. The message names the file, the line when known, and the key."""

    def __init__(self, path: Path | str, message: str, line: int | None = None) -> None:
        self.path = Path(path)
        self.line = line
        self.detail = message
        where = f"{self.path}:{line}" if line else str(self.path)
        super().__init__(f"{where}: {message}")


@dataclass(frozen=True)
class BuildSource:
    """Where the driver image comes from when it has to be built."""

    context: str  # local directory, https:// git URL, or tarball (path or https URL)
    containerfile: str = "Containerfile"
    args: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class InstanceConfig:
    name: str
    source: Path  # the file it was read from
    version: str
    modules: tuple[ModuleSpec, ...]
    build: BuildSource | None = None
    # A prebuilt image to pull first, with {kernel} and {version} placeholders.
    image: str | None = None
    # Where the module files sit inside the image; {kernel} is replaced.
    modules_path: str = "/lib/modules/{kernel}/"
    unload_on_stop: bool = True
    keep_images: int = 3
    wrapper_args: tuple[str, ...] = ()
    # KVC compatibility: the root-owned hook library, when the instance has one.
    kvc_lib: Path | None = None
    # Other assignments of a KVC .conf, handed to the hooks' environment as data.
    kvc_env: tuple[tuple[str, str], ...] = ()
    format: str = "toml"  # "toml" or "kvc"

    def image_ref(self, kernel: str) -> str | None:
        if self.image is None:
            return None
        return self.image.replace("{kernel}", kernel).replace("{version}", self.version)

    def image_tag(self, kernel: str) -> str:
        """kvcd's own local tag: kvcd-<instance>-<version>:<kernel, tag-safe>."""
        return f"localhost/kvcd-{tag_safe(self.name)}-{tag_safe(self.version)}:{tag_safe(kernel)}"

    def path_in_image(self, kernel: str) -> str:
        return self.modules_path.replace("{kernel}", kernel)

    def kvc_vars(self) -> tuple[tuple[str, str], ...]:
        """The KMOD_* variables KVC libraries read, then the rest of the .conf, as data."""
        typed = [
            ("KMOD_SOFTWARE_VERSION", self.version),
            ("KMOD_NAMES", " ".join(m.name for m in self.modules)),
        ]
        if self.build is not None:
            typed += [
                ("KMOD_CONTAINER_BUILD_CONTEXT", self.build.context),
                ("KMOD_CONTAINER_BUILD_FILE", self.build.containerfile),
            ]
        return (*typed, *self.kvc_env)


@dataclass(frozen=True)
class Settings:
    """Node-wide settings from /etc/kvcd/kvcd.toml (vendor defaults under /usr/lib/kvcd)."""

    podman_socket: str = "unix:///run/podman/podman.sock"
    annotation_prefix: str = "kvcd.io"
    extra: dict[str, str] = field(default_factory=dict)


_TAG_OK = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")


def tag_safe(text: str) -> str:
    """Make text usable as an image name part or tag: lower-case for names, others -> '_'.

    Tags allow [A-Za-z0-9_.-] up to 128 characters and must not start with '.' or '-'.
    """
    out = "".join(c if c in _TAG_OK else "_" for c in text)
    if out[:1] in {".", "-"}:
        out = "_" + out[1:]
    return out.lower()[:128]
