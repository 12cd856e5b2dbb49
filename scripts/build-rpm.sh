#!/usr/bin/env bash
# Build the kvcd RPMs from this source tree: kvcd, kvcd-kvc-compat (both noarch) and the SRPM.
#
#   scripts/build-rpm.sh [--lint] [--nocheck] [OUTDIR]     (OUTDIR default: out/rpm)
#
# The source tarball is the tree as git sees it (tracked and untracked files, minus ignored
# ones), so uncommitted work is packaged too. The version comes from pyproject.toml, which the
# spec reads itself (it is Source1). Prints the paths of the built packages, one per line.
#
# On Fedora/RHEL the spec's own macros are used and the build dependencies must be installed
# (dnf builddep rpm.spec). On a host without Fedora's macro packages (Debian: apt-get install
# rpm rpmlint) the build loads packaging/rpm-fallback.macros, builds with $PYTHON (default:
# the project's .venv python, which has setuptools, pytest and the runtime dependencies)
# and skips the rpmdb check of BuildRequires (--nodeps): nothing there is installed as an RPM.
#
#   --lint      run rpmlint on the built packages (fails on errors; warnings are printed)
#   --nocheck   skip %check (the unit tests)
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
lint=0
nocheck=0
out=
for arg in "$@"; do
  case $arg in
    --lint) lint=1 ;;
    --nocheck) nocheck=1 ;;
    -h | --help)
      sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'
      exit 0
      ;;
    -*)
      echo "build-rpm: unknown option $arg" >&2
      exit 2
      ;;
    *) out=$arg ;;
  esac
done
out=$(realpath -m "${out:-$repo/out/rpm}")

for tool in rpmbuild rpmspec tar; do
  command -v "$tool" >/dev/null || {
    echo "build-rpm: $tool is missing (apt-get install rpm / dnf install rpm-build)" >&2
    exit 1
  }
done

top=$out/rpmbuild
rm -rf "$top"
mkdir -p "$top"/{SOURCES,SPECS,BUILD,BUILDROOT,RPMS,SRPMS}
cp "$repo/pyproject.toml" "$top/SOURCES/"
# The SRPM carries the spec under the package's name (rpmlint: invalid-spec-name otherwise).
cp "$repo/rpm.spec" "$top/SPECS/kvcd.spec"
spec=$top/SPECS/kvcd.spec

args=(--define "_topdir $top" --define "_sourcedir $top/SOURCES")
build_args=(-ba)
if [ "$(rpm --eval '%{?pyproject_wheel:fedora}')" != fedora ]; then
  python=${PYTHON:-$repo/.venv/bin/python}
  [ -x "$python" ] || python=$(command -v python3)
  # Absolute, but not resolved: a venv's python is a symlink to the interpreter it was made from.
  python=$(cd "$(dirname "$python")" && pwd)/$(basename "$python")
  if ! "$python" -c 'import sys, pytest, setuptools; sys.exit(int(setuptools.__version__.split(".")[0]) < 77)' 2>/dev/null; then
    echo "build-rpm: $python needs setuptools>=77 and pytest (scripts/setup.sh)" >&2
    exit 1
  fi
  args+=(--load "$repo/packaging/rpm-fallback.macros" --define "python3 $python")
  build_args+=(--nodeps)
fi

version=$(rpmspec -q --srpm --qf '%{version}\n' "${args[@]}" "$spec" 2>/dev/null || true)
if [ -z "$version" ] || [ "$version" = "%{kvcd_version}" ]; then
  echo "build-rpm: could not read the version (rpmspec -q --srpm rpm.spec)" >&2
  exit 1
fi

# The tarball: deterministic (sorted, fixed owner and mtime) for a given tree.
cd "$repo"
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  epoch=$(git log -1 --format=%ct 2>/dev/null || date +%s)
  list_files() {
    git ls-files -z --cached --others --exclude-standard |
      while IFS= read -r -d '' f; do
        # Tracked files deleted in the work tree are not part of the tree.
        if [ -e "$f" ] || [ -L "$f" ]; then printf '%s\0' "$f"; fi
      done
  }
else
  epoch=$(date +%s)
  list_files() {
    find . -path ./.git -prune -o -path ./.venv -prune -o -path ./out -prune -o \
      \( -type f -o -type l \) -printf '%P\0'
  }
fi
list_files | tar --null -T - --sort=name --owner=0 --group=0 --numeric-owner \
  --mtime="@$epoch" --transform "s,^,kvcd-$version/," \
  -czf "$top/SOURCES/kvcd-$version.tar.gz"

if [ "$nocheck" = 1 ]; then build_args+=(--nocheck); fi
start=$(date +%s)
SOURCE_DATE_EPOCH=$epoch rpmbuild "${build_args[@]}" "${args[@]}" "$spec" >"$out/rpmbuild.log" 2>&1 || {
  tail -n 60 "$out/rpmbuild.log" >&2
  echo "build-rpm: rpmbuild failed; the whole log is $out/rpmbuild.log" >&2
  exit 1
}
echo "build-rpm: rpmbuild took $(($(date +%s) - start))s (log: $out/rpmbuild.log)" >&2

rm -f "$out"/*.rpm
cp "$top"/RPMS/noarch/*.rpm "$top"/SRPMS/*.src.rpm "$out/"
ls -1 "$out"/*.rpm

if [ "$lint" = 1 ]; then
  command -v rpmlint >/dev/null || {
    echo "build-rpm: rpmlint is missing (apt-get install rpmlint)" >&2
    exit 1
  }
  rpmlint -r "$repo/packaging/rpmlintrc" "$out"/*.rpm >&2
fi
