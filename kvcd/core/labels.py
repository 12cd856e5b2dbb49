"""Kubernetes' rules for label values, and KMM's for its ordered-upgrade label. Pure.

kvcd refuses, at check-config and at the CLI, any value a cluster would refuse: a node set up
without a cluster (the file backend) must not hold labels it could not hold with one.
"""

from __future__ import annotations

import re

# A label value: empty, or at most 63 characters of [A-Za-z0-9-_.], alphanumeric at both ends.
_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?")
LABEL_VALUE_RULE = (
    "a label value is empty or at most 63 characters of [A-Za-z0-9-_.], alphanumeric at both ends"
)


def valid_label_value(value: str) -> bool:
    return _LABEL_VALUE.fullmatch(value) is not None


# KMM's ordered-upgrade label, and KMM's own limit on its "<namespace>.<name>" part (KMM
# refuses a Module whose namespace and name together exceed it, so no node can carry more).
KMM_LABEL_PREFIX = "kmm.node.kubernetes.io/version-module."
KMM_NAME_MAX = 39


def kmm_label_problem(key: str) -> str | None:
    """Why `key`, a KMM ordered-upgrade label, cannot be one KMM makes; None when it can."""
    if not key.startswith(KMM_LABEL_PREFIX):
        return None
    namespace, _, module = key[len(KMM_LABEL_PREFIX) :].partition(".")
    if not namespace or not module:
        return f"{key!r} must be {KMM_LABEL_PREFIX}<namespace>.<module name>"
    if len(namespace) + len(module) > KMM_NAME_MAX:
        return (
            f"{key!r}: KMM allows at most {KMM_NAME_MAX} characters of namespace and module name "
            f"together, this has {len(namespace) + len(module)}"
        )
    return None
