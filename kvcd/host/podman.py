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

import glob
import io
import json
import logging
import os
import posixpath
import shutil
import tempfile
import uuid
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import IO

from kvcd.host.podapi import Client, error_text
from kvcd.host.podbuild import (
    Body,
    BuildLog,
    build_request,
    context_kind,
)
from kvcd.host.podtypes import (
    CHUNK,
    EXTRACT_PID_LABEL,
    EXTRACT_ROLE_LABEL,
    INSTANCE_LABEL,
    MODULE_PATTERNS,
    BuildSpec,
    ImageInfo,
    ImageInUse,
    PodmanError,
    PodmanUnavailable,
    image_info,
    protected,
    split_ref,
)
from kvcd.host.tarstream import (
    ChunkReader,
    extract_members,
    file_chunks,
    replace_dir,
)

log = logging.getLogger(__name__)


class Podman(Client):
    """A client of one podman API service: images, builds, pulls, extraction."""

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
        return image_info(resp.json())

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

    def pull(
        self, ref: str, tag: str, *, auth: str | None = None, tls_verify: bool = True
    ) -> ImageInfo:
        """Pull ``ref`` with the service's registries and signature policy, then tag it
        ``tag``. ``auth``: an X-Registry-Auth value (kvcd/host/regauth.py), else the service's
        own credentials; ``tls_verify`` False only when the admin asked for it."""
        what = f"pull {ref}"
        params = {"reference": ref}
        if not tls_verify:
            params["tlsVerify"] = "false"
        deadline = self._deadline()
        resp = self._call(
            "post",
            "/images/pull",
            what,
            stream=True,
            deadline=deadline,
            params=params,
            headers={"X-Registry-Auth": auth} if auth else None,
        )
        try:
            if resp.status_code != 200:
                raise self._failure(what, resp)
            image_id = error = None
            for msg in self._lines(resp, what, deadline):
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
        self.tag(image_id, tag)
        return self._must_get(image_id)

    def tag(self, image_id: str, ref: str, *, untag: bool = False) -> None:
        """Give the image the name ``ref``; with ``untag``, take that name away (the image
        stays, with its other names or none)."""
        repo, tag = split_ref(ref)
        verb = "untag" if untag else "tag"
        what = f"{verb} {image_id[:12]} {'from' if untag else 'as'} {ref}"
        params = {"repo": repo, "tag": tag}
        resp = self._call("post", f"/images/{image_id}/{verb}", what, params=params)
        if resp.status_code not in (200, 201):
            raise self._failure(what, resp)

    def load(self, archive: IO[bytes], name: str) -> ImageInfo:
        """Load an image archive (`podman save`: docker-archive or oci-archive), streamed from
        ``archive`` (named ``name`` in errors); PodmanError unless it holds exactly one image."""
        what = name
        resp = self._call(
            "post",
            "/images/load",
            what,
            deadline=self._deadline(),
            data=file_chunks(archive),
            headers={"Content-Type": "application/x-tar"},
        )
        if resp.status_code != 200:
            raise self._failure(what, resp)
        try:
            loaded = [str(n) for n in resp.json().get("Names") or ()]
        except (ValueError, AttributeError):
            loaded = []
        if len(loaded) != 1:
            raise PodmanError(
                f"{what}: a driver image archive holds one image, this one "
                f"{', '.join(loaded) if loaded else 'none'}"
            )
        return self._must_get(loaded[0])

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
        params, chunks, opened = build_request(spec, kind)
        body = Body(chunks)
        what = f"build {spec.tag} from {spec.context}"
        log.info("%s (%s context)", what, kind)
        deadline = self._deadline()
        try:
            resp = self._call(
                "post",
                "/build",
                what,
                stream=True,
                deadline=deadline,
                params=params,
                data=body if kind in ("dir", "tarball") else b"",
                headers={"Content-Type": "application/x-tar"},
            )
        except PodmanUnavailable:
            if body.error is not None:  # our side failed reading the context: permanent
                raise PodmanError(f"{what}: reading the context: {body.error}") from body.error
            raise
        finally:
            if opened is not None:
                opened.close()
        output = BuildLog(on_line)
        try:
            if resp.status_code != 200:
                # podman 4.3.1 answers a failed remote fetch with a 500 and then goes on
                # writing more error objects; the first one names the real cause.
                raise self._failure(what, resp)
            for msg in self._lines(resp, what, deadline):
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
        self.tag(output.image_id, spec.tag)
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
        kind: str = "kernel module",
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
                reader = io.BufferedReader(ChunkReader(self._chunks(resp, what)), CHUNK)
                found = extract_members(reader, staging, patterns, source=f"{image_ref}:{src}")
            finally:
                resp.close()
            if not found:
                raise PodmanError(
                    f"no {kind} ({', '.join(patterns)}) under {src} in image {image_ref}"
                )
            replace_dir(staging, dest)
            log.info("%s: %d %s file(s) into %s", what, len(found), kind, dest)
            return [dest / path.relative_to(staging) for path in found]
        finally:
            if container is not None:
                self._remove_container(container)
            shutil.rmtree(staging, ignore_errors=True)

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
            message = error_text(resp)
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
            log.warning("%s: %s", what, error_text(resp))
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
                log.warning("%s: %s", what, error_text(resp))
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
            if protected(info, protect):
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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
