"""What the podman rooms share: the image labels kvcd sets, the errors (PodmanUnavailable is
transient, PodmanError permanent for its input), ImageInfo and the BuildSpec of a build."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any, Protocol

DEFAULT_URL = "unix:///run/podman/podman.sock"

INSTANCE_LABEL = "io.kvcd.instance"
VERSION_LABEL = "io.kvcd.version"
KERNEL_LABEL = "io.kvcd.kernel"
# On extraction containers: their role, and the pid of the kvcd process that created them.
EXTRACT_ROLE_LABEL = "io.kvcd.role"
EXTRACT_PID_LABEL = "io.kvcd.pid"

MODULE_PATTERNS: tuple[str, ...] = ("*.ko", "*.ko.xz", "*.ko.gz", "*.ko.zst")
TARBALL_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.xz", ".tar.bz2", ".tar.zst")

TAIL_LINES = 20  # of a failed build's output, in its reason
IMAGE_ID = re.compile(r"^(?:sha256:)?([0-9a-f]{64})$")
CHUNK = 1 << 16


class PodmanUnavailable(Exception):
    """The podman API did not answer (socket missing, refused, timed out): retry later."""


class PodmanError(Exception):
    """The podman API answered but the operation failed: permanent for this input."""


class PodmanTimedOut(PodmanError):
    """A pull, build or image load ran past its time limit, and kvcd disconnected (podman
    abandons a build whose client went away once its current step ends)."""


class ImageInUse(PodmanError):
    """An image cannot be removed because a container uses it."""


@dataclass(frozen=True)
class ImageInfo:
    """One image in the store. ``created`` is seconds since the epoch (sub-second precision)."""

    id: str
    tags: tuple[str, ...]
    labels: Mapping[str, str]
    created: float

    @property
    def instance(self) -> str | None:
        return self.labels.get(INSTANCE_LABEL)

    @property
    def version(self) -> str | None:
        return self.labels.get(VERSION_LABEL)

    @property
    def kernel(self) -> str | None:
        return self.labels.get(KERNEL_LABEL)


@dataclass(frozen=True)
class BuildSpec:
    """What to build.

    ``context`` is one of: a local directory; a local tarball (``.tar``, ``.tar.gz``, ``.tgz``,
    ``.tar.xz``, ``.tar.bz2``, ``.tar.zst``), sent as is; an ``https://`` git URL whose path ends
    in ``.git`` (optionally ``#ref``, passed to buildah as is), cloned by the podman service
    (which needs ``git`` on its host); or an ``https://`` URL of a tarball, which the service
    downloads.
    ``containerfile`` is relative to the context root; for a local directory it may also be an
    absolute path anywhere (it is then sent along with the context). ``tag`` is set only when
    the build succeeded. kvcd passes KVER and KMODVER in ``build_args`` and the ``io.kvcd.*``
    labels in ``labels``.
    """

    context: str
    containerfile: str
    tag: str
    build_args: Mapping[str, str] = field(default_factory=dict)
    labels: Mapping[str, str] = field(default_factory=dict)


class PodmanApi(Protocol):
    """What kvcd asks of the podman service: kvcd.host.podman.Podman does it in this process,
    kvcd.host.podchild.PodmanChild in a helper process (the daemon's, so that podman-py and
    requests never stay resident in it)."""

    def ping(self) -> None: ...

    def get_image(self, ref: str) -> ImageInfo | None: ...

    def list_instance_images(self, instance: str) -> list[ImageInfo]: ...

    def pull(
        self, ref: str, tag: str, *, auth: str | None = None, tls_verify: bool = True
    ) -> ImageInfo: ...

    def tag(self, image_id: str, ref: str, *, untag: bool = False) -> None: ...

    def load(self, archive: IO[bytes], name: str) -> ImageInfo: ...

    def build(self, spec: BuildSpec, on_line: Callable[[str], None]) -> ImageInfo: ...

    def extract(
        self,
        image_ref: str,
        path_in_image: str,
        dest_dir: str | os.PathLike[str],
        patterns: Sequence[str] = MODULE_PATTERNS,
        kind: str = "kernel module",
    ) -> list[Path]: ...

    def remove_image(self, image_id: str) -> None: ...

    def gc(self, instance: str, keep: int, protect: Collection[str] = ()) -> list[ImageInfo]: ...

    def close(self) -> object: ...  # (what it returns is its own business)


def image_info(data: Mapping[str, Any]) -> ImageInfo:
    """An image as the API's inspect or list answer describes it."""
    labels = data.get("Labels") or (data.get("Config") or {}).get("Labels") or {}
    return ImageInfo(
        id=str(data["Id"]).removeprefix("sha256:"),
        tags=tuple(data.get("RepoTags") or ()),
        labels=dict(labels),
        created=timestamp(data.get("Created")),
    )


def timestamp(value: object) -> float:
    """RFC 3339 with nanoseconds (inspect) or integer seconds (list) -> epoch seconds."""
    if isinstance(value, (int, float)):
        return float(value)
    if not isinstance(value, str) or not value:
        return 0.0
    match = re.match(r"^(.*T\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)$", value)
    if not match:
        return 0.0
    base, frac, zone = match.groups()
    stamp = datetime.fromisoformat(base + ("+00:00" if zone == "Z" else zone))
    return stamp.replace(tzinfo=stamp.tzinfo or timezone.utc).timestamp() + float(f"0.{frac or 0}")


def split_ref(ref: str) -> tuple[str, str]:
    """``registry:5000/repo/name:tag`` -> (``registry:5000/repo/name``, ``tag``)."""
    if "@" in ref:
        raise PodmanError(f"cannot tag an image as {ref!r}: a digest is not a tag")
    colon, slash = ref.rfind(":"), ref.rfind("/")
    if colon > slash:
        return ref[:colon], ref[colon + 1 :]
    return ref, "latest"


def protected(info: ImageInfo, protect: Collection[str]) -> bool:
    for item in protect:
        ref = item.removeprefix("sha256:")
        if ref == info.id or (len(ref) >= 12 and info.id.startswith(ref)) or item in info.tags:
            return True
    return False
