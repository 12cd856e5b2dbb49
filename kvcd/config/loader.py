"""Instance and node configuration: find the file, refuse unsafe files, validate into dataclasses.

Where an instance comes from, first found wins whole (no merging):

1. ``/etc/kvcd/instances/<name>.toml``     admin, native TOML
2. ``/usr/lib/kvcd/instances/<name>.toml`` vendor, native TOML
3. ``/etc/kvc/<name>.conf``                KVC compatibility, read as data (see kvcconf.py)

Every problem is a :class:`ConfigError` naming the file, the line when known, and the key.
A config file decides what runs in the kernel, so one that someone other than root (or the user
kvcd runs as) could have written is refused before it is read.

This room reads files only; it runs nothing and imports nothing from ``kvcd.host`` (the layer
contract puts config below host): the locations come in through the small
:class:`ConfigLocations` protocol, which :class:`kvcd.host.paths.HostRoot` satisfies.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import os
import re
import stat
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

from kvcd.config.model import BuildSource, ConfigError, InstanceConfig, ModuleSpec, Settings
from kvcd.config.tomlsrc import KeyLines, decode
from kvcd.core import names
from kvcd.core.labels import LABEL_VALUE_RULE, kmm_label_problem, valid_label_value

if TYPE_CHECKING:
    from kvcd.config.kvcconf import Assignment

__all__ = [
    "ConfigLocations",
    "check_file",
    "list_instances",
    "load_instance",
    "load_settings",
    "parse_instance_toml",
    "parse_kvc_conf",
    "parse_settings_toml",
    "read_file",
    "setting_line",
    "settings_source",
]

log = logging.getLogger(__name__)


class ConfigLocations(Protocol):
    """The part of HostRoot this layer needs (HostRoot satisfies it structurally)."""

    def instance_dirs(self) -> tuple[Path, Path]: ...

    def kvc_conf(self, name: str) -> Path: ...

    def kvc_libs(self, name: str) -> tuple[Path, ...]: ...

    @property
    def main_config(self) -> Path: ...

    @property
    def vendor(self) -> Path: ...


# --- rules ---------------------------------------------------------------------------------

# The <name> of kvcd@<name>.service and of its files (kvcd/core/names.py).
INSTANCE_NAME = names.INSTANCE_NAME
# Build context URLs: what podman builds (https:// git repositories and tarballs, git://), and
# pip's git+https:// spelling of a git repository over https.
CONTEXT_SCHEMES = ("https", "git", "git+https")
# KVC's own node-wide conf, /etc/kvc/kmods-via-containers.conf: never an instance.
KVC_GLOBAL = "kmods-via-containers"
# Kernel module names: MODULE_NAME_LEN is 64 - sizeof(long) with the NUL, so 55 characters.
# A leading '-' is refused so that a name can never be read as a modprobe option.
MODULE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]{0,54}")
VERSION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+~-]{0,127}")
PARAM_NAME = re.compile(r"[A-Za-z0-9_]+")
BUILD_ARG_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
RESERVED_BUILD_ARGS = ("KVER", "KMODVER")  # kvcd passes these itself
_IMAGE_REF = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/:@-]*")
_PLACEHOLDER = re.compile(r"\{([^{}]*)\}")
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")

_TOP_KEYS = (
    "version",
    "modules",
    "image",
    "modules_path",
    "unload_on_stop",
    "keep_images",
    "wrapper_args",
    "build",
    "params",
    "ordered_upgrade",
    "upgrade_label",
    "drain",
    "watch_config",
    "on_external_unload",
    # capabilities, variants, device gating, links, depends_on: kvcd/config/capsconf.py
    "capabilities",
    "variants",
    "requires_device",
    "unload_on_device_removal",
    "expect_links",
    "expect_links_timeout",
    "depends_on",
    "kabi",
)
KABI_MODES = ("weak-updates-first", "rebuild")
_BUILD_KEYS = ("context", "containerfile", "args")
_SETTINGS_KEYS = (
    "podman_socket",
    "annotation_prefix",
    "node_backend",
    "node_name",
    "kubeconfig",
    "drain",
    "drain_timeout",
    "drift_interval",
    "node_capabilities",
    "module_tree",
)
NODE_BACKENDS = ("file", "kubernetes")
MODULE_TREES = ("kvcd", "system")
DRAIN_MODES = ("none", "cluster")
# A Kubernetes label/annotation name part: at most 63 characters, alphanumeric at both ends.
_QNAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")

# KVC: the variables kvcd maps onto typed fields; everything else becomes kvc_env.
KVC_VERSION = "KMOD_SOFTWARE_VERSION"
KVC_NAMES = "KMOD_NAMES"
KVC_CONTEXT = "KMOD_CONTAINER_BUILD_CONTEXT"
KVC_FILE = "KMOD_CONTAINER_BUILD_FILE"
KVC_DEFAULT_FILE = "Dockerfile"  # KVC's own default
_KVC_RUNTIME_ONLY = {
    "KVC_KVER": "it is the kernel version, known only at run time (kvcd passes KVER to the "
    "build and KVC_KVER to the hooks itself)",
}
_KVC_SET_BY_KVCD = "KVC_SOFTWARE_NAME"  # the instance name; may be expanded, not assigned
# Environment names that would change how the hook shell runs, not what it is told.
_ENV_REFUSED = frozenset(
    {
        "PATH",
        "IFS",
        "ENV",
        "BASH_ENV",
        "SHELLOPTS",
        "BASHOPTS",
        "PS4",
        "PROMPT_COMMAND",
        "CDPATH",
        "GLOBIGNORE",
        "GCONV_PATH",
        "HOSTALIASES",
        "NLSPATH",
    }
)
_ENV_REFUSED_PREFIXES = ("LD_", "BASH_FUNC_", "PYTHON")

_MAX_CONFIG_BYTES = 1 << 20
_UNSAFE = "it decides what runs in the kernel"


class _Invalid(Exception):
    """A value is wrong; the caller knows the file and line and turns it into ConfigError."""


# --- public API ----------------------------------------------------------------------------


def load_instance(root: ConfigLocations, name: str) -> InstanceConfig:
    """Load instance ``name``: native admin, native vendor, then KVC compatibility.

    With `depends_on`, the instances it depends on are loaded too: a cycle or a missing one
    is a ConfigError naming the chain."""
    config = _load_instance(root, name)
    if config.depends_on:
        from kvcd.config.capsconf import check_dependencies

        check_dependencies(root, config, _load_instance)
    return config


def _load_instance(root: ConfigLocations, name: str) -> InstanceConfig:
    admin_dir, vendor_dir = root.instance_dirs()
    _check_instance_name(name, admin_dir)
    natives = (admin_dir / f"{name}.toml", vendor_dir / f"{name}.toml")
    kvc = root.kvc_conf(name)
    for path in natives:
        if os.path.lexists(path):
            if os.path.lexists(kvc):
                log.warning("%s: ignored, %s configures instance %s", kvc, path, name)
            return parse_instance_toml(name, path, read_file(path))
    if os.path.lexists(kvc):
        config = parse_kvc_conf(name, kvc, read_file(kvc))
        return dataclasses.replace(config, kvc_lib=_find_kvc_lib(root, name))
    looked = ", ".join(str(p) for p in (*natives, kvc))
    raise ConfigError(natives[0], f"no configuration for instance {name!r}: looked in {looked}")


def list_instances(root: ConfigLocations) -> list[str]:
    """Sorted names of every configured instance, native or KVC."""
    names: set[str] = set()
    for directory in root.instance_dirs():
        names.update(_stems(directory, ".toml"))
    # HostRoot names KVC confs one by one; their directory is the parent of any of them.
    kvc_dir = root.kvc_conf("_").parent
    names.update(
        n
        for n in _stems(kvc_dir, ".conf")
        if root.kvc_conf(n).parent == kvc_dir and n != KVC_GLOBAL
    )
    return sorted(names)


def settings_source(root: ConfigLocations) -> Path | None:
    """The file the node-wide settings come from: /etc/kvcd/kvcd.toml, else the vendor's."""
    for path in (root.main_config, root.vendor / root.main_config.name):
        if os.path.lexists(path):
            return path
    return None


def load_settings(root: ConfigLocations) -> Settings:
    """Node-wide settings: /etc/kvcd/kvcd.toml, else the vendor's, else the defaults; and
    KVC's node-wide conf, which must ask for nothing kvcd cannot do (check_kvc_global)."""
    kvc_global = root.kvc_conf(KVC_GLOBAL)
    if os.path.lexists(kvc_global):
        check_kvc_global(kvc_global, read_file(kvc_global))
    path = settings_source(root)
    return Settings() if path is None else parse_settings_toml(path, read_file(path))


# KVC's stock kmods-via-containers.conf picks the runtime with a shell function: podman, unless
# the process runs in a Kubernetes pod's cgroup. kvcd never runs a conf as code; it knows this
# exact text (whitespace aside) and what it means for a host service: podman.
_KVC_STOCK_FUNCTION = re.compile(
    r"get_container_environment\(\)\s*\{\s*"
    r"if\s+awk\s+-F/\s+'\$2\s*==\s*\"kubepods\.slice\"'\s+/proc/self/cgroup\s*\|\s*"
    r"read\s+non_empty_input;\s*then\s+echo\s+kubernetes\s+else\s+echo\s+podman\s+fi\s*\}"
)
_KVC_STOCK_RUNTIME = "$(get_container_environment)"


def check_kvc_global(path: Path | str, text: str) -> str:
    """KVC's node-wide conf: the container runtime it asks for, which must be podman (the only
    runtime kvcd drives). Read as data like every KVC conf: any other variable, a runtime
    other than podman, or code other than KVC's stock runtime function is a ConfigError."""
    from kvcd.config.kvcconf import parse_assignments

    path = Path(path)
    stock = _KVC_STOCK_FUNCTION.search(text)
    if stock is not None:  # blank it out, keeping line numbers
        blank = re.sub(r"[^\n]", " ", stock.group(0))
        text = text[: stock.start()] + blank + text[stock.end() :]
        text = text.replace(_KVC_STOCK_RUNTIME, "podman")
    runtime = "podman"
    for a in parse_assignments(path, text):
        if a.name != "KVC_CONTAINER_RUNTIME":
            raise ConfigError(
                path,
                f"{a.name!r} is not a setting of KVC's node-wide conf that kvcd knows "
                "(only KVC_CONTAINER_RUNTIME)",
                a.line,
            )
        if a.value != "podman":
            raise ConfigError(
                path,
                f"KVC_CONTAINER_RUNTIME={a.value!r}: kvcd builds and runs driver containers "
                "with podman only; set KVC_CONTAINER_RUNTIME=podman",
                a.line,
            )
        runtime = a.value
    return runtime


def setting_line(path: Path, key: str) -> int | None:
    """The line of a top-level key in an (already accepted) settings file, if known."""
    try:
        return KeyLines(read_file(path)).line(key)
    except ConfigError:
        return None


def parse_instance_toml(name: str, path: Path | str, text: str) -> InstanceConfig:
    """Validate the text of a native instance file. Pure: touches no file."""
    path = Path(path)
    _check_instance_name(name, path)
    return _TomlInstance(name, path, text).build()


def parse_kvc_conf(name: str, path: Path | str, text: str) -> InstanceConfig:
    """Validate the text of a KVC conf (kvc_lib is left for load_instance). Pure."""
    path = Path(path)
    _check_instance_name(name, path)
    return _kvc_instance(name, path, text)


def parse_settings_toml(path: Path | str, text: str) -> Settings:
    """Validate the text of the node-wide settings file. Pure."""
    path = Path(path)
    data = decode(path, text)
    lines = KeyLines(text)

    def fail(message: str, *key: str) -> ConfigError:
        return ConfigError(path, message, lines.line(*key) if key else None)

    if "extra" in data:
        # Older docs put node_backend and kubeconfig in an [extra] table that nothing read: the
        # node stayed on the file backend without a word. Say where they belong.
        raise fail(
            "[extra] is not a kvcd setting: node_backend, kubeconfig and node_name are "
            "top-level keys (put them above the first [table]; see packaging/README.md)",
            "extra",
        )
    _unknown_keys(data, _SETTINGS_KEYS, "top level", fail)
    values: dict[str, Any] = {}
    rules: dict[str, Callable[[object, str], Any]] = {
        "podman_socket": _podman_socket,
        "annotation_prefix": _dns_subdomain,
        "node_backend": lambda v, k: _choice(v, k, NODE_BACKENDS),
        "node_name": _node_name,
        "kubeconfig": _abs_path,
        "drain": lambda v, k: _choice(v, k, DRAIN_MODES),
        "drain_timeout": _seconds,
        "drift_interval": _drift_interval,
        "module_tree": lambda v, k: _choice(v, k, MODULE_TREES),
    }
    for key, rule in rules.items():
        if key in data:
            try:
                values[key] = rule(data[key], key)
            except _Invalid as exc:
                raise fail(str(exc), key) from None
    if "node_capabilities" in data:
        from kvcd.config.capsconf import capability_set

        values["node_capabilities"] = capability_set(
            data["node_capabilities"], fail, ("node_capabilities",), "node_capabilities"
        )
    return Settings(**values)


# --- file safety ---------------------------------------------------------------------------


def read_file(path: Path) -> str:
    """Read a config file after checking that only root (or kvcd's own user) can change it."""
    flags = os.O_RDONLY | os.O_NOCTTY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)  # follows symlinks; the target is what gets checked
    except OSError as exc:
        raise ConfigError(path, f"cannot read: {exc.strerror}") from None
    try:
        # fstat of the open file: what is checked is exactly what is read.
        _check_stat(path, os.fstat(fd))
        _check_directories(path)
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "rb") as handle:
        data = handle.read(_MAX_CONFIG_BYTES + 1)
    if len(data) > _MAX_CONFIG_BYTES:
        raise ConfigError(path, f"refusing: larger than {_MAX_CONFIG_BYTES} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise ConfigError(path, "not valid UTF-8", line) from None


def check_file(path: Path) -> None:
    """The same safety rule for a file kvcd hands to something else (a KVC lib.sh)."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise ConfigError(path, f"cannot read: {exc.strerror}") from None
    _check_stat(path, st)
    _check_directories(path)


def _check_stat(path: Path, st: os.stat_result) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(path, "refusing: not a regular file")
    mode = stat.S_IMODE(st.st_mode)
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ConfigError(path, f"refusing: writable by group/others (mode {mode:04o}); {_UNSAFE}")
    euid = os.geteuid()
    if st.st_uid not in (0, euid):
        owners = "root" if euid == 0 else f"root or uid {euid} (kvcd's own user)"
        raise ConfigError(path, f"refusing: owned by uid {st.st_uid}, not by {owners}; {_UNSAFE}")


def _check_directories(path: Path) -> None:
    # The directory holding the name (which could swap a symlink) and the target's directory.
    dirs = [Path(os.path.abspath(path)).parent, Path(os.path.realpath(path)).parent]
    for directory in dict.fromkeys(dirs):
        try:
            mode = os.stat(directory).st_mode
        except OSError as exc:
            message = f"cannot check its directory {directory}: {exc.strerror}"
            raise ConfigError(path, message) from None
        if mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
            raise ConfigError(
                path,
                f"refusing: its directory {directory} is writable by others without the "
                f"sticky bit (mode {stat.S_IMODE(mode):04o}); {_UNSAFE}",
            )


def _find_kvc_lib(root: ConfigLocations, name: str) -> Path | None:
    for candidate in root.kvc_libs(name):
        if os.path.lexists(candidate):
            check_file(candidate)
            return candidate
    return None


def _stems(directory: Path, suffix: str) -> Iterable[str]:
    try:
        entries = sorted(directory.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as exc:
        raise ConfigError(directory, f"cannot list: {exc.strerror}") from None
    names = []
    for entry in entries:
        if entry.suffix != suffix or entry.is_dir():
            continue
        if INSTANCE_NAME.fullmatch(entry.stem):
            names.append(entry.stem)
        else:
            log.warning("%s: ignored, %r is not a valid instance name", entry, entry.stem)
    return names


# --- shared value rules (both formats) -----------------------------------------------------


def _check_instance_name(name: str, path: Path) -> None:
    if not isinstance(name, str) or not INSTANCE_NAME.fullmatch(name):
        raise ConfigError(
            path,
            f"bad instance name {name!r}: it must match [A-Za-z0-9][A-Za-z0-9_.-]{{0,127}} "
            "(the <name> of kvcd@<name>.service)",
        )
    if name == KVC_GLOBAL:
        raise ConfigError(
            path,
            f"{name!r} is not an instance name: /etc/kvc/{KVC_GLOBAL}.conf is KVC's node-wide "
            "conf (kvcd check-config --all checks it)",
        )


def _show(value: object) -> str:
    """A value as the message shows it: TOML-ish, one line."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "a table"
    return f"a {type(value).__name__}"


def _has_control(text: str) -> bool:
    return any(ord(c) < 32 or ord(c) == 127 for c in text)


def _version(value: object, label: str) -> str:
    if not isinstance(value, str) or not value:
        raise _Invalid(f"'{label}' must be a non-empty string, got {_show(value)}")
    if not VERSION.fullmatch(value):
        raise _Invalid(
            f"'{label}' must match [A-Za-z0-9][A-Za-z0-9._+~-]* (at most 128 characters; it "
            f"becomes part of an image name and KMODVER), got {_show(value)}"
        )
    return value


def _module_names(values: list[object], label: str) -> tuple[str, ...]:
    if not values:
        raise _Invalid(f"'{label}' must not be empty: name the modules in load order")
    if len(values) > MAX_MODULES:
        raise _Invalid(f"'{label}' lists {len(values)} modules; at most {MAX_MODULES}")
    seen: dict[str, str] = {}
    for value in values:
        if not isinstance(value, str):
            raise _Invalid(f"'{label}' entries must be strings, got {_show(value)}")
        if not MODULE_NAME.fullmatch(value):
            raise _Invalid(
                f"'{label}' entry {_show(value)} is not a module name: use [A-Za-z0-9_-], at "
                "most 55 characters, not starting with '-'"
            )
        kernel_name = value.replace("-", "_")
        if kernel_name in seen:
            first = seen[kernel_name]
            same = (
                "" if first == value else f" (same as {first!r}: the kernel treats - and _ alike)"
            )
            raise _Invalid(f"duplicate module {value!r} in '{label}'{same}")
        seen[kernel_name] = value
    return tuple(seen.values())


def _context(value: object, label: str) -> str:
    if not isinstance(value, str) or not value:
        raise _Invalid(f"'{label}' must be a non-empty string, got {_show(value)}")
    if _has_control(value):
        raise _Invalid(f"'{label}' must not contain control characters, got {_show(value)}")
    scheme = value.split("://", 1)[0] if "://" in value else ""
    if scheme in CONTEXT_SCHEMES:
        try:
            parts = urlsplit(value)
            host = parts.hostname
        except ValueError:
            parts, host = None, None
        if parts is None or not host or any(c.isspace() for c in value):
            raise _Invalid(f"'{label}' is not a valid {scheme}:// URL, got {_show(value)}")
        if parts.password is not None:
            raise _Invalid(
                f"'{label}' must not carry a password in the URL (it would be logged and kept "
                f"in image labels); got {scheme}://{parts.username}:…@{host}"
            )
        if scheme != "https" and not parts.path.strip("/"):
            raise _Invalid(f"'{label}' names no repository, got {_show(value)}")
        return value
    if scheme:
        raise _Invalid(
            f"'{label}': {scheme}:// is not a build context kvcd can use; use "
            f"{', '.join(s + '://' for s in CONTEXT_SCHEMES)} or an absolute path, "
            f"got {_show(value)}"
        )
    if not value.startswith("/"):
        raise _Invalid(
            f"'{label}' must be an absolute path (a directory or a tarball) or a URL "
            f"(https:// git or tarball, git://, git+https://), got {_show(value)}"
        )
    if ".." in value.split("/"):
        raise _Invalid(f"'{label}' must not contain '..', got {_show(value)}")
    return value


def _containerfile(value: object, label: str) -> str:
    if not isinstance(value, str) or not value:
        raise _Invalid(f"'{label}' must be a non-empty string, got {_show(value)}")
    if value.startswith("/") or ".." in value.split("/") or _has_control(value):
        raise _Invalid(
            f"'{label}' must be a relative path inside the build context, without '..', "
            f"got {_show(value)}"
        )
    return value


def _placeholders(value: str, label: str, allowed: tuple[str, ...]) -> str:
    """Check the {placeholders} of value; return it with them replaced by a plain word."""
    for found in _PLACEHOLDER.finditer(value):
        if found.group(1) not in allowed:
            only = " and ".join("{" + a + "}" for a in allowed)
            raise _Invalid(
                f"unknown placeholder {found.group(0)!r} in '{label}' (only {only}), "
                f"got {_show(value)}"
            )
    plain = _PLACEHOLDER.sub("x", value)
    if "{" in plain or "}" in plain:
        raise _Invalid(f"'{label}' has an unmatched '{{' or '}}', got {_show(value)}")
    return plain


def _image(value: object, label: str) -> str:
    if not isinstance(value, str) or not value:
        raise _Invalid(f"'{label}' must be a non-empty string, got {_show(value)}")
    plain = _placeholders(value, label, ("kernel", "version"))
    if not _IMAGE_REF.fullmatch(plain):
        raise _Invalid(f"'{label}' is not an image reference, got {_show(value)}")
    return value


def _modules_path(value: object, label: str) -> str:
    if not isinstance(value, str) or not value.startswith("/"):
        raise _Invalid(f"'{label}' must be an absolute path, got {_show(value)}")
    _placeholders(value, label, ("kernel",))
    if ".." in value.split("/") or _has_control(value):
        raise _Invalid(f"'{label}' must not contain '..' or control characters")
    return value


# Upper bounds on what an instance may ask for: far above any real driver, low enough that a
# typo or a generated file cannot make kvcd keep thousands of images or hand the kernel a
# megabyte of parameters (README: "Limits").
MAX_MODULES = 1000
MAX_KEEP_IMAGES = 100
MAX_PARAM_VALUE = 4096  # characters: one sysfs page, what the kernel shows of a parameter


def _param_value(value: object, label: str) -> str:
    if isinstance(value, bool):  # before int: bool is an int in Python
        return "1" if value else "0"  # the kernel accepts 1/0 (and y/n) for bool params
    if isinstance(value, int):
        return str(value)
    if not isinstance(value, str):
        raise _Invalid(f"'{label}' must be a string, integer or boolean, got {_show(value)}")
    if "\n" in value or "\0" in value:
        raise _Invalid(f"'{label}' must not contain a newline or NUL, got {_show(value)}")
    if len(value) > MAX_PARAM_VALUE:
        raise _Invalid(
            f"'{label}' is {len(value)} characters long; a parameter value may have at most "
            f"{MAX_PARAM_VALUE}"
        )
    if any(c.isspace() for c in value) or '"' in value or _has_control(value):
        raise _Invalid(
            f"'{label}' must not contain whitespace, quotes or control characters (modprobe "
            f"gets each parameter as one name=value argument), got {_show(value)}"
        )
    return value


EXTERNAL_UNLOAD_POLICIES = ("degrade", "reload")
DRIFT_INTERVAL_MIN = 10  # a re-check is a full re-hash: never let it become a busy poll
DRIFT_INTERVAL_MAX = 86400


def _external_unload(value: object, label: str) -> str:
    if value not in EXTERNAL_UNLOAD_POLICIES:
        raise _Invalid(
            f"'{label}' must be one of {', '.join(map(json.dumps, EXTERNAL_UNLOAD_POLICIES))}, "
            f"got {_show(value)}"
        )
    return str(value)


def _drift_interval(value: object, label: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _Invalid(f"'{label}' must be an integer number of seconds, got {_show(value)}")
    if not DRIFT_INTERVAL_MIN <= value <= DRIFT_INTERVAL_MAX:
        raise _Invalid(
            f"'{label}' must be between {DRIFT_INTERVAL_MIN} and {DRIFT_INTERVAL_MAX} seconds, "
            f"got {value}"
        )
    return value


def _podman_socket(value: object, label: str) -> str:
    if not isinstance(value, str) or _has_control(value) or " " in value:
        raise _Invalid(f"'{label}' must be a URL string, got {_show(value)}")
    try:
        url = urlsplit(value)
        host = url.hostname
    except ValueError:
        raise _Invalid(f"'{label}' is not a valid URL, got {_show(value)}") from None
    if url.scheme == "unix" and not url.netloc and url.path.startswith("/"):
        return value
    if url.scheme in ("tcp", "ssh") and host:
        return value
    raise _Invalid(
        f"'{label}' must be unix:///absolute/path, tcp://host:port or "
        f"ssh://user@host/path, got {_show(value)}"
    )


def _dns_subdomain(value: object, label: str) -> str:
    if (
        isinstance(value, str)
        and 0 < len(value) <= 253
        and all(_DNS_LABEL.fullmatch(part) for part in value.split("."))
    ):
        return value
    raise _Invalid(
        f"'{label}' must be a DNS subdomain (lower-case labels [a-z0-9-] of at most 63 "
        f"characters joined by '.', at most 253 in all), got {_show(value)}"
    )


def _choice(value: object, label: str, allowed: tuple[str, ...]) -> str:
    if isinstance(value, str) and value in allowed:
        return value
    raise _Invalid(f"'{label}' must be one of {', '.join(map(repr, allowed))}, got {_show(value)}")


def _node_name(value: object, label: str) -> str:
    if isinstance(value, str) and (value == "" or _dns_subdomain(value, label)):
        return value
    raise _Invalid(f"'{label}' must be a node name (a DNS subdomain), got {_show(value)}")


def _abs_path(value: object, label: str) -> str:
    if isinstance(value, str) and (
        value == "" or (value.startswith("/") and not _has_control(value))
    ):
        return value
    raise _Invalid(f"'{label}' must be an absolute path, got {_show(value)}")


def _seconds(value: object, label: str) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= 86400:
        return float(value)
    raise _Invalid(f"'{label}' must be a number of seconds in (0, 86400], got {_show(value)}")


def qualified_name(value: object, label: str) -> str:
    """A Kubernetes label key: [DNS-subdomain '/'] name, the name at most 63 characters."""
    if isinstance(value, str):
        prefix, _, name = value.rpartition("/")
        if _QNAME.fullmatch(name) and (not prefix or _is_dns_subdomain(prefix)):
            return value
    raise _Invalid(
        f"'{label}' must be a label key ([prefix/]name, the name at most 63 characters of "
        f"[A-Za-z0-9-_.], alphanumeric at both ends), got {_show(value)}"
    )


def _is_dns_subdomain(value: str) -> bool:
    return 0 < len(value) <= 253 and all(_DNS_LABEL.fullmatch(p) for p in value.split("."))


def _unknown_keys(
    table: Mapping[str, Any],
    allowed: tuple[str, ...],
    where: str,
    fail: Callable[..., ConfigError],
    prefix: tuple[str, ...] = (),
) -> None:
    for key in table:
        if key not in allowed:
            close = difflib.get_close_matches(key, allowed, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise fail(f"unknown key {key!r} in [{where}]{hint}", *prefix, key)


# --- native TOML ---------------------------------------------------------------------------


class _TomlInstance:
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
        except _Invalid as exc:
            raise self.fail(str(exc), *key) from None

    def build(self) -> InstanceConfig:
        data = self.data
        _unknown_keys(data, _TOP_KEYS, "top level", self.fail)
        if "version" not in data:
            raise self.fail("missing required key 'version'")
        version = self.check(_version, data["version"], "version")
        if "modules" not in data:
            raise self.fail("missing required key 'modules' (the modules, in load order)")
        modules = data["modules"]
        if not isinstance(modules, list):
            raise self.fail(
                f"'modules' must be an array of module names, got {_show(modules)}", "modules"
            )
        names = self.check(_module_names, modules, "modules")
        values: dict[str, Any] = {}
        if "image" in data:
            values["image"] = self.check(_image, data["image"], "image")
        if "modules_path" in data:
            values["modules_path"] = self.check(_modules_path, data["modules_path"], "modules_path")
        if "unload_on_stop" in data:
            value = data["unload_on_stop"]
            if not isinstance(value, bool):
                raise self.fail(
                    f"'unload_on_stop' must be true or false, got {_show(value)}", "unload_on_stop"
                )
            values["unload_on_stop"] = value
        if "keep_images" in data:
            value = data["keep_images"]
            in_range = isinstance(value, int) and 1 <= value <= MAX_KEEP_IMAGES
            if isinstance(value, bool) or not in_range:
                raise self.fail(
                    f"'keep_images' must be an integer from 1 to {MAX_KEEP_IMAGES}, got "
                    f"{_show(value)}",
                    "keep_images",
                )
            values["keep_images"] = value
        if "kabi" in data:
            value = data["kabi"]
            if value not in KABI_MODES:
                raise self.fail(
                    f"'kabi' must be one of {', '.join(map(repr, KABI_MODES))}, got {_show(value)}",
                    "kabi",
                )
            values["kabi"] = value
        if "watch_config" in data:
            value = data["watch_config"]
            if not isinstance(value, bool):
                raise self.fail(
                    f"'watch_config' must be true or false, got {_show(value)}", "watch_config"
                )
            values["watch_config"] = value
        if "on_external_unload" in data:
            values["on_external_unload"] = self.check(
                _external_unload, data["on_external_unload"], "on_external_unload"
            )
        if "wrapper_args" in data:
            values["wrapper_args"] = self.wrapper_args(data["wrapper_args"])
        if "build" in data:
            values["build"] = self.build_source(data["build"])
        if "build" not in values and "image" not in values and "variants" not in data:
            raise self.fail(
                "needs a [build] table or an 'image' (or both): without either there is no "
                "way to get the driver image"
            )
        values.update(self.node_keys(data))
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

    def wrapper_args(self, value: object) -> tuple[str, ...]:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self.fail(
                f"'wrapper_args' must be an array of strings, got {_show(value)}", "wrapper_args"
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
                    f"'ordered_upgrade' must be true or false, got {_show(value)}",
                    "ordered_upgrade",
                )
            values["ordered_upgrade"] = value
        if "upgrade_label" in data:
            values["upgrade_label"] = self.check(
                qualified_name, data["upgrade_label"], "upgrade_label"
            )
            kmm = kmm_label_problem(values["upgrade_label"])
            if kmm is not None:
                raise self.fail(f"'upgrade_label' {kmm}", "upgrade_label")
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
                lambda v, k: _choice(v, k, DRAIN_MODES), data["drain"], "drain"
            )
        return values

    def build_source(self, table: object) -> BuildSource:
        if not isinstance(table, dict):
            raise self.fail(f"'build' must be a table, got {_show(table)}", "build")
        _unknown_keys(table, _BUILD_KEYS, "build", self.fail, ("build",))
        if "context" not in table:
            raise self.fail("missing required key 'context' in [build]", "build")
        context = self.check(_context, table["context"], "build", "context")
        containerfile = "Containerfile"
        if "containerfile" in table:
            containerfile = self.check(
                _containerfile, table["containerfile"], "build", "containerfile"
            )
        args: list[tuple[str, str]] = []
        raw = table.get("args", {})
        if not isinstance(raw, dict):
            raise self.fail(f"'build.args' must be a table, got {_show(raw)}", "build", "args")
        for key, value in raw.items():
            where = ("build", "args", key)
            if key in RESERVED_BUILD_ARGS:
                raise self.fail(
                    f"'build.args.{key}' is reserved: kvcd passes KVER (the kernel) and "
                    "KMODVER (the version) itself",
                    *where,
                )
            if not BUILD_ARG_NAME.fullmatch(key):
                raise self.fail(
                    f"bad build argument name {key!r} in [build.args]: use [A-Za-z_][A-Za-z0-9_]*",
                    *where,
                )
            if not isinstance(value, str):
                raise self.fail(f"'build.args.{key}' must be a string, got {_show(value)}", *where)
            if "\0" in value or "\n" in value:
                raise self.fail(f"'build.args.{key}' must not contain a newline or NUL", *where)
            args.append((key, value))
        return BuildSource(context=context, containerfile=containerfile, args=tuple(args))

    def params(
        self, table: object, modules: tuple[str, ...]
    ) -> dict[str, tuple[tuple[str, str], ...]]:
        if not isinstance(table, dict):
            raise self.fail(f"'params' must be a table, got {_show(table)}", "params")
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
                    f"'params.{module}' must be a table of parameters, got {_show(values)}",
                    *where,
                )
            pairs: list[tuple[str, str]] = []
            for key, value in values.items():
                if not PARAM_NAME.fullmatch(key):
                    raise self.fail(
                        f"bad parameter name {key!r} in [params.{module}]: use [A-Za-z0-9_]",
                        *where,
                        key,
                    )
                pairs.append((key, self.check(_param_value, value, "params", module, key)))
            out[kernel_name] = tuple(pairs)
        return out


# --- KVC compatibility ---------------------------------------------------------------------


def _kvc_instance(name: str, path: Path, text: str) -> InstanceConfig:
    # The lexer's tables cost ~25 ms to import; only KVC instances need them.
    from kvcd.config.kvcconf import parse_assignments

    assignments = parse_assignments(
        path, text, known={_KVC_SET_BY_KVCD: name}, runtime_only=_KVC_RUNTIME_ONLY
    )
    last: dict[str, Assignment] = {}
    for a in assignments:
        if a.name == _KVC_SET_BY_KVCD:
            raise ConfigError(
                path, f"'{a.name}' is set by kvcd from the instance name; do not assign it", a.line
            )
        last[a.name] = a

    def get(variable: str, required: bool = True) -> Assignment | None:
        found = last.get(variable)
        if found is None and required:
            raise ConfigError(path, f"missing required variable {variable!r}")
        if found is not None and found.words is not None and variable != KVC_NAMES:
            raise ConfigError(path, f"'{variable}' must be a string, not an array", found.line)
        return found

    def check(rule: Any, value: object, a: Assignment) -> Any:
        try:
            return rule(value, a.name)
        except _Invalid as exc:
            raise ConfigError(path, str(exc), a.line) from None

    version_a = get(KVC_VERSION)
    names_a = get(KVC_NAMES)
    context_a = get(KVC_CONTEXT)
    assert version_a is not None and names_a is not None and context_a is not None
    version = check(_version, version_a.value, version_a)
    words = names_a.words if names_a.words is not None else tuple(names_a.value.split())
    names = check(_module_names, list(words), names_a)
    context = check(_context, context_a.value, context_a)
    file_a = get(KVC_FILE, required=False)
    containerfile = (
        KVC_DEFAULT_FILE if file_a is None else check(_containerfile, file_a.value, file_a)
    )
    mapped = {KVC_VERSION, KVC_NAMES, KVC_CONTEXT, KVC_FILE}
    env: list[tuple[str, str]] = []
    for variable, a in last.items():
        if variable in mapped:
            continue
        if a.words is not None:
            raise ConfigError(
                path,
                f"'{variable}' is an array: only {KVC_NAMES} may be one (the hooks get strings)",
                a.line,
            )
        if variable in _ENV_REFUSED or variable.startswith(_ENV_REFUSED_PREFIXES):
            raise ConfigError(
                path,
                f"'{variable}' would change how the hooks run, not what they are told; "
                "kvcd refuses it",
                a.line,
            )
        if "\0" in a.value:
            raise ConfigError(path, f"'{variable}' must not contain NUL", a.line)
        env.append((variable, a.value))
    return InstanceConfig(
        name=name,
        source=path,
        version=version,
        modules=tuple(ModuleSpec(n) for n in names),
        build=BuildSource(context=context, containerfile=containerfile),
        kvc_env=tuple(env),
        format="kvc",
    )
