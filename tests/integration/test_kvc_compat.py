"""An existing KVC instance (/etc/kvc/<name>.conf + <name>-lib.sh) runs unchanged through kvcd.

The library is run by real bash through kvcd's hook runner; its load_kmods uses the fake-host
modprobe (this kernel cannot load), and kvcd verifies the result in the fake /sys/module.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvcd.host.paths import HostRoot
from tests import fakehost

pytestmark = pytest.mark.integration

K = "6.1.0-56-amd64"
CONF = """\
# an ordinary KVC config
KMOD_CONTAINER_BUILD_CONTEXT="https://github.com/kmods-via-containers/kvc-simple-kmod.git"
KMOD_CONTAINER_BUILD_FILE=Dockerfile.fedora
KMOD_SOFTWARE_VERSION=dd1a7d4
KMOD_NAMES="simple-kmod simple-procfs-kmod"
export EXTRA_SETTING='a b'
"""
# A library in KVC's style: functions without arguments reading KVC_* and the conf's variables.
LIB = r"""
build_kmods() {
    echo "build $KVC_SOFTWARE_NAME $KVC_KVER $KMOD_SOFTWARE_VERSION" \
         "runtime=$KVC_CONTAINER_RUNTIME" >> "$FAKE_ROOT/hook.log"
    type kvc_c_build >/dev/null
}
load_kmods() {
    echo "load $KMOD_NAMES extra=$EXTRA_SETTING arg1=${1:-}" >> "$FAKE_ROOT/hook.log"
    for m in $KMOD_NAMES; do modprobe "${m//-/_}"; done
}
unload_kmods() {
    echo "unload" >> "$FAKE_ROOT/hook.log"
    for m in $KMOD_NAMES; do rmmod "${m//-/_}"; done
}
wrapper() {
    echo "wrapper $*"
}
"""


@pytest.fixture
def host(tmp_path: Path) -> tuple[HostRoot, dict[str, str]]:
    root = HostRoot(tmp_path / "root")
    fakehost.make_host(root, K)
    conf = root.kvc_conf("simple-kmod")
    conf.parent.mkdir(parents=True)
    conf.write_text(CONF)
    lib = root("/usr/lib/kvc/simple-kmod-lib.sh")
    lib.parent.mkdir(parents=True)
    lib.write_text(LIB)
    for p in (conf, lib):
        p.chmod(0o644)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name, body in fakehost.SCRIPTS.items():
        fakehost.write_command(bindir, name, body)
    env = {
        **os.environ,
        "PATH": f"{bindir}:{os.environ['PATH']}",
        "FAKE_ROOT": str(root.root),
        "KVCD_ROOT": str(root.root),
        "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
    }
    return root, env


def kvcd(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvcd.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_kvc_instance_loads_unloads_and_wraps_through_its_library(
    host: tuple[HostRoot, dict[str, str]],
) -> None:
    root, env = host
    check = kvcd(env, "check-config", "simple-kmod")
    assert check.returncode == 0, check.stdout + check.stderr
    assert "kvc format" in check.stdout
    assert "run build_kmods from the instance's KVC library" in check.stdout

    out = kvcd(env, "load", "simple-kmod")
    assert out.returncode == 0, out.stderr
    log = (root.root / "hook.log").read_text().splitlines()
    assert log == [
        f"build simple-kmod {K} dd1a7d4 runtime=podman",
        f"load simple-kmod simple-procfs-kmod extra=a b arg1={K}",
    ]
    assert (root.sys_module / "simple_procfs_kmod").is_dir()
    assert kvcd(env, "status", "simple-kmod").stdout.startswith("simple-kmod: Done")

    out = kvcd(env, "unload", "simple-kmod")
    assert out.returncode == 0, out.stderr
    assert not (root.sys_module / "simple_kmod").exists()

    out = kvcd(env, "wrapper", "simple-kmod", "spkut", "44")
    assert (out.returncode, out.stdout) == (0, "wrapper spkut 44\n")


def test_signing_that_cannot_reach_a_library_instance_is_said_at_check_config(
    host: tuple[HostRoot, dict[str, str]],
) -> None:
    """kvcd signs what it extracts; a library builds and loads its own modules. check-config
    says so for such an instance when kvcd.toml sets a signing key (the daemon's journal too)."""
    root, env = host
    keys = root.root / "keys"
    keys.mkdir()
    for name in ("k.key", "k.crt"):
        (keys / name).write_text("PEM\n")
        (keys / name).chmod(0o600)
    fakehost.write(root.main_config, f'sign_key = "{keys}/k.key"\nsign_cert = "{keys}/k.crt"\n')
    check = kvcd(env, "check-config", "simple-kmod")
    assert check.returncode == 0, check.stdout + check.stderr
    lib = root("/usr/lib/kvc/simple-kmod-lib.sh")
    assert (
        f"  warning: sign_key (kvcd.toml) does not reach this instance: its library {lib} builds "
        "and loads the modules itself, so kvcd neither signs them nor checks their signatures "
        "before the load\n"
    ) in check.stdout, check.stdout


LOAD_MODULES = 'for m in $KMOD_NAMES; do modprobe "${m//-/_}"; done'


def load_with_library(
    host: tuple[HostRoot, dict[str, str]], old: str, new: str
) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """`kvcd load` of the instance whose library has `old` replaced by `new`: it must fail."""
    root, env = host
    lib = root("/usr/lib/kvc/simple-kmod-lib.sh")
    lib.write_text(LIB.replace(old, new))
    out = kvcd(env, "load", "simple-kmod")
    assert out.returncode == 1, out.stderr
    return lib, out


def test_a_library_that_does_not_load_is_caught_by_verification(
    host: tuple[HostRoot, dict[str, str]],
) -> None:
    _, out = load_with_library(host, LOAD_MODULES, "true")
    assert "VerifyFailed: simple_kmod is not in /sys/module after loading" in out.stderr


def test_a_failing_library_function_is_reported_with_its_output(
    host: tuple[HostRoot, dict[str, str]],
) -> None:
    _, out = load_with_library(
        host, "type kvc_c_build >/dev/null", "echo 'no such image' >&2; return 3"
    )
    assert "HookFailed: build_kmods in" in out.stderr and "no such image" in out.stderr


def test_conf_injection_is_refused_before_anything_runs(
    host: tuple[HostRoot, dict[str, str]],
) -> None:
    root, env = host
    marker = root.root / "pwned"
    root.kvc_conf("simple-kmod").write_text(CONF + f'KMOD_NAMES="$(touch {marker})"\n')
    out = kvcd(env, "load", "simple-kmod")
    assert out.returncode == 2
    assert "simple-kmod.conf:7" in out.stderr
    assert not marker.exists()
    assert not (root.root / "hook.log").exists()


def test_a_conf_changed_after_kvcd_read_it_is_refused_before_a_library_sources_it(
    host: tuple[HostRoot, dict[str, str]],
) -> None:
    """simple-kmod-lib.sh sources the conf itself: bash runs the file as it is when the hook
    runs. Here something rewrites it between build_kmods and load_kmods."""
    root, env = host
    conf, marker = root.kvc_conf("simple-kmod"), root.root / "pwned"
    lib = root("/usr/lib/kvc/simple-kmod-lib.sh")
    lib.write_text(
        LIB.replace(
            "type kvc_c_build >/dev/null",
            f"echo 'X=\"$(touch {marker})\"' >> {conf}",
        ).replace("load_kmods() {", f"load_kmods() {{\n    source {conf}")
    )
    out = kvcd(env, "load", "simple-kmod")
    assert out.returncode == 1, out.stderr
    assert f"ConfigInvalid: {conf}:7: command substitution" in out.stderr, out.stderr
    assert not marker.exists()


def test_a_library_function_that_hangs_is_stopped_at_hook_timeout(
    host: tuple[HostRoot, dict[str, str]],
) -> None:
    """A hung load_kmods held its instance (and, after READY, the daemon's loop) for good."""
    root, env = host
    settings = root("/etc/kvcd/kvcd.toml")
    settings.parent.mkdir(parents=True, exist_ok=True)
    settings.write_text("hook_timeout = 1.5\n")
    lib, out = load_with_library(host, LOAD_MODULES, "sleep 61.5")
    assert (
        f"HookFailed: load_kmods in {lib} did not finish within hook_timeout = 1.5 s" in out.stderr
    )
    status = kvcd(env, "status", "simple-kmod").stdout
    assert status.startswith("simple-kmod: Degraded"), status
    sleeping = subprocess.run(["pgrep", "-fx", "sleep 61.5"], capture_output=True, check=False)
    assert sleeping.returncode == 1, f"the hook's sleep is still running: {sleeping.stdout!r}"


def test_a_stop_cuts_into_build_kmods(host: tuple[HostRoot, dict[str, str]]) -> None:
    """`kvcd run` stopped (SIGTERM) while the library's build_kmods runs: the daemon does not
    wait for the build (it did, for as long as it took), what the function started is gone,
    and the journal says the start was stopped before the stop's unload went through."""
    root, env = host
    step = "sleep 60.25"  # a command line nothing else runs
    lib = root("/usr/lib/kvc/simple-kmod-lib.sh")
    lib.write_text(LIB.replace("build_kmods() {\n", f"build_kmods() {{\n    {step}\n", 1))
    daemon = subprocess.Popen(
        [sys.executable, "-m", "kvcd.cli", "run", "simple-kmod"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not _running(step):
            assert daemon.poll() is None and time.monotonic() < deadline, "no build_kmods"
            time.sleep(0.05)
        t0 = time.monotonic()
        daemon.send_signal(signal.SIGTERM)
        _, err = daemon.communicate(timeout=30)
        assert time.monotonic() - t0 < 20  # not the 60 s of the build
    finally:
        daemon.kill()
        daemon.wait()
    assert daemon.returncode == 0, err
    assert not _running(step), "build_kmods' sleep is still running"
    assert "degraded: Stopped: stopped before this load finished" in err
    # Then the stop's unload (unload_policy = if-idle): nothing was loaded, nothing to run.
    assert not (root.root / "hook.log").exists()
    status = kvcd(env, "status", "simple-kmod").stdout
    assert status.startswith("simple-kmod: Done (unloaded)"), status


def _running(cmdline: str) -> bool:
    found = subprocess.run(["pgrep", "-fx", cmdline], capture_output=True, check=False)
    return found.returncode == 0
