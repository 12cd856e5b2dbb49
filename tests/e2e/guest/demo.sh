#!/bin/bash
# `make demo` inside the guest: start the e2e instance and show, in one screen, what kvcd did:
# the unit (systemctl status), the module in the kernel (lsmod), kvcd's record (kvcd status) and
# the instance's journal with the driver image's build output folded into one line.
#
#   demo.sh [RESULTS_DIR]    the instance's whole journal goes to RESULTS_DIR/kvcd@e2e-kmod.journal.txt
set -u
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
results=${1:-}
instance=e2e-kmod
unit=kvcd@$instance.service
section() { printf '\n===== %s\n' "$*"; }

t0=$SECONDS
timeout 900 systemctl start "$unit"
rc=$?
echo "systemctl start $unit: rc $rc after $((SECONDS - t0)) s"
for _ in $(seq 1 120); do
    kvcd status "$instance" 2>/dev/null | grep -qE 'Done|Degraded' && break
    sleep 5
done

section "systemctl status $unit"
# --lines=0: the journal has its own section below, without the build output.
SYSTEMD_COLORS=0 systemctl status "$unit" --no-pager --full --lines=0

section "lsmod | grep kvcd"
lsmod | grep -E '^Module|kvcd' || echo "(no kvcd module loaded)"
echo "cat /proc/kvcd_user: $(cat /proc/kvcd_user 2>&1)"

section "kvcd status $instance"
kvcd status "$instance"

section "journalctl -u $unit (image build output folded)"
journalctl -u "$unit" -o json --no-pager | python3 "$here/demo_journal.py" --limit 25
if [ -n "$results" ]; then
    journalctl -u "$unit" --no-pager >"$results/$unit.journal.txt" 2>&1
fi

section "systemctl stop $unit"
timeout 300 systemctl stop "$unit"
echo "stop rc=$?; $(lsmod | grep -c kvcd) kvcd module(s) loaded after it"
# The demo failed when the unit did not start: run-guest.sh reports this as the in-guest rc.
exit "$rc"
