"""A podman build request: what kind of context it is (directory, tarball, git, remote
tarball), its parameters and body, and the build log turned into lines."""

from __future__ import annotations

import collections
import json
import logging
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path, PurePosixPath
from typing import IO, Any

from kvcd.host.podtypes import (
    IMAGE_ID,
    TAIL_LINES,
    TARBALL_SUFFIXES,
    BuildSpec,
    PodmanError,
)
from kvcd.host.tarstream import (
    file_chunks,
    tar_directory,
)

log = logging.getLogger(__name__)


def context_kind(context: str) -> str:
    """``"dir"``, ``"tarball"``, ``"git"`` or ``"url"`` (a remote tarball); PodmanError if the
    context is none of the kinds BuildSpec allows."""
    if "://" in context:
        if context.startswith(("git://", "git+https://")):
            return "git"
        if not context.startswith("https://"):
            raise PodmanError(
                f"build context {context!r}: only https://, git:// and git+https:// URLs "
                "are accepted"
            )
        url_path = context.split("#", 1)[0].split("?", 1)[0]
        if url_path.endswith(".git"):
            return "git"
        if url_path.endswith(TARBALL_SUFFIXES):
            return "url"
        raise PodmanError(
            f"build context {context!r}: a URL must be a git repository (path ending in .git) "
            f"or a tarball ({', '.join(TARBALL_SUFFIXES)})"
        )
    path = Path(context)
    if path.is_dir():
        return "dir"
    if path.is_file() and path.name.endswith(TARBALL_SUFFIXES):
        return "tarball"
    if not path.exists():
        raise PodmanError(f"build context {context} does not exist")
    raise PodmanError(f"build context {context} is neither a directory nor a tarball")


def build_request(
    spec: BuildSpec, kind: str
) -> tuple[dict[str, Any], Iterator[bytes], IO[bytes] | None]:
    """The query, the body's chunks and the file to close after sending."""
    params: dict[str, Any] = {
        "dockerfile": spec.containerfile,
        "buildargs": json.dumps(dict(spec.build_args)),
        "labels": json.dumps(dict(spec.labels)),
        "rm": True,
        "forcerm": True,  # no intermediate containers left behind after a failure either
    }
    if kind == "dir":
        root = Path(spec.context)
        extra: dict[str, Path] = {}
        containerfile = Path(spec.containerfile)
        if containerfile.is_absolute():
            try:
                params["dockerfile"] = containerfile.relative_to(root).as_posix()
            except ValueError:  # outside the context: send it along under a name of ours
                params["dockerfile"] = ".kvcd.Containerfile"
                extra[params["dockerfile"]] = containerfile
        check_relative(params["dockerfile"], spec)
        if not (extra or (root / params["dockerfile"]).is_file()):
            raise PodmanError(f"build {spec.tag}: no {params['dockerfile']} in {root}")
        return params, tar_directory(root, extra), None
    check_relative(spec.containerfile, spec)
    if kind == "tarball":
        try:
            opened = open(spec.context, "rb")  # noqa: SIM115 (the caller closes it)
        except OSError as exc:
            raise PodmanError(f"build {spec.tag}: cannot read {spec.context}: {exc}") from exc
        return params, file_chunks(opened), opened
    params["remote"] = remote_context(spec.context)
    return params, iter(()), None


def remote_context(context: str) -> str:
    """The URL podman's build gets for a remote context. Podman clones git:// URLs and URLs
    whose path ends in .git, and downloads any other http(s) URL as a tarball; so
    git+https://host/repo[#ref] is sent as https://host/repo.git[#ref] (git servers answer to
    both spellings), and the rest as written."""
    if not context.startswith("git+https://"):
        return context
    url, hash_, ref = context[len("git+") :].partition("#")
    if not url.endswith(".git"):
        url = url.rstrip("/") + ".git"
    return url + hash_ + ref


class Body:
    """A request body of chunks that remembers a local read error (requests would report it as
    a connection error)."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self.chunks = chunks
        self.error: OSError | None = None

    def __iter__(self) -> Iterator[bytes]:
        try:
            yield from self.chunks
        except OSError as exc:
            self.error = exc
            raise


class BuildLog:
    """Turns the build reply's JSON objects into whole lines for ``on_line``, keeping the last
    few for an error message and the image id the service reports at the end."""

    def __init__(self, on_line: Callable[[str], None]) -> None:
        self.on_line = on_line
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.image_id: str | None = None
        self.error: str | None = None
        self._pending = ""

    def feed(self, msg: Mapping[str, Any]) -> None:
        if msg.get("error"):
            self.error = str(msg["error"]).strip()
            return
        aux = msg.get("aux")
        if isinstance(aux, dict) and aux.get("ID"):
            self.image_id = str(aux["ID"]).removeprefix("sha256:")
        text = msg.get("stream")
        if isinstance(text, str):
            # A message may hold part of a line or several lines.
            self._pending += text
            while "\n" in self._pending:
                line, self._pending = self._pending.split("\n", 1)
                self._emit(line)

    def flush(self) -> None:
        if self._pending:
            self._emit(self._pending)
            self._pending = ""

    def _emit(self, line: str) -> None:
        self.tail.append(line)
        match = IMAGE_ID.match(line.strip())
        if match:  # libpod ends a successful build with the bare image id
            self.image_id = match.group(1)
        self.on_line(line)


def check_relative(containerfile: str, spec: BuildSpec) -> None:
    pure = PurePosixPath(containerfile)
    if pure.is_absolute() or ".." in pure.parts or not containerfile:
        raise PodmanError(
            f"build {spec.tag}: containerfile {containerfile!r} must be a path inside the context"
        )
