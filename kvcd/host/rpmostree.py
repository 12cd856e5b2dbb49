"""The rpm-ostree room: which deployment (and kernel) boots next on an image-based host.

It may touch: the rpm-ostree daemon's D-Bus API on the system bus (through pydbus, imported
lazily), `rpm-ostree status --json` through :func:`kvcd.host.run.run` when D-Bus cannot answer,
and, read only under the HostRoot, ``/run/ostree-booted``, ``/run/ostree/`` and the deployment
trees under ``/ostree/deploy``.

The next deployment is the staged one (``rpm-ostree upgrade`` stages it; ostree-finalize-staged
writes the boot entries at shutdown), else the first of the list (the boot loader's default),
which is the booted one when nothing is pending. Its kernel is read from the deployment's own
``usr/lib/modules/<k>/`` (which also covers a kernel replaced with ``override replace``), else
from the base commit's ``ostree.linux`` metadata.

D-Bus: ``org.projectatomic.rpmostree1`` at ``/org/projectatomic/rpmostree1/Sysroot``, interface
``org.projectatomic.rpmostree1.Sysroot``, property ``Deployments`` (``aa{sv}``); the CLI's
``--json`` prints the same dictionaries, so one parser serves both.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvcd.host import ostreemark, pylibs
from kvcd.host.paths import HostRoot

if TYPE_CHECKING:  # the rest of the room, not `kvcd status` (is_ostree_host), needs these
    from kvcd.host.bootloader import NextBoot

log = logging.getLogger(__name__)

BUS_NAME = "org.projectatomic.rpmostree1"
SYSROOT_PATH = "/org/projectatomic/rpmostree1/Sysroot"
SYSROOT_IFACE = "org.projectatomic.rpmostree1.Sysroot"
BOOTED_MARKER = ostreemark.BOOTED_MARKER
STAGED_MARKER = "/run/ostree/staged-deployment"


class RpmOstreeError(Exception):
    """Neither the D-Bus API nor the CLI told what is deployed."""


@dataclass(frozen=True)
class Deployment:
    id: str
    osname: str
    checksum: str
    serial: int
    booted: bool
    staged: bool
    version: str
    kernel: str | None
    modules_dir: Path | None
    """the deployment's usr/lib/modules/<kernel> under the HostRoot, when it exists"""


def is_ostree_host(root: HostRoot) -> bool:
    return ostreemark.is_ostree_host(root)


def deployment_dir(root: HostRoot, osname: str, checksum: str, serial: int) -> Path:
    return root(f"/ostree/deploy/{osname}/deploy/{checksum}.{serial}")


def _str(d: Mapping[str, Any], key: str) -> str:
    value = d.get(key)
    return value if isinstance(value, str) else ""


def _tree_kernel(tree: Path) -> Path | None:
    """The one kernel directory of a deployment tree (it has a vmlinuz), or None."""
    from kvcd.host.bootloader import valid_kernel

    base = tree / "usr" / "lib" / "modules"
    try:
        found = sorted(p for p in base.iterdir() if (p / "vmlinuz").is_file())
    except (FileNotFoundError, NotADirectoryError):
        return None
    return found[-1] if len(found) >= 1 and valid_kernel(found[-1].name) else None


def parse_deployment(root: HostRoot, d: Mapping[str, Any]) -> Deployment:
    from kvcd.host.bootloader import valid_kernel

    osname = _str(d, "osname")
    checksum = _str(d, "checksum")
    serial = d.get("serial")
    serial = serial if isinstance(serial, int) and not isinstance(serial, bool) else 0
    kernel: str | None = None
    modules_dir = None
    if osname and checksum and "/" not in osname + checksum:
        modules_dir = _tree_kernel(deployment_dir(root, osname, checksum, serial))
        if modules_dir is not None:
            kernel = modules_dir.name
    if kernel is None:
        meta = d.get("base-commit-meta")
        linux = meta.get("ostree.linux") if isinstance(meta, Mapping) else None
        if isinstance(linux, str) and valid_kernel(linux):
            kernel = linux
    return Deployment(
        id=_str(d, "id"),
        osname=osname,
        checksum=checksum,
        serial=serial,
        booted=d.get("booted") is True,
        staged=d.get("staged") is True,
        version=_str(d, "version"),
        kernel=kernel,
        modules_dir=modules_dir,
    )


def next_deployment(deployments: Sequence[Deployment]) -> Deployment | None:
    """The staged deployment, else the default (first) one; None for an empty list."""
    for dep in deployments:
        if dep.staged:
            return dep
    return deployments[0] if deployments else None


def dbus_missing() -> str | None:
    """Why the D-Bus API cannot be asked from this process (None: pydbus and PyGObject import).
    Then the rpm-ostree CLI answers instead: logged at start, shown by `kvcd status`."""
    return pylibs.setting_problem("rpm-ostree D-Bus", pylibs.RPMOSTREE_DBUS)


def deployments_dbus(bus_address: str | None = None) -> list[dict[str, Any]]:
    """The Sysroot's ``Deployments`` property over D-Bus (system bus, or `bus_address`)."""
    try:
        import pydbus
        from gi.repository import GLib
    except ImportError:  # optional (kvcd/host/pylibs.py): the CLI answers the same
        raise RpmOstreeError(dbus_missing() or "no D-Bus client") from None

    try:
        bus = pydbus.connect(bus_address) if bus_address else pydbus.SystemBus()
        proxy = bus.get(BUS_NAME, SYSROOT_PATH)
        value = proxy.Deployments
    except (GLib.Error, KeyError, AttributeError) as exc:
        raise RpmOstreeError(f"D-Bus {BUS_NAME}: {exc}") from exc
    if not isinstance(value, list):
        raise RpmOstreeError(f"D-Bus {BUS_NAME}: Deployments is {type(value).__name__}")
    return [dict(d) for d in value if isinstance(d, Mapping)]


def parse_status_json(text: str) -> list[dict[str, Any]]:
    """The deployments of `rpm-ostree status --json` output."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise RpmOstreeError(f"rpm-ostree status --json: not JSON: {exc}") from exc
    deps = data.get("deployments") if isinstance(data, dict) else None
    if not isinstance(deps, list):
        raise RpmOstreeError("rpm-ostree status --json: no 'deployments' list")
    return [d for d in deps if isinstance(d, dict)]


def deployments_cli() -> list[dict[str, Any]]:
    from kvcd.host.run import CommandError, run

    try:
        out = run(["rpm-ostree", "status", "--json"], timeout=120).stdout
    except CommandError as exc:
        raise RpmOstreeError(f"rpm-ostree status --json: {exc}") from exc
    return parse_status_json(out)


def read_deployments(root: HostRoot, bus_address: str | None = None) -> list[Deployment]:
    """Deployments from D-Bus, else from the CLI; raises :class:`RpmOstreeError` if neither."""
    try:
        raw = deployments_dbus(bus_address)
    except RpmOstreeError as dbus_exc:
        log.debug("%s; asking the rpm-ostree CLI", dbus_exc)
        try:
            raw = deployments_cli()
        except RpmOstreeError as cli_exc:
            raise RpmOstreeError(f"{dbus_exc}; {cli_exc}") from cli_exc
    return [parse_deployment(root, d) for d in raw]


def next_boot(root: HostRoot, bus_address: str | None = None) -> NextBoot | None:
    """The next kernel of an rpm-ostree host; None when this is not one."""
    from kvcd.host.bootloader import NextBoot

    if not is_ostree_host(root):
        return None
    try:
        deps = read_deployments(root, bus_address)
    except RpmOstreeError as exc:
        return NextBoot(None, "unknown", str(exc))
    dep = next_deployment(deps)
    if dep is None:
        return NextBoot(None, "unknown", "rpm-ostree lists no deployments")
    what = "staged" if dep.staged else "booted" if dep.booted else "default"
    name = f"{what} deployment {dep.id or dep.checksum[:12]}" + (
        f" ({dep.version})" if dep.version else ""
    )
    if dep.kernel is None:
        return NextBoot(None, "unknown", f"{name}: its kernel cannot be told")
    modules = dep.modules_dir or root.system_modules(dep.kernel)
    return NextBoot(dep.kernel, "rpm-ostree", name, modules)


def watch_dirs(root: HostRoot) -> list[Path]:
    """Where staging shows: /run/ostree (the staged-deployment marker) and each stateroot's
    deploy/ directory (new deployment trees)."""
    dirs = [root(STAGED_MARKER).parent]
    base = root("/ostree/deploy")
    try:
        dirs += [p / "deploy" for p in sorted(base.iterdir()) if p.is_dir()]
    except (FileNotFoundError, NotADirectoryError):
        dirs.append(base)
    return dirs
