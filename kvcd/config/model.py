"""The validated shape of an instance. Everything downstream takes these, never raw dicts."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from kvcd.core import names
from kvcd.core.modulespec import ModuleSpec

if TYPE_CHECKING:
    from kvcd.core.capabilities import LinkSpec

__all__ = [
    "BuildSource",
    "ConfigError",
    "InstanceConfig",
    "LinkSpec",
    "ModuleSpec",
    "Settings",
    "Variant",
]


def __getattr__(name: str) -> Any:
    """LinkSpec on first use: only a config with expect_links needs kvcd.core.capabilities, and
    `kvcd status` parses every config (issue #20)."""
    if name == "LinkSpec":
        from kvcd.core.capabilities import LinkSpec

        return LinkSpec
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# A capability set (GEP-33): capability name -> values, as a hashable tuple of pairs.
Capabilities = tuple[tuple[str, tuple[str, ...]], ...]


class ConfigError(Exception):
    """A config file is wrong. The message names the file, the line when known, and the key."""

    def __init__(self, path: Path | str, message: str, line: int | None = None) -> None:
        self.path = Path(path)
        self.line = line
        self.detail = message
        where = f"{self.path}:{line}" if line else str(self.path)
        super().__init__(f"{where}: {message}")


@dataclass(frozen=True)
class BuildSource:
    """Where the driver image comes from when it has to be built."""

    context: str  # local directory, https:// git URL, or tarball (path or https URL)
    containerfile: str = "Containerfile"
    args: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Variant:
    """One image variant of an instance (`[variants.<name>]`): where its image comes from and
    the capability set it supports (GEP-33). Missing capabilities default to the instance's
    preference table."""

    name: str
    capabilities: Capabilities = ()
    image: str | None = None
    build: BuildSource | None = None


@dataclass(frozen=True)
class InstanceConfig:
    name: str
    source: Path  # the file it was read from
    version: str
    modules: tuple[ModuleSpec, ...]
    build: BuildSource | None = None
    # A prebuilt image to pull first, with {kernel} and {version} placeholders.
    image: str | None = None
    # Pinned to an image archive on the node (`podman save` output; {kernel} and {version}
    # placeholders): loaded when the image is not cached, never pulled or built (air gaps).
    image_archive: str = ""
    # Registry credentials for `image` (containers-auth.json(5)); "" = the node's pull_secret.
    auth_file: str = ""
    # Verify the registry's TLS certificate on pulls; false only for a registry the admin
    # chose to trust without one (a lab).
    tls_verify: bool = True
    # Where the module files sit inside the image; {kernel} is replaced.
    modules_path: str = "/lib/modules/{kernel}/"
    # Where firmware files sit inside the image (KMM's firmwarePath), {kernel} replaced; ""
    # = none. kvcd installs them into /var/lib/kvcd/firmware (kvcd/daemon/firmware.py).
    firmware_path: str = ""
    # What stopping does with the loaded modules: "if-idle" | "never" | "drain" (core/drain.py).
    unload_policy: str = "if-idle"
    keep_images: int = 3
    # In-tree modules (kernel names) unloaded before the instance loads, in this order, kept from
    # loading while it is active and loaded back when it unloads (KMM's inTreeModulesToRemove).
    in_tree_modules_to_remove: tuple[str, ...] = ()
    wrapper_args: tuple[str, ...] = ()
    # KVC compatibility: the root-owned hook library, when the instance has one.
    kvc_lib: Path | None = None
    # Other assignments of a KVC .conf, handed to the hooks as data: shell variables of the
    # library, passed on to the programs it runs only when the .conf exports them.
    kvc_env: tuple[tuple[str, str], ...] = ()
    kvc_exported: tuple[str, ...] = ()  # the .conf's variables it exports
    format: str = "toml"  # "toml" or "kvc"
    # Image variants (GEP-33) and the preference table that orders capability values; the
    # daemon picks one variant for the node (kvcd/daemon/observe.py resolve_variant), which
    # then supplies `image`/`build` and is named in `variant`.
    variants: tuple[Variant, ...] = ()
    capabilities: Capabilities = ()
    variant: str | None = None
    # Device gating: modalias globs or vendor:device ids; with none present nothing loads.
    requires_device: tuple[str, ...] = ()
    unload_on_device_removal: bool = False
    # Network-driver readiness: Done only once these links exist (and are up when asked).
    expect_links: tuple[LinkSpec, ...] = ()
    expect_links_timeout: float = 120.0
    # Instances that must be loaded first (and unloaded last): SRO's dependsOn.
    depends_on: tuple[str, ...] = ()
    # Drift: reconcile when this config file changes on disk (default: only on reload).
    watch_config: bool = False
    # Drift: an instance module removed/replaced outside kvcd -> "degrade" | "reload".
    on_external_unload: str = "degrade"
    # Ordered upgrade (KMM protocol): load `version` only while the node label equals it.
    ordered_upgrade: bool = False
    # The label to follow; None = "<annotation_prefix>/version.<instance>".
    upgrade_label: str | None = None
    # "none" | "cluster"; None = the node-wide Settings.drain.
    drain: str | None = None
    # Before a kernel update: "weak-updates-first" reuses the modules built for the running
    # kernel when they are kABI-compatible with the next one (else builds); "rebuild" always builds.
    kabi: str = "weak-updates-first"

    def image_ref(self, kernel: str) -> str | None:
        return self._expand(self.image, kernel) if self.image else None

    def archive_path(self, kernel: str) -> str | None:
        return self._expand(self.image_archive, kernel) if self.image_archive else None

    def _expand(self, template: str, kernel: str) -> str:
        return template.replace("{kernel}", kernel).replace("{version}", self.version)

    def image_tag(self, kernel: str) -> str:
        """kvcd's own name for this instance's image for `kernel` (kvcd.core.names.image_tag):
        localhost/kvcd/<instance>[/<variant>]/<version>:<kernel>, one per config and kernel."""
        return names.image_tag(self.name, self.variant, self.version, kernel)

    def path_in_image(self, kernel: str) -> str:
        return self.modules_path.replace("{kernel}", kernel)

    def firmware_in_image(self, kernel: str) -> str:
        return self.firmware_path.replace("{kernel}", kernel)

    def kvc_vars(self) -> tuple[tuple[str, str], ...]:
        """The KMOD_* variables KVC libraries read, then the rest of the .conf, as data."""
        typed = [
            ("KMOD_SOFTWARE_VERSION", self.version),
            ("KMOD_NAMES", " ".join(m.name for m in self.modules)),
        ]
        if self.build is not None:
            typed += [
                ("KMOD_CONTAINER_BUILD_CONTEXT", self.build.context),
                ("KMOD_CONTAINER_BUILD_FILE", self.build.containerfile),
            ]
        return (*typed, *self.kvc_env)


@dataclass(frozen=True)
class Settings:
    """Node-wide settings from /etc/kvcd/kvcd.toml (vendor defaults under /usr/lib/kvcd)."""

    podman_socket: str = "unix:///run/podman/podman.sock"
    annotation_prefix: str = "kvcd.io"
    # Drift: seconds between full re-checks of every instance's files (safety net for lost
    # watches, and the only check when the inotify watch limit is hit).
    drift_interval: int = 300
    # Where node state is reported: "file" (/var/lib/kvcd/node.json) or "kubernetes".
    node_backend: str = "file"
    node_name: str = ""  # "" = $KVCD_NODE_NAME, else the hostname
    kubeconfig: str = ""  # "" = in-cluster service account
    drain: str = "none"  # default drain mode of instances: "none" | "cluster"
    drain_timeout: float = 600.0  # seconds to wait for DrainComplete before Degraded
    # Capability values the admin pins for this node; they replace discovered ones (GEP-33).
    node_capabilities: Capabilities = ()
    # Where instance modules are installed: "kvcd" (kvcd's own module root under
    # /var/lib/kvcd/modules) or "system" (the system's /lib/modules, with weak-modules).
    module_tree: str = "kvcd"
    # node_exporter's textfile collector directory: kvcd-<instance>.prom files, rewritten after
    # each change (kvcd/daemon/metrics.py); "" = none (`kvcd metrics` still prints them).
    metrics_dir: str = "/run/kvcd/metrics"
    # Module signing (kvcd/host/modsign.py): the private key (PEM, mode 600) and its X.509
    # certificate; both or neither. Every module kvcd extracts is signed with them.
    sign_key: str = ""
    sign_cert: str = ""
    sign_hash: str = "sha256"
    # Registry credentials for every instance's pulls (containers-auth.json(5), e.g. the
    # kubelet's /var/lib/kubelet/config.json); an instance's auth_file is asked first.
    pull_secret: str = ""
    # OS-update gate (issue #18): hold a systemd shutdown inhibitor (block) while an instance
    # failed to prepare for the kernel the node boots next (kvcd/host/inhibit.py).
    inhibit_reboot: bool = False
    # Seconds a KVC library function (build_kmods, load_kmods, unload_kmods) may run before it
    # is stopped and its instance goes Degraded (HookFailed): below the unit's
    # TimeoutStartSec=30min, so a hung first start ends with its reason written down.
    hook_timeout: float = 1200.0
    # Seconds a pull, build or image load through podman may take before kvcd disconnects and
    # its instance goes Degraded (PullFailed, BuildFailed, ImportFailed). Generous: a big
    # driver's build on a small node may take tens of minutes. While kvcd waits for podman it
    # pushes the unit's start timeout out (EXTEND_TIMEOUT_USEC, kvcd.host.systemd.Keepalive),
    # so this limit, which kvcd explains, ends the wait, not systemd's kill.
    image_timeout: float = 3600.0


def is_kvcd_tag(ref: str) -> bool:
    """Whether `ref` is a name kvcd gives (InstanceConfig.image_tag)."""
    return names.is_image_tag(ref)


class ConfigLocations(Protocol):
    """The part of HostRoot this layer needs (HostRoot satisfies it structurally)."""

    def instance_dirs(self) -> tuple[Path, Path]: ...

    def kvc_conf(self, name: str) -> Path: ...

    def kvc_libs(self, name: str) -> tuple[Path, ...]: ...

    @property
    def main_config(self) -> Path: ...

    @property
    def vendor(self) -> Path: ...
