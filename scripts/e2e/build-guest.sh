#!/bin/bash
# Build (or reuse) the cached Debian 12 guest for kvcd's VM end-to-end tests.
#
#   scripts/e2e/build-guest.sh            # prints the guest directory on the last stdout line
#
# The guest directory holds: base.img (raw ext4 root fs, never written by test runs: they use a
# qcow2 overlay), vmlinuz, initrd.img, kver (guest kernel release), kver2 (the second kernel's
# release, see second-kernel.txt), build-times.txt.
# Inside base.img: systemd, podman (runc), the guest kernel's modules, kvcd's Python
# dependencies (offline wheels), two boot units that run whatever the payload disk brings, and
# the driver-container base image localhost/kvcd-e2e-base:latest (gcc, make,
# linux-headers-<guest kernel> and linux-headers-<second kernel>) already in
# /var/lib/containers/storage, and the second kernel installed (modules, vmlinuz, initrd) but
# not the default boot: the next-kernel scenario makes it the default.
#
# Cache: ${KVCD_E2E_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvcd-e2e}/guest-<key>, where <key> is a
# hash of this script, the package lists, second-kernel.txt and scripts/e2e/guest-base/. KVCD_E2E_REBUILD=1 forces
# a rebuild. The Debian mirror is read from the host's apt configuration. Needs root,
# debootstrap, podman (host, to import the base image), e2fsprogs, python3 + pip.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
CACHE=${KVCD_E2E_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvcd-e2e}
SUITE=bookworm
BASE_IMAGE=localhost/kvcd-e2e-base:latest
IMG_SIZE=${KVCD_E2E_IMG_SIZE:-8G}

log() { printf '[build-guest %s] %s\n' "$(date +%T)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
pkgs() { grep -v '^[[:space:]]*#' "$1" | grep -v '^[[:space:]]*$' | tr -d ' '; }
KVER2=$(pkgs "$HERE/second-kernel.txt" | head -n 1)
[[ $KVER2 =~ ^[0-9][A-Za-z0-9.+~-]*$ ]] || { log "ERROR: bad kernel in second-kernel.txt: '$KVER2'"; exit 1; }

[ "$(id -u)" = 0 ] || die "must run as root (debootstrap, chroot)"
for t in debootstrap chroot mkfs.ext4 podman python3 sha256sum; do
    command -v "$t" >/dev/null || die "missing tool: $t"
done

key=$(
    {
        cat "$HERE/build-guest.sh" "$HERE/guest-packages.txt" "$HERE/driver-base-packages.txt" \
            "$HERE/guest-requirements.txt" "$HERE/second-kernel.txt"
        (cd "$HERE/guest-base" && find . -type f | LC_ALL=C sort | xargs -d '\n' sha256sum)
    } | sha256sum | cut -c1-16
)
OUT=$CACHE/guest-$key
if [ -f "$OUT/.done" ] && [ -z "${KVCD_E2E_REBUILD:-}" ]; then
    log "cached guest $OUT (kernel $(cat "$OUT/kver"))"
    echo "$OUT"
    exit 0
fi

mkdir -p "$CACHE"
exec 9>"$CACHE/.build.lock"
flock 9
if [ -f "$OUT/.done" ] && [ -z "${KVCD_E2E_REBUILD:-}" ]; then echo "$OUT"; exit 0; fi

WORK=$CACHE/work-$key
ROOT=$WORK/rootfs
DROOT=$WORK/driver-base
MOUNTS=()
cleanup() {
    local m i
    for ((i = ${#MOUNTS[@]} - 1; i >= 0; i--)); do
        m=${MOUNTS[$i]}
        umount -l "$m" 2>/dev/null || true
    done
}
trap cleanup EXIT

# --- Debian mirror from the host's apt configuration -------------------------------------------
read -r MIRROR SECMIRROR < <(python3 - "$SUITE" <<'PY'
import glob, re, sys
suite = sys.argv[1]
entries = []  # (uri, suite, components)
for f in ["/etc/apt/sources.list"] + sorted(glob.glob("/etc/apt/sources.list.d/*.list")):
    try:
        lines = open(f).read().splitlines()
    except OSError:
        continue
    for line in lines:
        line = line.split("#", 1)[0].strip()
        m = re.match(r"deb\s+(?:\[[^\]]*\]\s+)?(\S+)\s+(\S+)\s*(.*)", line)
        if m:
            entries.append((m.group(1), m.group(2), m.group(3).split()))
for f in sorted(glob.glob("/etc/apt/sources.list.d/*.sources")):
    for stanza in re.split(r"\n\s*\n", open(f).read()):
        fields = {}
        for line in stanza.splitlines():
            if line.startswith("#") or ":" not in line:
                continue
            k, v = line.split(":", 1)
            fields[k.strip().lower()] = v.strip()
        if "deb" not in fields.get("types", "").split() or fields.get("enabled", "yes") == "no":
            continue
        for uri in fields.get("uris", "").split():
            for s in fields.get("suites", "").split():
                entries.append((uri, s, fields.get("components", "").split()))
main = next((u for u, s, c in entries if s == suite and "main" in c), None)
sec = next((u for u, s, c in entries if s == suite + "-security" and "main" in c), "")
if not main:
    sys.exit("no '%s main' Debian source in the host's apt configuration" % suite)
print(main.rstrip("/"), (sec or "-").rstrip("/"))
PY
)
log "mirror $MIRROR security ${SECMIRROR}"

write_sources() { # ROOTDIR
    {
        echo "deb $MIRROR $SUITE main"
        echo "deb $MIRROR $SUITE-updates main"
        [ "$SECMIRROR" = "-" ] || echo "deb $SECMIRROR $SUITE-security main"
    } >"$1/etc/apt/sources.list"
    rm -f "$1"/etc/apt/sources.list.d/*
    cp /etc/resolv.conf "$1/etc/resolv.conf"
    printf '#!/bin/sh\nexit 101\n' >"$1/usr/sbin/policy-rc.d"
    chmod 755 "$1/usr/sbin/policy-rc.d"
}
chroot_mounts() { # ROOTDIR
    mount -t proc proc "$1/proc" && MOUNTS+=("$1/proc")
    mount -t sysfs sysfs "$1/sys" && MOUNTS+=("$1/sys")
}
chroot_umounts() {
    cleanup
    MOUNTS=()
}
finish_root() { # ROOTDIR: drop build-only state before the tree is packed
    chroot "$1" apt-get clean
    rm -rf "$1"/var/lib/apt/lists/* "$1/usr/sbin/policy-rc.d"
    : >"$1/etc/resolv.conf"
}
T0=$(date +%s)
phase_start=$T0
TIMES=()
phase() { # NAME: record the time since the previous phase boundary
    local now
    now=$(date +%s)
    TIMES+=("$1 $((now - phase_start))s")
    log "phase $1 done in $((now - phase_start))s"
    phase_start=$now
}

export DEBIAN_FRONTEND=noninteractive LC_ALL=C.UTF-8
rm -rf "$WORK"
mkdir -p "$WORK" "$CACHE/debs-guest" "$CACHE/debs-base"

# --- driver-container base tree: debootstrap in the background while the guest is built ---------
log "debootstrap driver base (background, log $WORK/driver-base.log)"
debootstrap --variant=minbase --cache-dir="$CACHE/debs-base" \
    --include="$(pkgs "$HERE/driver-base-packages.txt" | paste -sd,)" \
    "$SUITE" "$DROOT" "$MIRROR" >"$WORK/driver-base.log" 2>&1 &
DB_PID=$!

# --- guest root -------------------------------------------------------------------------------
log "debootstrap guest"
include=$(pkgs "$HERE/guest-packages.txt" | grep -vx linux-image-amd64 | paste -sd,)
if ! debootstrap --variant=minbase --cache-dir="$CACHE/debs-guest" --include="$include" \
    "$SUITE" "$ROOT" "$MIRROR" >"$WORK/guest-debootstrap.log" 2>&1; then
    # Known: podman's virtual dependency container-network-stack stops debootstrap once.
    log "debootstrap guest stopped early (expected: container-network-stack); finishing with apt"
    tail -n 3 "$WORK/guest-debootstrap.log" >&2 || true
fi
[ -x "$ROOT/usr/bin/apt-get" ] || die "guest debootstrap failed: see $WORK/guest-debootstrap.log"
write_sources "$ROOT"
chroot_mounts "$ROOT"
chroot "$ROOT" apt-get install -y -f >"$WORK/guest-apt.log" 2>&1 || true
chroot "$ROOT" dpkg --configure -a >>"$WORK/guest-apt.log" 2>&1
chroot "$ROOT" apt-get update >>"$WORK/guest-apt.log" 2>&1
# shellcheck disable=SC2046
chroot "$ROOT" apt-get install -y --no-install-recommends $(pkgs "$HERE/guest-packages.txt") \
    >>"$WORK/guest-apt.log" 2>&1 || die "guest apt-get install failed: see $WORK/guest-apt.log"
# The second kernel, for the next-kernel scenario, installed here at native speed: under TCG
# its dpkg -i (unpack, depmod, update-initramfs) took over 10 minutes. The scenario's update is
# making it the default boot entry, which is what kvcd watches. Debian's /vmlinuz links stay on
# the guest's own kernel (kvcd reads them as the next boot when there is no boot entry).
chroot "$ROOT" apt-get install -y --no-install-recommends "linux-image-$KVER2" \
    >>"$WORK/guest-apt.log" 2>&1 || die "installing linux-image-$KVER2 failed: see $WORK/guest-apt.log"
phase guest-packages

# --- Python wheels for kvcd's dependencies, installed offline ------------------------------------
mkdir -p "$ROOT/tmp/wheels"
python3 -m pip download --quiet --disable-pip-version-check --only-binary=:all: \
    -d "$ROOT/tmp/wheels" -r "$HERE/guest-requirements.txt"
grep -v '^[[:space:]]*#' "$HERE/guest-requirements.txt" >"$ROOT/tmp/wheels/requirements.txt"
chroot "$ROOT" python3 -m pip install --no-index --find-links /tmp/wheels --break-system-packages \
    --disable-pip-version-check --root-user-action=ignore -r /tmp/wheels/requirements.txt \
    >>"$WORK/guest-apt.log" 2>&1 || die "pip install in guest failed: see $WORK/guest-apt.log"
rm -rf "$ROOT/tmp/wheels"
phase guest-wheels

# --- guest configuration ------------------------------------------------------------------------
cp -a "$HERE/guest-base/." "$ROOT/"
mkdir -p "$ROOT/mnt/e2e" "$ROOT/etc/kvcd/instances" "$ROOT/var/lib/kvcd"
chroot "$ROOT" passwd -d root >/dev/null
chroot "$ROOT" systemctl enable podman.socket kvcd-e2e-install.service kvcd-e2e.service \
    >>"$WORK/guest-apt.log" 2>&1
chroot "$ROOT" systemctl mask apt-daily.timer apt-daily-upgrade.timer e2scrub_all.timer \
    e2scrub_reap.service fstrim.timer man-db.timer systemd-timesyncd.service \
    getty@tty1.service podman-auto-update.timer podman-auto-update.service \
    podman-restart.service podman-clean-transient.service >>"$WORK/guest-apt.log" 2>&1
KVER=$(ls "$ROOT/lib/modules" | grep -vxF "$KVER2" || true)
[ "$(echo "$KVER" | wc -w)" = 1 ] || die "expected one guest kernel beside $KVER2, got: $KVER"
[ -f "$ROOT/boot/initrd.img-$KVER2" ] || die "no initrd for $KVER2 in the guest: see $WORK/guest-apt.log"
for link in vmlinuz initrd.img; do
    ln -sfn "boot/$link-$KVER" "$ROOT/$link"
    rm -f "$ROOT/$link.old"
done
cp "$ROOT/boot/vmlinuz-$KVER" "$WORK/vmlinuz"
cp "$ROOT/boot/initrd.img-$KVER" "$WORK/initrd.img"
chmod 644 "$WORK/vmlinuz" "$WORK/initrd.img"
chroot_umounts
finish_root "$ROOT"
phase guest-config
log "guest kernel $KVER"

# --- driver-container base image: + linux-headers-<guest kernel>, imported into guest storage ---
wait "$DB_PID" || die "driver base debootstrap failed: see $WORK/driver-base.log"
write_sources "$DROOT"
chroot_mounts "$DROOT"
chroot "$DROOT" apt-get update >"$WORK/driver-base-apt.log" 2>&1
chroot "$DROOT" apt-get install -y --no-install-recommends "linux-headers-$KVER" \
    "linux-headers-$KVER2" >>"$WORK/driver-base-apt.log" 2>&1 ||
    die "headers install failed: see $WORK/driver-base-apt.log"
chroot_umounts
finish_root "$DROOT"
rm -rf "$DROOT"/usr/share/doc/* "$DROOT"/usr/share/man/* "$DROOT"/usr/share/locale/*
tar -C "$DROOT" --numeric-owner -cf "$WORK/driver-base.tar" .
STORE=$ROOT/var/lib/containers/storage
RUNROOT=$(mktemp -d /tmp/kvcd-e2e-run.XXXXXX) # podman wants a short runroot path
mkdir -p "$STORE"
podman --root "$STORE" --runroot "$RUNROOT" --storage-driver overlay \
    import --quiet --change "LABEL kvcd.e2e.kernel=$KVER" --change "LABEL kvcd.e2e.kernel2=$KVER2" \
    "$WORK/driver-base.tar" "$BASE_IMAGE" >&2
podman --root "$STORE" --runroot "$RUNROOT" --storage-driver overlay \
    tag "$BASE_IMAGE" "localhost/kvcd-e2e-base:$KVER" "localhost/kvcd-e2e-base:$KVER2"
podman --root "$STORE" --runroot "$RUNROOT" --storage-driver overlay images >&2
# libpod's database records the host-side paths, and defaultNetworkBackend the host's
# (netavark); the guest recreates both on first use.
rm -rf "$STORE/libpod" "$STORE/defaultNetworkBackend" "$RUNROOT" "$WORK/driver-base.tar" "$DROOT"
phase driver-base-image

# --- the disk -------------------------------------------------------------------------------------
rm -f "$WORK/base.img"
mkfs.ext4 -q -F -L kvcdroot -E root_owner=0:0 -d "$ROOT" "$WORK/base.img" "$IMG_SIZE"
echo "$KVER" >"$WORK/kver"
echo "$KVER2" >"$WORK/kver2"
rm -rf "$ROOT"
phase disk
TIMES+=("total $(($(date +%s) - T0))s")
printf '%s\n' "${TIMES[@]}" >"$WORK/build-times.txt"
rm -rf "$OUT"
mv "$WORK" "$OUT"
touch "$OUT/.done"
ln -sfn "guest-$key" "$CACHE/current"
# Keep only this guest: older keys are stale.
for d in "$CACHE"/guest-*; do [ "$d" = "$OUT" ] || rm -rf "$d"; done
log "guest ready in $OUT ($(tr '\n' ' ' <"$OUT/build-times.txt"))"
echo "$OUT"
