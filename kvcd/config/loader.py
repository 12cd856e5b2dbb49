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
import logging
import os
import re
import stat
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvcd.config import rules
from kvcd.config.model import (
    BuildSource,
    ConfigError,
    ConfigLocations,
    InstanceConfig,
    ModuleSpec,
    Settings,
)
from kvcd.config.native import TomlInstance
from kvcd.config.tomlsrc import KeyLines, decode
from kvcd.core.text import shown

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


# --- public API ----------------------------------------------------------------------------


def load_instance(root: ConfigLocations, name: str) -> InstanceConfig:
    """Load instance ``name``: native admin, native vendor, then KVC compatibility.

    With `depends_on`, the instances it depends on are loaded too: a cycle or a missing one
    is a ConfigError naming the chain."""
    config = _load_instance(root, name)
    if config.depends_on:
        from kvcd.config import capsconf  # only then: `kvcd status` parses every config

        capsconf.check_dependencies(root, config, _load_instance)
    return config


def _load_instance(root: ConfigLocations, name: str) -> InstanceConfig:
    admin_dir, vendor_dir = root.instance_dirs()
    rules.check_instance_name(name, admin_dir)
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
        if root.kvc_conf(n).parent == kvc_dir and n != rules.KVC_GLOBAL
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
    kvc_global = root.kvc_conf(rules.KVC_GLOBAL)
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


# KVC_CONTAINER_RUNTIME other than podman, in KVC's node-wide conf or an instance's.
_RUNTIME_REFUSED = (
    "KVC_CONTAINER_RUNTIME={!r}: kvcd builds and runs driver containers with podman only; "
    "set KVC_CONTAINER_RUNTIME=podman"
)


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
            raise ConfigError(path, _RUNTIME_REFUSED.format(a.value), a.line)
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
    rules.check_instance_name(name, path)
    return TomlInstance(name, path, text).build()


def parse_kvc_conf(name: str, path: Path | str, text: str) -> InstanceConfig:
    """Validate the text of a KVC conf (kvc_lib is left for load_instance). Pure."""
    path = Path(path)
    rules.check_instance_name(name, path)
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
    rules.unknown_keys(data, rules.SETTINGS_KEYS, "top level", fail)
    values: dict[str, Any] = {}
    table: dict[str, Callable[[object, str], Any]] = {
        "podman_socket": rules.valid_podman_socket,
        "annotation_prefix": rules.valid_dns_subdomain,
        "node_backend": lambda v, k: rules.valid_choice(v, k, rules.NODE_BACKENDS),
        "node_name": rules.valid_node_name,
        "kubeconfig": rules.valid_abs_path,
        "drain": lambda v, k: rules.valid_choice(v, k, rules.DRAIN_MODES),
        "drain_timeout": rules.valid_seconds,
        "drift_interval": rules.valid_drift_interval,
        "module_tree": lambda v, k: rules.valid_choice(v, k, rules.MODULE_TREES),
        "metrics_dir": rules.valid_directory,
        "sign_key": partial(rules.valid_abs_path, secret=True),
        "sign_cert": rules.valid_abs_path,
        "sign_hash": lambda v, k: rules.valid_choice(v, k, rules.SIGN_HASHES),
        "inhibit_reboot": rules.valid_bool,
        "pull_secret": rules.valid_abs_path,
        "hook_timeout": rules.valid_seconds,
        "image_timeout": rules.valid_seconds,
    }
    for key, rule in table.items():
        if key in data:
            try:
                values[key] = rule(data[key], key)
            except rules.Invalid as exc:
                raise fail(str(exc), key) from None
    if "node_capabilities" in data:
        from kvcd.config import capsconf

        values["node_capabilities"] = capsconf.capability_set(
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
        data = handle.read(rules.MAX_CONFIG_BYTES + 1)
    if len(data) > rules.MAX_CONFIG_BYTES:
        raise ConfigError(path, f"refusing: larger than {rules.MAX_CONFIG_BYTES} bytes")
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
        raise ConfigError(
            path, f"refusing: writable by group/others (mode {mode:04o}); {rules.UNSAFE}"
        )
    euid = os.geteuid()
    if st.st_uid not in (0, euid):
        owners = "root" if euid == 0 else f"root or uid {euid} (kvcd's own user)"
        raise ConfigError(
            path, f"refusing: owned by uid {st.st_uid}, not by {owners}; {rules.UNSAFE}"
        )


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
                f"sticky bit (mode {stat.S_IMODE(mode):04o}); {rules.UNSAFE}",
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
        if rules.INSTANCE_NAME.fullmatch(entry.stem):
            names.append(entry.stem)
        else:
            _ignored(entry)
    return names


_said_ignored: set[Path] = set()


def _ignored(entry: Path) -> None:
    """Say once per process (a verb may list the instances more than once) that a file is not
    an instance; its name escaped, so that it cannot forge a log line."""
    if entry in _said_ignored:
        return
    _said_ignored.add(entry)
    log.warning("%s: ignored, %r is not a valid instance name", shown(str(entry)), entry.stem)


# --- KVC compatibility ---------------------------------------------------------------------


def _kvc_instance(name: str, path: Path, text: str) -> InstanceConfig:
    # The lexer's tables cost ~25 ms to import; only KVC instances need them.
    from kvcd.config.kvcconf import parse_assignments

    assignments = parse_assignments(
        path, text, known={rules.KVC_SET_BY_KVCD: name}, runtime_only=rules.KVC_RUNTIME_ONLY
    )
    last: dict[str, Assignment] = {}
    for a in assignments:
        if a.name == rules.KVC_SET_BY_KVCD:
            raise ConfigError(
                path, f"'{a.name}' is set by kvcd from the instance name; do not assign it", a.line
            )
        last[a.name] = a

    def get(variable: str, required: bool = True) -> Assignment | None:
        found = last.get(variable)
        if found is None and required:
            raise ConfigError(path, f"missing required variable {variable!r}")
        if found is not None and found.words is not None and variable != rules.KVC_NAMES:
            raise ConfigError(path, f"'{variable}' must be a string, not an array", found.line)
        return found

    def check(rule: Any, value: object, a: Assignment) -> Any:
        try:
            return rule(value, a.name)
        except rules.Invalid as exc:
            raise ConfigError(path, str(exc), a.line) from None

    version_a = get(rules.KVC_VERSION)
    names_a = get(rules.KVC_NAMES)
    context_a = get(rules.KVC_CONTEXT)
    assert version_a is not None and names_a is not None and context_a is not None
    version = check(rules.valid_version, version_a.value, version_a)
    words = names_a.words if names_a.words is not None else tuple(names_a.value.split())
    names = check(rules.valid_module_names, list(words), names_a)
    context = check(rules.valid_context, context_a.value, context_a)
    file_a = get(rules.KVC_FILE, required=False)
    containerfile = (
        rules.KVC_DEFAULT_FILE
        if file_a is None
        else check(rules.valid_containerfile, file_a.value, file_a)
    )
    mapped = {rules.KVC_VERSION, rules.KVC_NAMES, rules.KVC_CONTEXT, rules.KVC_FILE}
    env: list[tuple[str, str]] = []
    for variable, a in last.items():
        if variable in mapped:
            continue
        if a.words is not None:
            raise ConfigError(
                path,
                f"'{variable}' is an array: only {rules.KVC_NAMES} may be one "
                "(the hooks get strings)",
                a.line,
            )
        if variable in rules.ENV_REFUSED or variable.startswith(rules.ENV_REFUSED_PREFIXES):
            raise ConfigError(
                path,
                f"'{variable}' would change how the hooks run, not what they are told; "
                "kvcd refuses it",
                a.line,
            )
        if a.exported and variable.startswith(rules.EXPORT_REFUSED_PREFIXES):
            raise ConfigError(
                path,
                f"'export {variable}' would hand the programs the hooks run (git, podman …) "
                "what to run or which configuration to read; kvcd refuses it (unexported, it "
                "is the library's variable only)",
                a.line,
            )
        if "\0" in a.value:
            raise ConfigError(path, f"'{variable}' must not contain NUL", a.line)
        if variable == "KVC_CONTAINER_RUNTIME" and a.value != "podman":  # hooks get podman
            raise ConfigError(path, _RUNTIME_REFUSED.format(a.value), a.line)
        env.append((variable, a.value))
    return InstanceConfig(
        name=name,
        source=path,
        version=version,
        modules=tuple(ModuleSpec(n) for n in names),
        build=BuildSource(context=context, containerfile=containerfile),
        kvc_env=tuple(env),
        kvc_exported=tuple(sorted(n for n, a in last.items() if a.exported)),
        format="kvc",
    )
