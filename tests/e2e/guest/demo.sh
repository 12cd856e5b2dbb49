#!/bin/bash
# `make demo` inside the guest: start the e2e instance and show what kvcd did.
set -u
unit=kvcd@e2e-kmod.service
step() { printf '\n===== %s\n' "$*"; }
step "systemctl start $unit"
time timeout 900 systemctl start "$unit"
echo "start rc=$?"
for _ in $(seq 1 120); do
    kvcd status 2>/dev/null | grep -qE 'Done|Degraded' && break
    sleep 5
done
step "kvcd status"
kvcd status
step "lsmod | grep kvcd"
lsmod | grep kvcd
step "cat /proc/kvcd_user"
cat /proc/kvcd_user
step "journalctl -u $unit -o verbose (KVCD_* fields)"
journalctl -u "$unit" KVCD_INSTANCE=e2e-kmod -o verbose --no-pager | grep -E '^[A-Z][a-z]{2} |MESSAGE=|KVCD_|MESSAGE_ID=|PRIORITY='
step "systemctl stop $unit"
timeout 300 systemctl stop "$unit"
echo "stop rc=$?"
lsmod | grep kvcd || echo "(no kvcd modules loaded)"
