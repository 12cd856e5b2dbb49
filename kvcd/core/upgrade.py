"""Ordered upgrade (KMM's protocol): the node label decides which version may be loaded.

With `ordered_upgrade = true` an instance loads its configured version V only while the label
(`kmm.node.kubernetes.io/version-module.<ns>.<name>`, or `<prefix>/version.<instance>`) equals V.
Label removed -> unload. Label changed to the new version (and the config says the new version)
-> unload the old, load the new (the planner swaps them). While the admin has updated the config
but not yet the label, the old version stays loaded: the label, not the config, says when. It
stays across a reboot or a restart that unloaded it too: while kvcd's store still has the
labelled version whole for the running kernel, that version is loaded again from there (KMM
keeps the labelled version on the node until its label changes). When the store no longer has
it, nothing can be loaded: the modules go, and the state says Degraded, not Done.

Pure and stateless: the decision is a function of (label, configured version, whether the store
has the labelled version, loaded version), all re-read from the node, the store and /sys/module
on every reconcile, so a restart in the middle of an upgrade re-derives the same decision (the
table rows "reboot mid-upgrade", "restart mid-upgrade" … in tests/unit/test_upgrade.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcd.core.state import (
    DEGRADED,
    LABEL_ABSENT,
    NODE_UNAVAILABLE,
    UPGRADE_PENDING,
    reason_text,
)

# Verbs (the daemon maps them onto its LOAD / UNLOAD / HOLD verdicts).
LOAD = "load"
LOAD_LABELED = "load-labeled"  # load the labelled version (Decision.version), from the store
UNLOAD = "unload"
HOLD = "hold"


# What the label says, relative to the configured version.
ABSENT = "absent"
CONFIGURED = "configured"  # label == configured version
STORED = "stored"  # label names another version, whole in kvcd's store for this kernel
OTHER = "other"  # label names some other version, which the store does not have

# What is loaded now (any instance module in /sys/module), relative to label and config.
NONE = "none"
IS_CONFIGURED = "configured"  # loaded version == configured version
IS_LABELED = "labeled"  # loaded version == label value != configured version
IS_OTHER = "other"  # loaded, neither (or unknown)

# (label, loaded) -> (verb, state recorded: "" = Done, reason code). Literal on purpose: every
# row is a documented decision and one test row.
TABLE: dict[tuple[str, str], tuple[str, str, str]] = {
    # Label equals the configured version: load it (swapping out whatever else is loaded).
    (CONFIGURED, NONE): (LOAD, "", ""),
    (CONFIGURED, IS_CONFIGURED): (LOAD, "", ""),
    (CONFIGURED, IS_OTHER): (LOAD, "", ""),
    # Label removed: unload (KMM step 4), whatever is loaded.
    (ABSENT, NONE): (UNLOAD, "", LABEL_ABSENT),
    (ABSENT, IS_CONFIGURED): (UNLOAD, "", LABEL_ABSENT),
    (ABSENT, IS_OTHER): (UNLOAD, "", LABEL_ABSENT),
    # Config moved to V2 but the label still pins V1, which is loaded: keep V1 (KMM step 2).
    (STORED, IS_LABELED): (HOLD, "Done", UPGRADE_PENDING),
    (OTHER, IS_LABELED): (HOLD, "Done", UPGRADE_PENDING),
    # The label pins V1, which is not loaded (a reboot, a restart that unloaded, the label moved
    # back) but is in the store: load V1 from there (KMM loads the version the label names).
    (STORED, NONE): (LOAD_LABELED, "", UPGRADE_PENDING),
    (STORED, IS_CONFIGURED): (LOAD_LABELED, "", UPGRADE_PENDING),
    (STORED, IS_OTHER): (LOAD_LABELED, "", UPGRADE_PENDING),
    # Label names a version this config does not provide and the store does not have, and it
    # is not what is loaded: nothing may be loaded, and the node is not as the label asks.
    (OTHER, NONE): (UNLOAD, DEGRADED, UPGRADE_PENDING),
    (OTHER, IS_CONFIGURED): (UNLOAD, DEGRADED, UPGRADE_PENDING),
    (OTHER, IS_OTHER): (UNLOAD, DEGRADED, UPGRADE_PENDING),
}


@dataclass(frozen=True)
class Decision:
    verb: str
    state: str  # the state recorded ("" = Done)
    code: str  # "" for a plain load
    detail: str = ""
    version: str = ""  # LOAD_LABELED: the version to load (the label's), not the configured one

    @property
    def reason(self) -> str:
        return reason_text(self.code, self.detail)


def classify_label(label: str | None, configured: str, *, stored: bool = False) -> str:
    """`stored`: the label's version is whole in kvcd's store for the running kernel."""
    if label is None or label == "":
        return ABSENT
    if label == configured:
        return CONFIGURED
    return STORED if stored else OTHER


def classify_loaded(
    loaded: bool, loaded_version: str | None, label: str | None, configured: str
) -> str:
    if not loaded:
        return NONE
    if loaded_version == configured:
        return IS_CONFIGURED
    if loaded_version is not None and label and loaded_version == label:
        return IS_LABELED
    return IS_OTHER


def decide(
    label: str | None,
    configured: str,
    loaded: bool,
    loaded_version: str | None,
    label_key: str,
    *,
    stored: bool,
) -> Decision:
    """The verdict for one reconcile. `label` None = the label is not on the node; `stored`:
    the label's version is whole in kvcd's store for the running kernel."""
    lk = classify_label(label, configured, stored=stored)
    ld = classify_loaded(loaded, loaded_version, label, configured)
    verb, st, code = TABLE[(lk, ld)]
    if code == LABEL_ABSENT:
        detail = f"label {label_key} is not set; modules unloaded"
    elif code == UPGRADE_PENDING and verb in (HOLD, LOAD_LABELED):
        # What the record says once the labelled version is loaded (the hold that follows).
        detail = (
            f"label {label_key}={label} keeps version {label} loaded; "
            f"configured {configured} waits for the label"
        )
    elif code == UPGRADE_PENDING:
        detail = (
            f"label {label_key}={label} names a version kvcd cannot load (the configured "
            f"version is {configured}; {label} is not in kvcd's store for this kernel): "
            f"nothing is loaded until the label names {configured}"
        )
    else:
        detail = ""
    version = (label or "") if verb == LOAD_LABELED else ""
    return Decision(verb, st, code, detail, version)


def unreachable(label_key: str, detail: str) -> Decision:
    """The node cannot be read and no label was ever seen: change nothing (keep modules)."""
    return Decision(
        HOLD,
        "Working",
        NODE_UNAVAILABLE,
        f"cannot read label {label_key} ({detail}); keeping modules as they are",
    )
