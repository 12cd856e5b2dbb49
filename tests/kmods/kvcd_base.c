// SPDX-License-Identifier: GPL-2.0
/*
 * kvcd_base: a test module for kvcd. Exports one symbol so that kvcd_user depends on it.
 * Never shipped; built by scripts/build-test-kmods.sh for the integration and VM tests.
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/module.h>
#include <linux/kernel.h>

#ifndef KMODVER
#define KMODVER "1.0"
#endif

const char *kvcd_base_greet(void)
{
	return "hello from kvcd_base " KMODVER;
}
EXPORT_SYMBOL_GPL(kvcd_base_greet);

static int __init kvcd_base_init(void)
{
	pr_info("loaded, version %s\n", KMODVER);
	return 0;
}

static void __exit kvcd_base_exit(void)
{
	pr_info("unloaded\n");
}

module_init(kvcd_base_init);
module_exit(kvcd_base_exit);

MODULE_LICENSE("GPL");
MODULE_DESCRIPTION("kvcd test module: exports kvcd_base_greet()");
MODULE_VERSION(KMODVER);
