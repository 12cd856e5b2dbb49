"""Guest-side: `kvcd purge` on a real kernel, podman and systemd (issue #18, clean removal).

(u1) kvcd@e2e-purge (one module, kvcd_f01, compiled on the host by run-guest.sh; its own image
     from Containerfile.fleet) started and Done, its node annotations, metrics and drift
     expectations written; then `kvcd purge e2e-purge`: the unit stopped, the module gone from
     /proc/modules, no file or link of the instance under /var/lib/kvcd or /run/kvcd, no image
     labelled io.kvcd.instance=e2e-purge, no node annotation kvcd.io/e2e-purge.*; its config
     stays, and e2e-kmod's files are untouched. A held module's refusal (nothing removed) is a
     unit test (tests/unit/test_purge.py): the fleet module cannot be held from user space.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvcdguest import BUILD_TIMEOUT, DRIVER_DIR, INSTANCE, proc_modules, sh, state_is, wait_for

KVER = os.uname().release
NAME = "e2e-purge"
MOD = "kvcd_f01"
UNIT = f"kvcd@{NAME}.service"
CONFIG = Path(f"/etc/kvcd/instances/{NAME}.toml")
CONTEXT = DRIVER_DIR.parent / "purge"
OWN = (Path("/var/lib/kvcd"), Path("/run/kvcd"))


def of_instance(name: str) -> list[str]:
    """Every file, link or directory of `name` in kvcd's own directories."""
    found = []
    for base in OWN:
        for dirpath, dirnames, filenames in os.walk(base):
            for entry in [*dirnames, *filenames]:
                if entry == name or entry.startswith(f"{name}.") or entry == f"kvcd-{name}.prom":
                    found.append(os.path.join(dirpath, entry))
    return sorted(found)


def images(name: str) -> list[str]:
    out = sh(["podman", "images", "-q", "--filter", f"label=io.kvcd.instance={name}"]).stdout
    return out.split()


def annotations() -> dict[str, str]:
    return dict(json.loads(Path("/var/lib/kvcd/node.json").read_text())["annotations"])


@pytest.fixture(scope="module", autouse=True)
def _instance() -> Iterator[None]:
    src = DRIVER_DIR / "prebuilt" / KVER / "fleet" / f"{MOD}.ko"
    assert src.exists(), f"run-guest.sh compiled no {src}"
    shutil.rmtree(CONTEXT, ignore_errors=True)
    (CONTEXT / "fleet").mkdir(parents=True)
    shutil.copy2(src, CONTEXT / "fleet" / src.name)
    shutil.copy2(DRIVER_DIR / "Containerfile.fleet", CONTEXT / "Containerfile")
    CONFIG.write_text(
        f'version = "1.0"\nmodules = ["{MOD}"]\n\n[build]\ncontext = "{CONTEXT}"\n\n'
        f'[build.args]\nMOD = "{MOD}"\n'
    )
    yield
    sh(["systemctl", "stop", UNIT], check=False, timeout=600)
    sh(["kvcd", "purge", NAME], check=False, timeout=600)
    CONFIG.unlink(missing_ok=True)
    shutil.rmtree(CONTEXT, ignore_errors=True)


def start() -> None:
    sh(["systemctl", "start", UNIT], timeout=BUILD_TIMEOUT)
    wait_for(state_is("Done", instance=NAME), BUILD_TIMEOUT, f"{NAME} Done")
    assert MOD in proc_modules()
    # What the late hooks write after READY=1: the node report and the metrics textfile.
    wait_for(
        lambda: (
            annotations().get(f"kvcd.io/{NAME}.state") == "Done"
            and Path(f"/run/kvcd/metrics/kvcd-{NAME}.prom").exists()
        ),
        120,
        f"{NAME}'s node annotations and metrics",
    )


def test_u1_purge_leaves_nothing_of_the_instance() -> None:
    start()
    assert of_instance(NAME) and images(NAME)
    others = [Path(f) for f in of_instance(INSTANCE) if not f.startswith("/run/")]

    p = sh(["kvcd", "purge", NAME], timeout=600)

    assert f"purged {NAME}" in p.stdout, p
    assert sh(["systemctl", "is-active", UNIT], check=False).stdout.strip() != "active"
    assert MOD not in proc_modules()
    assert of_instance(NAME) == []
    assert images(NAME) == []
    assert not [k for k in annotations() if k.startswith(f"kvcd.io/{NAME}.")]
    assert CONFIG.exists()  # the admin's configuration stays
    assert [f for f in others if not f.exists()] == []  # another instance's files stay
    status = json.loads(sh(["kvcd", "status", NAME, "--json"], check=False).stdout)
    assert status["instances"][0]["reason"] == "never started", status
