"""The labels kvcd puts on a driver image it builds, and whether a cached image under an
instance's tag is that instance's build of the inputs the config names now."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING

from kvcd.config.model import InstanceConfig, is_kvcd_tag

if TYPE_CHECKING:
    from kvcd.host.podtypes import ImageInfo, PodmanApi


def _inputs(cfg: InstanceConfig, kernel: str) -> str:
    """A digest of what the build is made from, as the config says it (a local context's
    files are not read: a change there needs a new version, as the README says)."""
    build = cfg.build
    parts = {
        "instance": cfg.name,
        "variant": cfg.variant or "",
        "version": cfg.version,
        "kernel": kernel,
        "context": build.context if build else "",
        "containerfile": build.containerfile if build else "",
        "args": sorted(build.args) if build else [],
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def labels(cfg: InstanceConfig, kernel: str) -> dict[str, str]:
    return {
        "io.kvcd.instance": cfg.name,
        "io.kvcd.version": cfg.version,
        "io.kvcd.kernel": kernel,
        "io.kvcd.inputs": _inputs(cfg, kernel),
    }


def not_ours(cfg: InstanceConfig, kernel: str, image_labels: Mapping[str, str]) -> str | None:
    """Why an image kvcd built under this tag is not this instance's build of these inputs
    (None: it is, or it carries no kvcd labels: pulled, or built by an older kvcd)."""
    if "io.kvcd.instance" not in image_labels:
        return None
    want = labels(cfg, kernel)
    if "io.kvcd.inputs" not in image_labels or cfg.build is None:
        # Built before kvcd labelled its inputs; or this instance never builds (pulled or
        # pinned to an archive): which build made the image matters only to a rebuild.
        want.pop("io.kvcd.inputs")
    wrong = [
        f"{k.removeprefix('io.kvcd.')} {image_labels.get(k)!r}"
        for k in want
        if image_labels.get(k) != want[k]
    ]
    return f"for {', '.join(wrong)}" if wrong else None


def legacy_tag(cfg: InstanceConfig, kernel: str) -> str:
    """The name kvcd gave this image before names had one path component per field:
    localhost/kvcd-<instance>[-<variant>]-<version>:<kernel>, lower case, other characters '_'.
    Different configs could share it (`Foo` and `foo`), so an image found under it is taken only
    with proof that it is this config's (adoptable)."""

    def safe(text: str) -> str:
        out = "".join(c if c.isascii() and (c.isalnum() or c in "_.-") else "_" for c in text)
        return ("_" + out[1:] if out[:1] in {".", "-"} else out).lower()[:128]

    name = safe(cfg.name) + (f"-{safe(cfg.variant)}" if cfg.variant is not None else "")
    return f"localhost/kvcd-{name}-{safe(cfg.version)}:{safe(kernel)}"


def adoptable(cfg: InstanceConfig, kernel: str, info: ImageInfo, pull_ref: str | None) -> bool:
    """Whether an image under legacy_tag is this config's: kvcd built it for this instance,
    version and kernel (its labels say so), or it carries no kvcd labels and is the image this
    config pulls (it still has the registry name)."""
    if "io.kvcd.instance" in info.labels:
        return not_ours(cfg, kernel, info.labels) is None
    if pull_ref is None:
        return False
    return pull_ref in info.tags or f"{pull_ref}:latest" in info.tags


def release(client: PodmanApi, name: str, tags: Collection[str]) -> list[str]:
    """Give back the images `tags` name: the names kvcd gave the images it built, pulled or
    loaded for instance `name` (its store's manifests say which). One line per image.

    Another instance's build under one of these names (its label says so: names can collide,
    `Foo` and `foo`) is left alone. An image with another kvcd name (the same image pulled for
    another instance, or for another kernel) only loses these names. Any other image goes
    whole, with the registry name kvcd pulled it by. Raises PodmanError, PodmanUnavailable or
    ImageInUse."""
    from kvcd.host.podtypes import INSTANCE_LABEL

    out = []
    for tag in sorted(tags):
        info = client.get_image(tag)
        if info is None:  # gone, or removed with an earlier name
            continue
        owner = info.labels.get(INSTANCE_LABEL, name)
        others = [t for t in info.tags if is_kvcd_tag(t) and t not in tags]
        if owner != name:  # a colliding name (`Foo` and `foo`): that instance's, untouched
            out.append(f"kept {tag}: instance {owner}'s build")
        elif others:
            client.tag(info.id, tag, untag=True)
            out.append(f"untagged {tag} (image {info.id[:12]} is also {others[0]})")
        else:
            client.remove_image(info.id)
            out.append(f"removed image {', '.join(info.tags)}")
    return out
