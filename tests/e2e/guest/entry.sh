#!/bin/bash
# Runs in the e2e guest after multi-user.target (kvcd-e2e.service, from the base image).
# Mode (payload file /mnt/e2e/mode): smoke | e2e | demo. Writes everything to
# /mnt/e2e/results, which the host reads back with debugfs after the guest powers off.
# The unit powers the guest off when this script ends, whatever happened.
set -uo pipefail
P=/mnt/e2e
R=$P/results
G=$P/guest
mkdir -p "$R"
exec > >(tee -a "$R/entry.log") 2>&1
mode=$(cat "$P/mode" 2>/dev/null || echo smoke)
up() { cut -d' ' -f1 /proc/uptime; }
echo "KVCD-E2E: entry mode=$mode uptime=$(up)"
{
    echo "entry_uptime $(up)"
    echo "kernel $(uname -r)"
} >"$R/timings.txt"
# Boot is not "finished" for systemd-analyze while this unit runs; read the target's timestamp.
mu=$(systemctl show -P ActiveEnterTimestampMonotonic multi-user.target)
echo "multi_user_reached_uptime $(awk -v u="$mu" 'BEGIN{printf "%.1f", u/1e6}')" >>"$R/timings.txt"
systemd-analyze blame 2>/dev/null | head -n 20 >"$R/systemd-blame.txt" || true
export PYTHONDONTWRITEBYTECODE=1 KVCD_E2E_RESULTS=$R KVCD_E2E_PAYLOAD=$P

run_pytest() { # JUNIT FILES...
    local junit=$1
    shift
    (cd "$G" && timeout "${KVCD_E2E_GUEST_TIMEOUT:-3000}" python3 -m pytest -v -p no:cacheprovider \
        --rootdir="$G" -o junit_family=xunit2 -o junit_logging=all --junitxml="$R/$junit" "$@")
}

rc=0
case "$mode" in
smoke)
    run_pytest junit-guest.xml guest_smoke.py || rc=$?
    ;;
e2e)
    run_pytest junit-guest.xml guest_smoke.py guest_scenarios.py || rc=$?
    ;;
demo)
    bash "$G/demo.sh" 2>&1 | tee "$R/demo.txt" || rc=$?
    ;;
cmd)
    # run-guest.sh --mode cmd --cmd FILE: an ad-hoc script, for debugging the guest.
    timeout "${KVCD_E2E_GUEST_TIMEOUT:-3000}" bash "$P/cmd.sh" 2>&1 | tee "$R/cmd.txt" || rc=$?
    ;;
*)
    echo "unknown mode $mode"
    rc=2
    ;;
esac
echo "$rc" >"$R/rc"
echo "tests_done_uptime $(up)" >>"$R/timings.txt"

# Artifacts, whatever happened.
command -v kvcd >/dev/null && {
    kvcd status >"$R/kvcd-status.txt" 2>&1
    kvcd status --json >"$R/kvcd-status.json" 2>"$R/kvcd-status.json.err"
}
systemctl status --no-pager --full 'kvcd@*' >"$R/systemctl-status.txt" 2>&1
systemctl list-units --failed --no-pager >"$R/failed-units.txt" 2>&1
podman images >"$R/podman-images.txt" 2>&1
cat /proc/modules >"$R/proc-modules.txt" 2>&1
find -L /var/lib/kvcd -maxdepth 9 >"$R/var-lib-kvcd.txt" 2>&1
dmesg >"$R/dmesg.txt" 2>&1
journalctl -b --no-pager >"$R/journal.txt" 2>&1
journalctl -b -o export >"$R/journal.export" 2>/dev/null
echo "artifacts_done_uptime $(up)" >>"$R/timings.txt"
echo "KVCD-E2E: done rc=$rc uptime=$(up)"
touch "$R/done"
sync
