#!/bin/sh
# Template: run a driver's userspace tools from its driver image, under their own names.
#
# One copy per kvcd instance, with INSTANCE set; then one symlink per tool, named like the tool:
#
#   install -m 0755 kvc-wrapper.sh /usr/local/libexec/kvcd/simple-kmod-tools
#   sed -i 's/^INSTANCE=.*/INSTANCE=simple-kmod/' /usr/local/libexec/kvcd/simple-kmod-tools
#   ln -s ../libexec/kvcd/simple-kmod-tools /usr/local/bin/spkut
#
# `spkut -x 1` then runs `kvcd wrapper simple-kmod spkut -x 1`: the tool `spkut` inside the
# driver image built for the running kernel (or the instance's KVC library `wrapper` function).
# It replaces KVC's /usr/local/bin/spkut, which ran
# `kmods-via-containers wrapper simple-kmod $(uname -r) spkut "$@"` (and still works with the
# kvcd-kvc-compat package installed).
set -u

INSTANCE=simple-kmod

tool=${0##*/}
if [ "$tool" = "${INSTANCE}-tools" ] || [ "$tool" = kvc-wrapper.sh ]; then
    echo "$tool: run me through a symlink named like the tool (see the comment at the top)" >&2
    exit 2
fi
exec kvcd wrapper "$INSTANCE" "$tool" "$@"
