#!/bin/bash
# KVC-format library for scenario (f): installed as /usr/lib/kvc/e2e-kvc-lib.sh in the e2e guest.
# Same shape as kmods-via-containers' simple-kmod-lib.sh: defines build_kmods, load_kmods,
# unload_kmods and wrapper on top of the framework's kvc_c_build / kvc_c_run / kvc_c_images,
# with KVC_SOFTWARE_NAME and KVC_KVER in scope. Like simple-kmod-lib.sh it sources its own
# conf: KVC's framework script never reads it (kvcd reads it as data, and passes its variables
# too, so a library that does not source it runs under kvcd as well).
set -eu

# shellcheck source=/dev/null
source "/etc/kvc/${KVC_SOFTWARE_NAME}.conf"

IMAGE="localhost/${KVC_SOFTWARE_NAME}-${KMOD_SOFTWARE_VERSION}:${KVC_KVER}"

build_kmod_container() {
    echo "Building ${IMAGE} kernel module container..."
    kvc_c_build -t "${IMAGE}" \
        --file "${KMOD_CONTAINER_BUILD_FILE}" \
        --label="name=${KVC_SOFTWARE_NAME}" \
        --build-arg "KVER=${KVC_KVER}" \
        --build-arg "KMODVER=${KMOD_SOFTWARE_VERSION}" \
        "${KMOD_CONTAINER_BUILD_CONTEXT}"
}

build_kmods() {
    if [ -n "$(kvc_c_images -q "${IMAGE}" 2>/dev/null)" ]; then
        echo "Found existing kernel module container image ${IMAGE}"
        return 0
    fi
    build_kmod_container
}

load_kmods() {
    local module
    echo "Loading kernel modules using the kernel module container..."
    for module in ${KMOD_NAMES}; do
        if ! lsmod | grep -q "^${module} "; then
            kvc_c_run --privileged "${IMAGE}" modprobe "${module}"
        fi
    done
}

unload_kmods() {
    local module modules=""
    echo "Unloading kernel modules..."
    for module in ${KMOD_NAMES}; do modules="${module} ${modules}"; done  # reverse order
    for module in ${modules}; do
        if lsmod | grep -q "^${module} "; then
            kvc_c_run --privileged "${IMAGE}" rmmod "${module}"
        fi
    done
}

wrapper() {
    echo "Running userspace wrapper using the kernel module container..."
    kvc_c_run --privileged "${IMAGE}" "$@"
}
