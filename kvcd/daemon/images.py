"""The image step of a plan (AcquireImage) and `kvcd image import`: where an instance's driver
image comes from — kvcd's cache, a registry, a build, or an image archive on the node.

An archive (`podman save` output, docker-archive or oci-archive) is how an air-gapped node gets
its driver: `image_archive` pins an instance to one (kvcd loads it when its tag is missing and
never pulls or builds), and `kvcd image import NAME ARCHIVE` loads one by hand. Either way the
archive must hold exactly one image, and one kvcd built for another instance, version or kernel
is refused (its labels say so), never loaded under this instance's tag.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvcd.config.model import InstanceConfig, Settings
from kvcd.core import actions as act
from kvcd.core import metrics as m
from kvcd.core import state
from kvcd.core.plan import Plan
from kvcd.core.state import StepFailed
from kvcd.daemon import imagelabels, metrics
from kvcd.host import failpoint, files, journal
from kvcd.host.paths import HostRoot
from kvcd.host.regauth import AuthFileError, credentials, files_for

if TYPE_CHECKING:
    from kvcd.host.podchild import PodmanChild
    from kvcd.host.podtypes import ImageInfo, PodmanApi

log = logging.getLogger(__name__)


@dataclass
class Images:
    """The image steps of one instance on one kernel."""

    cfg: InstanceConfig
    kernel: str
    settings: Settings | None
    podman: Callable[[], PodmanApi]
    on_build_line: Callable[[str], None]
    fields: Mapping[str, str]

    def acquire(self, a: act.AcquireImage) -> bool:
        """Make a.tag exist; True when it was cached already (a cache hit, not a build)."""
        from kvcd.host.podtypes import PodmanUnavailable

        try:
            cached = self.podman().get_image(a.tag) or self._adopted(a)
            foreign = None if cached is None else self.foreign(cached)
            if cached is not None and foreign is None:
                log.info("image %s is cached; no build", a.tag, extra=self.fields)
                metrics.count(m.IMAGE_CACHE_HITS)
                return True
            metrics.count(m.IMAGE_CACHE_MISSES)
            if foreign is not None:
                log.warning(
                    "cached image %s was built %s; getting it again",
                    a.tag,
                    foreign,
                    extra=self.fields,
                )
            if a.archive:
                self.load_archive(Path(a.archive), a.tag)
            elif not (a.pull_ref and self._pulled(a.pull_ref, a.tag, a.context)):
                assert a.context is not None  # the config loader requires a way to the image
                self._build(a.tag, a.context)
        except PodmanUnavailable as exc:
            raise StepFailed(state.PODMAN_UNAVAILABLE, str(exc), transient=True) from exc
        return False

    def _adopted(self, a: act.AcquireImage) -> ImageInfo | None:
        """The image cached under the name an older kvcd gave it, when it is provably this
        config's (imagelabels.adoptable): renamed to a.tag, so an update of kvcd builds nothing."""
        from kvcd.host.podtypes import PodmanError

        legacy = imagelabels.legacy_tag(self.cfg, self.kernel)
        try:
            info = self.podman().get_image(legacy)
            if info is None or not imagelabels.adoptable(self.cfg, self.kernel, info, a.pull_ref):
                return None
            self.podman().tag(info.id, a.tag)
            self.podman().tag(info.id, legacy, untag=True)
        except PodmanError as exc:  # then it is got again, as if there were none
            log.warning("cannot rename image %s to %s: %s", legacy, a.tag, exc, extra=self.fields)
            return None
        log.info("image %s is now named %s", legacy, a.tag, extra=self.fields)
        return self.podman().get_image(a.tag)

    def foreign(self, info: ImageInfo) -> str | None:
        return imagelabels.not_ours(self.cfg, self.kernel, info.labels)

    # -- an archive ----------------------------------------------------------------------------
    def load_archive(self, archive: Path, tag: str) -> ImageInfo:
        """Load `archive` into podman and tag its one image `tag`. A missing archive is retried
        on the back-off timer (it may still be on its way to an air-gapped node); anything else
        wrong with it is ImportFailed until the config or the archive changes."""
        from kvcd.host.podtypes import PodmanError

        try:
            with files.open_input(archive) as fh:
                info = self.podman().load(fh, str(archive))
        except FileNotFoundError:
            raise StepFailed(
                state.IMPORT_FAILED,
                f"{archive}: no such file (copy the driver image archive there, or run "
                f"`kvcd image import {self.cfg.name} ARCHIVE`)",
                transient=True,
            ) from None
        except OSError as exc:  # Refused (a FIFO, a directory), EACCES …
            raise StepFailed(state.IMPORT_FAILED, files.os_error(exc)) from exc
        except PodmanError as exc:
            raise StepFailed(state.IMPORT_FAILED, str(exc)) from exc
        foreign = self.foreign(info)
        if foreign is not None:
            raise StepFailed(
                state.IMPORT_FAILED,
                f"{archive}: its image {info.id[:12]} was built by kvcd {foreign}, not for "
                f"{self.cfg.name} {self.cfg.version} on {self.kernel}",
            )
        try:
            self.podman().tag(info.id, tag)
        except PodmanError as exc:
            raise StepFailed(state.IMPORT_FAILED, str(exc)) from exc
        log.info("loaded %s (image %s) as %s", archive, info.id[:12], tag, extra=self.fields)
        return info

    # -- a registry ----------------------------------------------------------------------------
    def _pulled(self, ref: str, tag: str, context: str | None) -> bool:
        """Pull ref as tag; False when it failed and there is a build to fall back on."""
        from kvcd.host.podtypes import PodmanError

        try:
            self._pull(ref, tag)
        except PodmanError as exc:
            if not context:
                # Retried on the back-off timer, as the kubelet's ImagePullBackOff: a registry
                # down or a tag not pushed yet is usually fixed elsewhere.
                raise StepFailed(state.PULL_FAILED, f"{ref}: {exc}", transient=True) from exc
            log.warning("pull of %s failed (%s); building instead", ref, exc, extra=self.fields)
            return False
        log.info("pulled %s as %s", ref, tag, extra=self.fields)
        return True

    def _pull(self, ref: str, tag: str) -> None:
        """Pull with the instance's (else the node's) registry credentials, if any has some."""
        try:
            creds = credentials(ref, files_for(self.cfg, self.settings))
        except AuthFileError as exc:
            raise StepFailed(state.PULL_FAILED, f"{ref}: credentials: {exc}") from exc
        if creds is not None:
            log.info("pulling %s with the credentials of %s", ref, creds.source, extra=self.fields)
        auth, verify = (creds.header() if creds else None), self.cfg.tls_verify
        self.podman().pull(ref, tag, auth=auth, tls_verify=verify)

    # -- a build -------------------------------------------------------------------------------
    def _build(self, tag: str, context: str) -> None:
        from kvcd.host.podtypes import BuildSpec, PodmanError

        build = self.cfg.build
        spec = BuildSpec(
            context=context,
            containerfile=build.containerfile if build else "Containerfile",
            tag=tag,
            build_args={
                **dict(build.args if build else ()),
                "KVER": self.kernel,
                "KMODVER": self.cfg.version,
            },
            labels=imagelabels.labels(self.cfg, self.kernel),
        )
        log.info(
            "build of %s started from %s",
            tag,
            context,
            extra=journal.with_message_id(self.fields, journal.MSG_BUILD_STARTED),
        )
        if context.startswith("git://"):
            log.warning(
                "build context %s is fetched over git://, unauthenticated and unencrypted: "
                "anyone on the network path can change the driver this node loads; "
                "prefer https://",
                context,
                extra=self.fields,
            )

        def line(text: str) -> None:
            self.on_build_line(text)
            failpoint.hit("build")

        try:
            self.podman().build(spec, line)
        except PodmanError as exc:
            log.error(
                "build of %s failed: %s",
                tag,
                exc,
                extra=journal.with_message_id(self.fields, journal.MSG_BUILD_FAILED),
            )
            raise StepFailed(state.BUILD_FAILED, str(exc)) from exc
        log.info(
            "build of %s finished",
            tag,
            extra=journal.with_message_id(self.fields, journal.MSG_BUILD_FINISHED),
        )

    # -- housekeeping --------------------------------------------------------------------------
    def collect(self, keep: int) -> None:
        from kvcd.host.podtypes import PodmanError, PodmanUnavailable

        try:
            removed = self.podman().gc(self.cfg.name, keep, protect=())
        except (PodmanError, PodmanUnavailable) as exc:  # housekeeping never fails a load
            log.warning("image garbage collection failed: %s", exc, extra=self.fields)
            return
        for img in removed:
            log.info("removed old image %s", ", ".join(img.tags) or img.id, extra=self.fields)


def client(settings: Settings) -> PodmanChild:
    """A client of the podman service kvcd.toml names, whose pulls, builds and image loads
    end at image_timeout. It talks to podman from a helper process it starts when first used
    and ends when closed (kvcd/host/podchild.py): podman-py never stays in kvcd's memory."""
    from kvcd.host.podchild import PodmanChild

    return PodmanChild(settings.podman_socket, image_timeout=settings.image_timeout)


def archive_problem(planned: Plan) -> OSError | None:
    """check-config: why an archive the plan loads (image_archive) cannot be read now."""
    for a in planned.actions:
        if isinstance(a, act.AcquireImage) and a.archive:
            try:
                files.open_input(Path(a.archive)).close()
            except OSError as exc:
                return exc
    return None


def import_command(root: HostRoot, name: str, archive: str, kernel: str | None) -> int:
    """`kvcd image import NAME ARCHIVE [--kernel K]`: load ARCHIVE as NAME's image of its
    configured version for kernel K (the running one by default); the daemon finds it cached."""
    from kvcd.config.loader import load_instance, load_settings
    from kvcd.daemon.record import running_kernel
    from kvcd.daemon.variants import resolve_variant
    from kvcd.host.podtypes import PodmanUnavailable

    settings = load_settings(root)
    kernel = kernel or running_kernel(root)
    cfg, no_variant = resolve_variant(root, settings, load_instance(root, name), kernel)
    if no_variant is not None:
        print(f"kvcd: {name}: {no_variant}", file=sys.stderr)
        return 1
    tag = cfg.image_tag(kernel)
    with client(settings) as podman:
        images = Images(cfg, kernel, settings, lambda: podman, lambda _s: None, {})
        try:
            info = images.load_archive(Path(archive), tag)
        except (StepFailed, PodmanUnavailable) as exc:
            print(f"kvcd: {name}: {exc}", file=sys.stderr)
            return 1
    print(f"{archive}: image {info.id[:12]} is {tag}: kvcd@{name} {cfg.version} on {kernel}")
    return 0
