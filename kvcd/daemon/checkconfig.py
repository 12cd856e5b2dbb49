"""`kvcd check-config`: every instance's config checked offline (its keys, its module owners,
its image tag against its neighbours', its registry credentials), and with a kernel its plan.
Reads and prints; changes nothing.
"""

from __future__ import annotations

import os

from kvcd.config.loader import list_instances, load_instance, load_settings
from kvcd.config.model import ConfigError, InstanceConfig, Settings
from kvcd.config.rules import KVC_GLOBAL
from kvcd.core import owners, state
from kvcd.core.state import StepFailed
from kvcd.daemon.images import archive_problem
from kvcd.daemon.instance import Instance, config_checks, held_modules
from kvcd.daemon.observe import host_for
from kvcd.daemon.record import KernelUnknown, running_kernel
from kvcd.host import files
from kvcd.host.paths import HostRoot
from kvcd.host.pylibs import check_settings, locate


def check_config_command(root: HostRoot, names: list[str], kernel: str | None) -> int:
    """`kvcd check-config NAME|--all [--kernel K]`: exit 0 every instance is ok, 2 some is not
    (or kvcd.toml is not), else 1 when the archive one would load is not there (yet)."""

    settings = load_settings(root)  # ConfigError: kvcd.toml, or KVC's node-wide conf
    check_settings(root, settings, locate)  # ConfigError: a setting needs a missing library
    if os.path.lexists(root.kvc_conf(KVC_GLOBAL)):  # load_settings checked it
        print(f"{root.kvc_conf(KVC_GLOBAL)}: ok (KVC's node-wide conf: container runtime podman)")
    if not names:
        print("no instances configured")
        return 0
    root = host_for(root, settings)
    if kernel is None:
        try:
            kernel = running_kernel(root)
        except KernelUnknown:  # offline check of a tree without /proc: validate, do not plan
            kernel = None
    node = _Node(root)
    return max(_check_one(node, settings, name, kernel) for name in names)


class _Node:
    """What check-config reads of every instance, read once per run: each config (checking N
    instances against their neighbours would load every config N times) and the modules each
    instance holds now."""

    def __init__(self, root: HostRoot) -> None:

        self.root = root
        self.names = list_instances(root)
        self.held = held_modules(root)
        self._configs: dict[str, InstanceConfig | Exception] = {}

    def config(self, name: str) -> InstanceConfig:
        """The instance's config; its ConfigError, every time it is asked for."""

        if name not in self._configs:
            try:
                self._configs[name] = load_instance(self.root, name)
            except ConfigError as exc:
                self._configs[name] = exc
        got = self._configs[name]
        if isinstance(got, Exception):
            raise got
        return got


# What _check_one answers: the exit status of check-config for that instance alone.
_OK, _NO_IMAGE, _INVALID = 0, 1, 2


def _check_one(node: _Node, settings: Settings, name: str, kernel: str | None) -> int:
    """check-config of one instance: its config, its modules' owner, its plan. Printed; _OK,
    _INVALID (a config kvcd refuses, no plan for this node, an archive that is no file), or
    _NO_IMAGE (its archive is not there yet: the daemon waits for it, README "Air-gapped
    nodes")."""

    root = node.root
    try:
        cfg = node.config(name)
        checked = config_checks(root, cfg, settings)
    except ConfigError as exc:
        print(f"{name}: INVALID: {exc}")
        return _INVALID
    problem, warnings = _neighbours(node, cfg)
    if problem:
        print(f"{name}: INVALID: {problem}")
        return _INVALID
    print(f"{name}: ok ({cfg.source}, {cfg.format} format)")
    for line in [*warnings, *checked]:
        print(f"  warning: {line}")
    print(f"  version {cfg.version}; load order: {', '.join(m.name for m in cfg.modules)}")
    if not kernel:
        return _OK
    inst = Instance(root, settings, cfg, kernel)
    if inst.cfg.variant is not None:
        print(f"  image variant for this node: {inst.cfg.variant}")
    if inst.no_variant is not None:
        print(f"  {name}: NO PLAN: {inst.no_variant}")
        return _INVALID
    try:
        planned = inst.plan("load")
    except StepFailed as exc:
        print(f"  {name}: NO PLAN: {exc}")
        return _INVALID
    print(f"  plan for {kernel}:")
    for line in planned.describe():
        print(f"    {line}")

    unreadable = archive_problem(planned)
    if unreadable is None:
        return _OK
    print(f"  {name}: NO IMAGE: {files.os_error(unreadable)}")
    return _NO_IMAGE if isinstance(unreadable, FileNotFoundError) else _INVALID


def _neighbours(node: _Node, cfg: InstanceConfig) -> tuple[str, list[str]]:
    """What another instance makes impossible for this one: the error ("" when none) when
    another holds one of its modules; a warning per other configured
    instance that lists some of its modules (only one of them can be running)."""

    name, modules = cfg.name, [m.kernel_name for m in cfg.modules]
    held = owners.shared(name, modules, {o: m for o, m in node.held.items() if o != name})
    if held:
        return f"{state.MODULE_OWNED}: {owners.describe(name, held)}", []
    others: dict[str, InstanceConfig] = {}
    for other in node.names:
        if other != name:
            try:
                others[other] = node.config(other)
            except ConfigError:  # said where that instance is checked
                continue
    found: dict[str, list[str]] = {}
    claims = {o: [m.kernel_name for m in c.modules] for o, c in others.items()}
    for s in owners.shared(name, modules, claims):
        found.setdefault(s.other, []).append(s.module)
    return "", [
        f"{', '.join(mods)} also listed by instance {other}: one owner per module, only one "
        "of the two can be running"
        for other, mods in found.items()
    ]
