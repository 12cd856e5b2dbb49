"""`kvcd [--root DIR] <verb> …`: parse argv, dispatch, return the exit code. Nothing else here.

Exit codes: 0 ok, 1 failed, 2 bad usage or bad configuration.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvcd.host.paths import HostRoot

if TYPE_CHECKING:  # imported where used: `kvcd status` must not pay for the config loader
    from kvcd.config.model import InstanceConfig, Settings

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 70  # 70: EX_SOFTWARE

log = logging.getLogger("kvcd")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"kvcd: error: {message}\n")


_PURGE = "stop, unload and remove everything kvcd keeps for an instance"
_PREPARE = "make instances ready for a kernel before it boots (the kernel-install plugin)"


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="kvcd", description="Deliver out-of-tree kernel modules through driver containers."
    )
    p.add_argument(
        "--root",
        default=os.environ.get("KVCD_ROOT", "/"),
        help="prefix every host path with DIR (default: $KVCD_ROOT or /)",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="verb", required=True, metavar="VERB")

    def instance_verb(
        name: str, help_text: str, *, dry_run: bool = False, kernel: bool = False
    ) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help_text)
        sp.add_argument("instance", metavar="NAME")
        if kernel:
            sp.add_argument(
                "--kernel", metavar="KVER", help="kernel release (default: the running one)"
            )
        if dry_run:
            sp.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
        return sp

    instance_verb("run", "run as the kvcd@NAME.service main process")
    instance_verb(
        "build",
        "build (or pull) the driver image and extract its modules",
        dry_run=True,
        kernel=True,
    )
    instance_verb(
        "load", "build if needed, then load and verify the modules", dry_run=True, kernel=True
    )
    instance_verb(
        "unload", "unload the modules in reverse order and verify they are gone", dry_run=True
    )
    rl = instance_verb("reload", "ask the running kvcd@NAME to re-read its config and reconcile")
    rl.add_argument(
        "--timeout",
        type=float,
        default=1800.0,
        help="seconds to wait for the result (default: 1800, the unit's TimeoutStartSec)",
    )
    st = sub.add_parser("status", help="state of every instance (or one)")
    st.add_argument("instance", metavar="NAME", nargs="?")
    st.add_argument("--json", action="store_true")
    cc = sub.add_parser("check-config", help="validate instance configuration offline")
    grp = cc.add_mutually_exclusive_group(required=True)
    grp.add_argument("instance", metavar="NAME", nargs="?")
    grp.add_argument("--all", action="store_true")
    cc.add_argument("--kernel", metavar="KVER")
    cp = sub.add_parser("capabilities", help="the node's capabilities (GEP-33) for image variants")
    cp.add_argument("--json", action="store_true")
    cp.add_argument(
        "--explain", metavar="NAME", help="show how instance NAME's image variant is chosen"
    )
    cp.add_argument("--kernel", metavar="KVER", help="describe kernel KVER, not the running one")
    kb = sub.add_parser("kabi", help="would an instance's modules (or a .ko) load on kernel KVER?")
    kb.add_argument(
        "target",
        metavar="NAME|PATH.ko",
        help="instance (its newest extracted modules) or a module file (not under --root)",
    )
    kb.add_argument("--kernel", metavar="KVER", required=True, help="kernel release to check")
    kb.add_argument("--json", action="store_true")
    for verb, what in (("label", "labels"), ("annotate", "annotations")):
        nv = sub.add_parser(
            verb, help=f"set (KEY=VALUE) or remove (KEY-) node {what} in the node file"
        )
        nv.add_argument("edits", nargs="*", metavar="KEY=VALUE|KEY-", help="none: list them")
    for verb, what, helptext in (
        ("purge", "every configured or recorded instance", _PURGE),
        ("prepare", "every configured instance", _PREPARE),
    ):
        vp = sub.add_parser(verb, help=helptext)
        group = vp.add_mutually_exclusive_group(required=True)
        group.add_argument("instance", metavar="NAME", nargs="?")
        group.add_argument("--all", action="store_true", help=what)
    vp.add_argument("--kernel", metavar="KVER", required=True, help="the kernel release")
    mt = sub.add_parser("metrics", help="every instance's metrics (or one's), Prometheus text")
    mt.add_argument("instance", metavar="NAME", nargs="?")
    mt.add_argument(
        "--write",
        action="store_true",
        help="write metrics_dir/kvcd-NAME.prom (node_exporter's textfile collector) instead",
    )
    _image_verbs(sub)
    wr = sub.add_parser("wrapper", help="run a command from the instance's driver image")
    wr.add_argument("instance", metavar="NAME")
    wr.add_argument("command", nargs=argparse.REMAINDER, metavar="CMD")
    wr.add_argument("--kernel", metavar="KVER")
    return p


def _image_verbs(sub: Any) -> None:
    im = sub.add_parser("image", help="driver images on this node")
    verbs = im.add_subparsers(dest="image_verb", required=True, metavar="VERB")
    ip = verbs.add_parser(
        "import",
        help="load a driver image archive (`podman save` output) as NAME's image: air-gapped nodes",
    )
    ip.add_argument("instance", metavar="NAME")
    ip.add_argument("archive", metavar="ARCHIVE", help="docker-archive or oci-archive file")
    ip.add_argument("--kernel", metavar="KVER", help="kernel release (default: the running one)")


def main(argv: Sequence[str] | None = None) -> int:
    """The CLI. Exit 0 ok, 1 failed (including a host error: one line naming the path and the
    cause, never a traceback), 2 bad usage or configuration, 70 a bug in kvcd (one line; the
    traceback with -v or KVCD_DEBUG=1), 130 interrupted."""
    args = _parser().parse_args(argv)
    from kvcd.config.model import ConfigError
    from kvcd.core import names
    from kvcd.host.journal import setup_logging

    # Names and kernels at the edge, before any path is made of them (kvcd/core/names.py).
    name, kernel = getattr(args, "instance", None), getattr(args, "kernel", None)
    problem = (name is not None and names.instance_problem(name)) or (
        kernel is not None and names.kernel_problem(kernel)
    )
    if problem:
        print(f"kvcd: {problem}", file=sys.stderr)
        return EXIT_USAGE
    setup_logging(args.verbose, name)
    root = HostRoot(Path(args.root))
    try:
        return _verb(root, args)
    except ConfigError as exc:
        print(f"kvcd: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as exc:  # read-only /run, a full /var, EACCES …: the host said no
        from kvcd.host.files import os_error

        print(f"kvcd: {os_error(exc)}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # a bug: say so in one line, the traceback only when asked
        # (and always from the daemon: its stderr is the journal, where the traceback belongs)
        if args.verbose or args.verb == "run" or os.environ.get("KVCD_DEBUG") == "1":
            raise
        print(
            f"kvcd: internal error: {type(exc).__name__}: {exc} "
            "(a bug in kvcd; run again with -v or KVCD_DEBUG=1 for the traceback)",
            file=sys.stderr,
        )
        return EXIT_INTERNAL


def _verb(root: HostRoot, args: argparse.Namespace) -> int:
    if args.verb == "status":
        return _status(root, args.instance, args.json)
    if args.verb in ("label", "annotate"):
        from kvcd.daemon.report import edit_node_command

        return edit_node_command(root, args.verb, args.edits)
    if args.verb == "kabi":
        from kvcd.daemon.kabi import kabi_command

        return kabi_command(root, args.target, args.kernel, args.json)
    if args.verb == "purge":
        from kvcd.daemon.purge import purge_command

        return purge_command(root, args.instance, args.all)
    if args.verb == "prepare":
        from kvcd.daemon.ahead import prepare_command

        return prepare_command(root, None if args.all else args.instance, args.kernel)
    if args.verb == "metrics":
        from kvcd.daemon.metrics import metrics_command

        return metrics_command(root, args.instance, args.write)
    if args.verb == "image":
        from kvcd.daemon.images import import_command

        return import_command(root, args.instance, args.archive, args.kernel)
    if args.verb == "capabilities":
        from kvcd.daemon.variants import capabilities_command

        return capabilities_command(root, args.json, args.explain, args.kernel)
    return _dispatch(root, args)


def _status(root: HostRoot, only: str | None, as_json: bool) -> int:
    from kvcd.daemon.status import collect, failed, kernel, render, render_kernel

    entries = collect(root, only)
    # With instances: what their modules run on (taint flags, signature enforcement).
    running_on = kernel(root) if entries else None
    if as_json:
        out = {"instances": entries, **({"kernel": running_on} if running_on else {})}
        print(json.dumps(out, indent=2, sort_keys=True))
    else:
        print(render(entries))
        if running_on:
            print(render_kernel(running_on))
    return EXIT_FAILED if failed(entries) else EXIT_OK


def _kernel(root: HostRoot, args: argparse.Namespace) -> str:
    from kvcd.daemon.record import running_kernel

    kernel: str | None = getattr(args, "kernel", None)
    return kernel or running_kernel(root)


def _dispatch(root: HostRoot, args: argparse.Namespace) -> int:
    from kvcd.config.loader import list_instances, load_instance, load_settings
    from kvcd.core.state import StepFailed
    from kvcd.daemon.instance import Instance

    verb = args.verb
    if verb in ("check-config", "run"):
        from kvcd.host import pylibs

        # A library kvcd needs is part of the installation, not a feature that may be off.
        # Looked up here (importing podman and pyroute2 is most of a start's CPU); `kvcd run`
        # has a child interpreter import them all after READY=1 (kvcd/daemon/libraries.py).
        try:
            pylibs.require_all(pylibs.locate)
        except pylibs.Missing as exc:
            print(f"kvcd: {exc}", file=sys.stderr)
            return EXIT_USAGE
    if verb == "check-config":
        return _check_config(
            root, list_instances(root) if args.all else [args.instance], args.kernel
        )
    if verb == "run":
        from kvcd.daemon.service import Service
        from kvcd.host.systemd import Notifier

        return Service(
            root, args.instance, _kernel(root, args), Notifier.from_environ(unset_environment=True)
        ).run()
    if verb == "reload":
        from kvcd.daemon.control import request_reload

        return request_reload(root, args.instance, args.timeout)
    from kvcd.daemon.observe import host_for

    settings = load_settings(root)
    root = host_for(root, settings)
    cfg = load_instance(root, args.instance)
    if verb == "wrapper":
        from kvcd.daemon.control import wrapper

        return wrapper(root, settings, cfg, _kernel(root, args), args.command)
    if verb in ("load", "unload") and not args.dry_run:
        from kvcd.daemon.control import daemon_pid

        pid = daemon_pid(root, cfg.name)
        if pid is not None:
            # The daemon would read a change behind its back as drift (ModuleRemoved …).
            how = "systemctl reload" if verb == "load" else "systemctl stop"
            print(
                f"kvcd: kvcd@{cfg.name} is running (pid {pid}, {root.pid_file(cfg.name)}) and "
                f"owns {cfg.name}'s modules: use `{how} kvcd@{cfg.name}`",
                file=sys.stderr,
            )
            return EXIT_FAILED
    progress = _Progress()
    inst = Instance(
        root,
        settings,
        cfg,
        _kernel(root, args),
        on_step=progress.step,
        on_build_line=progress.line,
    )
    if args.dry_run:
        try:
            planned = inst.plan(verb)
        except StepFailed as exc:  # e.g. NoVariant: no image variant fits this node
            print(f"kvcd: {cfg.name}: {exc}", file=sys.stderr)
            return EXIT_FAILED
        for line in planned.describe():
            print(line)
        return EXIT_OK
    try:
        inst.apply(verb)
    except StepFailed as exc:
        progress.done()
        print(f"kvcd: {cfg.name}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    progress.done()
    return EXIT_OK


def _check_config(root: HostRoot, names: list[str], kernel: str | None) -> int:
    from kvcd.config.loader import load_settings
    from kvcd.config.rules import KVC_GLOBAL
    from kvcd.daemon.observe import host_for
    from kvcd.daemon.record import KernelUnknown, running_kernel
    from kvcd.host.pylibs import check_settings, locate

    settings = load_settings(root)  # ConfigError: kvcd.toml, or KVC's node-wide conf
    check_settings(root, settings, locate)  # ConfigError: a setting needs a missing library
    if os.path.lexists(root.kvc_conf(KVC_GLOBAL)):  # load_settings checked it
        print(f"{root.kvc_conf(KVC_GLOBAL)}: ok (KVC's node-wide conf: container runtime podman)")
    if not names:
        print("no instances configured")
        return EXIT_OK
    root = host_for(root, settings)
    if kernel is None:
        try:
            kernel = running_kernel(root)
        except KernelUnknown:  # offline check of a tree without /proc: validate, do not plan
            kernel = None
    node = _Node(root)
    bad = sum(not _check_one(node, settings, name, kernel) for name in names)
    return EXIT_USAGE if bad else EXIT_OK


class _Node:
    """What check-config reads of every instance, read once per run: each config (checking N
    instances against their neighbours would load every config N times) and the modules each
    instance holds now."""

    def __init__(self, root: HostRoot) -> None:
        from kvcd.config.loader import list_instances
        from kvcd.daemon.instance import held_modules

        self.root = root
        self.names = list_instances(root)
        self.held = held_modules(root)
        self._configs: dict[str, InstanceConfig | Exception] = {}

    def config(self, name: str) -> InstanceConfig:
        """The instance's config; its ConfigError, every time it is asked for."""
        from kvcd.config.loader import load_instance
        from kvcd.config.model import ConfigError

        if name not in self._configs:
            try:
                self._configs[name] = load_instance(self.root, name)
            except ConfigError as exc:
                self._configs[name] = exc
        got = self._configs[name]
        if isinstance(got, Exception):
            raise got
        return got


def _check_one(node: _Node, settings: Settings, name: str, kernel: str | None) -> bool:
    """check-config of one instance: its config, its modules' owner, its plan. Printed; ok?"""
    from kvcd.config.model import ConfigError
    from kvcd.core.state import StepFailed
    from kvcd.daemon.instance import Instance
    from kvcd.daemon.upgrade import check_upgrade_label
    from kvcd.host import regauth

    root = node.root
    try:
        cfg = node.config(name)
        check_upgrade_label(cfg, settings)
        regauth.check(root, cfg, settings)
    except ConfigError as exc:
        print(f"{name}: INVALID: {exc}")
        return False
    problem, warnings = _neighbours(node, cfg, kernel)
    if problem:
        print(f"{name}: INVALID: {problem}")
        return False
    print(f"{name}: ok ({cfg.source}, {cfg.format} format)")
    for line in warnings:
        print(f"  warning: {line}")
    print(f"  version {cfg.version}; load order: {', '.join(m.name for m in cfg.modules)}")
    if not kernel:
        return True
    inst = Instance(root, settings, cfg, kernel)
    if inst.cfg.variant is not None:
        print(f"  image variant for this node: {inst.cfg.variant}")
    if inst.no_variant is not None:
        print(f"  {name}: NO PLAN: {inst.no_variant}")
        return False
    try:
        planned = inst.plan("load")
    except StepFailed as exc:
        print(f"  {name}: NO PLAN: {exc}")
        return False
    print(f"  plan for {kernel}:")
    for line in planned.describe():
        print(f"    {line}")
    from kvcd.daemon.images import archive_problem

    problem = archive_problem(planned)
    if problem:
        print(f"  {name}: NO IMAGE: {problem}")
    return not problem


def _neighbours(node: _Node, cfg: InstanceConfig, kernel: str | None) -> tuple[str, list[str]]:
    """What another instance makes impossible for this one: the error ("" when none) when
    another holds one of its modules or would use its image tag; a warning per other configured
    instance that lists some of its modules (only one of them can be running)."""
    from kvcd.config.model import ConfigError
    from kvcd.core import owners, state

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
    if kernel:
        tag = cfg.image_tag(kernel)
        clash = sorted(o for o, c in others.items() if c.image_tag(kernel) == tag)
        if clash:
            return f"image tag {tag} is also instance {clash[0]}'s: rename one of them", []
    found: dict[str, list[str]] = {}
    claims = {o: [m.kernel_name for m in c.modules] for o, c in others.items()}
    for s in owners.shared(name, modules, claims):
        found.setdefault(s.other, []).append(s.module)
    return "", [
        f"{', '.join(mods)} also listed by instance {other}: one owner per module, only one "
        "of the two can be running"
        for other, mods in found.items()
    ]


class _Progress:
    """Build output: one live line on a terminal, plain log lines (the journal) otherwise."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self._live = False

    def step(self, text: str) -> None:
        self.done()
        if self.tty:
            print(f"kvcd: {text}", file=sys.stderr)

    def line(self, text: str) -> None:
        text = text.rstrip()
        if not text:
            return
        if self.tty:
            width = max(20, os.get_terminal_size(sys.stderr.fileno()).columns - 1)
            sys.stderr.write("\r\x1b[K" + text[:width])
            sys.stderr.flush()
            self._live = True
        else:
            log.info("%s", text)

    def done(self) -> None:
        if self._live:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()
            self._live = False


if __name__ == "__main__":
    sys.exit(main())
