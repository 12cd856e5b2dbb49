#!/usr/bin/env bash
# Prints the interpreter scripts/setup.sh builds .venv-oldest with: the oldest Python kvcd
# supports (requires-python; RHEL 9's python3 is 3.9). $KVCD_OLDEST_PYTHON when set (refused,
# naming it, unless it is that Python with venv), else python3.9 on PATH or pyenv's. None is an
# error, not a skipped check.
set -euo pipefail
OLDEST=3.9

usable() {  # an executable Python $OLDEST that can make a venv
  [ -x "$1" ] && "$1" -c "import sys, venv; sys.exit(sys.version_info[:2] != (${OLDEST/./, }))" 2>/dev/null
}

if [ -n "${KVCD_OLDEST_PYTHON:-}" ]; then
  usable "$KVCD_OLDEST_PYTHON" || {
    echo "setup: KVCD_OLDEST_PYTHON=$KVCD_OLDEST_PYTHON is not an executable Python $OLDEST with venv" >&2
    exit 1
  }
  echo "$KVCD_OLDEST_PYTHON"
  exit 0
fi
# (pyenv's shim for python3.9 is on PATH even where it refuses to run: each is tried.)
for c in "$(command -v python$OLDEST || true)" "${PYENV_ROOT:-$HOME/.pyenv}"/versions/$OLDEST.*/bin/python$OLDEST; do
  usable "$c" && { echo "$c"; exit 0; }
done
echo "setup: no Python $OLDEST (the oldest kvcd supports) found: install python$OLDEST or set KVCD_OLDEST_PYTHON" >&2
exit 1
