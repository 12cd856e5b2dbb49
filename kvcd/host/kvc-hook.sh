#!/bin/bash
# kvcd's runner for a KVC instance library (<name>-lib.sh, root-owned code).
#
# argv: LIBRARY FUNCTION [ARGS...]. kvcd passes everything as argv and environment; nothing here
# is built from a config value. The library is sourced exactly as kmods-via-containers did, with
# the same helpers and variables defined first, so existing libraries run unchanged:
#   KVC_SOFTWARE_NAME, KVC_KVER, KVC_CONTAINER_RUNTIME, and the instance .conf's variables
#   (exported to what the library runs only when the .conf exports them).
set -eu

kvc_library=$1
kvc_function=$2
shift 2

# The container helpers KVC libraries call; each logs its command line as KVC did.
kvc_c_run()    { (set -x; "$KVC_CONTAINER_RUNTIME" run -i --rm "$@"); }
kvc_c_build()  { (set -x; "$KVC_CONTAINER_RUNTIME" build "$@"); }
kvc_c_images() { (set -x; "$KVC_CONTAINER_RUNTIME" images "$@"); }
kvc_c_rmi()    { (set -x; "$KVC_CONTAINER_RUNTIME" rmi "$@"); }

# Defaults the library overrides, as in KVC.
kvc_unimplemented() { echo "$1 is not implemented for ${KVC_SOFTWARE_NAME}" >&2; return 1; }
build_kmods()  { kvc_unimplemented build_kmods; }
load_kmods()   { kvc_unimplemented load_kmods; }
unload_kmods() { kvc_unimplemented unload_kmods; }
wrapper()      { kvc_unimplemented wrapper; }

# The instance .conf's variables came in the environment, the only way in. KVC sourced the
# .conf, so they were the library's shell variables, never seen by the programs it runs: make
# them so again (export -n), but for those the .conf itself exports.
for kvc_name in ${KVCD_UNEXPORT-}; do
    export -n "$kvc_name"
done
unset KVCD_UNEXPORT kvc_name

# shellcheck source=/dev/null
source "$kvc_library"

case "$kvc_function" in
    build_kmods|load_kmods|unload_kmods)
        # Older libraries take the kernel release as $1; newer ones read KVC_KVER.
        "$kvc_function" "$KVC_KVER"
        ;;
    wrapper)
        wrapper "$@"
        ;;
    *)
        echo "kvcd: unknown KVC function '$kvc_function'" >&2
        exit 2
        ;;
esac
