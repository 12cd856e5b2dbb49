#!/bin/bash
# Boot the kvcd e2e guest once and bring its results back.
#
#   scripts/e2e/run-guest.sh [--mode smoke|e2e|demo] [--out DIR] [--timeout SECONDS]
#   scripts/e2e/run-guest.sh --mode cmd --cmd FILE   # run a bash script in the guest, print it
#
# 1. builds or reuses the cached guest (scripts/e2e/build-guest.sh),
# 2. packs this run's payload onto a small ext4 disk (mkfs.ext4 -d, no loop mounts): kvcd as
#    the RPMs built from this checkout (scripts/build-rpm.sh) unpack it (rpm2cpio | cpio, here
#    on the host) with their file digests and %post scriptlets, tests/e2e/guest (the in-guest
#    driver), tests/e2e/driver + tests/kmods (driver container build context), the mode,
#    (KVCD_E2E_INSTALL=wheel: a wheel + systemd/ unit files instead, the pre-RPM way)
# 3. boots qemu on a qcow2 overlay of the cached base image (the base stays clean), bounded by
#    `timeout`; the guest runs the mode's scenarios from a systemd unit and powers off,
# 4. reads the results directory back with `debugfs -R rdump` (no mount) into OUT/results.
# 5. when the guest asked for a reboot (results/reboot holds the kernel release to boot), boots
#    the same overlay and payload again, with that kernel (its vmlinuz and initrd copied by the
#    guest to results/boot/), up to KVCD_E2E_MAX_BOOTS boots (default 8): a reboot as a host
#    without a bootloader sees it. The guest's entry.sh continues where it stopped.
#
# OUT (default: <repo>/out/e2e/<mode>) then holds console.log, results/ (junit-guest.xml,
# journal.txt, journal.export, dmesg.txt, kvcd-status.*, timings.txt, ...), times.txt.
# Exit 0 when the guest ran to the end (test verdicts are in results/rc and the junit files;
# --mode demo: 1 when the demo failed in the guest), 3 when the harness itself failed (no
# results: see console.log, or the step's log it names: guest-build.log, rpm.log, prebuilt.log).
# Host steps write their output to those logs and print one line each.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
CACHE=${KVCD_E2E_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvcd-e2e}
MODE=e2e
OUT=
CMD=
TIMEOUT=${KVCD_E2E_TIMEOUT:-5400}
INSTALL=${KVCD_E2E_INSTALL:-rpm}
MAX_BOOTS=${KVCD_E2E_MAX_BOOTS:-8}
MEM=${KVCD_E2E_MEM:-2048}
SMP=${KVCD_E2E_SMP:-2}

while [ $# -gt 0 ]; do
    case "$1" in
    --mode) MODE=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --timeout) TIMEOUT=$2; shift 2 ;;
    --cmd) CMD=$(cd "$(dirname "$2")" && pwd)/$(basename "$2"); shift 2 ;;
    -h | --help) sed -n '2,19p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
    esac
done
case "$MODE" in smoke | e2e | demo | cmd) ;; *) echo "bad --mode $MODE" >&2; exit 2 ;; esac
case "$INSTALL" in rpm | wheel) ;; *) echo "bad KVCD_E2E_INSTALL=$INSTALL (rpm|wheel)" >&2; exit 2 ;; esac
[ "$MODE" != cmd ] || [ -f "$CMD" ] || { echo "--mode cmd needs --cmd FILE" >&2; exit 2; }
OUT=${OUT:-$REPO/out/e2e/$MODE}

log() { printf '[run-guest %s] %s\n' "$(date +%T)" "$*" >&2; }
die() { log "ERROR: $*"; exit 3; }
# A host step's output goes to its own log under OUT; a failure shows the log's end.
step_failed() { # LOG MESSAGE
    tail -n 30 "$1" >&2 || true
    die "$2; the whole log is $1"
}
# A path as the user typed it: relative to the current directory when it is under it.
show() { realpath -s --relative-base=. "$1"; }
tools=(qemu-system-x86_64 qemu-img debugfs mkfs.ext4 timeout)
[ "$INSTALL" = wheel ] || tools+=(rpm rpm2cpio cpio rpmbuild)
for t in "${tools[@]}"; do
    command -v "$t" >/dev/null || die "missing tool: $t"
done

mkdir -p "$(dirname "$OUT")"
exec 8>"$OUT.lock"
flock -n 8 || die "another run is using $OUT"
rm -rf "$OUT"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

T0=$(date +%s)
log "guest image: reusing the cached one or building it (~4 min, once); log: $(show "$OUT/guest-build.log")"
GUEST=$("$HERE/build-guest.sh" 2>"$OUT/guest-build.log" | tail -n 1) || GUEST=
[ -n "$GUEST" ] && [ -f "$GUEST/.done" ] || step_failed "$OUT/guest-build.log" "the guest build failed"
T_BUILD=$(($(date +%s) - T0))
KVER=$(cat "$GUEST/kver")
KVER2=$(cat "$GUEST/kver2" 2>/dev/null || true)
P=$OUT/payload
mkdir -p "$P/wheels" "$P/units" "$P/results"

# --- payload ------------------------------------------------------------------------------
T1=$(date +%s)
echo "$MODE" >"$P/mode"
# KVCD_E2E_ONLY="core scenarios_x reboot_y": run only these e2e steps (entry.sh), e.g. one file.
[ -z "${KVCD_E2E_ONLY:-}" ] || echo "$KVCD_E2E_ONLY" >"$P/only"
# KVCD_KVC_UPSTREAM=DIR: a checkout of KVC's upstream repository, for the side-by-side guest
# benchmark (bench_kvc.py). Its script, conf and unit go into payload/kvc-upstream/; kvcd's
# tree carries none of KVC's code.
if [ -n "${KVCD_KVC_UPSTREAM:-}" ]; then
    mkdir -p "$P/kvc-upstream"
    for f in kmods-via-containers kmods-via-containers.conf kmods-via-containers@.service; do
        [ -f "$KVCD_KVC_UPSTREAM/$f" ] ||
            die "KVCD_KVC_UPSTREAM=$KVCD_KVC_UPSTREAM has no $f: it must be a checkout of" \
                "github.com/kmods-via-containers/kmods-via-containers"
        cp "$KVCD_KVC_UPSTREAM/$f" "$P/kvc-upstream/"
    done
fi
[ -z "$CMD" ] || cp "$CMD" "$P/cmd.sh"
echo "$KVER" >"$P/kver"
echo "$INSTALL" >"$P/install-method"
[ -z "$KVER2" ] || echo "$KVER2" >"$P/kver2"
# A CA and a certificate for localhost signed by it: the guest's TLS registry
# (scenarios_registry.py). Made per run, valid two days; the guest has no openssl.
mkdir -p "$P/registry"
(
    cd "$P/registry"
    ec=(-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes)
    openssl req -x509 "${ec[@]}" -days 2 -subj "/CN=kvcd e2e CA" -keyout ca.key -out ca.crt
    openssl req "${ec[@]}" -subj "/CN=localhost" -keyout tls.key -out tls.csr
    printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n' >ext.cnf
    openssl x509 -req -in tls.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 2 \
        -extfile ext.cnf -out tls.crt
    rm -f ca.key tls.csr ext.cnf ca.srl
) >"$OUT/registry-tls.log" 2>&1 || step_failed "$OUT/registry-tls.log" "making the registry's TLS certificates failed"
if [ "$INSTALL" = rpm ]; then
    # kvcd as the RPMs built from this checkout ship it. Unpacked here, on the host, with
    # rpm2cpio | cpio: the host has the rpm tools (they build the package) and the Debian guest
    # has none, and the payload disk then carries a plain tree that mkfs.ext4 -d packs as is.
    # The guest installs exactly the files of the RPMs' file lists (install.sh) and its test
    # checks every one against the digest recorded in the RPM header (files.tsv), so what runs
    # in the guest is provably the package's payload, not the source tree.
    # --nocheck: `make check` runs the unit tests already.
    "$REPO/scripts/build-rpm.sh" --nocheck "$OUT/rpm" >"$OUT/rpm.log" 2>&1 ||
        step_failed "$OUT/rpm.log" "building the RPMs failed"
    mkdir -p "$P/rpm/root"
    for rpmf in "$OUT"/rpm/*.noarch.rpm; do
        name=$(rpm -qp --qf '%{NAME}' "$rpmf")
        cp "$rpmf" "$P/rpm/"
        (cd "$P/rpm/root" && rpm2cpio "$rpmf" | cpio -idm --quiet --no-absolute-filenames) ||
            die "unpacking $rpmf failed"
        # One line per file: path, mode (octal), sha256 digest (empty for directories), flags.
        rpm -qp --qf '[%{FILENAMES}\t%{FILEMODES:octal}\t%{FILEDIGESTS}\t%{FILEFLAGS:fflags}\n]' \
            "$rpmf" >"$P/rpm/$name.files.tsv"
        rpm -qp --qf '%{FILEDIGESTALGO}\n' "$rpmf" >"$P/rpm/$name.digestalgo"
        # The scriptlets, as the guest's rpmpayload.py runs them for an install and an erase.
        for s in POSTIN:post PREUN:preun POSTUN:postun; do
            rpm -qp --qf "%{${s%%:*}}" "$rpmf" | sed '/^(none)$/d' >"$P/rpm/$name.${s#*:}"
        done
        rpm -qp --qf '%{NEVRA}\n' "$rpmf" >"$P/rpm/$name.nevra"
    done
    [ -f "$P/rpm/kvcd.files.tsv" ] || die "no kvcd RPM in $OUT/rpm"
    log "payload: $(cat "$P"/rpm/*.nevra | paste -sd' '); log: $(show "$OUT/rpm.log")"
else
    # Build from a copy so no build/ or *.egg-info lands in the checkout; offline first, then
    # with build isolation (needs the PyPI mirror) when the local interpreter lacks `wheel`.
    SRC=$OUT/src
    mkdir -p "$SRC"
    cp -r "$REPO/pyproject.toml" "$REPO/kvcd" "$SRC/"
    for f in README.md README.rst LICENSE setup.cfg setup.py MANIFEST.in; do
        if [ -e "$REPO/$f" ]; then cp "$REPO/$f" "$SRC/"; fi
    done
    find "$SRC" -name __pycache__ -prune -exec rm -rf {} +
    PY=python3
    [ -x "$REPO/.venv/bin/python" ] && PY=$REPO/.venv/bin/python
    if ! "$PY" -m pip wheel --quiet --no-deps --no-build-isolation --disable-pip-version-check \
        -w "$P/wheels" "$SRC" >"$OUT/wheel.log" 2>&1 &&
        ! "$PY" -m pip wheel --quiet --no-deps --disable-pip-version-check \
            -w "$P/wheels" "$SRC" >>"$OUT/wheel.log" 2>&1; then
        log "WARNING: building the kvcd wheel failed (see $OUT/wheel.log); kvcd scenarios will fail"
    fi
    rm -rf "$SRC"
    [ -f "$REPO/systemd/kvcd@.service" ] || die "$REPO/systemd/kvcd@.service missing"
    find "$REPO/systemd" -maxdepth 1 -type f \
        \( -name '*.service' -o -name '*.timer' -o -name '*.path' -o -name '*.socket' \) \
        -exec cp {} "$P/units/" \;
    mkdir -p "$P/shim"
    cp "$REPO/packaging/kmods-via-containers" "$P/shim/"
fi
cp -r "$REPO/tests/e2e/guest" "$P/guest"
cp -r "$REPO/tests/e2e/driver" "$P/driver"
rm -rf "$P/driver/src"
if [ -f "$REPO/tests/kmods/Kbuild" ]; then
    mkdir -p "$P/driver/src"
    cp "$REPO"/tests/kmods/Kbuild "$REPO"/tests/kmods/*.c "$P/driver/src/"
else
    die "tests/kmods/Kbuild missing"
fi
# Modules for the later scenarios, compiled here with native gcc (seconds) rather than in the
# guest under TCG (minutes each); scenario (a) still compiles inside the driver container, the
# KVC way. Only when this host has the guest kernel's headers: otherwise the scenarios build
# from source (slower, same result).
# Layout: prebuilt/<kernel>/<KMODVER>/ (Containerfile.prebuilt), for the guest kernel and the
# second one (the next-kernel scenario); prebuilt/<guest kernel>/fleet/ (Containerfile.fleet);
# prebuilt/<kernel>/fw/kvcd_fw.ko (scenarios_firmware.py).
for k in $KVER $KVER2; do
    if [ -f "/usr/src/linux-headers-$k/Makefile" ]; then
        for v in 1.0 2.0 3.0; do
            # The fleet (20 one-module instances, bench_fleet.py) runs on the guest kernel.
            fleet=0
            [ "$k/$v" != "$KVER/1.0" ] || fleet=20
            KVCD_FLEET=$fleet "$REPO/scripts/build-test-kmods.sh" "$k" "$P/driver/prebuilt/$k/$v" "$v" \
                >>"$OUT/prebuilt.log" 2>&1 ||
                step_failed "$OUT/prebuilt.log" "compiling the test modules for $k failed"
            rm -f "$P/driver/prebuilt/$k/$v/Module.symvers"
            # kvcd_fw (scenarios_firmware.py) and the fleet's modules live apart: in a version
            # directory they would be in every e2e image built from it (Containerfile.prebuilt),
            # and in the module tree under two instances (a load refused as another's).
            for extra in fw fleet; do
                [ -d "$P/driver/prebuilt/$k/$v/$extra" ] || continue
                if [ "$v" = 1.0 ]; then
                    rm -rf "$P/driver/prebuilt/$k/$extra"
                    mv "$P/driver/prebuilt/$k/$v/$extra" "$P/driver/prebuilt/$k/$extra"
                else
                    rm -rf "$P/driver/prebuilt/$k/$v/$extra"
                fi
            done
        done
        log "test modules compiled for $k; log: $(show "$OUT/prebuilt.log")"
    else
        log "no linux-headers-$k on this host: scenarios compile for $k in the guest (slower)"
    fi
done
# Caches of the host's test runs, not the RPM's own bytecode (it ships compiled modules).
find "$P" -path "$P/rpm/root" -prune -o -name __pycache__ -prune -exec rm -rf {} +
mkfs.ext4 -q -F -L kvcde2e -E root_owner=0:0 -d "$P" "$OUT/payload.img" 1G >/dev/null
qemu-img create -q -f qcow2 -F raw -b "$GUEST/base.img" "$OUT/overlay.qcow2"
T_PAYLOAD=$(($(date +%s) - T1))

# --- accelerator: KVM only if it demonstrably boots a kernel (it hangs on some hosts) --------
accel=tcg
if [ -z "${KVCD_E2E_ACCEL:-}" ] && [ -w /dev/kvm ]; then
    probe=$CACHE/kvm-probe-$(cat /proc/sys/kernel/random/boot_id 2>/dev/null || echo x)
    if [ ! -f "$probe" ]; then
        log "probing KVM (20 s at most)"
        if timeout 20 qemu-system-x86_64 -accel kvm -cpu host -m 256 -nographic -no-reboot \
            -nic none -kernel "$GUEST/vmlinuz" -append "console=ttyS0 panic=-1 root=/dev/null" \
            </dev/null 2>&1 | grep -q -m1 'Linux version'; then
            echo kvm >"$probe"
        else
            echo tcg >"$probe"
        fi
    fi
    accel=$(cat "$probe")
fi
accel=${KVCD_E2E_ACCEL:-$accel}
cpu=max
[ "$accel" = kvm ] && cpu=host
log "booting guest (kernel $KVER, accel $accel, mode $MODE, timeout ${TIMEOUT}s); console: $(show "$OUT/console.log")"

# --- boot (again after each reboot the guest asks for) ----------------------------------------
R=$OUT/results
boot=0
kernel=$GUEST/vmlinuz
initrd=$GUEST/initrd.img
boot_kver=$KVER
T2=$(date +%s)
: >"$OUT/boots.txt"
while :; do
    boot=$((boot + 1))
    console=$OUT/console.log
    [ $boot -eq 1 ] || console=$OUT/console-boot$boot.log
    [ $boot -eq 1 ] || log "boot $boot: kernel $boot_kver; console: $console"
    tb=$(date +%s)
    set +e
    timeout -k 10 "$TIMEOUT" qemu-system-x86_64 \
        -accel "$accel" -cpu "$cpu" -smp "$SMP" -m "$MEM" -nographic -no-reboot -nic none \
        -kernel "$kernel" -initrd "$initrd" \
        -drive "file=$OUT/overlay.qcow2,format=qcow2,if=virtio,cache=unsafe" \
        -drive "file=$OUT/payload.img,format=raw,if=virtio,cache=unsafe" \
        -append "console=ttyS0 root=/dev/vda rw panic=-1 systemd.show_status=1 ${KVCD_E2E_APPEND:-}" \
        </dev/null >"$console" 2>&1 &
    qpid=$!
    # When the e2e units cannot start (no payload disk), the guest would idle at its login
    # prompt until the timeout: stop it as soon as the console says so.
    while kill -0 "$qpid" 2>/dev/null; do
        if grep -a -q -E 'Dependency failed for .*kvcd e2e: run' \
            "$console" 2>/dev/null; then
            log "the guest's e2e units could not start (see $console): stopping qemu"
            sleep 5
            kill "$qpid" 2>/dev/null
            break
        fi
        sleep 5
    done
    wait "$qpid"
    qrc=$?
    set -e
    echo "boot$boot $boot_kver $(($(date +%s) - tb))s rc $qrc" >>"$OUT/boots.txt"
    [ $qrc -eq 124 ] && log "qemu TIMED OUT after ${TIMEOUT}s (boot $boot)"
    rm -rf "$R"
    debugfs -R "rdump /results $OUT" "$OUT/payload.img" >"$OUT/debugfs.log" 2>&1 || true
    # A reboot request: results/reboot names the kernel release, results/boot/ has its files.
    if [ $qrc -ne 0 ] || [ -f "$R/done" ] || [ ! -f "$R/reboot" ]; then break; fi
    boot_kver=$(tr -d '[:space:]' <"$R/reboot")
    if [ $boot -ge "$MAX_BOOTS" ]; then
        log "the guest asked for boot $((boot + 1)) (kernel $boot_kver): more than KVCD_E2E_MAX_BOOTS=$MAX_BOOTS"
        break
    fi
    if [ "$boot_kver" = "$KVER" ]; then
        kernel=$GUEST/vmlinuz initrd=$GUEST/initrd.img
    else
        kernel=$R/boot/vmlinuz-$boot_kver initrd=$R/boot/initrd.img-$boot_kver
        if [ ! -s "$kernel" ] || [ ! -s "$initrd" ]; then
            log "the guest asked to boot $boot_kver but left no results/boot/{vmlinuz,initrd.img}-$boot_kver"
            break
        fi
        mkdir -p "$OUT/boot"
        cp "$kernel" "$initrd" "$OUT/boot/"
        kernel=$OUT/boot/vmlinuz-$boot_kver initrd=$OUT/boot/initrd.img-$boot_kver
    fi
done
T_QEMU=$(($(date +%s) - T2))

# --- results ----------------------------------------------------------------------------------
[ -n "${KVCD_E2E_KEEP:-}" ] || rm -f "$OUT/overlay.qcow2"
{
    echo "guest_build_or_reuse ${T_BUILD}s"
    echo "payload ${T_PAYLOAD}s"
    echo "qemu_total ${T_QEMU}s (accel $accel, rc $qrc, boots $boot)"
    sed 's/^/qemu_/' "$OUT/boots.txt"
    [ -f "$R/timings.txt" ] && sed 's/^/guest: /' "$R/timings.txt"
    up=$(sed -n 's/^artifacts_done_uptime //p' "$R/timings.txt" 2>/dev/null | tail -n 1 || true)
    last=$(tail -n 1 "$OUT/boots.txt" | awk '{print $3}' | tr -d s)
    [ -n "$up" ] && [ -n "$last" ] && echo "shutdown_and_qemu_overhead_last_boot $(awk -v q="$last" -v u="$up" \
        'BEGIN{printf "%.0f", q-u}')s"
} >"$OUT/times.txt"
# The demo lists it with the other logs at the end, after what the guest showed.
[ "$MODE" = demo ] || cat "$OUT/times.txt" >&2

if [ ! -f "$R/done" ]; then
    log "guest did not finish (qemu rc $qrc)."
    log "console log: $OUT/console.log"
    [ -f "$R/journal.txt" ] && log "guest journal: $R/journal.txt"
    tail -n 30 "$OUT/console.log" >&2 || true
    exit 3
fi
grc=$(cat "$R/rc" 2>/dev/null || echo '?')
if [ "$MODE" = demo ] && [ -f "$R/demo.txt" ]; then
    cat "$R/demo.txt"
    echo
    log "demo finished in $(($(date +%s) - T0)) s (in-guest rc $grc). The whole logs:"
    {
        echo "  guest image build   $(show "$OUT/guest-build.log")"
        echo "  RPM build           $(show "$OUT/rpm.log")"
        echo "  guest console       $(show "$OUT/console.log")"
        echo "  driver image build  $(show "$R/kvcd@e2e-kmod.service.journal.txt") (the instance's journal)"
        echo "  guest journal       $(show "$R/journal.txt")"
        echo "  timings             $(show "$OUT/times.txt")"
    } >&2
fi
if [ "$MODE" = cmd ] && [ -f "$R/cmd.txt" ]; then
    cat "$R/cmd.txt"
fi
log "guest finished, in-guest rc $grc; results: $R"
if [ "$grc" != 0 ]; then
    log "console log: $OUT/console.log"
    log "guest journal: $R/journal.txt (export: $R/journal.export)"
    # The e2e modes' verdicts are the junit files the host reads; the demo's is this rc.
    [ "$MODE" != demo ] || exit 1
fi
exit 0
