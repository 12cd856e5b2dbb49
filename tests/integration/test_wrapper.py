"""`kvcd wrapper NAME CMD…`: a tool from the instance's driver image, run with the podman
CLI (a fake one here, which says what it was asked), from the image the daemon uses: the
variant picked for this node."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvcd.host.paths import HostRoot
from tests import fakehost

pytestmark = pytest.mark.integration

K = "6.1.0-18-amd64"
INSTANCE = """\
version = "1.0"
modules = ["nicmod"]
wrapper_args = ["--privileged"]
[capabilities]
kernel_flavor = ["rt", "generic"]
[variants.rt]
image = "registry.example.com/drivers/nic:{version}-{kernel}-rt"
capabilities = { kernel_flavor = ["rt"] }
[variants.generic]
capabilities = { kernel_flavor = ["generic"] }
[variants.generic.build]
context = "/usr/share/nic"
"""


def wrapper(tmp_path: Path, settings: str, instance: str = INSTANCE) -> tuple[int, str, str]:
    root = HostRoot(tmp_path / "root")
    fakehost.make_host(root, K)
    fakehost.write(root.instance_dirs()[0] / "nic.toml", instance)
    fakehost.write(root.main_config, settings)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fakehost.write_command(bindir, "podman", 'echo "podman $*"; exit 7')
    argv = [sys.executable, "-m", "kvcd.cli", "--root", str(root.root)]
    out = subprocess.run(
        [*argv, "wrapper", "nic", "tool", "-x"],
        env={
            **os.environ,
            "PATH": f"{bindir}:{os.environ['PATH']}",
            "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
        },
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return out.returncode, out.stdout, out.stderr


def test_the_wrapper_runs_the_variant_image_the_daemon_builds(tmp_path: Path) -> None:
    code, out, err = wrapper(tmp_path, "")
    assert code == 7, err  # the tool's own exit status
    assert out == f"podman run --rm -i --privileged localhost/kvcd/nic/generic/1.0:{K} tool -x\n"


@pytest.mark.parametrize(
    "socket",
    [
        "tcp://build-host.example.com:8888",
        "unix:///run/build-host.sock",  # e.g. another host's, forwarded with ssh -L
    ],
)
def test_the_wrapper_refuses_a_podman_other_than_the_systems(tmp_path: Path, socket: str) -> None:
    """The podman CLI runs the system service's images; kvcd built the driver's elsewhere,
    maybe on another host, where the tool would run or not find its image."""
    code, out, err = wrapper(tmp_path, f'podman_socket = "{socket}"\n')
    assert (code, out) == (2, "")
    assert err == (
        f"kvcd: wrapper: podman_socket = '{socket}' (kvcd.toml) is not the system podman "
        "(unix:///run/podman/podman.sock), whose images this node's podman CLI runs: the "
        "driver image is not among them\n"
    )


def test_the_wrapper_says_when_no_variant_fits_this_node(tmp_path: Path) -> None:
    only_rt = INSTANCE.partition("[variants.generic]")[0]
    code, out, err = wrapper(tmp_path, "", only_rt)
    assert (code, out) == (1, "")
    assert err == (
        "kvcd: nic: no image variant fits this node: rt (kernel_flavor: wants [rt], node has "
        "[generic])\n"
    )
