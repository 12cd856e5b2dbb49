"""`kvcd [--root DIR] <verb> …`: parse argv, dispatch, return the exit code. Nothing else here.

Exit codes: 0 ok, 1 failed, 2 bad usage or bad configuration.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from kvcd.host.paths import HostRoot

if TYPE_CHECKING:
    from kvcd.config.model import InstanceConfig

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 70  # 70: EX_SOFTWARE

log = logging.getLogger("kvcd")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"kvcd: error: {message}\n")

    def _get_formatter(self) -> argparse.HelpFormatter:
        """argparse's (kvcd sets no formatter_class), told the terminal's width: left to itself
        it asks shutil, whose import (zlib, bz2, lzma) every add_argument would pay, ~2 ms of
        each `kvcd status` (#20)."""
        return argparse.HelpFormatter(self.prog, width=_columns() - 2)


def _columns() -> int:
    """The terminal's width as shutil.get_terminal_size (3.11+) tells it: $COLUMNS, else
    stdout's terminal, else 80 (older shutil gives 0 for a terminal that reports no width)."""
    try:
        columns = int(os.environ.get("COLUMNS", "0"))
    except ValueError:
        columns = 0
    out = sys.__stdout__
    if columns <= 0 and out is not None:
        try:
            columns = os.get_terminal_size(out.fileno()).columns
        except (ValueError, OSError):
            columns = 0
    return columns if columns > 0 else 80


_PURGE = "stop, unload and remove everything kvcd keeps for an instance"
_PREPARE = "make instances ready for a kernel before it boots (the kernel-install plugin)"


def _instance(
    sp: argparse.ArgumentParser, *, dry_run: bool = False, kernel: bool = False
) -> argparse.ArgumentParser:
    sp.add_argument("instance", metavar="NAME")
    if kernel:
        sp.add_argument(
            "--kernel", metavar="KVER", help="kernel release (default: the running one)"
        )
    if dry_run:
        sp.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    return sp


def _seconds(text: str) -> float:
    """A positive, finite number of seconds (float() also takes 'nan', 'inf' and '-1')."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


def _reload(sp: argparse.ArgumentParser) -> None:
    _instance(sp).add_argument(
        "--timeout",
        type=_seconds,
        default=1800.0,
        help="seconds to wait for the result (default: 1800, the unit's TimeoutStartSec)",
    )


def _status_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("instance", metavar="NAME", nargs="?")
    sp.add_argument("--json", action="store_true")


def _check_config_args(sp: argparse.ArgumentParser) -> None:
    grp = sp.add_mutually_exclusive_group(required=True)
    grp.add_argument("instance", metavar="NAME", nargs="?")
    grp.add_argument("--all", action="store_true")
    sp.add_argument("--kernel", metavar="KVER")


def _capabilities_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--json", action="store_true")
    sp.add_argument(
        "--explain", metavar="NAME", help="show how instance NAME's image variant is chosen"
    )
    sp.add_argument("--kernel", metavar="KVER", help="describe kernel KVER, not the running one")


def _kabi_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument(
        "target",
        metavar="NAME|PATH.ko",
        help="instance (its newest extracted modules) or a module file (not under --root)",
    )
    sp.add_argument("--kernel", metavar="KVER", required=True, help="kernel release to check")
    sp.add_argument("--json", action="store_true")


def _node_edit_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("edits", nargs="*", metavar="KEY=VALUE|KEY-", help="none: list them")


def _one_or_all(what: str, *, kernel: bool = False) -> Callable[[argparse.ArgumentParser], None]:
    def add(sp: argparse.ArgumentParser) -> None:
        group = sp.add_mutually_exclusive_group(required=True)
        group.add_argument("instance", metavar="NAME", nargs="?")
        group.add_argument("--all", action="store_true", help=what)
        if kernel:
            sp.add_argument("--kernel", metavar="KVER", required=True, help="the kernel release")

    return add


def _metrics_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("instance", metavar="NAME", nargs="?")
    sp.add_argument(
        "--write",
        action="store_true",
        help="write metrics_dir/kvcd-NAME.prom (node_exporter's textfile collector) instead",
    )


def _image_args(sp: argparse.ArgumentParser) -> None:
    verbs = sp.add_subparsers(dest="image_verb", required=True, metavar="VERB")
    ip = verbs.add_parser(
        "import",
        help="load a driver image archive (`podman save` output) as NAME's image: air-gapped nodes",
    )
    ip.add_argument("instance", metavar="NAME")
    ip.add_argument("archive", metavar="ARCHIVE", help="docker-archive or oci-archive file")
    ip.add_argument("--kernel", metavar="KVER", help="kernel release (default: the running one)")


def _wrapper_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("instance", metavar="NAME")
    sp.add_argument("command", nargs=argparse.REMAINDER, metavar="CMD")
    sp.add_argument("--kernel", metavar="KVER")


# Verb -> (its help line, what adds its arguments), in `kvcd --help`'s order.
_VERBS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], object]]] = {
    "run": ("run as the kvcd@NAME.service main process", _instance),
    "build": (
        "build (or pull) the driver image and extract its modules",
        partial(_instance, dry_run=True, kernel=True),
    ),
    "load": (
        "build if needed, then load and verify the modules",
        partial(_instance, dry_run=True, kernel=True),
    ),
    "unload": (
        "unload the modules in reverse order and verify they are gone",
        partial(_instance, dry_run=True),
    ),
    "reload": ("ask the running kvcd@NAME to re-read its config and reconcile", _reload),
    "status": ("state of every instance (or one)", _status_args),
    "check-config": ("validate instance configuration offline", _check_config_args),
    "capabilities": (
        "the node's capabilities (GEP-33) for image variants",
        _capabilities_args,
    ),
    "kabi": ("would an instance's modules (or a .ko) load on kernel KVER?", _kabi_args),
    "label": ("set (KEY=VALUE) or remove (KEY-) node labels in the node file", _node_edit_args),
    "annotate": (
        "set (KEY=VALUE) or remove (KEY-) node annotations in the node file",
        _node_edit_args,
    ),
    "purge": (_PURGE, _one_or_all("every configured or recorded instance")),
    "prepare": (_PREPARE, _one_or_all("every configured instance", kernel=True)),
    "metrics": ("every instance's metrics (or one's), Prometheus text", _metrics_args),
    "image": ("driver images on this node", _image_args),
    "wrapper": ("run a command from the instance's driver image", _wrapper_args),
}


def _named_verb(argv: Sequence[str]) -> str | None:
    """The verb argv names, when kvcd has it and every word before it is spelt out in full
    (`--root DIR`, `--root=DIR`, `-v`, `--verbose`); None otherwise (help, a typo, no verb, an
    abbreviated option such as `--ro DIR`), and then the whole parser decides."""
    words = iter(argv)
    for word in words:
        if word == "--root":
            next(words, None)
        elif word.startswith("--root=") or word in ("-v", "--verbose"):
            continue
        elif word.startswith("-"):
            return None
        else:
            return word if word in _VERBS else None
    return None


def _parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """kvcd's parser. Given argv that names a verb, with that verb alone: every verb's parser
    costs its share of a `kvcd status` (#20), and the verb's own parse, its errors and its
    help are the same either way (tests/unit/test_cli.py compares them). Otherwise (`kvcd`,
    `kvcd --help`, a typo) with every verb, so the usage lists them all."""
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
    only = None if argv is None else _named_verb(argv)
    for verb, (help_text, add_args) in _VERBS.items():
        if only is None or verb == only:
            add_args(sub.add_parser(verb, help=help_text))
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """The CLI. Exit 0 ok, 1 failed (including a host error: one line naming the path and the
    cause, never a traceback), 2 bad usage or configuration, 70 a bug in kvcd (one line; the
    traceback with -v or KVCD_DEBUG=1), 130 interrupted."""
    argv = sys.argv[1:] if argv is None else argv
    args = _parser(argv).parse_args(argv)
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
        from kvcd.daemon.checkconfig import check_config_command

        return check_config_command(
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
        return _told(root, verb, cfg, inst.kernel, EXIT_FAILED)
    progress.done()
    return _told(root, verb, cfg, inst.kernel, EXIT_OK)


def _told(root: HostRoot, verb: str, cfg: InstanceConfig, kernel: str, code: int) -> int:
    """`kvcd load` / `unload` (refused while a daemon runs, so none does): the node and the
    metrics textfile say what the record now says, as a daemon's last word would (one short
    try; stderr says what failed). `kvcd build` changes no module, and a daemon may run."""
    from kvcd.daemon import extensions

    if verb not in ("load", "unload"):
        return code
    why = extensions.last_words(root, cfg.name, kernel, {"KVCD_INSTANCE": cfg.name}, cfg)
    if why is not None:
        print(f"kvcd: {cfg.name}: the node is not told: {why}", file=sys.stderr)
    return code


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
