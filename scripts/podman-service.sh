#!/bin/bash
# Run a private rootful podman API service for tests, CI and demos on a build host.
#
#   scripts/podman-service.sh start  DIR   start it (idempotent), print the socket URL
#   scripts/podman-service.sh stop   DIR   stop it and unmount its storage
#   scripts/podman-service.sh socket DIR   print the socket URL (exit 1 if not answering)
#
# Everything lives under DIR; nothing outside it is written:
#   DIR/containers.conf   runtime runc, default_ulimits within this sandbox's hard limits
#   DIR/storage.conf      graphroot DIR/storage, runroot DIR/run (a store of its own, so tests
#                         never see or touch the host's images and `rm -rf DIR` cleans up)
#   DIR/tmp               the service's TMPDIR (build contexts, image copies)
#   DIR/env               sourceable: CONTAINERS_CONF, CONTAINERS_STORAGE_CONF, CONTAINER_HOST,
#                         so the podman CLI and scripts/make-base-image.sh use the same store
#   DIR/podman.sock, DIR/podman.pid, DIR/service.log
#
# The host's /etc/containers is never modified (also not under CI=true): CONTAINERS_CONF and
# CONTAINERS_STORAGE_CONF point at DIR, which is enough for `podman system service` and the CLI.
# Rootful: run as root. DIR should be short (a unix socket path must stay under 108 bytes).
set -euo pipefail

usage() {
    echo "usage: $0 start|stop|socket DIR" >&2
    exit 2
}

[[ $# -eq 2 ]] || usage
verb=$1
dir=$2
mkdir -p "$dir"
dir=$(cd "$dir" && pwd -P)
sock="$dir/podman.sock"
url="unix://$sock"
pidfile="$dir/podman.pid"

running() {
    [[ -f $pidfile ]] && kill -0 "$(cat "$pidfile")" 2>/dev/null
}

answers() {
    # The libpod ping endpoint; curl is not guaranteed, so use python3's http over the socket.
    python3 - "$sock" <<'EOF' 2>/dev/null
import http.client, socket, sys
class C(http.client.HTTPConnection):
    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(2)
        self.sock.connect(sys.argv[1])
c = C("localhost", timeout=2)
c.request("GET", "/_ping")
sys.exit(0 if c.getresponse().status == 200 else 1)
EOF
}

write_config() {
    mkdir -p "$dir/storage" "$dir/run" "$dir/tmp"
    cat >"$dir/containers.conf" <<EOF
# Written by scripts/podman-service.sh for a test/CI podman service.
[containers]
# The podman defaults exceed this sandbox's hard limits (no CAP_SYS_RESOURCE).
default_ulimits = ["nofile=1024:1024", "nproc=4096:4096"]

[engine]
# crun fails here ("cgroups in hybrid mode not supported").
runtime = "runc"
EOF
    cat >"$dir/storage.conf" <<EOF
# Written by scripts/podman-service.sh: a store of its own under $dir.
[storage]
driver = "overlay"
graphroot = "$dir/storage"
runroot = "$dir/run"
EOF
    cat >"$dir/env" <<EOF
export CONTAINERS_CONF=$dir/containers.conf
export CONTAINERS_STORAGE_CONF=$dir/storage.conf
export CONTAINER_HOST=$url
EOF
}

start() {
    if running && answers; then
        echo "$url"
        return 0
    fi
    running && stop # ours, but hung: replace it
    command -v podman >/dev/null || { echo "$0: podman is not installed" >&2; exit 1; }
    write_config
    rm -f "$sock"
    # The service must outlive this script; setsid detaches it from our session and signals.
    CONTAINERS_CONF="$dir/containers.conf" \
        CONTAINERS_STORAGE_CONF="$dir/storage.conf" \
        TMPDIR="$dir/tmp" \
        setsid podman system service --time=0 "$url" \
        </dev/null >"$dir/service.log" 2>&1 &
    echo $! >"$pidfile"
    for _ in $(seq 1 150); do
        if answers; then
            echo "$url"
            return 0
        fi
        if ! running; then
            echo "$0: podman service exited; log follows" >&2
            cat "$dir/service.log" >&2
            exit 1
        fi
        sleep 0.1
    done
    echo "$0: podman service did not answer on $url within 15s" >&2
    exit 1
}

stop() {
    if running; then
        pid=$(cat "$pidfile")
        kill "$pid"
        for _ in $(seq 1 100); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
    fi
    rm -f "$pidfile" "$sock"
    # Leave no mounts behind, so `rm -rf DIR` works: the overlay driver keeps its home and
    # any still-mounted layers mounted after the service exits.
    if [[ -d $dir/storage ]]; then
        findmnt -rn -o TARGET | grep -F "$dir/" | sort -r | while read -r m; do
            umount "$m" 2>/dev/null || umount -l "$m" || true
        done
    fi
}

case $verb in
start) start ;;
stop) stop ;;
socket)
    answers || { echo "$0: nothing answers on $url" >&2; exit 1; }
    echo "$url"
    ;;
*) usage ;;
esac
