"""Node annotation and label keys kvcd uses, within Kubernetes' 63-character name limit.

A key is `<prefix>/<name>`; the name part may have at most 63 characters of [A-Za-z0-9-_.],
alphanumeric at both ends. Every key of one instance shares one *stem*: the instance name when
it fits (at most STEM_MAX characters, all allowed), else the first characters of the name made
safe, '-', and 10 hex digits of its SHA-256 (`kvcd status` shows the mapping). Pure: no I/O.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

NAME_MAX = 63
# The longest per-instance suffix is ".next-kernel" (12): 63 - 12 = 51.
SUFFIXES = ("state", "reason", "version", "kernel", "next-kernel", "boot-id", "ready", "drain")
STEM_MAX = NAME_MAX - 1 - max(len(s) for s in SUFFIXES)
_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")
_UNSAFE = re.compile(r"[^-A-Za-z0-9_.]")
HASH_LEN = 10

# Node-wide drain handshake (SR-IOV operator shape).
DRAIN = "drain"
DRAIN_CURRENT = "drain-current"


def valid_name(name: str) -> bool:
    return _NAME.fullmatch(name) is not None


def stem(instance: str) -> str:
    """The instance's part of every key name: the name itself, or a safe prefix + hash."""
    if len(instance) <= STEM_MAX and valid_name(instance):
        return instance
    import hashlib  # only for a name too long for a key

    digest = hashlib.sha256(instance.encode()).hexdigest()[:HASH_LEN]
    head = _UNSAFE.sub("-", instance)[: STEM_MAX - HASH_LEN - 1].strip("-_.")
    return f"{head}-{digest}" if head else f"i-{digest}"


@dataclass(frozen=True)
class Keys:
    """The keys of one instance under one prefix."""

    prefix: str
    instance: str

    @property
    def stem(self) -> str:
        return stem(self.instance)

    @property
    def hashed(self) -> bool:
        return self.stem != self.instance

    def of(self, suffix: str) -> str:
        if suffix not in SUFFIXES:
            raise ValueError(f"unknown key suffix {suffix!r}")
        return f"{self.prefix}/{self.stem}.{suffix}"

    @property
    def state(self) -> str:
        return self.of("state")

    @property
    def reason(self) -> str:
        return self.of("reason")

    @property
    def ready(self) -> str:
        return self.of("ready")

    @property
    def drain_request(self) -> str:
        """This instance's claim on the node-wide drain request (value: when it was made)."""
        return self.of("drain")

    @property
    def version_label(self) -> str:
        """The default ordered-upgrade label: `<prefix>/version.<stem>`."""
        return f"{self.prefix}/version.{self.stem}"

    def ours(self, key: str) -> bool:
        """Is `key` one this instance writes?"""
        return key in {self.of(s) for s in SUFFIXES}


def drain_key(prefix: str) -> str:
    return f"{prefix}/{DRAIN}"


def drain_current_key(prefix: str) -> str:
    return f"{prefix}/{DRAIN_CURRENT}"


def kmm_label(namespace: str, module: str) -> str:
    """KMM's ordered-upgrade label; KMM limits namespace + name to 39 characters."""
    return f"kmm.node.kubernetes.io/version-module.{namespace}.{module}"
