// SPDX-License-Identifier: GPL-2.0
/*
 * kvcd_user: a test module for kvcd. Depends on kvcd_base (calls kvcd_base_greet() at init),
 * takes a `greeting` parameter and shows it with its version in /proc/kvcd_user.
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/module.h>
#include <linux/kernel.h>
#include <linux/proc_fs.h>
#include <linux/seq_file.h>

#ifndef KMODVER
#define KMODVER "1.0"
#endif

extern const char *kvcd_base_greet(void);

static char *greeting = "hello";
module_param(greeting, charp, 0444);
MODULE_PARM_DESC(greeting, "Text shown in /proc/kvcd_user");

static int kvcd_user_show(struct seq_file *m, void *v)
{
	seq_printf(m, "greeting=%s\nversion=%s\n", greeting, KMODVER);
	return 0;
}

static int __init kvcd_user_init(void)
{
	if (!proc_create_single("kvcd_user", 0444, NULL, kvcd_user_show))
		return -ENOMEM;
	pr_info("loaded, version %s, base says: %s\n", KMODVER, kvcd_base_greet());
	return 0;
}

static void __exit kvcd_user_exit(void)
{
	remove_proc_entry("kvcd_user", NULL);
	pr_info("unloaded\n");
}

module_init(kvcd_user_init);
module_exit(kvcd_user_exit);

MODULE_LICENSE("GPL");
MODULE_DESCRIPTION("kvcd test module: uses kvcd_base, shows a parameter in /proc/kvcd_user");
MODULE_VERSION(KMODVER);
