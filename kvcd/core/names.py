"""The grammar of instance names and kernel releases, checked at the edge. Pure.

An instance name becomes a unit name (kvcd@NAME.service), file names (NAME.toml, NAME.json,
NAME.pid …) and annotation keys; a kernel release becomes a directory name (/lib/modules/K)
and an image tag. So neither may hold '/', be '.' or '..', start with '-' (an option to the
tools it is passed to) or hold anything systemd does not allow in an instance string ('@',
whitespace, control characters).
"""

from __future__ import annotations

import re

INSTANCE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
INSTANCE_RULE = "[A-Za-z0-9][A-Za-z0-9_.-]{0,127}"
KERNEL_RELEASE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+~-]{0,127}")
KERNEL_RULE = "[A-Za-z0-9_][A-Za-z0-9_.+~-]{0,127}, as uname -r prints it"


def instance_problem(name: str) -> str | None:
    """Why `name` cannot be an instance name; None when it can."""
    if INSTANCE_NAME.fullmatch(name):
        return None
    return f"bad instance name {name!r}: it must match {INSTANCE_RULE}"


def kernel_problem(kernel: str) -> str | None:
    """Why `kernel` cannot be a kernel release; None when it can."""
    if KERNEL_RELEASE.fullmatch(kernel):
        return None
    return f"bad kernel release {kernel!r}: it must match {KERNEL_RULE}"


# The names kvcd gives the driver images it builds, pulls or loads: one repository path
# component per field, so no field's '-' can be read as a separator; IMAGE_PREFIX marks them.
IMAGE_PREFIX = "localhost/kvcd/"
# A path component of an image name (the distribution spec's grammar), and a tag.
_COMPONENT = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*")
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
# A longer field is shortened and named by its digest: three path components stay within a
# name's 255 characters; a kernel release is at most 128, a tag's limit.
_LONGEST_AS_IS = 64


def image_tag(instance: str, variant: str | None, version: str, kernel: str) -> str:
    """kvcd's own name for the image of `instance` (`variant`) at `version` for `kernel`:
    localhost/kvcd/INSTANCE[/VARIANT]/VERSION:KERNEL.

    A field goes in as it is when it is a valid name part (a tag, for the kernel) without "--";
    any other (upper case in a name, '+', '~', a name part over 64 characters) as a readable
    stem, "--" and 12 hex digits of its sha256. No field written as it is holds "--", so
    different configs never share a name (`Foo` and `foo`; instance `a-1.0` at version `2` and
    `a` at `1.0-2`), and the whole name stays within podman's 255 characters, the tag within
    128."""
    path = [_part(instance, _COMPONENT), *([_part(variant, _COMPONENT)] if variant else [])]
    return f"{IMAGE_PREFIX}{'/'.join(path)}/{_part(version, _COMPONENT)}:{_part(kernel, _TAG)}"


def is_image_tag(ref: str) -> bool:
    """Whether `ref` is a name image_tag gives."""
    path, _, tag = ref.removeprefix(IMAGE_PREFIX).rpartition(":")
    parts = path.split("/")
    return (
        ref.startswith(IMAGE_PREFIX)
        and len(parts) in (2, 3)
        and all(_COMPONENT.fullmatch(p) for p in parts)
        and _TAG.fullmatch(tag) is not None
    )


def _part(text: str, grammar: re.Pattern[str]) -> str:
    longest = 128 if grammar is _TAG else _LONGEST_AS_IS
    if grammar.fullmatch(text) and "--" not in text and len(text) <= longest:
        return text
    import hashlib  # only here: every verb imports this module, few names need a digest

    if grammar is _TAG:  # a tag keeps case, '.' and '_'
        stem = re.sub(r"[^A-Za-z0-9_.]+", "-", text).strip("-.")
    else:
        stem = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    return f"{stem[:48].strip('-.') or 'x'}--{hashlib.sha256(text.encode()).hexdigest()[:12]}"
