// SPDX-License-Identifier: GPL-2.0
/*
 * kvcd_fleet: the template of the fleet test modules kvcd_f01, kvcd_f02, ... (copies of this
 * file under those names, built by scripts/build-test-kmods.sh with KVCD_FLEET=N): one module
 * per instance when many instances run on one node (issue #20). No symbols of its own, so the
 * copies never clash; each is its own module, named by its file.
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/module.h>
#include <linux/kernel.h>

#ifndef KMODVER
#define KMODVER "1.0"
#endif

static int __init kvcd_fleet_init(void)
{
	pr_info("loaded, version %s\n", KMODVER);
	return 0;
}

static void __exit kvcd_fleet_exit(void)
{
	pr_info("unloaded\n");
}

module_init(kvcd_fleet_init);
module_exit(kvcd_fleet_exit);

MODULE_LICENSE("GPL");
MODULE_DESCRIPTION("kvcd test module: one of a fleet of identical modules");
MODULE_VERSION(KMODVER);
