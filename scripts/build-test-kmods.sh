#!/bin/bash
# Build kvcd's test kernel modules (tests/kmods) out of tree.
#
#   scripts/build-test-kmods.sh KVER OUTDIR [KMODVER]
#
# Compiles against /usr/src/linux-headers-KVER (override with KVCD_KDIR=DIR) in a scratch copy
# of tests/kmods, so nothing is written to the source tree, then puts kvcd_base.ko,
# kvcd_user.ko, kvcd_bad.ko and the Module.symvers of base+user into OUTDIR, and kvcd_fw.ko
# (it asks for a firmware file at load: the firmware scenario) into OUTDIR/fw/.
# KMODVER (default 1.0) becomes MODULE_VERSION of every module.
# KVCD_FLEET=N (default 0) also builds N copies of kvcd_fleet.c named kvcd_f01 ... into
# OUTDIR/fleet/: one module per instance for the many-instances scenario.
#
# Two passes: base+user are built with modpost's default (an unresolved symbol is an error);
# kvcd_bad, whose whole point is an unresolved symbol, is built alone with KBUILD_MODPOST_WARN=1.
set -euo pipefail

usage() { echo "usage: $0 KVER OUTDIR [KMODVER]" >&2; exit 2; }
[ $# -ge 2 ] && [ $# -le 3 ] || usage
kver=$1
outdir=$2
kmodver=${3:-1.0}

# KMODVER ends up inside a C string literal: keep it to version-ish characters.
if ! [[ $kmodver =~ ^[A-Za-z0-9._+~-]+$ ]]; then
	echo "$0: KMODVER must match [A-Za-z0-9._+~-]+, got '$kmodver'" >&2
	exit 2
fi

fleet=${KVCD_FLEET:-0}
if ! [[ $fleet =~ ^[0-9]+$ ]] || [ "$fleet" -gt 99 ]; then
	echo "$0: KVCD_FLEET must be a number from 0 to 99, got '$fleet'" >&2
	exit 2
fi

kdir=${KVCD_KDIR:-/usr/src/linux-headers-$kver}
if [ ! -f "$kdir/Makefile" ]; then
	echo "$0: no kernel build tree at $kdir (install linux-headers-$kver)" >&2
	exit 1
fi

src=$(cd "$(dirname "$0")/../tests/kmods" && pwd)
scratch=$(mktemp -d "${TMPDIR:-/tmp}/kvcd-kmods.XXXXXX")
trap 'rm -rf "$scratch"' EXIT

jobs=$(nproc 2>/dev/null || echo 1)
build() { # DIR MODULES [make args...]
	local dir=$1 mods=$2
	shift 2
	mkdir -p "$dir"
	cp "$src"/Kbuild "$src"/*.c "$dir"/
	make -s -C "$kdir" M="$dir" KMODVER="$kmodver" KVCD_KMODS="$mods" -j"$jobs" "$@" modules
}

build "$scratch/good" "kvcd_base kvcd_user kvcd_fw"
build "$scratch/bad" "kvcd_bad" KBUILD_MODPOST_WARN=1 2>"$scratch/bad.log" || {
	cat "$scratch/bad.log" >&2
	exit 1
}
# The only unresolved symbol the bad pass may have is the one it exists for.
if grep 'undefined!' "$scratch/bad.log" | grep -vq '"kvcd_no_such_symbol"'; then
	cat "$scratch/bad.log" >&2
	echo "$0: unexpected output building kvcd_bad" >&2
	exit 1
fi

mkdir -p "$outdir"
install -m 0644 "$scratch/good/kvcd_base.ko" "$scratch/good/kvcd_user.ko" \
	"$scratch/good/Module.symvers" "$scratch/bad/kvcd_bad.ko" "$outdir"/
install -D -m 0644 -t "$outdir/fw" "$scratch/good/kvcd_fw.ko"

if [ "$fleet" -gt 0 ]; then
	names=$(seq -f 'kvcd_f%02g' 1 "$fleet" | tr '\n' ' ')
	mkdir -p "$scratch/fleet" "$outdir/fleet"
	for n in $names; do
		cp "$src/kvcd_fleet.c" "$scratch/fleet/$n.c"
	done
	build "$scratch/fleet" "$names"
	for n in $names; do
		install -m 0644 "$scratch/fleet/$n.ko" "$outdir/fleet/"
	done
fi
