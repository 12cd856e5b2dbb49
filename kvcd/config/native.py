"""A native TOML instance file (`/etc/kvcd/instances/<name>.toml`) read into InstanceConfig,
every error with the file, the key's line and the key."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvcd.config import rules
from kvcd.config.model import BuildSource, ConfigError, InstanceConfig, ModuleSpec
from kvcd.config.tomlsrc import KeyLines, decode
from kvcd.core.labels import LABEL_VALUE_RULE, kmm_label_problem, valid_label_value
from kvcd.core.state import IF_IDLE, NEVER, UNLOAD_POLICIES

# --- native TOML ---------------------------------------------------------------------------


class TomlInstance:
    def __init__(self, name: str, path: Path, text: str) -> None:
        self.name = name
        self.path = path
        self.data = decode(path, text)
        self.lines = KeyLines(text)

    def fail(self, message: str, *key: str) -> ConfigError:
        return ConfigError(self.path, message, self.lines.line(*key) if key else None)

    def check(self, rule: Any, value: object, *key: str) -> Any:
        try:
            return rule(value, ".".join(key))
        except rules.Invalid as exc:
            raise self.fail(str(exc), *key) from None

    def variant_build(self, where: tuple[str, ...], raw: object) -> BuildSource:
        """A [variants.<name>.build] table: the [build] rules, key paths under the variant."""
        return TomlInstance.build_source(_Under(self, where), raw)  # type: ignore[arg-type]

    def unload_policy(self, data: dict[str, Any]) -> str:
        """`unload_policy`, or the older `unload_on_stop` (true = "if-idle", false = "never")."""
        if "unload_policy" in data and "unload_on_stop" in data:
            raise self.fail(
                "'unload_on_stop' is the older spelling of 'unload_policy': set only "
                "'unload_policy'",
                "unload_on_stop",
            )
        if "unload_policy" in data:
            policy: str = self.check(
                lambda v, k: rules.valid_choice(v, k, UNLOAD_POLICIES),
                data["unload_policy"],
                "unload_policy",
            )
            return policy
        value = data["unload_on_stop"]
        if not isinstance(value, bool):
            raise self.fail(
                f"'unload_on_stop' must be true or false, got {rules.show(value)}",
                "unload_on_stop",
            )
        return IF_IDLE if value else NEVER

    def in_tree(self, raw: object) -> tuple[str, ...]:
        """`in_tree_modules_to_remove`: module names, in the order they are unloaded."""
        key = "in_tree_modules_to_remove"
        if not isinstance(raw, list):
            raise self.fail(f"'{key}' must be an array of module names, got {rules.show(raw)}", key)
        if not raw:
            return ()
        names: tuple[str, ...] = self.check(rules.valid_module_names, raw, key)
        return tuple(n.replace("-", "_") for n in names)

    def build(self) -> InstanceConfig:
        data = self.data
        rules.unknown_keys(data, rules.TOP_KEYS, "top level", self.fail)
        if "version" not in data:
            raise self.fail("missing required key 'version'")
        version = self.check(rules.valid_version, data["version"], "version")
        if "modules" not in data:
            raise self.fail("missing required key 'modules' (the modules, in load order)")
        modules = data["modules"]
        if not isinstance(modules, list):
            raise self.fail(
                f"'modules' must be an array of module names, got {rules.show(modules)}", "modules"
            )
        names = self.check(rules.valid_module_names, modules, "modules")
        values = self.image_source(data)
        for key, rule in (
            ("modules_path", rules.valid_modules_path),
            ("firmware_path", rules.valid_firmware_path),
            ("auth_file", rules.valid_abs_path),
            ("tls_verify", rules.valid_bool),
            ("watch_config", rules.valid_bool),
        ):
            if key in data:
                values[key] = self.check(rule, data[key], key)
        if "unload_policy" in data or "unload_on_stop" in data:
            values["unload_policy"] = self.unload_policy(data)
        if "in_tree_modules_to_remove" in data:
            values["in_tree_modules_to_remove"] = self.in_tree(data["in_tree_modules_to_remove"])
        if "keep_images" in data:
            value = data["keep_images"]
            in_range = isinstance(value, int) and 1 <= value <= rules.MAX_KEEP_IMAGES
            if isinstance(value, bool) or not in_range:
                raise self.fail(
                    f"'keep_images' must be an integer from 1 to {rules.MAX_KEEP_IMAGES}, got "
                    f"{rules.show(value)}",
                    "keep_images",
                )
            values["keep_images"] = value
        if "kabi" in data:
            value = data["kabi"]
            if value not in rules.KABI_MODES:
                raise self.fail(
                    f"'kabi' must be one of {', '.join(map(repr, rules.KABI_MODES))}, "
                    f"got {rules.show(value)}",
                    "kabi",
                )
            values["kabi"] = value
        if "on_external_unload" in data:
            values["on_external_unload"] = self.check(
                rules.valid_external_unload, data["on_external_unload"], "on_external_unload"
            )
        if "wrapper_args" in data:
            values["wrapper_args"] = self.wrapper_args(data["wrapper_args"])
        for key, what in (("auth_file", "holds credentials for"), ("tls_verify", "applies to")):
            if key in values and "image" not in values and "variants" not in data:
                raise self.fail(f"'{key}' {what} pulling 'image': set 'image'", key)
        values.update(self.node_keys(data))

        if not rules.CAPSCONF_KEYS.isdisjoint(data):  # only then: `kvcd status` parses every config
            from kvcd.config import capsconf

            values.update(capsconf.parse(self, data))
        params = self.params(data.get("params", {}), names)
        return InstanceConfig(
            name=self.name,
            source=self.path,
            version=version,
            modules=tuple(ModuleSpec(n, params.get(n.replace("-", "_"), ())) for n in names),
            format="toml",
            **values,
        )

    def image_source(self, data: Mapping[str, Any]) -> dict[str, Any]:
        """Where the driver image comes from: `image` (pulled), [build], both (the build when
        the pull fails), variants (each names its own), or `image_archive` alone (pinned)."""
        values: dict[str, Any] = {}
        if "image" in data:
            values["image"] = self.check(rules.valid_image, data["image"], "image")
        if "build" in data:
            values["build"] = self.build_source(data["build"])
        if "image_archive" in data:
            values["image_archive"] = self.check(
                rules.valid_archive, data["image_archive"], "image_archive"
            )
            other = [k for k in ("image", "build", "variants") if k in data]
            if other:
                raise self.fail(
                    "'image_archive' pins the instance to an archive on the node, which is "
                    f"never pulled or built: remove {' and '.join(map(repr, other))}",
                    "image_archive",
                )
        elif "build" not in values and "image" not in values and "variants" not in data:
            raise self.fail(
                "needs a [build] table, an 'image' (or both), or an 'image_archive': without "
                "one there is no way to get the driver image"
            )
        return values

    def wrapper_args(self, value: object) -> tuple[str, ...]:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self.fail(
                f"'wrapper_args' must be an array of strings, got {rules.show(value)}",
                "wrapper_args",
            )
        for arg in value:
            if "\0" in arg:
                raise self.fail("'wrapper_args' entries must not contain NUL", "wrapper_args")
        return tuple(value)

    def node_keys(self, data: Mapping[str, Any]) -> dict[str, Any]:
        """ordered_upgrade, upgrade_label, drain (issue #6: node state)."""
        values: dict[str, Any] = {}
        if "ordered_upgrade" in data:
            value = data["ordered_upgrade"]
            if not isinstance(value, bool):
                raise self.fail(
                    f"'ordered_upgrade' must be true or false, got {rules.show(value)}",
                    "ordered_upgrade",
                )
            values["ordered_upgrade"] = value
        if "upgrade_label" in data:
            values["upgrade_label"] = self.check(
                rules.qualified_name, data["upgrade_label"], "upgrade_label"
            )
            kmm = kmm_label_problem(values["upgrade_label"])
            if kmm is not None:
                raise self.fail(f"'upgrade_label' {kmm}", "upgrade_label")
            if not values.get("ordered_upgrade"):
                raise self.fail("'upgrade_label' needs 'ordered_upgrade = true'", "upgrade_label")
        version = data.get("version")
        if (
            values.get("ordered_upgrade")
            and isinstance(version, str)
            and not valid_label_value(version)
        ):
            raise self.fail(
                f"'version' {version!r} cannot be an ordered-upgrade label value, which "
                f"must equal it ({LABEL_VALUE_RULE})",
                "version",
            )
        if "drain" in data:
            values["drain"] = self.check(
                lambda v, k: rules.valid_choice(v, k, rules.DRAIN_MODES), data["drain"], "drain"
            )
        return values

    def build_source(self, table: object) -> BuildSource:
        if not isinstance(table, dict):
            raise self.fail(f"'build' must be a table, got {rules.show(table)}", "build")
        rules.unknown_keys(table, rules.BUILD_KEYS, "build", self.fail, ("build",))
        if "context" not in table:
            raise self.fail("missing required key 'context' in [build]", "build")
        context = self.check(rules.valid_context, table["context"], "build", "context")
        containerfile = "Containerfile"
        if "containerfile" in table:
            containerfile = self.check(
                rules.valid_containerfile, table["containerfile"], "build", "containerfile"
            )
        args: list[tuple[str, str]] = []
        raw = table.get("args", {})
        if not isinstance(raw, dict):
            raise self.fail(f"'build.args' must be a table, got {rules.show(raw)}", "build", "args")
        for key, value in raw.items():
            where = ("build", "args", key)
            if key in rules.RESERVED_BUILD_ARGS:
                raise self.fail(
                    f"'build.args.{key}' is reserved: kvcd passes KVER (the kernel) and "
                    "KMODVER (the version) itself",
                    *where,
                )
            if not rules.BUILD_ARG_NAME.fullmatch(key):
                raise self.fail(
                    f"bad build argument name {key!r} in [build.args]: use [A-Za-z_][A-Za-z0-9_]*",
                    *where,
                )
            if not isinstance(value, str):
                raise self.fail(
                    f"'build.args.{key}' must be a string, got {rules.show(value)}", *where
                )
            if "\0" in value or "\n" in value:
                raise self.fail(f"'build.args.{key}' must not contain a newline or NUL", *where)
            args.append((key, value))
        return BuildSource(context=context, containerfile=containerfile, args=tuple(args))

    def params(
        self, table: object, modules: tuple[str, ...]
    ) -> dict[str, tuple[tuple[str, str], ...]]:
        if not isinstance(table, dict):
            raise self.fail(f"'params' must be a table, got {rules.show(table)}", "params")
        listed = {m.replace("-", "_") for m in modules}
        out: dict[str, tuple[tuple[str, str], ...]] = {}
        for module, values in table.items():
            where = ("params", module)
            kernel_name = module.replace("-", "_")
            if kernel_name not in listed:
                raise self.fail(f"[params.{module}]: module {module!r} is not in 'modules'", *where)
            if kernel_name in out:
                raise self.fail(f"[params.{module}]: parameters given twice for it", *where)
            if not isinstance(values, dict):
                raise self.fail(
                    f"'params.{module}' must be a table of parameters, got {rules.show(values)}",
                    *where,
                )
            pairs: list[tuple[str, str]] = []
            for key, value in values.items():
                if not rules.PARAM_NAME.fullmatch(key):
                    raise self.fail(
                        f"bad parameter name {key!r} in [params.{module}]: use [A-Za-z0-9_]",
                        *where,
                        key,
                    )
                pairs.append(
                    (key, self.check(rules.valid_param_value, value, "params", module, key))
                )
            out[kernel_name] = tuple(pairs)
        return out


class _Under:
    """A TomlInstance seen from inside a sub-table: key paths get `prefix` (for lines)."""

    def __init__(self, inst: Any, prefix: tuple[str, ...]) -> None:
        self.inst = inst
        self.prefix = prefix

    def fail(self, message: str, *key: str) -> ConfigError:
        return self.inst.fail(message, *self.prefix, *key)  # type: ignore[no-any-return]

    def check(self, rule: Any, value: object, *key: str) -> Any:
        return self.inst.check(rule, value, *self.prefix, *key)
