"""The libraries kvcd runs on: a missing required one stops `kvcd run` and `kvcd check-config`
with the package to install; an optional one is refused by the setting that needs it; the
packaging (pyproject.toml, rpm.spec) lists the same set; `kvcd status` shows each capability."""

from __future__ import annotations

import json
import os
import re
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from kvcd.cli import main
from kvcd.config.loader import parse_settings_toml
from kvcd.config.model import ConfigError
from kvcd.core import state
from kvcd.core.attempts import RETRY
from kvcd.daemon import status
from kvcd.daemon.events import Event
from kvcd.daemon.record import Record
from kvcd.daemon.service import Service
from kvcd.host import pylibs
from kvcd.host.paths import HostRoot
from tests import fakehost

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]
K = "6.1.0-56-amd64"
GOOD = 'version = "1.0"\nmodules = ["kvcd_base", "kvcd_user"]\n[build]\ncontext = "/src"\n'


def without(*gone: str) -> pylibs.Importer:
    """An importer for which the modules `gone` (and their submodules) are not installed."""

    def importer(name: str) -> object:
        for g in gone:
            if name == g or name.startswith(g + "."):
                raise ModuleNotFoundError(f"No module named '{g}'", name=g)
        return object()

    return importer


# module missing -> the one line `kvcd run` / `kvcd check-config` print
REQUIRED_TABLE = [
    (
        "podman",
        "kvcd needs the Python package 'podman' (RPM python3-podman) for driver images "
        "(podman API): No module named 'podman'",
    ),
    (
        "elftools",
        "kvcd needs the Python package 'pyelftools' (RPM python3-pyelftools) for module files "
        "(ELF): No module named 'elftools'",
    ),
    (
        "inotify_simple",
        "kvcd needs the Python package 'inotify_simple' (RPM python3-inotify_simple) for drift "
        "monitor (inotify): No module named 'inotify_simple'",
    ),
    (
        "pyudev",
        "kvcd needs the Python package 'pyudev' (RPM python3-pyudev) for udev module and device "
        "events: No module named 'pyudev'",
    ),
    (
        "psutil",
        "kvcd needs the Python package 'psutil' (RPM python3-psutil) for holder checks: "
        "No module named 'psutil'",
    ),
    (
        "pyroute2",
        "kvcd needs the Python package 'pyroute2' (RPM python3-pyroute2) for link readiness "
        "(netlink): No module named 'pyroute2'",
    ),
    (
        "prometheus_client",
        "kvcd needs the Python package 'prometheus_client' (RPM python3-prometheus_client) for "
        "metrics (Prometheus text format): No module named 'prometheus_client'",
    ),
]


@pytest.mark.parametrize(("module", "text"), REQUIRED_TABLE)
def test_a_missing_required_library_is_named_with_what_to_install(module: str, text: str) -> None:
    assert pylibs.required_problems(without(module)) == [text]
    with pytest.raises(pylibs.Missing) as exc:
        pylibs.require_all(without(module))
    assert str(exc.value) == text


def test_the_required_table_covers_every_required_library() -> None:
    assert sorted(m for m, _ in REQUIRED_TABLE) == sorted(
        p.module.split(".")[0] for r in pylibs.REQUIRED for p in r.packages
    )
    assert pylibs.required_problems(without()) == []


# setting -> module missing -> the refusal
SETTING_TABLE = [
    (
        'node_backend = "kubernetes"',
        pylibs.NODE_KUBERNETES,
        "kubernetes",
        "node_backend = \"kubernetes\" needs the Python package 'kubernetes' "
        "(RPM python3-kubernetes): No module named 'kubernetes'",
    ),
    (
        "rpm-ostree D-Bus",
        pylibs.RPMOSTREE_DBUS,
        "pydbus",
        "rpm-ostree D-Bus needs the Python package 'pydbus' (RPM python3-pydbus): "
        "No module named 'pydbus'",
    ),
    (
        "rpm-ostree D-Bus",
        pylibs.RPMOSTREE_DBUS,
        "gi",
        "rpm-ostree D-Bus needs the Python package 'PyGObject' (RPM python3-gobject): "
        "No module named 'gi'",
    ),
]


@pytest.mark.parametrize(("setting", "req", "module", "text"), SETTING_TABLE)
def test_a_setting_names_the_optional_library_it_needs(
    setting: str, req: pylibs.Requirement, module: str, text: str
) -> None:
    assert pylibs.setting_problem(setting, req, without(module)) == text
    assert pylibs.setting_problem(setting, req, without()) is None


def test_only_the_kubernetes_backend_needs_the_kubernetes_client() -> None:
    kube = parse_settings_toml("/k.toml", 'node_backend = "kubernetes"\n')
    fileb = parse_settings_toml("/k.toml", 'node_backend = "file"\n')
    assert [k for k, _ in pylibs.settings_problems(kube, without("kubernetes"))] == ["node_backend"]
    assert pylibs.settings_problems(fileb, without("kubernetes")) == []
    assert pylibs.settings_problems(kube, without("pydbus")) == []


def test_inhibit_reboot_needs_pygobject_and_says_where_it_is_set() -> None:
    on = parse_settings_toml("/k.toml", "inhibit_reboot = true\n")
    assert on.inhibit_reboot is True
    [(key, text)] = pylibs.settings_problems(on, without("gi.repository.GLib"))
    assert key == "inhibit_reboot"
    assert text.startswith(
        "inhibit_reboot = true needs the Python package 'PyGObject' (RPM python3-gobject): "
    )
    assert pylibs.settings_problems(on, without()) == []
    off = parse_settings_toml("/k.toml", "inhibit_reboot = false\n")
    assert pylibs.settings_problems(off, without("gi.repository.GLib")) == []
    with pytest.raises(ConfigError) as exc:
        parse_settings_toml("/k.toml", 'inhibit_reboot = "yes"\n')
    assert str(exc.value) == "/k.toml:1: 'inhibit_reboot' must be true or false, got \"yes\""


# --- check-config and run, with the module really gone from this interpreter ----------------


@pytest.fixture
def root(tmp_path: Path) -> HostRoot:
    r = HostRoot(tmp_path)
    fakehost.make_host(r, K)
    fakehost.write_config(r, "e2e", GOOD)
    return r


def test_check_config_refuses_the_kubernetes_backend_without_its_client(
    root: HostRoot, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fakehost.write(root.main_config, 'annotation_prefix = "x.io"\nnode_backend = "kubernetes"\n')
    monkeypatch.setitem(sys.modules, "kubernetes", None)  # import kubernetes -> ImportError
    assert main(["--root", str(root.root), "check-config", "--all"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f'kvcd: {root.main_config}:2: node_backend = "kubernetes" needs ')
    assert "the Python package 'kubernetes' (RPM python3-kubernetes)" in err
    assert "\n" not in err


def test_check_config_accepts_the_kubernetes_backend_with_its_client(
    root: HostRoot, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("kubernetes")
    kubeconfig = root.root / "kubeconfig"
    kubeconfig.write_text("apiVersion: v1\nkind: Config\n")
    fakehost.write(root.main_config, f'node_backend = "kubernetes"\nkubeconfig = "{kubeconfig}"\n')
    assert main(["--root", str(root.root), "check-config", "--all"]) == 0
    assert "e2e: ok" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("kubeconfig", "environ", "want"),
    [
        ("", {}, ("node_backend", "needs 'kubeconfig': kvcd runs on the host")),
        ("", {"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, None),  # in a pod after all
        ("{tmp}/missing", {}, ("kubeconfig", "kubeconfig {tmp}/missing: No such file")),
        ("{tmp}", {}, ("kubeconfig", "kubeconfig {tmp}: not a regular file")),
        ("{tmp}/kubeconfig", {}, None),
    ],
)
def test_the_kubernetes_backend_needs_credentials_it_can_read(
    tmp_path: Path, kubeconfig: str, environ: dict[str, str], want: tuple[str, str] | None
) -> None:
    (tmp_path / "kubeconfig").write_text("apiVersion: v1\n")
    got = pylibs.kube_credentials_problem(kubeconfig.format(tmp=tmp_path), environ)
    if want is None:
        assert got is None
    else:
        assert got is not None and got[0] == want[0]
        assert want[1].format(tmp=tmp_path) in got[1], got


@pytest.mark.parametrize(
    ("node_name", "env", "refused"),
    [
        ("", "worker-1.example", False),
        ("", "Worker-1", True),  # the kubelet lower-cases: its Node is worker-1
        ("", "node_1", True),
        ("", "", False),  # the host name, lower-cased
        ("worker-1", "Worker-1", False),  # kvcd.toml's node_name wins (checked where read)
    ],
)
def test_a_node_name_from_the_environment_must_be_one_the_api_takes(
    node_name: str, env: str, refused: bool
) -> None:
    got = pylibs.kube_node_problem(node_name, {"KVCD_NODE_NAME": env} if env else {})
    if not refused:
        assert got is None
    else:
        assert got is not None and got[0] == "node_backend"
        assert got[1].startswith("'KVCD_NODE_NAME' must be a DNS subdomain"), got
        assert got[1].endswith(f'got "{env}", in kvcd\'s environment (a drop-in of kvcd@.service)')


def test_check_config_and_run_refuse_a_missing_kubeconfig_alike(
    root: HostRoot, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("kubernetes")
    fakehost.write(root.main_config, 'node_backend = "kubernetes"\nkubeconfig = "/nonexistent"\n')
    for verb in (["check-config", "--all"], ["run", "e2e"]):
        assert main(["--root", str(root.root), *verb]) == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err.endswith(
            f"{root.main_config}:2: kubeconfig /nonexistent: No such file or directory"
        ), err


@pytest.mark.parametrize("verb", [["check-config", "--all"], ["run", "e2e"]])
def test_a_missing_required_library_stops_check_config_and_run(
    root: HostRoot,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    verb: list[str],
) -> None:
    monkeypatch.setitem(sys.modules, "psutil", None)
    assert main(["--root", str(root.root), *verb]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "kvcd: kvcd needs the Python package 'psutil' (RPM python3-psutil) for holder checks: "
        "import of psutil halted; None in sys.modules"
    )
    assert Record.read(root, "e2e") is None  # stopped before it did anything


def test_a_required_library_that_is_installed_but_broken_degrades_the_running_instance(
    tmp_path: Path, fake_commands: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The start only looks the libraries up; the idle work after READY=1 has a child import
    them for real, beside the loop: one that does not import wakes it, and keeps the instance
    Degraded with its import error, cycle after cycle, from the early after-hooks: the outcome
    a reload's answer and READY=1 give (before the late hooks) says it too
    (tests/integration/test_daemon_imports.py: the child itself)."""
    from kvcd.daemon import libraries

    release = threading.Event()

    def broken(timeout: float = 0) -> None:
        release.wait(30)  # the child still importing while the first cycle ends
        raise pylibs.Missing("kvcd needs the Python package 'podman' (RPM python3-podman) for "
                             "driver images (podman API): No module named 'requests'")  # fmt: skip

    mods = ["kvcd_base", "kvcd_user"]
    config = 'version = "1.0"\nmodules = ["kvcd_base", "kvcd_user"]\n[build]\ncontext = "/src"\n'
    root = fakehost.instance_host(HostRoot(tmp_path), K, fake_commands, monkeypatch, config, mods)
    monkeypatch.setattr(libraries.pylibs, "require_all_in_child", broken)
    svc = Service(root, "e2e", K, fakehost.RecordingNotifier())
    svc.defer_late = True  # as `kvcd run` does: the late hooks wait for run_late
    rec = svc.reconcile()
    assert rec is not None and rec.state == state.DONE, rec
    proof = next(e for e in svc.exts if isinstance(e, libraries.LibraryProof))
    assert proof.proof is None  # not before READY=1
    svc.mail.drain()  # the loop's idle moment: no event waits
    svc._idle()  # the proof starts beside the loop: the loop does not wait for it
    assert proof.proof is not None
    release.set()
    proof.proof.join(timeout=30)
    assert ("libraries", "broken") in [(e.source, e.what) for e in svc.mail.drain()]
    for _ in range(2):  # the cycle that event wakes, and every later one
        rec = svc.reconcile()
        assert rec is not None and rec.state == state.DEGRADED, rec
        assert rec.reason.startswith("HostError: kvcd needs the Python package 'podman'"), rec
        assert rec.reason.endswith("No module named 'requests'"), rec
    assert sorted(p.name for p in root.sys_module.iterdir()) == ["kvcd_base", "kvcd_user"]
    # A reload to a changed config builds a new set of extensions: the answer it gets says the
    # failure the last proof found, not Done until the new proof answers.
    fakehost.write_config(root, "e2e", config.replace("[build]", "keep_images = 2\n[build]"))
    rec = svc.reconcile([Event("signal", "reload", kind=RETRY)])
    assert proof not in svc.exts  # rebuilt
    assert rec is not None and rec.state == state.DEGRADED, rec
    svc.stop_extensions()


def test_a_library_check_without_an_answer_is_asked_again_and_degrades_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A child still importing when the wait ends proves nothing: the proof asks again, waiting
    twice as long, and only an answer decides (here: every library imports)."""
    from kvcd.daemon import libraries
    from kvcd.daemon.events import Mailbox

    waits: list[float] = []

    def slow_then_fine(timeout: float = 0) -> None:
        waits.append(timeout)
        if len(waits) < 3:
            raise pylibs.NoAnswer(f"no answer from the child in {timeout:g} s")

    monkeypatch.setattr(libraries.pylibs, "require_all_in_child", slow_then_fine)
    mail = Mailbox()
    proof = libraries.LibraryProof()
    proof._prove(_proof_context(HostRoot(tmp_path), "e2e", mail.post))
    assert waits == [pylibs.CHILD_TIMEOUT, 2 * pylibs.CHILD_TIMEOUT, 4 * pylibs.CHILD_TIMEOUT]
    assert proof.problem is None
    assert mail.drain() == []


# --- one proof per boot and installation -------------------------------------------------------


def _proof_context(root: HostRoot, name: str, post: Any = None) -> Any:
    from kvcd.daemon.events import Context

    cfg: Any = None  # the proof reads neither the config nor the settings
    return Context(root, name, K, cfg, cfg, post or (lambda event: None))


class Children:
    """A stand-in for the child interpreter: counts the proofs; `missing` makes them fail."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, missing: str = "") -> None:
        from kvcd.daemon import libraries

        self.calls = 0
        self.missing = missing
        monkeypatch.setattr(libraries.pylibs, "require_all_in_child", self)

    def __call__(self, timeout: float = 0) -> None:
        self.calls += 1
        if self.missing:
            raise pylibs.Missing(self.missing)


def _prove(root: HostRoot, name: str) -> Any:
    from kvcd.daemon import libraries

    proof = libraries.LibraryProof()
    proof._prove(_proof_context(root, name))
    return proof


def test_one_proof_serves_every_start_of_the_boot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restart, another instance, a reload to a new config: none starts the child again while
    the installation is the one proved (the child is a second of CPU and 50 MiB on hardware)."""
    root = HostRoot(tmp_path)
    children = Children(monkeypatch)
    for name in ("a", "a", "b"):
        assert _prove(root, name).problem is None
    assert children.calls == 1
    memo = json.loads(root.libraries_proof.read_text())
    assert memo == {"installation": pylibs.installation(), "instance": "a", "pid": os.getpid()}


def test_twenty_instances_starting_at_once_run_one_child(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first holds the lock while its child imports; the others wait for it, then find the
    proof remembered."""
    root = HostRoot(tmp_path)
    children = Children(monkeypatch)
    importing = threading.Event()
    release = threading.Event()

    def slow(timeout: float = 0) -> None:
        importing.set()
        release.wait(30)
        children(timeout)

    from kvcd.daemon import libraries

    monkeypatch.setattr(libraries.pylibs, "require_all_in_child", slow)
    first = threading.Thread(target=_prove, args=(root, "f00"))
    first.start()
    assert importing.wait(30)
    others = [threading.Thread(target=_prove, args=(root, f"f{i:02d}")) for i in range(1, 20)]
    for t in others:
        t.start()
    release.set()
    for t in [first, *others]:
        t.join(30)
    assert children.calls == 1


def test_a_changed_installation_is_proved_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Installing, upgrading or removing a package changes the directory it is in."""
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    root = HostRoot(tmp_path / "host")
    children = Children(monkeypatch)
    _prove(root, "a")
    (site / "podman-5.0.0.dist-info").mkdir()  # an upgrade adds its new metadata ...
    _prove(root, "a")
    (site / "podman-5.0.0.dist-info").rmdir()  # ... a removal takes it away
    _prove(root, "a")
    _prove(root, "a")
    assert children.calls == 3


def test_a_failed_proof_is_said_from_the_first_cycle_and_proved_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure is remembered with its import error: the next set of extensions (a reload's,
    another instance's start) says it from its first cycle, so a reload's answer never says
    Done meanwhile; each still proves again, and a fix clears it, with an event for the loop."""
    from kvcd.daemon import libraries
    from kvcd.daemon.events import Mailbox

    root = HostRoot(tmp_path)
    why = "kvcd needs the Python package 'pyudev' (RPM python3-pyudev) for udev: gone"
    children = Children(monkeypatch, missing=why)
    assert _prove(root, "a").problem == why
    assert json.loads(root.libraries_proof.read_text())["problem"] == why

    def started(name: str) -> tuple[libraries.LibraryProof, Any, Mailbox]:
        """A new set's proof after its first cycle (READY=1 and its idle work come after)."""
        mail = Mailbox()
        proof = libraries.LibraryProof()
        ctx = _proof_context(root, name, mail.post)
        proof.start(ctx)
        proof.after(ctx, Record(name, state.DONE))
        return proof, ctx, mail

    again, ctx, mail = started("b")
    assert again.problem == why  # before its own proof answers
    again._prove(ctx)
    assert (again.problem, children.calls, mail.drain()) == (why, 2, [])  # the same: no event
    children.missing = ""  # fixed without a change the digest sees
    fixed, ctx, mail = started("a")
    assert fixed.problem == why
    fixed._prove(ctx)
    assert (fixed.problem, mail.drain()) == (None, [Event("libraries", "fixed")])
    assert "problem" not in json.loads(root.libraries_proof.read_text())
    assert started("b")[0].problem is None
    assert _prove(root, "b").problem is None
    assert children.calls == 3  # the last start found it proved


@pytest.mark.parametrize(
    ("memo", "said"),
    [
        ("not json", "is not valid JSON"),
        ('["installation"]', ""),
        ('{"installation": "another interpreter"}', ""),
        ("symlink", "is a symlink"),
        ("fifo", "is a FIFO"),
    ],
)
def test_a_memo_kvcd_did_not_write_for_this_installation_proves_nothing(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    memo: str,
    said: str,
) -> None:
    """Damaged, another installation's, or not a regular file: proved again. What is not
    kvcd's regular file is said, and left as it is (a symlink's target is not written)."""
    root = HostRoot(tmp_path / "host")
    root.runtime.mkdir(parents=True)
    target = tmp_path / "target"
    target.write_text("someone else's\n")
    if memo == "symlink":
        root.libraries_proof.symlink_to(target)
    elif memo == "fifo":
        os.mkfifo(root.libraries_proof)
    else:
        root.libraries_proof.write_text(memo)
    children = Children(monkeypatch)
    assert _prove(root, "a").problem is None
    assert children.calls == 1
    assert target.read_text() == "someone else's\n"
    if said:
        assert said in caplog.text
    if memo in ("symlink", "fifo"):
        assert not root.libraries_proof.is_file() or root.libraries_proof.is_symlink()
    else:  # replaced by this proof
        assert json.loads(root.libraries_proof.read_text())["installation"] == (
            pylibs.installation()
        )
        assert _prove(root, "a").problem is None and children.calls == 1


def test_a_lock_kvcd_cannot_take_still_proves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A symlink where the lock goes: said, not followed, and the proof runs (remembering
    nothing), so the instance still learns whether its libraries import."""
    root = HostRoot(tmp_path / "host")
    root.runtime.mkdir(parents=True)
    target = tmp_path / "target"
    root.libraries_lock.symlink_to(target)
    children = Children(monkeypatch)
    assert _prove(root, "a").problem is None
    assert _prove(root, "a").problem is None
    assert children.calls == 2
    assert not target.exists() and not root.libraries_proof.exists()
    assert "is a symlink; proving without it" in caplog.text


def test_the_installation_is_the_interpreter_and_every_import_directory(tmp_path: Path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    base = pylibs.installation([str(one), str(two)])
    assert pylibs.installation([str(one), str(two)]) == base
    assert pylibs.installation([str(two), str(one)]) != base  # the search order matters
    assert pylibs.installation([str(one)]) != base
    assert pylibs.installation([str(one), str(two), str(tmp_path / "gone")]) != base
    (two / "pkg").mkdir()
    assert pylibs.installation([str(one), str(two)]) != base


def test_run_refuses_the_kubernetes_backend_without_its_client(
    root: HostRoot, monkeypatch: pytest.MonkeyPatch
) -> None:
    fakehost.write(root.main_config, 'node_backend = "kubernetes"\n')
    monkeypatch.setitem(sys.modules, "kubernetes", None)
    svc = Service(root, "e2e", K, fakehost.RecordingNotifier())
    assert svc.reconcile() is None and svc.config_invalid  # run() exits 2 on this
    rec = Record.read(root, "e2e")
    assert rec is not None and rec.state == state.DEGRADED
    assert rec.reason.startswith(
        f'ConfigInvalid: {root.main_config}:1: node_backend = "kubernetes" needs the Python '
        "package 'kubernetes' (RPM python3-kubernetes)"
    )


# --- the packaging lists the same set (docs are tests) --------------------------------------


def _pyproject() -> dict[str, object]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def _dist_name(requirement: str) -> str:
    found = re.match(r"[A-Za-z0-9._-]+", requirement)
    assert found, requirement
    return found.group(0).lower()


def _spec_deps(tag: str) -> set[str]:
    text = (REPO / "rpm.spec").read_text()
    return set(re.findall(rf"^{tag}:\s+(python3-\S+)\s*$", text, re.MULTILINE))


def test_pyproject_dependencies_are_the_required_table() -> None:
    project = _pyproject()["project"]
    assert isinstance(project, dict)
    deps = {_dist_name(d) for d in project["dependencies"] if "python_version" not in d}
    assert deps == {p.pip.lower() for r in pylibs.REQUIRED for p in r.packages}


def test_rpm_requires_name_the_same_set_as_pyproject() -> None:
    project = _pyproject()["project"]
    assert isinstance(project, dict)
    # Every pyproject dependency (tomli too, which the spec requires under %if) as its RPM name.
    assert _spec_deps("Requires") == {f"python3-{_dist_name(d)}" for d in project["dependencies"]}
    required_rpms = {p.rpm for r in pylibs.REQUIRED for p in r.packages}
    assert required_rpms <= _spec_deps("Requires")


def test_rpm_recommends_are_the_optional_extras() -> None:
    project = _pyproject()["project"]
    assert isinstance(project, dict)
    extras = project["optional-dependencies"]
    assert isinstance(extras, dict)
    assert sorted(k for k in extras if k != "dev") == ["dbus", "kubernetes"]
    assert {_dist_name(d) for d in extras["kubernetes"]} == {
        p.pip.lower() for p in pylibs.NODE_KUBERNETES.packages
    }
    assert {_dist_name(d) for d in extras["dbus"]} == {
        p.pip.lower() for p in pylibs.RPMOSTREE_DBUS.packages
    }
    # python3-pydbus brings python3-gobject with it on Fedora/RHEL.
    assert _spec_deps("Recommends") == {"python3-kubernetes", "python3-pydbus"}
    assert not _spec_deps("Requires") & _spec_deps("Recommends")


# --- kvcd status: each capability on or off, and why ----------------------------------------


def test_status_lists_the_capabilities_of_a_running_instance(
    root: HostRoot, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("kubernetes")
    fakehost.write(root.main_config, 'node_backend = "kubernetes"\n')
    fakehost.write_config(
        root, "e2e", GOOD.replace("[build]", 'expect_links = [{ driver = "ixgbe" }]\n[build]')
    )
    fakehost.pretend_daemon(root, "e2e", monkeypatch)  # as `kvcd run` does: it runs
    fakehost.write(
        root.runtime / "e2e.drift.json",
        json.dumps({"line": "watching 12 files", "udev": False, "udev_off": "no udevd socket"}),
    )
    fakehost.write(
        root.runtime / "e2e.links.json",
        json.dumps({"provided": [], "missing": [], "watch_off": ""}),
    )
    assert main(["--root", str(root.root), "status"]) == 0
    out = capsys.readouterr().out
    for line in (
        "  drift: watching 12 files\n",
        "  udev module events: off (no udevd socket)\n",
        "  holder checks: on\n",
        "  links: netlink link events\n",
        "  node backend: kubernetes\n",
        "  on stop: unload_policy = if-idle (unloads; refused while a module is in use)\n",
    ):
        assert line in out
    assert "rpm-ostree" not in out  # not an rpm-ostree host
    assert main(["--root", str(root.root), "status", "--json"]) == 0
    caps = json.loads(capsys.readouterr().out)["instances"][0]["capabilities"]
    assert caps["udev"] == {"on": False, "detail": "no udevd socket"}
    assert caps["drift"] == {"on": True, "detail": "watching 12 files"}
    assert caps["holders"] == {"on": True, "detail": ""}
    assert caps["node_backend"] == {"on": True, "detail": "kubernetes"}


def test_status_says_why_capabilities_are_off(
    root: HostRoot, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Not running: its runtime files say nothing about now, even when left behind.
    fakehost.write(
        root.runtime / "e2e.drift.json", json.dumps({"line": "watching 3 files", "udev": True})
    )
    fakehost.write(root.main_config, 'node_backend = "kubernetes"\n')
    fakehost.write(root("/run/ostree-booted"), "")
    monkeypatch.setitem(sys.modules, "kubernetes", None)
    monkeypatch.setitem(sys.modules, "pydbus", None)
    fakehost.write_config(root, "e2e", GOOD.replace("[build]", 'unload_policy = "never"\n[build]'))
    out = status.render(status.collect(root, "e2e"))
    assert "  on stop: unload_policy = never (modules stay loaded)\n" in out
    assert "  drift: off (kvcd@e2e is not running)\n" in out
    assert "  udev module events: off (kvcd@e2e is not running)\n" in out
    assert "  links: off (instance has no expect_links)\n" in out
    assert (
        '  node backend: off (node_backend = "kubernetes" needs the Python package '
        "'kubernetes' (RPM python3-kubernetes): import of kubernetes halted; None in sys.modules)"
    ) in out
    assert (
        "  rpm-ostree: CLI (rpm-ostree D-Bus needs the Python package 'pydbus' "
        "(RPM python3-pydbus): import of pydbus halted; None in sys.modules)"
    ) in out


def test_the_node_backend_line_is_not_another_settings_refusal(
    root: HostRoot, monkeypatch: pytest.MonkeyPatch
) -> None:
    """inhibit_reboot without its library is refused, but it is not the node backend's."""
    fakehost.write(root.main_config, 'node_backend = "file"\ninhibit_reboot = true\n')
    monkeypatch.setitem(sys.modules, "gi", None)
    monkeypatch.setitem(sys.modules, "gi.repository", None)
    fakehost.write_config(root, "e2e", GOOD)
    out = status.render(status.collect(root, "e2e"))
    assert "  node backend: file\n" in out, out
