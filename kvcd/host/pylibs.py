"""pylibs: the Python libraries kvcd runs on, and whether this interpreter can import them.

The room for kvcd's own installation. It may touch: the import system (importlib) and a child
interpreter of its own (kvcd.host.run), nothing else on the host. The table is the one place
that says which library serves which capability and what to install (pip name, Fedora/RHEL RPM
name); pyproject.toml's dependencies and rpm.spec's Requires list the same required set
(tests/unit/test_pylibs.py checks both).

Required libraries are looked up (:func:`locate`) at the start of `kvcd run` and by `kvcd
check-config`: a missing one is an error there, never a capability that quietly stays off
later; a settled daemon then has a child import them all (:func:`require_all_in_child`).
Optional ones are needed only by a setting (the kubernetes client by
``node_backend = "kubernetes"``), which is then refused with the same one-line text, or have a
real alternative path that is logged and shown in `kvcd status` (pydbus: the rpm-ostree CLI
answers what its D-Bus API would).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvcd.config.model import ConfigLocations, Settings

Importer = Callable[[str], Any]


@dataclass(frozen=True)
class Package:
    """One distribution package: what is imported, what `pip install` and `dnf install` take."""

    module: str  # the module kvcd imports (a submodule where the top one imports too little)
    pip: str
    rpm: str

    def named(self) -> str:
        return f"the Python package '{self.pip}' (RPM {self.rpm})"


@dataclass(frozen=True)
class Requirement:
    """A capability and the packages it imports (all of them, in order)."""

    capability: str
    packages: tuple[Package, ...]


PODMAN = Package("podman", "podman", "python3-podman")
PYELFTOOLS = Package("elftools.elf.elffile", "pyelftools", "python3-pyelftools")
INOTIFY = Package("inotify_simple", "inotify_simple", "python3-inotify_simple")
PYUDEV = Package("pyudev", "pyudev", "python3-pyudev")
PSUTIL = Package("psutil", "psutil", "python3-psutil")
PYROUTE2 = Package("pyroute2", "pyroute2", "python3-pyroute2")
PROMETHEUS = Package("prometheus_client", "prometheus_client", "python3-prometheus_client")
KUBERNETES = Package("kubernetes", "kubernetes", "python3-kubernetes")
PYDBUS = Package("pydbus", "pydbus", "python3-pydbus")
# pydbus runs on GLib's D-Bus through PyGObject (gi); Fedora/RHEL ship it as python3-gobject.
PYGOBJECT = Package("gi.repository.GLib", "PyGObject", "python3-gobject")

REQUIRED: tuple[Requirement, ...] = (
    Requirement("driver images (podman API)", (PODMAN,)),
    Requirement("module files (ELF)", (PYELFTOOLS,)),
    Requirement("drift monitor (inotify)", (INOTIFY,)),
    Requirement("udev module and device events", (PYUDEV,)),
    Requirement("holder checks", (PSUTIL,)),
    Requirement("link readiness (netlink)", (PYROUTE2,)),
    Requirement("metrics (Prometheus text format)", (PROMETHEUS,)),
)
# What the child of require_all_in_child imports, and what its proof is remembered for.
REQUIRED_MODULES = tuple(p.module for r in REQUIRED for p in r.packages)
NODE_KUBERNETES = Requirement("node backend kubernetes", (KUBERNETES,))
RPMOSTREE_DBUS = Requirement("rpm-ostree D-Bus", (PYDBUS, PYGOBJECT))
# The shutdown inhibitor speaks to logind with GLib's own D-Bus (Gio): the lock is a file
# descriptor, which pydbus does not hand back.
LOGIND_DBUS = Requirement("shutdown inhibitor (logind D-Bus)", (PYGOBJECT,))


class Missing(Exception):
    """A library kvcd or a setting needs does not import. The message is one line."""


class NoAnswer(Exception):
    """The child that imports the required libraries did not answer in time: it proves
    nothing either way (a busy node starves an idle-class child; ask again)."""


def locate(name: str) -> object:
    """An :data:`Importer` that finds the module without running it (its top-level package's
    spec): what the read-only verbs ask. Importing podman, pyroute2 or the kubernetes client
    only to learn that they are installed costs several times the verb itself (issue #20).

    Raises ModuleNotFoundError worded as `import` words it, for a package that is not
    installed or is blocked in sys.modules. A package that is installed but fails to import is
    found here; `kvcd run` imports every required one after READY=1 and says it (libraries.py).
    """
    import importlib.util

    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        prefix = ".".join(parts[:i])
        if prefix in sys.modules and sys.modules[prefix] is None:
            raise ModuleNotFoundError(
                f"import of {prefix} halted; None in sys.modules", name=prefix
            )
    top = parts[0]
    if top in sys.modules:
        return sys.modules[top]
    spec = importlib.util.find_spec(top)
    if spec is None:
        raise ModuleNotFoundError(f"No module named {top!r}", name=top)
    return spec


def import_error(pkg: Package, importer: Importer = importlib.import_module) -> str | None:
    """Why `pkg` does not import ('' never: None when it does)."""
    try:
        importer(pkg.module)
    except ImportError as exc:
        return str(exc) or type(exc).__name__
    return None


def first_missing(
    req: Requirement, importer: Importer = importlib.import_module
) -> tuple[Package, str] | None:
    """The first package of `req` that does not import, with the import error."""
    for pkg in req.packages:
        why = import_error(pkg, importer)
        if why is not None:
            return pkg, why
    return None


def required_problems(importer: Importer = importlib.import_module) -> list[str]:
    """One line per required library that does not import (empty: all do)."""
    out = []
    for req in REQUIRED:
        gone = first_missing(req, importer)
        if gone is not None:
            pkg, why = gone
            out.append(f"kvcd needs {pkg.named()} for {req.capability}: {why}")
    return out


def require_all(importer: Importer = importlib.import_module) -> None:
    """Raise :class:`Missing` naming every required library that does not import."""
    problems = required_problems(importer)
    if problems:
        raise Missing("; ".join(problems))


# The child of :func:`require_all_in_child`: argv[1] is the daemon's sys.path (JSON), the rest
# the modules; it prints {module: why it does not import, or null} as one JSON line.
_PROBE = """\
import importlib, json, os, sys
try:  # idle class: the imports take seconds of CPU in a slow guest; nothing waits for them
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
except (AttributeError, OSError):
    pass
sys.path[:] = json.loads(sys.argv[1])
why = {}
for name in sys.argv[2:]:
    try:
        importlib.import_module(name)
        why[name] = None
    except ImportError as exc:
        why[name] = str(exc) or type(exc).__name__
    except Exception as exc:
        why[name] = f"{type(exc).__name__}: {exc}"
print(json.dumps(why))
"""
CHILD_TIMEOUT = 300.0  # seconds: importing them all takes seconds in a TCG guest


def require_all_in_child(timeout: float = CHILD_TIMEOUT) -> None:
    """:func:`require_all`, the imports done by a child of this interpreter (its executable,
    its sys.path): `kvcd run` learns whether every required library imports without keeping
    them resident (issue #20: podman-py with requests, and pyroute2, are most of a daemon's
    memory, and a cached start needs neither). A child that fails without an answer is the
    problem; one still importing after `timeout` seconds is stopped and NoAnswer raised."""
    from kvcd.host import run

    argv = [sys.executable, "-c", _PROBE, json.dumps(sys.path), *REQUIRED_MODULES]
    try:
        done = run.run(argv, timeout=timeout)
    except run.CommandError as exc:
        if exc.rc == run.TIMED_OUT:
            raise NoAnswer(f"no answer from the child in {timeout:g} s") from exc
        raise Missing(f"kvcd could not import its required libraries in a child: {exc}") from exc
    try:
        why: dict[str, str | None] = json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError) as exc:
        raise Missing(f"kvcd could not import its required libraries in a child: {exc}") from exc

    def answered(name: str) -> object:
        text = why.get(name, "the child did not try it")
        if text is not None:
            raise ImportError(text)
        return None

    require_all(answered)


def installation(path: Sequence[str] | None = None) -> str:
    """What a proof that the required libraries import holds for, as a digest (sha256, hex):
    this interpreter (its version, and its file's identity and times), the modules proved, and
    each directory the imports search (`path`, default sys.path) with its identity and times.
    Installing, upgrading or removing a package adds or removes an entry of its directory,
    which changes that directory's mtime and ctime, so the digest changes with it. A relative
    entry ("" of `python -c`) is the current directory, as for the imports; what changes
    outside these directories (a shared library a package loads) is seen at the next boot."""
    import hashlib

    lines = [sys.version, *REQUIRED_MODULES]
    for entry in [sys.executable, *(sys.path if path is None else path)]:
        try:
            st = os.stat(entry or ".")
        except OSError as exc:
            lines.append(f"{entry!r} {exc.errno}")
            continue
        lines.append(f"{entry!r} {st.st_dev} {st.st_ino} {st.st_mtime_ns} {st.st_ctime_ns}")
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def setting_problem(
    setting: str, req: Requirement, importer: Importer = importlib.import_module
) -> str | None:
    """`setting` needs the packages of `req`: the one-line refusal when one does not import."""
    gone = first_missing(req, importer)
    if gone is None:
        return None
    pkg, why = gone
    return f"{setting} needs {pkg.named()}: {why}"


def settings_problems(
    settings: Settings, importer: Importer = importlib.import_module
) -> list[tuple[str, str]]:
    """(key, one-line refusal) for each node-wide setting whose optional library is missing."""
    out = []
    if settings.node_backend == "kubernetes":
        text = setting_problem('node_backend = "kubernetes"', NODE_KUBERNETES, importer)
        if text is not None:
            out.append(("node_backend", text))
    if settings.inhibit_reboot:
        text = setting_problem("inhibit_reboot = true", LOGIND_DBUS, importer)
        if text is not None:
            out.append(("inhibit_reboot", text))
    return out


def kube_node_problem(node_name: str, environ: Mapping[str, str]) -> tuple[str, str] | None:
    """(key, one-line refusal) when the node name kvcd would report under comes from its
    environment (rules.NODE_NAME_ENV; kvcd.toml's node_name, checked where it is read, wins)
    and is not one the API server takes: kvcd would look for a Node that never exists, and
    retry forever."""
    from kvcd.config import rules

    name = environ.get(rules.NODE_NAME_ENV, "")
    if node_name or not name:
        return None
    try:
        rules.valid_dns_subdomain(name, rules.NODE_NAME_ENV)
    except rules.Invalid as exc:
        return ("node_backend", f"{exc}, in kvcd's environment (a drop-in of kvcd@.service)")
    return None


def kube_credentials_problem(kubeconfig: str, environ: Mapping[str, str]) -> tuple[str, str] | None:
    """(key, one-line refusal) when the kubernetes backend has no credentials it could read:
    a `kubeconfig` that is not a readable regular file, or none set where there is no
    in-cluster service account (kvcd runs on the host, not in a pod)."""
    import stat

    if not kubeconfig:
        if environ.get("KUBERNETES_SERVICE_HOST"):
            return None
        return (
            "node_backend",
            "node_backend = \"kubernetes\" needs 'kubeconfig': kvcd runs on the host, where "
            "there is no in-cluster service account (packaging/README.md makes a kubeconfig)",
        )
    try:
        mode = os.stat(kubeconfig).st_mode
    except OSError as exc:
        return ("kubeconfig", f"kubeconfig {kubeconfig}: {exc.strerror or exc}")
    if not stat.S_ISREG(mode):
        return ("kubeconfig", f"kubeconfig {kubeconfig}: not a regular file")
    if not os.access(kubeconfig, os.R_OK):
        return ("kubeconfig", f"kubeconfig {kubeconfig}: not readable")
    return None


def check_settings(
    root: ConfigLocations, settings: Settings, importer: Importer = importlib.import_module
) -> None:
    """Refuse settings this installation cannot honor: ConfigError naming the file and line."""
    problems = settings_problems(settings, importer)
    if settings.sign_key or settings.sign_cert:
        from kvcd.host.modsign import signing_problem

        signing = signing_problem(settings.sign_key, settings.sign_cert)
        problems += [signing] if signing else []
    if settings.node_backend == "kubernetes" and not problems:
        kube = kube_node_problem(settings.node_name, os.environ) or kube_credentials_problem(
            settings.kubeconfig, os.environ
        )
        problems += [kube] if kube else []
    if not problems:
        return
    from kvcd.config.loader import setting_line, settings_source
    from kvcd.config.model import ConfigError

    path = settings_source(root)
    key, text = problems[0]
    if path is None:  # defaults never need an optional library; say where it would be set
        raise ConfigError(root.main_config, text)
    raise ConfigError(path, text, setting_line(path, key))
