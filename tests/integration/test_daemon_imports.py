"""A settled `kvcd run` daemon keeps only what it uses resident (issue #20: RSS per daemon).

The late hook that proves every required library imports (kvcd/daemon/libraries.py) has a
child interpreter import them: podman-py with requests, and pyroute2, would otherwise be most
of the daemon's memory for as long as it runs, and a cached start needs none of them. A real
`kvcd run` process on a scratch root (fake modprobe/depmod, the version already in the store),
and the modules it had imported once its late hooks were done.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kvcd.host import pylibs
from kvcd.host.paths import HostRoot
from tests import fakehost
from tests.integration.kmods import compiled_kmods_or_skip

pytestmark = pytest.mark.integration

K = "6.1.0-56-amd64"
REPO = Path(__file__).resolve().parents[2]
MODS = ["kvcd_base", "kvcd_user"]
CONFIG = 'version = "1.0"\nmodules = ["kvcd_base", "kvcd_user"]\n[build]\ncontext = "/src"\n'

# The clients a cached start of a plain config (no links, no device gating) does not use.
RESIDENT_NEVER = (
    "podman",
    "requests",
    "urllib3",
    "rich",
    "pyroute2",
    "pyudev",
    "elftools",
    "psutil",
    "kubernetes",
    "pydbus",
    "gi",
    "prometheus_client",  # the metrics textfile is written by a child (kvcd/daemon/metrics.py)
)

# What talking to the podman API imports (podman-py and its HTTP stack).
PODMAN_CLIENT = ("podman", "requests", "urllib3", "rich")

# `kvcd run`, writing sys.modules to $KVCD_MODULES_TO once the late hooks of a cycle are done,
# and to $KVCD_MODULES_TO.ready when it first sent READY=1.
PROBE = """\
import json, os, sys
from kvcd.daemon import service

late = service.Service.run_late

def run_late(self, record):
    out = late(self, record)
    to = os.environ["KVCD_MODULES_TO"]
    with open(to + ".tmp", "w") as f:
        json.dump(sorted(sys.modules), f)
    os.replace(to + ".tmp", to)
    return out

service.Service.run_late = run_late
announce = service.Service._announce

def _announce(self, record, ready):
    out = announce(self, record, ready)
    at = os.environ["KVCD_MODULES_TO"] + ".ready"
    if out and not os.path.exists(at):  # READY=1 sent: the modules are live
        with open(at, "w") as f:
            json.dump(sorted(sys.modules), f)
    return out

service.Service._announce = _announce
from kvcd.cli import main
sys.exit(main(sys.argv[1:]))
"""


def settled_daemon(
    tmp: Path,
    pythonpath: list[Path],
    want: str = "Done",
    also: str | None = None,
    build: tuple[str, Path] | None = None,
    kernel: str = K,
    said: str | None = None,
) -> tuple[set[str], dict[str, object]]:
    """(modules imported, record) of a `kvcd run e2e` whose late hooks have run in a cycle
    that left the record in state `want` (the library proof ends beside the loop: a broken
    library is Degraded in the cycle its event wakes), and host file `also` exists. With
    `build` (the podman service's URL, a build context), its start on `kernel` builds and
    extracts version 1.0; else 1.0 is in the store already (a cached start). A second call on
    the same `tmp` starts it again on the same root. With `said`, it runs with -v and until
    its log says that."""
    root = HostRoot(tmp / "root")
    bindir = tmp / "bin"
    if not root.root.exists():
        fakehost.make_host(root, kernel)
        if build is None:
            fakehost.store_version(root, "e2e", "1.0", kernel, MODS)
            fakehost.write_config(root, "e2e", CONFIG)
        else:
            url, context = build
            fakehost.write(root.main_config, f'podman_socket = "{url}"\n')
            fakehost.write_config(root, "e2e", CONFIG.replace("/src", str(context)))
        bindir.mkdir()
        (tmp / "cwd").mkdir()  # its sys.path[0]: a directory nothing writes to between starts
        for name, body in fakehost.SCRIPTS.items():
            fakehost.write_command(bindir, name, body, tmp / "calls.log")
    to = tmp / "modules.json"
    env = {
        **os.environ,
        "PATH": f"{bindir}:{os.environ['PATH']}",
        "FAKE_ROOT": str(root.root),
        "PYTHONPATH": os.pathsep.join(str(p) for p in [*pythonpath, REPO]),
        "KVCD_MODULES_TO": str(to),
    }
    env.pop("NOTIFY_SOCKET", None)
    with open(tmp / "stderr", "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-c", PROBE, "--root", str(root.root)]
            + (["-v"] if said else [])
            + ["run", "e2e"],
            env=env,
            cwd=tmp / "cwd",
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    try:
        deadline = time.monotonic() + 120
        record: dict[str, object] = {}
        while proc.poll() is None and time.monotonic() < deadline:
            if to.exists():
                record = json.loads(root.state_file("e2e").read_text())
                if (
                    record.get("state") == want
                    and (also is None or root(also).exists())
                    and (said is None or said in (tmp / "stderr").read_text())
                ):
                    break
            time.sleep(0.05)
        assert to.exists(), (tmp / "stderr").read_text()[-3000:]
        modules = set(json.loads(to.read_text()))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return modules, record


def resident(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if m.split(".")[0] in RESIDENT_NEVER)


def test_a_settled_daemon_has_proven_its_libraries_without_importing_them(
    tmp_path: Path,
) -> None:
    prom = "/run/kvcd/metrics/kvcd-e2e.prom"
    modules, record = settled_daemon(tmp_path, [], also=prom)
    assert record["state"] == "Done", record
    assert "kvcd.daemon.libraries" in modules  # the proof ran
    assert resident(modules) == []
    # The metrics textfile, written by a child with prometheus_client.
    text = (tmp_path / "root" / prom.lstrip("/")).read_text()
    assert 'kvcd_instance_state{instance="e2e",state="Done"} 1.0' in text


def test_a_start_in_the_same_boot_does_not_prove_the_libraries_again(tmp_path: Path) -> None:
    """The first start's child proved them, and the runtime directory remembers it for this
    installation: the next start (a restart, another instance) starts no child."""
    root = HostRoot(tmp_path / "root")
    settled_daemon(tmp_path, [], also="/run/kvcd/.libraries.json")
    first = json.loads(root.libraries_proof.read_text())
    assert first["instance"] == "e2e" and len(first["installation"]) == 64, first
    _, record = settled_daemon(tmp_path, [], said="library check: proven in this boot")
    assert record["state"] == "Done", record
    assert json.loads(root.libraries_proof.read_text()) == first  # not proved again
    stderr = (tmp_path / "stderr").read_text()
    assert f"library check: proven in this boot by e2e (pid {first['pid']})" in stderr


def test_a_daemon_that_built_its_image_keeps_none_of_podman_py(
    tmp_path: Path, podman_service: Any
) -> None:
    """A start that builds and extracts talks to podman from a helper process
    (kvcd/host/podchild.py), which ends with the change: podman-py, requests and rich never
    enter the daemon, whose first start would otherwise keep them for as long as it runs."""
    kmods = compiled_kmods_or_skip("the daemon's build")
    context = tmp_path / "context"
    context.mkdir()
    for ko in (kmods.base, kmods.user):
        (context / ko.name).write_bytes(ko.read_bytes())
    (context / "Containerfile").write_text(
        "FROM scratch\nARG KVER\nCOPY *.ko /lib/modules/${KVER}/extra/\n"
    )
    build = (podman_service.url, context)
    modules, record = settled_daemon(tmp_path, [], build=build, kernel=kmods.kernel)
    assert record["state"] == "Done", record
    assert "kvcd.host.podchild" in modules  # it did talk to podman
    # (pyelftools stays: the daemon reads the extracted modules' ELF itself.)
    assert [m for m in resident(modules) if m.split(".")[0] in PODMAN_CLIENT] == []


def test_a_broken_library_degrades_the_daemon_with_its_import_error_and_stays_out(
    tmp_path: Path,
) -> None:
    """Installed (the start's look-up finds it) but not importable: the child's import error,
    the instance Degraded (HostError), and the daemon itself never imported it."""
    shadow = tmp_path / "shadow"
    fakehost.write(shadow / "pyudev" / "__init__.py", "raise ImportError('libudev.so.1: gone')\n")
    modules, record = settled_daemon(tmp_path, [shadow], want="Degraded")
    assert record["state"] == "Degraded", record
    assert record["reason"] == (
        "HostError: kvcd needs the Python package 'pyudev' (RPM python3-pyudev) for udev module "
        "and device events: libudev.so.1: gone"
    ), record
    assert resident(modules) == []


def test_the_child_proof_names_each_library_that_does_not_import(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shadow = tmp_path / "shadow"
    fakehost.write(shadow / "psutil" / "__init__.py", "raise ImportError('built for 3.6')\n")
    fakehost.write(shadow / "pyroute2" / "__init__.py", "1 / 0\n")
    monkeypatch.syspath_prepend(str(shadow))  # the child gets this interpreter's sys.path
    with pytest.raises(pylibs.Missing) as exc:
        pylibs.require_all_in_child()
    assert str(exc.value) == (
        "kvcd needs the Python package 'psutil' (RPM python3-psutil) for holder checks: "
        "built for 3.6; kvcd needs the Python package 'pyroute2' (RPM python3-pyroute2) for "
        "link readiness (netlink): ZeroDivisionError: division by zero"
    )


def test_a_child_that_gives_no_answer_is_the_problem(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "executable", "/bin/false")
    with pytest.raises(pylibs.Missing) as exc:
        pylibs.require_all_in_child()
    assert str(exc.value) == (
        "kvcd could not import its required libraries in a child: /bin/false exited 1: no output"
    )


def test_a_child_still_importing_at_the_timeout_is_no_answer_not_a_missing_library(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Twenty instances starting at once on a one-CPU guest starved the idle-class children
    past the wait: a timeout said "could not import its required libraries", and every
    instance went Degraded with libraries that import."""
    slow = tmp_path / "slow"
    fakehost.write(slow / "podman" / "__init__.py", "import time\ntime.sleep(30)\n")
    monkeypatch.syspath_prepend(str(slow))
    with pytest.raises(pylibs.NoAnswer) as exc:
        pylibs.require_all_in_child(timeout=1)
    assert str(exc.value) == "no answer from the child in 1 s"


def _start_imports() -> tuple[str, ...]:
    """scenarios_perf.START_IMPORTS, read from its source (the guest file imports guest-only
    helpers)."""
    tree = ast.parse((REPO / "tests/e2e/guest/scenarios_perf.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "START_IMPORTS":
            names = ast.literal_eval(node.value)
            assert isinstance(names, tuple)
            return names
    raise AssertionError("no START_IMPORTS in scenarios_perf.py")


def test_the_guest_figure_of_a_starts_imports_imports_what_a_start_has_at_ready(
    tmp_path: Path,
) -> None:
    """scenarios_perf p5 times importing START_IMPORTS, a list written by hand, as what a cached
    start imports before its modules are live: a real cached start had imported exactly its
    kvcd modules, and nothing the list leaves out, when it sent READY=1."""
    settled_daemon(tmp_path, [])
    at_ready = set(json.loads((tmp_path / "modules.json.ready").read_text()))
    listed = subprocess.run(
        [sys.executable, "-c", IMPORT_ALL, *_start_imports()],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        cwd=tmp_path / "cwd",
        capture_output=True,
        text=True,
        check=True,
    )
    probed = set(json.loads(listed.stdout))
    assert sorted(at_ready - probed) == []
    beyond = probed - at_ready  # the list imports no kvcd module and no library a start does not
    assert sorted(m for m in beyond if m.split(".")[0] not in sys.stdlib_module_names) == []


IMPORT_ALL = """\
import importlib, json, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
print(json.dumps(sorted(sys.modules)))
"""
