"""The podman room: driver-container images through the podman API service.

May touch: the podman API socket (HTTP through podman-py's low-level ``APIClient``, never the
podman CLI), the build context it is asked to send, and the destination directory of
:meth:`Podman.extract` (staged next to it, never in /tmp). It starts no process.

Errors are typed for the daemon: :class:`PodmanUnavailable` is transient (the socket is missing,
refuses, or times out: retry with backoff); :class:`PodmanError` is permanent for the given
input (the service answered and said no), its message fit for a Degraded reason's detail.

We use podman-py's low-level client rather than its high-level managers because (podman-py
4.9 against podman 4.3.1) ``images.build`` reads the whole build log before it returns and
writes the context tarball to /tmp, ``Container.get_archive`` buffers the whole archive in
memory, and high-level errors lose the difference between "no answer" and "answered no".
"""

from __future__ import annotations

import collections
import fnmatch
import glob
import io
import json
import logging
import os
import posixpath
import re
import shutil
import stat
import tarfile
import tempfile
import uuid
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path, PurePosixPath
from typing import IO, Any, cast

import requests
from podman.api import APIClient

from kvcd.host import failpoint

log = logging.getLogger(__name__)

DEFAULT_URL = "unix:///run/podman/podman.sock"

INSTANCE_LABEL = "io.kvcd.instance"
VERSION_LABEL = "io.kvcd.version"
KERNEL_LABEL = "io.kvcd.kernel"
# On extraction containers: their role, and the pid of the kvcd process that created them.
EXTRACT_ROLE_LABEL = "io.kvcd.role"
EXTRACT_PID_LABEL = "io.kvcd.pid"

MODULE_PATTERNS: tuple[str, ...] = ("*.ko", "*.ko.xz", "*.ko.gz", "*.ko.zst")
TARBALL_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.xz", ".tar.bz2", ".tar.zst")

_TAIL_LINES = 20
_IMAGE_ID = re.compile(r"^(?:sha256:)?([0-9a-f]{64})$")
_CHUNK = 1 << 16


class PodmanUnavailable(Exception):
    """The podman API did not answer (socket missing, refused, timed out): retry later."""


class PodmanError(Exception):
    """The podman API answered but the operation failed: permanent for this input."""


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


class Podman:
    """A client of one podman API service. Cheap to construct; connects on first use."""

    def __init__(self, url: str = DEFAULT_URL, timeout: float = 30.0) -> None:
        """``url``: ``unix:///path.sock`` (or any scheme podman-py takes); ``timeout``: seconds
        for connecting and for each reply. Builds and pulls wait for output without a limit
        (a compile step may be silent for long); everything else is bounded by ``timeout``."""
        self.url = url
        self.timeout = timeout
        try:
            self._api: Any = APIClient(base_url=url, timeout=timeout)
        except ValueError as exc:
            raise PodmanError(f"bad podman API URL {url!r}: {exc}") from exc

    @classmethod
    def from_env(cls, env: Mapping[str, str], timeout: float = 30.0) -> Podman:
        """The service named by CONTAINER_HOST in ``env`` (as the podman CLI does), else the
        default rootful socket."""
        return cls(env.get("CONTAINER_HOST") or DEFAULT_URL, timeout)

    def close(self) -> None:
        self._api.close()

    def __enter__(self) -> Podman:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- plumbing -----------------------------------------------------------------------

    def _call(
        self, method: str, path: str, what: str, *, stream: bool = False, **kwargs: Any
    ) -> requests.Response:
        """One API request; transport failures become PodmanUnavailable. HTTP error statuses
        are returned for the caller to judge (see :meth:`_failure`)."""
        kwargs.setdefault("timeout", self.timeout)
        try:
            resp = getattr(self._api, method)(path, stream=stream, **kwargs)
        except requests.RequestException as exc:
            # podman-py wraps every OSError of the transport in an APIError without a response.
            raise self._unavailable(what, exc) from exc
        # podman-py's APIResponse forwards every attribute to the requests.Response it wraps.
        return cast("requests.Response", resp)

    def _unavailable(self, what: str, exc: BaseException) -> PodmanUnavailable:
        cause: BaseException | None = exc
        while cause is not None and cause.__cause__ is not None:
            cause = cause.__cause__
        return PodmanUnavailable(f"podman API at {self.url} did not answer ({what}): {cause}")

    @staticmethod
    def _failure(
        what: str, resp: requests.Response, cls: type[PodmanError] = PodmanError
    ) -> PodmanError:
        return cls(f"{what}: {_message(resp)}")

    def _lines(self, resp: requests.Response, what: str) -> Iterator[dict[str, Any]]:
        """The JSON objects of a streamed reply, one per line, as they arrive."""
        try:
            for raw in resp.iter_lines():
                if not raw:
                    continue
                try:
                    obj = json.loads(raw)
                except ValueError:
                    obj = {"stream": raw.decode("utf-8", "replace") + "\n"}
                if isinstance(obj, dict):
                    yield obj
        except requests.RequestException as exc:
            raise self._unavailable(what, exc) from exc

    # --- queries ------------------------------------------------------------------------

    def ping(self) -> None:
        """Return if the service answers; raise PodmanUnavailable otherwise."""
        resp = self._call("get", "/_ping", "ping")
        if resp.status_code != 200:
            raise self._failure("ping", resp)

    def get_image(self, ref: str) -> ImageInfo | None:
        """The image ``ref`` (name, tag or id) names, or None if there is none."""
        resp = self._call("get", f"/images/{ref}/json", f"inspect image {ref}")
        if resp.status_code == 404:
            return None
        if resp.status_code != 200:
            raise self._failure(f"inspect image {ref}", resp)
        return _image_info(resp.json())

    def _list(self, filters: Mapping[str, Sequence[str]]) -> list[tuple[ImageInfo, int]]:
        """Images matching ``filters``, newest first, each with its number of containers."""
        what = f"list images {dict(filters)}"
        resp = self._call("get", "/images/json", what, params={"filters": json.dumps(filters)})
        if resp.status_code != 200:
            raise self._failure(what, resp)
        found = []
        for entry in resp.json() or []:
            # The list reports Created in whole seconds; inspect has nanoseconds, which matter
            # when several builds finish within one second.
            info = self.get_image(entry["Id"])
            if info is not None:  # removed meanwhile
                found.append((info, int(entry.get("Containers") or 0)))
        found.sort(key=lambda pair: (pair[0].created, pair[0].id), reverse=True)
        return found

    def list_instance_images(self, instance: str) -> list[ImageInfo]:
        """Images labelled ``io.kvcd.instance=<instance>`` (tagged or not), newest first."""
        return [info for info, _ in self._list({"label": [f"{INSTANCE_LABEL}={instance}"]})]

    # --- pull, tag, build ---------------------------------------------------------------

    def pull(self, ref: str, tag: str) -> ImageInfo:
        """Pull ``ref`` with the service's own registries, auth and signature policy, then tag
        it ``tag``."""
        what = f"pull {ref}"
        resp = self._call(
            "post",
            "/images/pull",
            what,
            stream=True,
            params={"reference": ref},
            timeout=(self.timeout, None),
        )
        try:
            if resp.status_code != 200:
                raise self._failure(what, resp)
            image_id = error = None
            for msg in self._lines(resp, what):
                if msg.get("error"):
                    error = str(msg["error"]).strip()
                elif msg.get("id"):
                    image_id = str(msg["id"])
                elif msg.get("stream"):
                    log.info("%s: %s", what, str(msg["stream"]).rstrip())
        finally:
            resp.close()
        if error or not image_id:
            raise PodmanError(f"{what}: {error or 'the service reported no image'}")
        self._tag(image_id, tag)
        return self._must_get(image_id)

    def _tag(self, image_id: str, ref: str) -> None:
        repo, tag = _split_ref(ref)
        what = f"tag {image_id[:12]} as {ref}"
        resp = self._call(
            "post", f"/images/{image_id}/tag", what, params={"repo": repo, "tag": tag}
        )
        if resp.status_code not in (200, 201):
            raise self._failure(what, resp)

    def _must_get(self, ref: str) -> ImageInfo:
        info = self.get_image(ref)
        if info is None:
            raise PodmanError(f"image {ref} vanished right after it was made")
        return info

    def build(self, spec: BuildSpec, on_line: Callable[[str], None]) -> ImageInfo:
        """Build ``spec``, passing each output line to ``on_line`` as it arrives; tag the
        result ``spec.tag`` only on success, so a failed build leaves the previous image of
        that tag in place. Raises PodmanError with the last lines of output on failure."""
        kind = context_kind(spec.context)
        params, chunks, opened = _build_request(spec, kind)
        body = _Body(chunks)
        what = f"build {spec.tag} from {spec.context}"
        log.info("%s (%s context)", what, kind)
        try:
            resp = self._call(
                "post",
                "/build",
                what,
                stream=True,
                params=params,
                data=body if kind in ("dir", "tarball") else b"",
                headers={"Content-Type": "application/x-tar"},
                timeout=(self.timeout, None),
            )
        except PodmanUnavailable:
            if body.error is not None:  # our side failed reading the context: permanent
                raise PodmanError(f"{what}: reading the context: {body.error}") from body.error
            raise
        finally:
            if opened is not None:
                opened.close()
        output = _BuildLog(on_line)
        try:
            if resp.status_code != 200:
                # podman 4.3.1 answers a failed remote fetch with a 500 and then goes on
                # writing more error objects; the first one names the real cause.
                raise self._failure(what, resp)
            for msg in self._lines(resp, what):
                output.feed(msg)
            output.flush()
        finally:
            resp.close()  # if on_line raised, this disconnect also cancels the build
        if output.error or output.image_id is None:
            lines = "\n".join(output.tail)
            raise PodmanError(
                f"{what} failed: {output.error or 'no image id in the output'}\n"
                f"last {len(output.tail)} lines of output:\n{lines}"
            )
        self._tag(output.image_id, spec.tag)
        info = self._must_get(output.image_id)
        log.info("%s: built %s", what, info.id[:12])
        return info

    # --- extract ------------------------------------------------------------------------

    def extract(
        self,
        image_ref: str,
        path_in_image: str,
        dest_dir: str | os.PathLike[str],
        patterns: Sequence[str] = MODULE_PATTERNS,
    ) -> list[Path]:
        """Copy the module files under ``path_in_image`` (a directory, e.g.
        ``/lib/modules/<kver>``) of ``image_ref`` into ``dest_dir``, keeping their directories
        relative to ``path_in_image``; ``dest_dir`` is replaced as a whole, or left as it was
        on failure. Uses a created, never started container that is always removed. Raises
        PodmanError if no file matching ``patterns`` is there."""
        src = posixpath.normpath(path_in_image)
        if not src.startswith("/"):
            raise PodmanError(f"extract from {image_ref}: {path_in_image!r} is not absolute")
        dest = Path(dest_dir)
        dest.parent.mkdir(parents=True, exist_ok=True)
        what = f"extract {src} from {image_ref}"
        self._remove_leftovers(dest)
        staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".new", dir=dest.parent))
        container: str | None = None
        try:
            container = self._create_container(image_ref)
            # "/." makes the archive hold the directory's contents, not the directory itself.
            resp = self._call(
                "get",
                f"/containers/{container}/archive",
                what,
                stream=True,
                params={"path": src.rstrip("/") + "/."},
            )
            try:
                if resp.status_code == 404:
                    raise PodmanError(f"{what}: no directory {src} in image {image_ref}")
                if resp.status_code != 200:
                    raise self._failure(what, resp)
                reader = io.BufferedReader(_ChunkReader(self._chunks(resp, what)), _CHUNK)
                found = extract_members(reader, staging, patterns, source=f"{image_ref}:{src}")
            finally:
                resp.close()
            if not found:
                raise PodmanError(
                    f"no kernel module ({', '.join(patterns)}) under {src} in image {image_ref}"
                )
            _replace_dir(staging, dest)
            log.info("%s: %d module file(s) into %s", what, len(found), dest)
            return [dest / path.relative_to(staging) for path in found]
        finally:
            if container is not None:
                self._remove_container(container)
            shutil.rmtree(staging, ignore_errors=True)

    def _chunks(self, resp: requests.Response, what: str) -> Iterator[bytes]:
        try:
            yield from resp.iter_content(_CHUNK)
        except requests.RequestException as exc:
            raise self._unavailable(what, exc) from exc

    def _create_container(self, image_ref: str) -> str:
        what = f"create a container of {image_ref}"
        spec = {
            "image": image_ref,
            "name": f"kvcd-extract-{uuid.uuid4().hex[:12]}",
            # Never started; a command makes creation work for images without CMD/ENTRYPOINT.
            "command": ["/kvcd-extract-never-runs"],
            "labels": {EXTRACT_ROLE_LABEL: "extract", EXTRACT_PID_LABEL: str(os.getpid())},
        }
        resp = self._call("post", "/containers/create", what, data=json.dumps(spec))
        if resp.status_code not in (200, 201):
            message = _message(resp)
            if resp.status_code == 404 or "image not known" in message:  # 4.3.1 says 500
                raise PodmanError(f"{what}: no such image")
            raise PodmanError(f"{what}: {message}")
        return str(resp.json()["Id"])

    def _remove_leftovers(self, dest: Path) -> None:
        """What an extraction killed with SIGKILL left behind: its staging directories beside
        ``dest`` and its never-started containers.

        The caller holds the instance lock, so a staging directory of ``dest`` belongs to a dead
        process. A container is only removed when the process named by its pid label is gone
        (other instances may be extracting right now).
        """
        for stale in dest.parent.glob(f".{glob.escape(dest.name)}.*.new"):
            log.info("removing %s, left by an interrupted extraction", stale)
            shutil.rmtree(stale, ignore_errors=True)
        what = "list extraction containers"
        flt = json.dumps({"label": [f"{EXTRACT_ROLE_LABEL}=extract"]})
        resp = self._call("get", "/containers/json", what, params={"all": True, "filters": flt})
        if resp.status_code != 200:
            log.warning("%s: %s", what, _message(resp))
            return
        for ctr in resp.json() or []:
            owner = (ctr.get("Labels") or {}).get(EXTRACT_PID_LABEL, "")
            if owner.isdigit() and _alive(int(owner)):
                continue
            log.info("removing extraction container %s, left by pid %s", ctr["Id"][:12], owner)
            self._remove_container(str(ctr["Id"]))

    def _remove_container(self, container: str) -> None:
        """Best effort: it runs in a finally and must not hide the error that got us there."""
        what = f"remove container {container[:12]}"
        try:
            resp = self._call(
                "delete", f"/containers/{container}", what, params={"force": True, "v": True}
            )
            if resp.status_code not in (200, 204, 404):
                log.warning("%s: %s", what, _message(resp))
        except PodmanUnavailable as exc:
            log.warning("%s", exc)

    # --- removal and garbage collection ---------------------------------------------------

    def remove_image(self, image_id: str) -> None:
        """Remove the image with all its tags (``image_id`` may also be a short id or a name).
        A missing image is not an error; an image a container uses raises ImageInUse
        (containers are never removed for it)."""
        what = f"remove image {image_id[:12]}"
        found = self.get_image(image_id)  # also resolves a short id or a name
        matches = self._list({"id": [found.id]}) if found is not None else []
        if not matches:
            log.debug("%s: not there", what)
            return
        info, containers = matches[0]
        if containers:
            raise ImageInUse(f"{what}: in use by {containers} container(s)")
        if len(info.tags) > 1:
            # podman refuses to delete by id an image with several tags unless forced, and
            # force would also remove its containers.
            resp = self._call("post", f"/images/{info.id}/untag", what)
            if resp.status_code not in (200, 201, 404):
                raise self._failure(what, resp)
        resp = self._call("delete", f"/images/{info.id}", what)
        if resp.status_code == 404:
            return
        if resp.status_code == 409:
            raise self._failure(what, resp, ImageInUse)
        if resp.status_code != 200:
            raise self._failure(what, resp)
        log.info("removed image %s %s", info.id[:12], ",".join(info.tags) or "(untagged)")

    def gc(self, instance: str, keep: int, protect: Collection[str] = ()) -> list[ImageInfo]:
        """Remove all but the newest ``keep`` images labelled for ``instance``; images named in
        ``protect`` (id, id prefix of 12+ characters, or tag) are never removed and do not count
        toward ``keep``. Images in use by a container are skipped. Returns what was removed."""
        if keep < 0:
            raise ValueError(f"keep must be >= 0, not {keep}")
        removed = []
        for info in self.list_instance_images(instance)[keep:]:
            if info.instance != instance:  # the label filter already says so; be sure
                continue
            if _protected(info, protect):
                log.debug("gc %s: keeping protected image %s", instance, info.id[:12])
                continue
            try:
                self.remove_image(info.id)
            except ImageInUse as exc:
                log.info("gc %s: skipping %s", instance, exc)
                continue
            removed.append(info)
        return removed


# --- pure helpers (no API) --------------------------------------------------------------


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


def tar_directory(root: Path, extra: Mapping[str, Path] | None = None) -> Iterator[bytes]:
    """Stream ``root`` as an uncompressed tar, chunk by chunk (nothing staged on disk, one
    file's chunk in memory at a time). Regular files, directories and symlinks are sent
    (owned by root, like podman-remote does); other file types are left out. ``extra`` adds
    files under the given archive names."""

    def header(name: str, st: os.stat_result, kind: bytes, size: int = 0, link: str = "") -> bytes:
        info = tarfile.TarInfo(name)
        info.type = kind
        info.mode = stat.S_IMODE(st.st_mode)
        info.mtime = int(st.st_mtime)
        info.size = size
        info.linkname = link
        info.uname = info.gname = "root"
        return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")

    def regular(name: str, path: Path, st: os.stat_result) -> Iterator[bytes]:
        yield header(name, st, tarfile.REGTYPE, st.st_size)
        left = st.st_size
        with open(path, "rb") as fh:
            while left > 0:
                chunk = fh.read(min(_CHUNK, left))
                if not chunk:  # shrank while we read: keep the header's promise
                    chunk = b"\0" * left
                left -= len(chunk)
                yield chunk
        if st.st_size % tarfile.BLOCKSIZE:
            yield b"\0" * (tarfile.BLOCKSIZE - st.st_size % tarfile.BLOCKSIZE)

    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        rel = Path(dirpath).relative_to(root)
        for name in [*dirnames, *sorted(filenames)]:
            path = Path(dirpath, name)
            arcname = (rel / name).as_posix()
            st = os.lstat(path)
            if stat.S_ISDIR(st.st_mode):
                yield header(arcname + "/", st, tarfile.DIRTYPE)
            elif stat.S_ISLNK(st.st_mode):
                yield header(arcname, st, tarfile.SYMTYPE, link=os.readlink(path))
            elif stat.S_ISREG(st.st_mode):
                yield from regular(arcname, path, st)
            else:
                log.debug("build context: leaving out %s (not a file, dir or symlink)", path)
    for arcname, path in (extra or {}).items():
        yield from regular(arcname, path, os.stat(path))
    yield b"\0" * (2 * tarfile.BLOCKSIZE)


def extract_members(
    archive: IO[bytes],
    dest: Path,
    patterns: Sequence[str] = MODULE_PATTERNS,
    *,
    source: str = "archive",
) -> list[Path]:
    """Read a tar stream and write each regular file whose name matches one of ``patterns``
    to ``dest`` (an existing, empty directory) at its relative path. An absolute member name
    or one with a ``..`` component refuses the whole archive (PodmanError); symlinks, hard
    links, devices and fifos are never written (a matching one is skipped with a warning).
    Returns the written files in archive order."""
    written: list[Path] = []
    try:
        with tarfile.open(fileobj=archive, mode="r|*") as tar:
            for member in tar:
                rel = _safe_name(member.name, source)
                if rel is None or member.isdir():
                    continue
                if not any(fnmatch.fnmatchcase(rel.name, pat) for pat in patterns):
                    continue
                if not member.isreg():
                    log.warning("%s: skipping %s: not a regular file", source, member.name)
                    continue
                target = dest.joinpath(*rel.parts)
                target.parent.mkdir(parents=True, exist_ok=True)
                data = tar.extractfile(member)
                if data is None:
                    continue
                with open(target, "wb") as out:
                    shutil.copyfileobj(data, out, _CHUNK)
                    out.flush()
                    os.fsync(out.fileno())
                os.chmod(target, 0o644)
                os.utime(target, (member.mtime, member.mtime))
                if target not in written:
                    written.append(target)
                failpoint.hit("extract")
    except tarfile.TarError as exc:
        raise PodmanError(f"{source}: unreadable archive: {exc}") from exc
    except OSError as exc:  # e.g. a file and a directory of the same name, or a full disk
        raise PodmanError(f"{source}: cannot write into {dest}: {exc}") from exc
    return written


def _safe_name(name: str, source: str) -> PurePosixPath | None:
    """The member's relative path, None for the archive root; PodmanError if it escapes."""
    if name.startswith("/"):
        raise PodmanError(f"{source}: refusing archive member with absolute path {name!r}")
    parts = [p for p in PurePosixPath(name).parts if p not in ("", ".")]
    if ".." in parts:
        raise PodmanError(f"{source}: refusing archive member with '..' in {name!r}")
    return PurePosixPath(*parts) if parts else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _replace_dir(staging: Path, dest: Path) -> None:
    """Put ``staging`` at ``dest`` (same filesystem), replacing what was there."""
    old = None
    if dest.exists() or dest.is_symlink():
        old = dest.with_name(f".{dest.name}.old-{uuid.uuid4().hex[:8]}")
        os.rename(dest, old)
    os.rename(staging, dest)
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old)
        else:
            old.unlink()
    fd = os.open(dest.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _build_request(
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
        _check_relative(params["dockerfile"], spec)
        if not (extra or (root / params["dockerfile"]).is_file()):
            raise PodmanError(f"build {spec.tag}: no {params['dockerfile']} in {root}")
        return params, tar_directory(root, extra), None
    _check_relative(spec.containerfile, spec)
    if kind == "tarball":
        try:
            opened = open(spec.context, "rb")  # noqa: SIM115 (the caller closes it)
        except OSError as exc:
            raise PodmanError(f"build {spec.tag}: cannot read {spec.context}: {exc}") from exc
        return params, _file_chunks(opened), opened
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


class _Body:
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


class _BuildLog:
    """Turns the build reply's JSON objects into whole lines for ``on_line``, keeping the last
    few for an error message and the image id the service reports at the end."""

    def __init__(self, on_line: Callable[[str], None]) -> None:
        self.on_line = on_line
        self.tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
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
        match = _IMAGE_ID.match(line.strip())
        if match:  # libpod ends a successful build with the bare image id
            self.image_id = match.group(1)
        self.on_line(line)


def _check_relative(containerfile: str, spec: BuildSpec) -> None:
    pure = PurePosixPath(containerfile)
    if pure.is_absolute() or ".." in pure.parts or not containerfile:
        raise PodmanError(
            f"build {spec.tag}: containerfile {containerfile!r} must be a path inside the context"
        )


def _split_ref(ref: str) -> tuple[str, str]:
    """``registry:5000/repo/name:tag`` -> (``registry:5000/repo/name``, ``tag``)."""
    if "@" in ref:
        raise PodmanError(f"cannot tag an image as {ref!r}: a digest is not a tag")
    colon, slash = ref.rfind(":"), ref.rfind("/")
    if colon > slash:
        return ref[:colon], ref[colon + 1 :]
    return ref, "latest"


def _protected(info: ImageInfo, protect: Collection[str]) -> bool:
    for item in protect:
        ref = item.removeprefix("sha256:")
        if ref == info.id or (len(ref) >= 12 and info.id.startswith(ref)) or item in info.tags:
            return True
    return False


def _image_info(data: Mapping[str, Any]) -> ImageInfo:
    labels = data.get("Labels") or (data.get("Config") or {}).get("Labels") or {}
    return ImageInfo(
        id=str(data["Id"]).removeprefix("sha256:"),
        tags=tuple(data.get("RepoTags") or ()),
        labels=dict(labels),
        created=_timestamp(data.get("Created")),
    )


def _timestamp(value: object) -> float:
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


def _message(resp: requests.Response) -> str:
    """The service's own words from an error reply (first JSON object), else its text."""
    try:
        text = resp.text
    except requests.RequestException:
        return f"HTTP {resp.status_code}"
    first = text.strip().splitlines()[0] if text.strip() else ""
    try:
        body = json.loads(first)
    except ValueError:
        return f"HTTP {resp.status_code}: {first or 'no detail'}"
    if isinstance(body, dict):
        return str(body.get("message") or body.get("cause") or body)
    return str(body)


def _file_chunks(fh: IO[bytes]) -> Iterator[bytes]:
    while chunk := fh.read(_CHUNK):
        yield chunk


class _ChunkReader(io.RawIOBase):
    """A readable file over an iterator of byte chunks (for tarfile's stream mode)."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self._chunks = chunks
        self._buf = b""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self._buf:
            try:
                self._buf = next(self._chunks)
            except StopIteration:
                return 0
        view = memoryview(buffer).cast("B")
        n = min(len(view), len(self._buf))
        view[:n] = self._buf[:n]
        self._buf = self._buf[n:]
        return n
