"""Instance states and the stable vocabulary of reasons operators grep and script against."""

from __future__ import annotations

from dataclasses import dataclass

DONE = "Done"
WORKING = "Working"
DEGRADED = "Degraded"

# Unload policies (`unload_policy`, issue #17): what stopping the instance does with its modules;
# the steps are the table kvcd.core.drain.STOP.
IF_IDLE = "if-idle"  # unload; a module in use refuses the stop, its holders named
NEVER = "never"  # the modules stay loaded (drivers the node cannot run without)
UNLOAD_DRAIN = "drain"  # unload; a module in use first asks the cluster to drain the node
UNLOAD_POLICIES = (IF_IDLE, NEVER, UNLOAD_DRAIN)

# Reason codes: the first word of every reason. Stable; add, never rename.
CONFIG_INVALID = "ConfigInvalid"
PODMAN_UNAVAILABLE = "PodmanUnavailable"
PULL_FAILED = "PullFailed"
# The instance's image archive (image_archive, `kvcd image import`) is missing, is not a
# regular file, or is not one image of this instance's version and kernel.
IMPORT_FAILED = "ImportFailed"
BUILD_FAILED = "BuildFailed"
EXTRACT_FAILED = "ExtractFailed"
WRONG_KERNEL = "WrongKernel"
KERNEL_TREE_MISSING = "KernelTreeMissing"
# The modules could not be put into the module tree (module_tree = "system": /lib/modules is
# read-only, or holds a directory kvcd did not install).
INSTALL_FAILED = "InstallFailed"
DEPMOD_FAILED = "DepmodFailed"
LOAD_FAILED = "LoadFailed"
UNLOAD_FAILED = "UnloadFailed"
MODULE_IN_USE = "ModuleInUse"
VERIFY_FAILED = "VerifyFailed"
HOOK_FAILED = "HookFailed"
# Module signatures (kvcd/host/modsign.py): signing with the configured key failed; this kernel
# loads only signed modules and one is not signed, or signed by a key it does not trust.
SIGN_FAILED = "SignFailed"
SIGNATURE_REQUIRED = "SignatureRequired"
UNTRUSTED_SIGNER = "UntrustedSigner"
# Firmware (kvcd/daemon/firmware.py): a file of the same name with other content is another
# instance's (or not kvcd's) in the node's firmware directory; the kernel's firmware search path
# is set to another directory, or this kernel has none.
FIRMWARE_CONFLICT = "FirmwareConflict"
FIRMWARE_PATH = "FirmwarePath"
# Drift (kvcd/daemon/drift.py): a file kvcd owns differs from what kvcd left there; an instance
# module was removed from the kernel, or another build of it loaded, outside kvcd.
DRIFT = "Drift"
MODULE_REMOVED = "ModuleRemoved"
MODULE_REPLACED = "ModuleReplaced"
# Capabilities (kvcd/daemon/variants.py, links.py): no image variant fits the node; expected
# network links did not appear in time.
NO_VARIANT = "NoVariant"
LINKS_MISSING = "LinksMissing"
# Node state machines (kvcd/core/upgrade.py, drain.py): the ordered-upgrade label holds the
# instance back or is absent, the node object cannot be read; a drain or reboot was asked of the
# cluster and is pending, or its answer did not come in time.
UPGRADE_PENDING = "UpgradePending"
LABEL_ABSENT = "LabelAbsent"
NODE_UNAVAILABLE = "NodeUnavailable"
DRAIN_PENDING = "DrainRequired"
DRAIN_TIMEOUT = "DrainTimeout"
REBOOT_PENDING = "RebootRequired"
# A file of kvcd's own (the instance record, a drift record, the node file) did not parse and
# was set aside, or is not a regular file; kvcd rebuilds what it can from the host.
STATE_DAMAGED = "StateDamaged"
# The host refused kvcd's own files (read-only, full, permission denied): retried with backoff.
HOST_ERROR = "HostError"
# Another instance holds a module this one lists (kvcd/core/owners.py): one owner per module.
MODULE_OWNED = "ModuleOwned"
# A change was stopped before it finished: the daemon's stop cut into a wait for podman (a
# build, a pull; kvcd.host.interrupt), or ^C a one-shot verb. What it had done was undone.
STOPPED = "Stopped"
REASONS = (
    CONFIG_INVALID,
    PODMAN_UNAVAILABLE,
    PULL_FAILED,
    IMPORT_FAILED,
    BUILD_FAILED,
    EXTRACT_FAILED,
    WRONG_KERNEL,
    KERNEL_TREE_MISSING,
    INSTALL_FAILED,
    DEPMOD_FAILED,
    LOAD_FAILED,
    UNLOAD_FAILED,
    MODULE_IN_USE,
    VERIFY_FAILED,
    HOOK_FAILED,
    DRIFT,
    MODULE_REMOVED,
    MODULE_REPLACED,
    NO_VARIANT,
    LINKS_MISSING,
    UPGRADE_PENDING,
    LABEL_ABSENT,
    NODE_UNAVAILABLE,
    DRAIN_PENDING,
    DRAIN_TIMEOUT,
    REBOOT_PENDING,
    STATE_DAMAGED,
    MODULE_OWNED,
    HOST_ERROR,
    SIGN_FAILED,
    SIGNATURE_REQUIRED,
    UNTRUSTED_SIGNER,
    FIRMWARE_CONFLICT,
    FIRMWARE_PATH,
    STOPPED,
)

# Annotations and status lines stay readable; the journal keeps the whole story.
MAX_REASON = 512


class StepFailed(Exception):
    """A step could not be applied. `transient` failures are retried with backoff."""

    def __init__(self, code: str, detail: str, *, transient: bool = False) -> None:
        if code not in REASONS:
            raise ValueError(f"unknown reason code {code!r}")
        self.code = code
        self.detail = detail
        self.transient = transient
        super().__init__(reason_text(code, detail))


def reason_text(code: str, detail: str) -> str:
    """The one spelling of a reason: "<Code>: <detail>", or the detail alone for a note that has
    no code ("waiting for links: …", "no device")."""
    text = (f"{code}: {detail}" if detail else code) if code else detail
    return text if len(text) <= MAX_REASON else text[: MAX_REASON - 1] + "…"


@dataclass(frozen=True)
class Backoff:
    """Retry delays for transient failures: doubling from `first`, capped at `cap` seconds."""

    first: float = 2.0
    cap: float = 300.0

    def delay(self, attempt: int) -> float:
        return min(self.cap, self.first * 2.0 ** max(0, attempt))
