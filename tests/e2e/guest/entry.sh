#!/bin/bash
# Runs in the e2e guest after multi-user.target (kvcd-e2e.service, from the base image).
# Mode (payload file /mnt/e2e/mode): smoke | e2e | demo | cmd. Writes everything to
# /mnt/e2e/results, which the host reads back with debugfs after the guest powers off.
# The unit powers the guest off when this script ends, whatever happened.
#
# e2e mode runs steps, each its own pytest session with its own junit file, so one failing
# file does not hide the others:
#   core                    guest_smoke.py guest_scenarios.py guest_kvc_shim.py -> junit-guest.xml
#   scenarios_<x>.py        each file alone, in name order                      -> junit-scenarios_<x>.xml
#   reboot_<x>.py           each file alone, after those (they may reboot)      -> junit-reboot_<x>-boot<N>.xml
#   bench_<x>.py            each file alone, last, only when payload/only names it (make bench-guest)
# Hard resets: kvcdguest.request_reset(trigger) also leaves a command; after the step this script
# syncs, runs it and waits for the machine to reset (the host boots it again, as after a reboot).
# Reboots: a test calls kvcdguest.request_reboot(kernel) (writes /var/lib/kvcd-e2e/reboot-request)
# and ends its session; after that step this script copies the kernel's vmlinuz + initrd to
# results/boot/, writes results/reboot (the kernel release) and this boot's artifacts, and powers
# off without results/done; run-guest.sh boots the same disks again with that kernel, and the
# next boot's run of this script skips the steps already done (/var/lib/kvcd-e2e/steps-done) and
# runs the interrupted step again with KVCD_E2E_BOOT=N+1: its tests marked
# @pytest.mark.boot(N+1) run then (tests/e2e/guest/conftest.py).
#
# The directories can be moved (tests/e2e/test_harness.py runs this on the host with fakes):
# KVCD_E2E_PAYLOAD_DIR (/mnt/e2e), KVCD_E2E_STATE_DIR (/var/lib/kvcd-e2e), KVCD_E2E_BOOT_DIR (/boot).
set -uo pipefail
P=${KVCD_E2E_PAYLOAD_DIR:-/mnt/e2e}
R=$P/results
G=$P/guest
S=${KVCD_E2E_STATE_DIR:-/var/lib/kvcd-e2e}
B=${KVCD_E2E_BOOT_DIR:-/boot}
mkdir -p "$R" "$S"
exec > >(tee -a "$R/entry.log") 2>&1
mode=$(cat "$P/mode" 2>/dev/null || echo smoke)
up() { cut -d' ' -f1 /proc/uptime; }
boot=$(($(cat "$S/boot" 2>/dev/null || echo 0) + 1))
echo "$boot" >"$S/boot"
rm -f "$R/reboot" "$S/reboot-request"
rm -rf "$R/boot"
echo "KVCD-E2E: entry mode=$mode boot=$boot kernel=$(uname -r) uptime=$(up)"
{
    echo "boot$boot entry_uptime $(up)"
    echo "boot$boot kernel $(uname -r)"
} >>"$R/timings.txt"
# Boot is not "finished" for systemd-analyze while this unit runs; read the target's timestamp.
mu=$(systemctl show -P ActiveEnterTimestampMonotonic multi-user.target)
echo "boot$boot multi_user_reached_uptime $(awk -v u="$mu" 'BEGIN{printf "%.1f", u/1e6}')" >>"$R/timings.txt"
systemd-analyze blame 2>/dev/null | head -n 20 >"$R/systemd-blame-boot$boot.txt" || true
export PYTHONDONTWRITEBYTECODE=1 KVCD_E2E_RESULTS=$R KVCD_E2E_PAYLOAD=$P KVCD_E2E_BOOT=$boot \
    KVCD_E2E_STATE_DIR=$S

run_pytest() { # JUNIT FILES...
    local junit=$1
    shift
    (cd "$G" && timeout "${KVCD_E2E_GUEST_TIMEOUT:-3000}" python3 -m pytest -v -p no:cacheprovider \
        --rootdir="$G" -o junit_family=xunit2 -o junit_logging=all --junitxml="$R/$junit" "$@")
}

artifacts() { # SUFFIX ("" for the last boot, "-boot<N>" before a reboot)
    local s=$1
    command -v kvcd >/dev/null && {
        kvcd status >"$R/kvcd-status$s.txt" 2>&1
        kvcd status --json >"$R/kvcd-status$s.json" 2>"$R/kvcd-status$s.json.err"
    }
    systemctl status --no-pager --full 'kvcd@*' >"$R/systemctl-status$s.txt" 2>&1
    systemctl list-units --failed --no-pager >"$R/failed-units$s.txt" 2>&1
    podman images >"$R/podman-images$s.txt" 2>&1
    cat /proc/modules >"$R/proc-modules$s.txt" 2>&1
    find -L /var/lib/kvcd -maxdepth 9 >"$R/var-lib-kvcd$s.txt" 2>&1
    dmesg >"$R/dmesg$s.txt" 2>&1
    journalctl -b --no-pager >"$R/journal$s.txt" 2>&1
    journalctl -b -o export >"$R/journal$s.export" 2>/dev/null
}

# A test asked for a reboot: hand the kernel to the host and power off (without results/done).
reboot_if_requested() {
    [ -f "$S/reboot-request" ] || return 1
    local k
    k=$(tr -d '[:space:]' <"$S/reboot-request")
    [ -n "$k" ] || k=$(uname -r)
    echo "KVCD-E2E: reboot requested into $k after boot $boot"
    if [ -f "$B/vmlinuz-$k" ] && [ -f "$B/initrd.img-$k" ]; then
        mkdir -p "$R/boot"
        cp "$B/vmlinuz-$k" "$B/initrd.img-$k" "$R/boot/"
    elif [ "$k" != "$(cat "$P/kver")" ]; then
        echo "KVCD-E2E: no $B/vmlinuz-$k or $B/initrd.img-$k: cannot reboot into it"
        rm -f "$S/reboot-request"
        return 1
    fi
    echo "boot$boot reboot_uptime $(up)" >>"$R/timings.txt"
    artifacts "-boot$boot"
    echo "$k" >"$R/reboot"
    sync
    if [ -f "$S/reset-trigger" ]; then
        # A hard reset (kvcdguest.request_reset): the test armed a fail point that resets the
        # machine; start what reaches it and wait. The reset is the reboot (no sync after this).
        mv "$S/reset-trigger" "$S/reset-trigger.fired"
        sync
        echo "KVCD-E2E: hard reset expected after boot $boot: $(cat "$S/reset-trigger.fired")"
        bash -c "$(cat "$S/reset-trigger.fired")"
        sleep "${KVCD_E2E_RESET_WAIT:-600}"
        echo "KVCD-E2E: no hard reset within ${KVCD_E2E_RESET_WAIT:-600}s"
        rm -f "$R/reboot" "$S/reboot-request"
        note_rc 1
        return 1
    fi
    exit 0
}

# payload/only (run-guest.sh KVCD_E2E_ONLY): the steps to run; the others count as done.
step_done() {
    grep -qxF "$1" "$S/steps-done" 2>/dev/null && return 0
    [ -s "$P/only" ] && ! tr ' ' '\n' <"$P/only" | grep -qxF "$1"
}
mark_done() { echo "$1" >>"$S/steps-done"; }

rc=$(cat "$S/rc" 2>/dev/null || echo 0)
note_rc() { [ "$1" = 0 ] || rc=$1; echo "$rc" >"$S/rc"; }

case "$mode" in
smoke)
    run_pytest junit-guest.xml guest_smoke.py
    note_rc $?
    ;;
e2e)
    if ! step_done core; then
        run_pytest junit-guest.xml guest_smoke.py guest_scenarios.py guest_kvc_shim.py
        note_rc $?
        reboot_if_requested
        mark_done core
    fi
    shopt -s nullglob
    for f in "$G"/scenarios_*.py "$G"/reboot_*.py "$G"/bench_*.py; do
        name=$(basename "$f" .py)
        step_done "$name" && continue
        # bench_*: guest benchmarks (make bench-guest), only when KVCD_E2E_ONLY names them.
        if [[ $name == bench_* ]] && ! { [ -s "$P/only" ] && tr ' ' '\n' <"$P/only" | grep -qxF "$name"; }; then
            continue
        fi
        junit="junit-$name.xml"
        [[ $name == reboot_* ]] && junit="junit-$name-boot$boot.xml"
        echo "KVCD-E2E: step $name (boot $boot) uptime=$(up)"
        t0=$(up)
        run_pytest "$junit" "$(basename "$f")"
        frc=$?
        # 5: pytest collected no test (a reboot_* file with nothing for this boot).
        [ $frc = 5 ] && frc=0
        note_rc $frc
        echo "step_$name boot$boot $(awk -v a="$t0" -v b="$(up)" 'BEGIN{printf "%.1f", b-a}')s rc $frc" >>"$R/timings.txt"
        reboot_if_requested
        mark_done "$name"
    done
    ;;
demo)
    bash "$G/demo.sh" "$R" 2>&1 | tee "$R/demo.txt"
    note_rc "${PIPESTATUS[0]}"
    ;;
cmd)
    # run-guest.sh --mode cmd --cmd FILE: an ad-hoc script, for debugging the guest.
    timeout "${KVCD_E2E_GUEST_TIMEOUT:-3000}" bash "$P/cmd.sh" 2>&1 | tee "$R/cmd.txt"
    note_rc $?
    ;;
*)
    echo "unknown mode $mode"
    note_rc 2
    ;;
esac
echo "$rc" >"$R/rc"
echo "boot$boot tests_done_uptime $(up)" >>"$R/timings.txt"

# Artifacts, whatever happened.
artifacts ""
echo "artifacts_done_uptime $(up)" >>"$R/timings.txt"
echo "KVCD-E2E: done rc=$rc boots=$boot uptime=$(up)"
touch "$R/done"
sync
