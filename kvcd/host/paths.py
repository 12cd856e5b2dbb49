"""HostRoot: every host path kvcd touches, under an optional prefix (`--root` / KVCD_ROOT).

Passed explicitly everywhere; there are no module-level path globals. With root "/" these are the
real locations of DESIGN.md's file contract.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

OWN_DIRS = ("/var/lib/kvcd", "/run/kvcd")
"""kvcd's own directories (under any root): every file in them, and every directory below
them, is opened through kvcd/host/files.py, which refuses symlinks and special files there."""
STORE = f"{OWN_DIRS[0]}/store"  # the extracted modules: regular files only, no link among them


@dataclass(frozen=True)
class HostRoot:
    root: Path = Path("/")
    system_tree: bool = False
    """kvcd.toml ``module_tree = "system"``: instance modules are installed into the system's
    own /lib/modules (the module root is the root itself) instead of kvcd's module root."""

    def __call__(self, absolute: str) -> Path:
        """Map an absolute host path into the root."""
        if not absolute.startswith("/"):
            raise ValueError(f"not an absolute host path: {absolute!r}")
        return self.root / absolute.lstrip("/")

    # --- configuration (admin over vendor) ---
    @property
    def etc(self) -> Path:
        return self("/etc/kvcd")

    @property
    def vendor(self) -> Path:
        return self("/usr/lib/kvcd")

    def instance_dirs(self) -> tuple[Path, Path]:
        """Native instance directories, highest precedence first."""
        return (self.etc / "instances", self.vendor / "instances")

    def kvc_conf(self, name: str) -> Path:
        return self(f"/etc/kvc/{name}.conf")

    def kvc_libs(self, name: str) -> tuple[Path, ...]:
        """Where a KVC instance library may live, in the order KVC itself searched."""
        return (
            self(f"/etc/kvc/lib/kvc/{name}-lib.sh"),
            self(f"/usr/lib/kvc/{name}-lib.sh"),
            self(f"/usr/local/lib/kvc/{name}-lib.sh"),
        )

    @property
    def main_config(self) -> Path:
        return self.etc / "kvcd.toml"

    # --- state and runtime ---
    @property
    def state(self) -> Path:
        return self(OWN_DIRS[0])

    @property
    def module_root(self) -> Path:
        """The base directory handed to `depmod -b` and `modprobe -d`: kvcd's own tree, or
        with `system_tree` the root itself (its /lib/modules)."""
        return self.root if self.system_tree else self.state / "modules"

    @property
    def module_lock(self) -> Path:
        """The lock every writer of the module tree holds (beside kvcd's own tree either way)."""
        return self.state / "modules" / ".kvcd.lock"

    @property
    def kernel_dirs(self) -> Path:
        """The module root's lib/modules: one tree per kernel."""
        return self.module_root / "lib" / "modules"

    def kernel_dir(self, kernel: str) -> Path:
        return self.kernel_dirs / kernel

    def store(self, instance: str) -> Path:
        """Extracted module trees of an instance, one directory per version and kernel."""
        return self(STORE) / instance

    @property
    def firmware_dir(self) -> Path:
        """One directory for every instance's firmware files: the kernel's search path."""
        return self.state / "firmware"

    @property
    def firmware_owners(self) -> Path:
        """Which instance owns which file of firmware_dir, and its sha256."""
        return self.state / "firmware.json"

    @property
    def firmware_lock(self) -> Path:
        """Node-wide: held while an instance changes firmware_dir and its owners."""
        return self.runtime / ".firmware.lock"

    @property
    def libraries_proof(self) -> Path:
        """Node-wide, for this boot: the installation of the libraries a child last proved
        importable (kvcd/daemon/libraries.py), so that one proof serves every start."""
        return self.runtime / ".libraries.json"

    @property
    def libraries_lock(self) -> Path:
        """Node-wide: held while an instance proves the libraries, so that twenty instances
        starting at once run one child, not twenty."""
        return self.runtime / ".libraries.lock"

    @property
    def firmware_search_path(self) -> Path:
        """The kernel's custom firmware directory (firmware_class.path), searched first."""
        return self("/sys/module/firmware_class/parameters/path")

    def state_file(self, instance: str) -> Path:
        return self.state / "instances" / f"{instance}.json"

    @property
    def runtime(self) -> Path:
        return self(OWN_DIRS[1])

    # Per-instance files are <instance>.<suffix>; node-wide ones start with a dot, which no
    # instance name does (kvcd/core/names.py), so no instance can name a node-wide file. A
    # suffix with a dot in it must not end in another suffix: instance "a"'s "a.reload.lock"
    # would be instance "a.reload"'s lock (tests/unit/test_names.py checks the set).
    def instance_lock(self, instance: str) -> Path:
        """Held while the instance's record and module files change (daemon and CLI verbs)."""
        return self.runtime / f"{instance}.lock"

    @property
    def owners_lock(self) -> Path:
        """Node-wide: held while an instance checks that no other one owns its modules."""
        return self.runtime / ".modules.lock"

    def force_file(self, instance: str) -> Path:
        return self.runtime / f"{instance}.force"

    def pid_file(self, instance: str) -> Path:
        return self.runtime / f"{instance}.pid"

    def reload_request(self, instance: str) -> Path:
        """`kvcd reload` writes a sequence number here before it signals the daemon."""
        return self.runtime / f"{instance}.reload"

    def drift_note(self, instance: str) -> Path:
        """The drift monitor's own status (watching N files / periodic only)."""
        return self.runtime / f"{instance}.drift.json"

    def links_note(self, instance: str) -> Path:
        """The links an instance provides, as its daemon last saw them."""
        return self.runtime / f"{instance}.links.json"

    def node_note(self, instance: str) -> Path:
        """Present while the daemon cannot reach the node backend: since when, and why."""
        return self.runtime / f"{instance}.node.json"

    def unsaved_record(self, instance: str) -> Path:
        """The instance record while its file in the state directory cannot be written (a
        full or read-only /var): what the daemon knows, for `kvcd status`, until it can."""
        return self.runtime / f"{instance}.unsaved.json"

    def metrics_counts(self, instance: str) -> Path:
        """The daemon's metric counts (phase durations, drift events, image cache hits)."""
        return self.runtime / f"{instance}.metrics.json"

    def reload_lock(self, instance: str) -> Path:
        """Held by `kvcd reload` while it numbers its request."""
        return self.runtime / f"{instance}.reload-lock"

    def reload_answer(self, instance: str) -> Path:
        """The daemon's answer to the newest reload it handled: that number and the outcome."""
        return self.runtime / f"{instance}.reloaded"

    def in_tree_note(self, instance: str) -> Path:
        """The in-tree modules kvcd keeps out for the instance and those it unloaded
        (kvcd/host/intree.py)."""
        return self.runtime / f"{instance}.in-tree.json"

    def keep_out_conf(self, instance: str) -> Path:
        """The modprobe.d file that keeps the instance's in-tree modules to remove from loading."""
        return self("/run/modprobe.d") / f"kvcd-{instance}.conf"

    def instance_files(self, instance: str) -> tuple[Path, ...]:
        """Every file kvcd keeps under the instance's name here (not its store, a directory,
        nor its drift expectations, which kvcd/daemon/driftstore.py names): what `kvcd purge`
        removes, and what no other instance's name may reach (tests/unit/test_names.py)."""
        return (
            self.state_file(instance),
            self.instance_lock(instance),
            self.force_file(instance),
            self.pid_file(instance),
            self.reload_request(instance),
            self.reload_lock(instance),
            self.reload_answer(instance),
            self.drift_note(instance),
            self.links_note(instance),
            self.unsaved_record(instance),
            self.node_note(instance),
            self.metrics_counts(instance),
            self.in_tree_note(instance),
            self.keep_out_conf(instance),
        )

    # --- the running kernel ---
    @property
    def sys_module(self) -> Path:
        return self("/sys/module")

    def system_modules(self, kernel: str) -> Path:
        return self(f"/lib/modules/{kernel}")

    @property
    def boot_id(self) -> Path:
        return self("/proc/sys/kernel/random/boot_id")

    @property
    def osrelease(self) -> Path:
        return self("/proc/sys/kernel/osrelease")
