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
