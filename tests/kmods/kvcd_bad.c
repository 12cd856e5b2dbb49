// SPDX-License-Identifier: GPL-2.0
/*
 * kvcd_bad: a test module for kvcd that can never load. It calls a symbol no kernel exports,
 * so the loader refuses it with "Unknown symbol kvcd_no_such_symbol" (failure scenarios).
 * modpost rejects this by default; the build script allows it for this module only.
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/module.h>
#include <linux/kernel.h>

#ifndef KMODVER
#define KMODVER "1.0"
#endif

extern int kvcd_no_such_symbol(void);

static int __init kvcd_bad_init(void)
{
	return kvcd_no_such_symbol();
}

static void __exit kvcd_bad_exit(void)
{
}

module_init(kvcd_bad_init);
module_exit(kvcd_bad_exit);

MODULE_LICENSE("GPL");
MODULE_DESCRIPTION("kvcd test module: needs a symbol that does not exist, never loads");
MODULE_VERSION(KMODVER);
