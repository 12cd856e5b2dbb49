"""Guest benchmark: kvcd side by side with KVC's own unit on the same boot (issue #20, goal 2).
Not a CI step: `make bench-guest BENCH_GUEST=bench_kvc KVC_UPSTREAM=DIR` runs it, where DIR is a
checkout of KVC's upstream repository (github.com/kmods-via-containers/kmods-via-containers).
kvcd's tree carries none of KVC's code: run-guest.sh copies that checkout's
`kmods-via-containers`, `kmods-via-containers.conf` and `kmods-via-containers@.service` into the
payload (kvc-upstream/), and without them this benchmark fails saying so.

The same modules (kvcd_base, kvcd_user), the same image, cached; five starts of each, stopped
(modules gone) between starts:

(k1) KVC's unit as upstream ships it, kmods-via-containers@e2e-kvc, running upstream's script
     (installed in /usr/local/bin, ahead of kvcd-kvc-compat's /usr/bin one on systemd's PATH)
     with the reference-style instance library (driver/kvc/e2e-kvc-lib.sh, the shape of KVC's
     simple-kmod-lib.sh: `podman images` to find the image, `podman run --privileged IMAGE
     modprobe` per module).
(k2) kvcd@e2e-kvc: kvcd running the same KVC conf and library (build_kmods and load_kmods
     hooks), then verifying in /sys/module.
(k3) kvcd@e2e-kmod: kvcd's native instance of the same modules, store prepared: no podman.
(k4) where (k3)'s time goes: `python3 -c pass` in this guest, and one start of kvcd@e2e-kmod
     with PYTHONPROFILEIMPORTTIME=1 (the sum of its top-level imports).

For each: the unit's activation (systemd's InactiveExitTimestampMonotonic, before ExecStartPre)
-> every module Live in /proc/modules (polled every 10 ms, CLOCK_MONOTONIC like systemd's) ->
the unit active (ActiveEnterTimestampMonotonic: KVC's oneshot finished, kvcd's READY=1).
Table: results/kvc-table.md; raw timings: results/kvc-raw.json. Nothing asserts a time.
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvcdguest import (
    BUILD_TIMEOUT,
    DRIVER_DIR,
    INSTANCE,
    INSTANCE_FILE,
    MODS,
    PAYLOAD,
    RESULTS,
    containerfile,
    record_timing,
    set_instance,
    sh,
    unit_prop,
)

ROUNDS = 5
UPSTREAM = PAYLOAD / "kvc-upstream"
KVC_NAME = "e2e-kvc"
KVC_UNIT = f"kmods-via-containers@{KVC_NAME}.service"
KVCD_KVC_UNIT = f"kvcd@{KVC_NAME}.service"
NATIVE_UNIT = f"kvcd@{INSTANCE}.service"
INSTALLED = {
    "kmods-via-containers": Path("/usr/local/bin/kmods-via-containers"),
    "kmods-via-containers.conf": Path("/etc/kvc/kmods-via-containers.conf"),
    "kmods-via-containers@.service": Path("/etc/systemd/system/kmods-via-containers@.service"),
}
IMPORT_DROPIN = Path(f"/run/systemd/system/{NATIVE_UNIT}.d/bench-importtime.conf")
RAW: dict[str, object] = {}
TABLE: list[tuple[str, str]] = []


def prop(unit: str, name: str) -> int:
    return int(unit_prop(name, unit) or 0)


def now_us() -> int:
    return time.monotonic_ns() // 1000


def all_live() -> bool:
    lines = Path("/proc/modules").read_text().splitlines()
    live = {f[0] for f in (ln.split() for ln in lines) if len(f) > 4 and f[4] == "Live"}
    return set(MODS) <= live


def stop(unit: str) -> None:
    sh(["systemctl", "stop", unit], timeout=600)
    assert not any(m in Path("/proc/modules").read_text() for m in MODS), f"{unit} left modules"


def start_once(unit: str) -> tuple[float, float]:
    """Start `unit` (stopped, modules gone) and return (activation -> live, activation ->
    active) in seconds."""
    live_at: list[int] = []
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            if all_live():
                live_at.append(now_us())
                return
            time.sleep(0.01)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        sh(["systemctl", "start", unit], timeout=BUILD_TIMEOUT)
        poller.join(timeout=60)
    finally:
        done.set()
    assert live_at, f"{unit} active but its modules are not all Live: {MODS}"
    began = prop(unit, "InactiveExitTimestampMonotonic")
    active = prop(unit, "ActiveEnterTimestampMonotonic")
    assert began < live_at[0] and began < active, (unit, began, live_at[0], active)
    return (live_at[0] - began) / 1e6, (active - began) / 1e6


def measure(key: str, label: str, unit: str) -> None:
    """A warm-up start (image and store ready), then ROUNDS measured starts."""
    start_once(unit)
    stop(unit)
    live, active = [], []
    for _ in range(ROUNDS):
        t_live, t_active = start_once(unit)
        stop(unit)
        live.append(t_live)
        active.append(t_active)
    RAW[key] = {"unit": unit, "live_s": live, "active_s": active}
    for what, values in (("live", live), ("active", active)):
        med = statistics.median(values)
        TABLE.append(
            (f"{label}: start -> {what} (median of {ROUNDS})", f"{med:.2f} s ({_spread(values)})")
        )
        record_timing(f"kvc_{key}_{what}", med)


def _spread(values: list[float]) -> str:
    return f"min {min(values):.2f}, max {max(values):.2f}"


@pytest.fixture(scope="module", autouse=True)
def _setup() -> Iterator[None]:
    missing = [n for n in INSTALLED if not (UPSTREAM / n).is_file()]
    assert not missing, (
        f"no KVC upstream files {missing} in {UPSTREAM}: run "
        "`make bench-guest BENCH_GUEST=bench_kvc KVC_UPSTREAM=/path/to/kmods-via-containers` "
        "with a checkout of github.com/kmods-via-containers/kmods-via-containers"
    )
    sh(["systemctl", "stop", "kvcd@*.service"], check=False, timeout=600)
    for m in reversed(MODS):
        if m in Path("/proc/modules").read_text():
            sh(["modprobe", "-r", m], check=False)
    aside: dict[Path, bytes] = {}
    for name, dst in INSTALLED.items():
        if dst.exists():
            aside[dst] = dst.read_bytes()
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(UPSTREAM / name, dst)
    INSTALLED["kmods-via-containers"].chmod(0o755)
    src = DRIVER_DIR / "kvc"
    conf = Path(f"/etc/kvc/{KVC_NAME}.conf")
    lib = Path(f"/usr/lib/kvc/{KVC_NAME}-lib.sh")  # upstream looks in /usr/{local/,}lib/kvc
    lib.parent.mkdir(parents=True, exist_ok=True)
    text = (src / f"{KVC_NAME}.conf").read_text()
    conf.write_text(text.replace("=Containerfile\n", f"={containerfile('1.0')}\n"))
    shutil.copy(src / f"{KVC_NAME}-lib.sh", lib)
    native = INSTANCE_FILE.read_text()
    set_instance(version="1.0", **{"build.containerfile": containerfile("1.0")})
    sh(["systemctl", "daemon-reload"])
    try:
        yield
    finally:
        sh(["systemctl", "stop", KVC_UNIT, KVCD_KVC_UNIT, NATIVE_UNIT], check=False, timeout=600)
        IMPORT_DROPIN.unlink(missing_ok=True)
        INSTANCE_FILE.write_text(native)
        for dst in INSTALLED.values():
            if dst in aside:
                dst.write_bytes(aside[dst])
            else:
                dst.unlink(missing_ok=True)
        sh(["systemctl", "daemon-reload"], check=False)
        (RESULTS / "kvc-raw.json").write_text(json.dumps(RAW, indent=2) + "\n")
        lines = ["| figure | measured |", "|---|---|", *(f"| {k} | {v} |" for k, v in TABLE)]
        (RESULTS / "kvc-table.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))


def test_k1_kvc_upstream_unit() -> None:
    measure("upstream", "KVC upstream unit, reference-style library", KVC_UNIT)
    # It was upstream's script, not kvcd-kvc-compat's (whose banner ends in "(kvcd)").
    journal = sh(["journalctl", "-b", "--no-pager", "-o", "cat", "-u", KVC_UNIT]).stdout
    banners = [ln for ln in journal.splitlines() if ln.startswith(f"KVC: load {KVC_NAME} for")]
    assert banners and not any(b.endswith("(kvcd)") for b in banners), banners[-3:]


def test_k2_kvcd_same_kvc_config() -> None:
    measure("kvcd_kvc", "kvcd, the same KVC conf and library", KVCD_KVC_UNIT)


def test_k3_kvcd_native_instance() -> None:
    measure("kvcd_native", "kvcd, native instance, store prepared", NATIVE_UNIT)


def test_k4_where_kvcds_start_goes() -> None:
    floor = []
    for _ in range(ROUNDS):
        t0 = time.monotonic()
        subprocess.run(["python3", "-c", "pass"], check=True)
        floor.append(time.monotonic() - t0)
    IMPORT_DROPIN.parent.mkdir(parents=True, exist_ok=True)
    IMPORT_DROPIN.write_text("[Service]\nEnvironment=PYTHONPROFILEIMPORTTIME=1\n")
    sh(["systemctl", "daemon-reload"])
    try:
        start_once(NATIVE_UNIT)
        invocation = unit_prop("InvocationID", NATIVE_UNIT)
        stop(NATIVE_UNIT)
    finally:
        IMPORT_DROPIN.unlink()
        sh(["systemctl", "daemon-reload"])
    out = sh(
        ["journalctl", "--no-pager", "-o", "cat", f"_SYSTEMD_INVOCATION_ID={invocation}"]
    ).stdout
    # "import time: <self us> | <cumulative us> | <name, indented two spaces per level>"
    rows = [ln.split("|") for ln in out.splitlines() if ln.startswith("import time:")]
    top = [r for r in rows if len(r) == 3 and r[1].strip().isdigit()]
    total_us = sum(int(r[1]) for r in top if not r[2].startswith("  "))
    assert top, "no -X importtime lines in the journal of the daemon's start"
    RAW["importtime"] = {
        "invocation": invocation,
        "rows": ["|".join(r) for r in top],
        "top_level_us": total_us,
    }
    TABLE.append((f"python3 -c pass (median of {ROUNDS})", f"{statistics.median(floor):.2f} s"))
    TABLE.append(
        ("kvcd run: top-level imports (-X importtime, one start)", f"{total_us / 1e6:.2f} s")
    )
    record_timing("kvc_python_floor", statistics.median(floor))
    record_timing("kvc_kvcd_imports", total_us / 1e6)
