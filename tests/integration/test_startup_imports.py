"""The read-only verbs import only what they need (issue #20): a fresh `kvcd` process per verb,
on a scratch root, and the modules it had imported when main() returned.

Their start-up is the price of every `kvcd status` an operator or a monitoring script runs; the
libraries below each cost more than the verb itself (benchmarks/bench_startup.py times them).
No timings here: only which modules were imported, which does not depend on the machine's load.
The scratch root asks for the worst case: the kubernetes node backend and an rpm-ostree host,
whose libraries `kvcd status` and `check-config` must look up without importing them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvcd.host.paths import HostRoot
from tests import fakehost

K = "6.1.0-56-amd64"
REPO = Path(__file__).resolve().parents[2]

# The driver-image, inotify, udev, netlink, ELF, process, D-Bus and Kubernetes clients and what
# they pull in: only `kvcd run` and the verbs that build or load import them.
CLIENTS = (
    "podman",
    "requests",
    "urllib3",
    "kubernetes",
    "yaml",
    "pyudev",
    "pyroute2",
    "elftools",
    "inotify_simple",
    "psutil",
    "pydbus",
    "gi",
)
# What the status path stopped importing in #20: commands, sockets, the module tree machinery,
# and shutil with its compression modules (argparse asked it for the terminal's width).
STATUS_EXTRA = (
    "subprocess",
    "shutil",
    "bz2",
    "lzma",
    "socket",
    "secrets",
    "difflib",
    "kvcd.host.run",
    "kvcd.host.kmod",
    "kvcd.host.hooks",
    "kvcd.host.bootloader",
    "kvcd.daemon.executor",
)
# Nor, for configs without capabilities, variants, device gating, links or depends_on, their
# parser and its dataclasses (`kvcd status` parses every config for its links line); nor,
# without a pid file, the proof that a process is kvcd@NAME.
STATUS_CONFIG = (
    "kvcd.config.capsconf",
    "kvcd.core.capabilities",
    "kvcd.daemon.control",
    "kvcd.host.procs",
    "kvcd.host.rpmostree",  # the scratch root is an rpm-ostree host: status asks only its marker
)

# argv after `--root ROOT` -> exit code -> modules that must not be imported
TABLE = [
    (["status"], 0, CLIENTS + STATUS_EXTRA + STATUS_CONFIG),
    (["status", "--json"], 0, CLIENTS + STATUS_EXTRA + STATUS_CONFIG),
    (["status", "drv0"], 0, CLIENTS + STATUS_EXTRA + STATUS_CONFIG),
    (["check-config", "drv0"], 0, (*CLIENTS, "kvcd.daemon.executor", "secrets", "difflib")),
    (["check-config", "--all"], 0, (*CLIENTS, "kvcd.daemon.executor", "secrets", "difflib")),
    (["capabilities", "--json"], 0, CLIENTS + STATUS_EXTRA),
]

PROBE = (
    "import sys\n"
    "from kvcd.cli import main\n"
    "rc = main(sys.argv[1:])\n"
    "seen = sorted(sys.modules)\n"
    "import json\n"
    "sys.stderr.write('\\nMODULES ' + json.dumps({'rc': rc, 'modules': seen}) + '\\n')\n"
)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> HostRoot:
    root = HostRoot(tmp_path_factory.mktemp("startup"))
    fakehost.make_host(root, K)
    # The kubernetes backend, with credentials it can read: check-config must still not
    # import the client (it looks the package up; the start imports it).
    fakehost.write(root("/etc/kvcd/kubeconfig"), "apiVersion: v1\nkind: Config\n")
    fakehost.write(
        root.main_config,
        f'node_backend = "kubernetes"\nkubeconfig = "{root("/etc/kvcd/kubeconfig")}"\n',
    )
    fakehost.write(root("/run/ostree-booted"), "")
    for name in ("drv0", "drv1"):
        fakehost.write_config(
            root,
            name,
            f'version = "1.0"\nmodules = ["{name}_a"]\n[build]\ncontext = "/src"\n',
        )
        (root.sys_module / f"{name}_a" / "holders").mkdir(parents=True)
        (root.sys_module / f"{name}_a" / "refcnt").write_text("0\n")
        fakehost.write(
            root.state_file(name),
            json.dumps(
                {
                    "instance": name,
                    "state": "Done",
                    "version": "1.0",
                    "kernel": K,
                    "goal": "loaded",
                    "modules": [f"{name}_a"],
                }
            ),
        )
    return root


def imported(root: HostRoot, argv: list[str]) -> tuple[int, set[str], str]:
    """(exit code, modules imported when main() returned, stdout) of a fresh `kvcd` process."""
    # KVCD_STARTUP_TREE: another source tree to check (this test must fail on one before #20).
    env = {**os.environ, "PYTHONPATH": os.environ.get("KVCD_STARTUP_TREE", str(REPO))}
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, "--root", str(root.root), *argv],
        env=env,
        cwd=root.root,  # not the checkout: `-c` puts the working directory first on sys.path
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    marker = proc.stderr.rfind("\nMODULES ")
    assert marker >= 0, proc.stderr
    found = json.loads(proc.stderr[marker + len("\nMODULES ") :])
    return found["rc"], set(found["modules"]), proc.stdout


@pytest.mark.parametrize(("argv", "rc", "forbidden"), TABLE, ids=[" ".join(t[0]) for t in TABLE])
def test_a_read_only_verb_imports_no_client(
    scratch: HostRoot, argv: list[str], rc: int, forbidden: tuple[str, ...]
) -> None:
    code, modules, out = imported(scratch, argv)
    assert code == rc, out
    assert out  # it did its work: the verb printed its answer
    heavy = sorted(m for m in modules if m.split(".")[0] in forbidden or m in forbidden)
    assert heavy == [], f"kvcd {' '.join(argv)} imported {heavy}"
