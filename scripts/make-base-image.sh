#!/bin/bash
# Make a tiny local base image NAME (e.g. localhost/kvcd-busybox:latest) from Debian's
# busybox-static with `podman import`: no registry is needed. Idempotent: does nothing when
# NAME already exists in the store podman uses (honours CONTAINERS_CONF,
# CONTAINERS_STORAGE_CONF; source DIR/env of scripts/podman-service.sh to target its store).
#
#   scripts/make-base-image.sh NAME
#
# Installs busybox-static with apt-get when /bin/busybox is missing or not static. Root only.
set -euo pipefail

[[ $# -eq 1 ]] || { echo "usage: $0 NAME" >&2; exit 2; }
name=$1

# CONTAINER_HOST would send the CLI to a service; the CLI here works on the store directly.
unset CONTAINER_HOST

if podman image exists "$name"; then
    echo "$name"
    exit 0
fi

busybox=/bin/busybox
if ! dpkg-query -W -f='${Status}' busybox-static 2>/dev/null | grep -q 'ok installed'; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y busybox-static >&2
fi

# Scratch space: TMPDIR (podman-service.sh sets DIR/tmp) or /var/tmp; removed on exit.
work=$(mktemp -d "${TMPDIR:-/var/tmp}/kvcd-base.XXXXXX")
trap 'rm -rf "$work"' EXIT
root=$work/rootfs
mkdir -p "$root"/{bin,sbin,usr/bin,usr/sbin,etc,tmp,proc,sys,dev,root,lib/modules}
chmod 1777 "$root/tmp"
cp "$busybox" "$root/bin/busybox"
# One link per applet, at the path busybox itself lists (sh, cp, find, xz, gzip ...).
(cd "$root" && ./bin/busybox --list-full | while read -r applet; do
    [[ -e $applet ]] || ln -s /bin/busybox "$applet"
done)
echo 'root:x:0:0:root:/root:/bin/sh' >"$root/etc/passwd"
echo 'root:x:0:' >"$root/etc/group"

tar -C "$root" --numeric-owner --owner=0 --group=0 -cf "$work/rootfs.tar" .
podman import --quiet \
    --change 'CMD ["/bin/sh"]' \
    --change 'ENV PATH=/usr/sbin:/usr/bin:/sbin:/bin' \
    --message "busybox-static base for kvcd" \
    "$work/rootfs.tar" "$name" >/dev/null
echo "$name"
