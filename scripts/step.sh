#!/usr/bin/env bash
# Runs one step of `make check` and records its wall time, so CI's log says where the time went.
#   scripts/step.sh NAME CMD...    appends "NAME <seconds>s rc <rc>" to out/steps.txt
#   scripts/step.sh --report       prints out/steps.txt as a table (and the guest's own times)
set -uo pipefail
cd "$(dirname "$0")/.."
steps=out/steps.txt
if [ "${1:-}" = --report ]; then
    [ -f "$steps" ] || exit 0
    echo "== wall time per step =="
    awk '{printf "  %-14s %6s  %s %s\n", $1, $2, $3, $4; s += $2} END {printf "  %-14s %5ds\n", "total", s}' "$steps"
    for t in out/e2e/e2e/times.txt out/e2e/e2e-[0-9]*/times.txt; do
        [ -f "$t" ] && { echo "== guest ($t) =="; grep -E '^(guest_build|payload|qemu_|guest: step_|guest: boot[0-9]+ (multi_user|entry))' "$t" | sed 's/^/  /'; }
    done
    exit 0
fi
name=$1
shift
mkdir -p out
t0=$(date +%s)
"$@"
rc=$?
echo "$name $(($(date +%s) - t0))s rc $rc" >>"$steps"
echo "step $name: $(($(date +%s) - t0))s (rc $rc)"
[ $rc = 0 ] || "$0" --report
exit $rc
