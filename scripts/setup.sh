#!/usr/bin/env bash
# Everything a fresh Debian 12 machine needs to build, test and demo kvcd. Idempotent.
#   scripts/setup.sh            apt packages (when missing) + the project venv in .venv
# Root is needed for apt; on a machine that already has the packages it is not.
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(
  # podman and what it needs here (runc: crun fails on this host's cgroups)
  podman buildah skopeo runc busybox-static git
  # kernel module tooling and headers to compile the test modules
  kmod gcc make libc6-dev linux-headers-amd64
  # systemd-analyze verify for the unit file
  systemd
  # the VM guest for end-to-end tests (make e2e / make demo)
  qemu-system-x86 qemu-utils debootstrap cpio e2fsprogs
  # the guest registry's TLS certificates (run-guest.sh; scenarios_registry.py)
  openssl
  # RPM build and lint
  rpm rpmlint
  # python venv
  python3-venv
  # GNU time: the benchmarks' peak RSS of a child (benchmarks/common.py peak_rss_kib)
  time
  # pydbus (the `dbus` extra) needs PyGObject, built from source in the venv (no wheel), and
  # the D-Bus tests start a private dbus-daemon
  libgirepository1.0-dev libcairo2-dev pkg-config python3-dev dbus-daemon
)

# A second 6.1 headers ABI: the guest's second kernel (scripts/e2e/second-kernel.txt), so that
# run-guest.sh compiles the test modules for it here in seconds instead of in the guest under
# TCG (minutes: the next-kernel scenarios); the kABI tests use it too. When the archive no
# longer has it, the oldest 6.1 ABI it has (Debian retires old ABI names).
second=$(grep -v '^#' scripts/e2e/second-kernel.txt | sed -n 1p)
if [ ! -f "/usr/src/linux-headers-$second/Makefile" ]; then
  [ -n "$(apt-cache policy linux-headers-amd64 2>/dev/null)" ] || apt-get update -qq
  if [ -n "$(apt-cache policy "linux-headers-$second" 2>/dev/null | grep Candidate | grep -v none)" ]; then
    APT_PACKAGES+=("linux-headers-$second")
  elif ! ls -d /usr/src/linux-headers-6.1.0-*-amd64 2>/dev/null | sed -n 2p | grep -q .; then
    older=$(apt-cache search --names-only '^linux-headers-6\.1\.0-[0-9]+-amd64$' | cut -d' ' -f1 | sort -V | head -1)
    [ -n "$older" ] && APT_PACKAGES+=("$older")
  fi
fi

missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.kvcd-deps-$(sha256sum pyproject.toml | cut -c1-16)
# .venv/bin/kvcd too: a venv from before build-rpm.sh stopped touching it can have lost kvcd.
if [ ! -e "$stamp" ] || [ ! -x .venv/bin/kvcd ]; then
  # setuptools' notes on every editable install are not news: the log keeps them, a failure shows them.
  log=.venv/setup-pip.log
  echo "setup: installing the project venv (.venv; log: $log)"
  if ! { .venv/bin/pip install -q -U pip && .venv/bin/pip install -q -e '.[dev]'; } >"$log" 2>&1; then
    tail -n 30 "$log" >&2
    echo "setup: pip install failed; the whole log is $log" >&2
    exit 1
  fi
  rm -f .venv/.kvcd-deps-*
  touch "$stamp"
fi

# The oldest Python kvcd supports: its own venv, the runtime dependencies and what the unit and
# docs tests need, so `make test-oldest` runs them on it (scripts/oldest-python.sh picks it).
py_oldest=$(scripts/oldest-python.sh)
if [ ! -x .venv-oldest/bin/python ]; then
  "$py_oldest" -m venv .venv-oldest
fi
stamp=.venv-oldest/.kvcd-deps-$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [ ! -e "$stamp" ]; then
  log=.venv-oldest/setup-pip.log
  echo "setup: installing the oldest-Python venv (.venv-oldest, $("$py_oldest" --version); log: $log)"
  # The runtime dependencies as pyproject.toml names them, the kubernetes extra, and the tests'
  # own (the dbus extra compiles PyGObject: its tests import it only where it is installed).
  mapfile -t deps < <(.venv/bin/python -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; [print(d) for d in p["dependencies"] + p["optional-dependencies"]["kubernetes"]]')
  if ! .venv-oldest/bin/pip install -q "${deps[@]}" pytest pytest-xdist hypothesis pyyaml >"$log" 2>&1; then
    tail -n 30 "$log" >&2
    echo "setup: pip install into .venv-oldest failed; the whole log is $log" >&2
    exit 1
  fi
  rm -f .venv-oldest/.kvcd-deps-*
  touch "$stamp"
fi
echo "setup: ok ($(.venv/bin/python --version), oldest $(.venv-oldest/bin/python --version), $(podman --version))"
