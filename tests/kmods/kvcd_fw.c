// SPDX-License-Identifier: GPL-2.0
/*
 * kvcd_fw: a test module for kvcd's firmware delivery. At load it asks the kernel for the
 * firmware file `name` (request_firmware_direct: the kernel's search path, no user-space
 * helper to wait for) and fails to load without it, as a real driver does. The first bytes it
 * got are kept in the read-only parameter `got`, for the test to compare.
 * Never shipped; built by scripts/build-test-kmods.sh for the VM tests.
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/device.h>
#include <linux/firmware.h>
#include <linux/kernel.h>
#include <linux/module.h>
#include <linux/string.h>

#ifndef KMODVER
#define KMODVER "1.0"
#endif

static char *name = "kvcd/e2e-fw.bin";
module_param(name, charp, 0444);
MODULE_PARM_DESC(name, "the firmware file to load");

static char got[64];
module_param_string(got, got, sizeof(got), 0444);
MODULE_PARM_DESC(got, "the first bytes of the firmware file, as loaded");

static int __init kvcd_fw_init(void)
{
	const struct firmware *fw;
	struct device *dev;
	size_t n;
	int ret;

	dev = root_device_register("kvcd_fw");
	if (IS_ERR(dev))
		return PTR_ERR(dev);
	ret = request_firmware_direct(&fw, name, dev);
	if (ret) {
		pr_err("%s: error %d\n", name, ret);
		root_device_unregister(dev);
		return ret;
	}
	n = min(fw->size, sizeof(got) - 1);
	memcpy(got, fw->data, n);
	got[n] = '\0';
	pr_info("%s: %zu bytes, version %s\n", name, fw->size, KMODVER);
	release_firmware(fw);
	root_device_unregister(dev);
	return 0;
}

static void __exit kvcd_fw_exit(void)
{
	pr_info("unloaded\n");
}

module_init(kvcd_fw_init);
module_exit(kvcd_fw_exit);

MODULE_LICENSE("GPL");
MODULE_DESCRIPTION("kvcd test module: fails to load without its firmware file");
MODULE_VERSION(KMODVER);
