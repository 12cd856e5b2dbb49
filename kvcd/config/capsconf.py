"""Instance keys for capability matching, device gating, link readiness and dependsOn.

Kept beside native.py (which calls it) so the loader stays readable: `[capabilities]`,
`[variants.<name>]`, `requires_device`, `unload_on_device_removal`, `expect_links`,
`expect_links_timeout`, `depends_on`, the node-wide `[node_capabilities]` pins, and the
dependency graph check (cycle or missing dependency = ConfigError naming the chain).

Reads files only (through the loader); runs nothing.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from kvcd.config import rules
from kvcd.config.model import (
    BuildSource,
    ConfigError,
    ConfigLocations,
    InstanceConfig,
    LinkSpec,
    Variant,
)
from kvcd.config.tomlsrc import KeyLines
from kvcd.core.capabilities import is_vendor_device
from kvcd.core.depends import DependencyError, load_order

_VARIANT_KEYS = ("capabilities", "image", "build")
_LINK_KEYS = ("driver", "name", "up")
CAPABILITY_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.-]{0,62}")
VARIANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
_MODALIAS_GLOB = re.compile(r"[A-Za-z0-9_:*?\[\]!.-]{1,256}")
# Hex digits (or '*') on both sides of one colon: meant as a vendor:device id, whatever its
# length; no bus's modalias looks so (they start with the bus's name: pci:, usb:, acpi:).
_ID_LIKE = re.compile(r"[0-9A-Fa-f*]+:[0-9A-Fa-f*]+")
_LINK_GLOB = re.compile(r"[A-Za-z0-9_.:@*?\[\]!-]{1,64}")

Fail = Callable[..., ConfigError]


def capability_set(
    table: object, fail: Fail, where: tuple[str, ...], label: str
) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """name -> [values] (a single string is one value); names and values checked."""
    if not isinstance(table, dict):
        raise fail(
            f"'{label}' must be a table of capability -> [values], got {rules.show(table)}", *where
        )
    out: list[tuple[str, tuple[str, ...]]] = []
    for name, raw in table.items():
        key = (*where, name)
        if not CAPABILITY_NAME.fullmatch(name):
            raise fail(
                f"bad capability name {name!r} in [{label}]: use [A-Za-z][A-Za-z0-9_.-]*", *key
            )
        values = [raw] if isinstance(raw, str) else raw
        if not isinstance(values, list) or not values:
            raise fail(
                f"'{label}.{name}' must be a non-empty array of strings, got {rules.show(raw)}",
                *key,
            )
        seen: list[str] = []
        for v in values:
            if not isinstance(v, str) or not v or any(ord(c) < 33 or ord(c) == 127 for c in v):
                raise fail(
                    f"'{label}.{name}' values must be non-empty strings without spaces or "
                    f"control characters, got {rules.show(v)}",
                    *key,
                )
            if v in seen:
                raise fail(f"'{label}.{name}' lists {v!r} twice", *key)
            seen.append(v)
        out.append((name, tuple(seen)))
    return tuple(out)


def parse(inst: Any, data: Mapping[str, Any]) -> dict[str, Any]:
    """The InstanceConfig fields for this module's keys (only those present in `data`).

    `inst` is the TomlInstance being read (fail, check, variant_build)."""

    fail: Fail = inst.fail
    values: dict[str, Any] = {}
    table: tuple[tuple[str, tuple[str, ...]], ...] = ()
    if "capabilities" in data:
        table = capability_set(data["capabilities"], fail, ("capabilities",), "capabilities")
        values["capabilities"] = table
    if "variants" in data:
        values["variants"] = _variants(inst, data["variants"], dict(table))
    elif "capabilities" in data:
        raise fail(
            "[capabilities] orders the values of image variants, but there is no [variants.*]",
            "capabilities",
        )
    if "requires_device" in data:
        values["requires_device"] = _requires_device(data["requires_device"], fail)
    if "unload_on_device_removal" in data:
        value = data["unload_on_device_removal"]
        if not isinstance(value, bool):
            raise fail(
                f"'unload_on_device_removal' must be true or false, got {rules.show(value)}",
                "unload_on_device_removal",
            )
        if "requires_device" not in data:
            raise fail(
                "'unload_on_device_removal' needs 'requires_device'", "unload_on_device_removal"
            )
        values["unload_on_device_removal"] = value
    if "expect_links" in data:
        values["expect_links"] = _expect_links(data["expect_links"], fail)
    if "expect_links_timeout" in data:
        value = data["expect_links_timeout"]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 86400:
            raise fail(
                f"'expect_links_timeout' must be a number of seconds in (0, 86400], "
                f"got {rules.show(value)}",
                "expect_links_timeout",
            )
        if "expect_links" not in data:
            raise fail("'expect_links_timeout' needs 'expect_links'", "expect_links_timeout")
        values["expect_links_timeout"] = float(value)
    if "depends_on" in data:
        raw = data["depends_on"]
        if not isinstance(raw, list) or not all(isinstance(v, str) for v in raw):
            raise fail(
                f"'depends_on' must be an array of instance names, got {rules.show(raw)}",
                "depends_on",
            )
        for v in raw:
            if not rules.INSTANCE_NAME.fullmatch(v):
                raise fail(f"'depends_on' entry {v!r} is not an instance name", "depends_on")
        if len(set(raw)) != len(raw):
            raise fail("'depends_on' lists an instance twice", "depends_on")
        values["depends_on"] = tuple(raw)
    return values


def _variants(inst: Any, raw: object, table: dict[str, tuple[str, ...]]) -> tuple[Variant, ...]:
    fail: Fail = inst.fail

    if not isinstance(raw, dict) or not raw:
        raise fail(
            f"'variants' must be tables [variants.<name>], got {rules.show(raw)}", "variants"
        )
    out = []
    for name, body in raw.items():
        where = ("variants", name)
        if not VARIANT_NAME.fullmatch(name):
            raise fail(f"bad variant name {name!r}: use [A-Za-z0-9][A-Za-z0-9_.-]*", *where)
        if not isinstance(body, dict):
            raise fail(f"'variants.{name}' must be a table, got {rules.show(body)}", *where)
        rules.unknown_keys(body, _VARIANT_KEYS, f"variants.{name}", fail, where)
        caps = capability_set(
            body.get("capabilities", {}),
            fail,
            (*where, "capabilities"),
            f"variants.{name}.capabilities",
        )
        for cap, vals in caps:
            order = table.get(cap)
            unknown = [v for v in vals if order is not None and v not in order]
            if unknown:
                raise fail(
                    f"'variants.{name}.capabilities.{cap}': {unknown[0]!r} is not one of the "
                    f"values [capabilities] lists for {cap!r} ({', '.join(order or ())})",
                    *where,
                    "capabilities",
                    cap,
                )
        image = (
            inst.check(rules.valid_image, body["image"], *where, "image")
            if "image" in body
            else None
        )
        build: BuildSource | None = None
        if "build" in body:
            # The instance's own [build] rules; key paths (for line numbers) under the variant.
            build = inst.variant_build(where, body["build"])
        if image is None and build is None:
            raise fail(
                f"[variants.{name}] needs an 'image' or a [variants.{name}.build] table", *where
            )
        out.append(Variant(name=name, capabilities=caps, image=image, build=build))
    return tuple(out)


def _requires_device(raw: object, fail: Fail) -> tuple[str, ...]:
    values = [raw] if isinstance(raw, str) else raw
    if not isinstance(values, list) or not values or not all(isinstance(v, str) for v in values):
        raise fail(
            "'requires_device' must be a non-empty array of modalias globs or vendor:device "
            f"ids, got {rules.show(raw)}",
            "requires_device",
        )
    for v in values:
        if (_ID_LIKE.fullmatch(v) or (":" in v and len(v) <= 9)) and not is_vendor_device(v):
            raise fail(
                f"'requires_device' entry {v!r}: a vendor:device id is two 4-digit hex numbers "
                "(e.g. \"8086:1521\", either may be '*')",
                "requires_device",
            )
        if not is_vendor_device(v) and not _MODALIAS_GLOB.fullmatch(v):
            raise fail(
                f"'requires_device' entry {v!r} is neither a vendor:device id nor a modalias "
                'glob (e.g. "pci:v00001AF4d00001000*")',
                "requires_device",
            )
    return tuple(values)


def _expect_links(raw: object, fail: Fail) -> tuple[LinkSpec, ...]:
    if not isinstance(raw, list) or not raw:
        raise fail(
            "'expect_links' must be a non-empty array of tables such as "
            f'{{ driver = "ixgbe", up = true }}, got {rules.show(raw)}',
            "expect_links",
        )
    out = []
    for i, entry in enumerate(raw, 1):
        label = f"'expect_links' entry {i}"
        if not isinstance(entry, dict):
            raise fail(f"{label} must be a table, got {rules.show(entry)}", "expect_links")
        for key in entry:
            if key not in _LINK_KEYS:
                raise fail(f"{label}: unknown key {key!r} (only driver, name, up)", "expect_links")
        if "driver" not in entry and "name" not in entry:
            raise fail(f"{label} needs a 'driver' or a 'name' (or both)", "expect_links")
        globs: dict[str, str] = {}
        for key in ("driver", "name"):
            if key in entry:
                v = entry[key]
                if not isinstance(v, str) or not _LINK_GLOB.fullmatch(v):
                    raise fail(
                        f"{label}: '{key}' must be a name or glob of [A-Za-z0-9_.:@-*?[]!], "
                        f"got {rules.show(v)}",
                        "expect_links",
                    )
                globs[key] = v
        up = entry.get("up", False)
        if not isinstance(up, bool):
            raise fail(f"{label}: 'up' must be true or false, got {rules.show(up)}", "expect_links")
        out.append(LinkSpec(driver=globs.get("driver"), name=globs.get("name"), up=up))
    return tuple(out)


# --- dependsOn across instance files -------------------------------------------------------


def check_dependencies(
    root: ConfigLocations,
    config: InstanceConfig,
    load: Callable[[ConfigLocations, str], InstanceConfig],
) -> None:
    """Load the dependency graph reachable from `config`; a cycle or a dependency that is not
    configured is a ConfigError on `config`'s file, at its `depends_on` line, naming the chain."""
    graph: dict[str, tuple[str, ...]] = {config.name: config.depends_on}
    pending = list(config.depends_on)
    while pending:
        name = pending.pop()
        if name in graph:
            continue
        try:
            dep = load(root, name)
        except ConfigError as exc:
            if _missing(root, name):
                continue  # load_order names the chain
            raise ConfigError(
                config.source, f"depends_on: instance {name!r} is invalid: {exc}", _line(config)
            ) from None
        graph[name] = dep.depends_on
        pending.extend(dep.depends_on)
    try:
        load_order(graph, [config.name])
    except DependencyError as exc:
        raise ConfigError(config.source, f"depends_on: {exc}", _line(config)) from None


def _missing(root: ConfigLocations, name: str) -> bool:
    admin, vendor = root.instance_dirs()
    paths = (admin / f"{name}.toml", vendor / f"{name}.toml", root.kvc_conf(name))
    return not any(os.path.lexists(p) for p in paths)


def _line(config: InstanceConfig) -> int | None:
    try:
        text = Path(config.source).read_text()
    except OSError:
        return None
    return KeyLines(text).line("depends_on")
