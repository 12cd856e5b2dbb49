"""The value rules both config formats share: names, versions, image references, build
contexts, paths, choices, and the key sets each table allows. Each rule takes a value and its
key's label and returns the checked value or raises Invalid (the caller adds file and line)."""

from __future__ import annotations

import json
import logging
import posixpath
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from kvcd.config.model import ConfigError
from kvcd.core import names

log = logging.getLogger(__name__)

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
IMAGE_REF = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/:@-]*")
PLACEHOLDER = re.compile(r"\{([^{}]*)\}")
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")

# The keys kvcd/config/capsconf.py reads (capabilities, variants, device gating, links,
# depends_on): a config without any of them never imports it.
_CAPSCONF_ORDER = (
    "capabilities",
    "variants",
    "requires_device",
    "unload_on_device_removal",
    "expect_links",
    "expect_links_timeout",
    "depends_on",
)
CAPSCONF_KEYS = frozenset(_CAPSCONF_ORDER)
TOP_KEYS = (
    "version",
    "modules",
    "image",
    "image_archive",
    "auth_file",
    "tls_verify",
    "modules_path",
    "firmware_path",
    "unload_policy",
    "unload_on_stop",
    "in_tree_modules_to_remove",
    "keep_images",
    "wrapper_args",
    "build",
    "params",
    "ordered_upgrade",
    "upgrade_label",
    "drain",
    "watch_config",
    "on_external_unload",
    *_CAPSCONF_ORDER,
    "kabi",
)
KABI_MODES = ("weak-updates-first", "rebuild")
BUILD_KEYS = ("context", "containerfile", "args")
SETTINGS_KEYS = (
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
    "metrics_dir",
    "sign_key",
    "sign_cert",
    "sign_hash",
    "inhibit_reboot",
    "pull_secret",
    "hook_timeout",
    "image_timeout",
)
NODE_BACKENDS = ("file", "kubernetes")
MODULE_TREES = ("kvcd", "system")
DRAIN_MODES = ("none", "cluster")
SIGN_HASHES = ("sha256", "sha384", "sha512")
# A Kubernetes label/annotation name part: at most 63 characters, alphanumeric at both ends.
QNAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")

# KVC: the variables kvcd maps onto typed fields; everything else becomes kvc_env.
KVC_VERSION = "KMOD_SOFTWARE_VERSION"
KVC_NAMES = "KMOD_NAMES"
KVC_CONTEXT = "KMOD_CONTAINER_BUILD_CONTEXT"
KVC_FILE = "KMOD_CONTAINER_BUILD_FILE"
KVC_DEFAULT_FILE = "Dockerfile"  # KVC's own default
KVC_RUNTIME_ONLY = {
    "KVC_KVER": "it is the kernel version, known only at run time (kvcd passes KVER to the "
    "build and KVC_KVER to the hooks itself)",
}
KVC_SET_BY_KVCD = "KVC_SOFTWARE_NAME"  # the instance name; may be expanded, not assigned
# Environment names that would change how the hook shell runs, not what it is told.
ENV_REFUSED = frozenset(
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
ENV_REFUSED_PREFIXES = ("LD_", "BASH_FUNC_", "PYTHON")
# What an exported KVC variable may not be: the environment of git, podman, perl … that says
# what to run or which configuration to read (GIT_CONFIG_*, GIT_SSH_COMMAND, CONTAINERS_CONF).
EXPORT_REFUSED_PREFIXES: tuple[str, ...] = ("GIT_", "CONTAINERS_", "REGISTRY_AUTH_FILE", "XDG_")
EXPORT_REFUSED_PREFIXES += ("DOCKER_", "PERL", "RUBY", "NODE_", "SSH_", "GNUPG", "OPENSSL_")
EXPORT_REFUSED_PREFIXES += ("SSL_", "HOME")

MAX_CONFIG_BYTES = 1 << 20
UNSAFE = "it decides what runs in the kernel"


class Invalid(Exception):
    """A value is wrong; the caller knows the file and line and turns it into ConfigError."""


# --- shared value rules (both formats) -----------------------------------------------------


def check_instance_name(name: str, path: Path) -> None:
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


def show(value: object) -> str:
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


def has_control(text: str) -> bool:
    return any(ord(c) < 32 or ord(c) == 127 for c in text)


def valid_version(value: object, label: str) -> str:
    if not isinstance(value, str) or not value:
        raise Invalid(f"'{label}' must be a non-empty string, got {show(value)}")
    if not VERSION.fullmatch(value):
        raise Invalid(
            f"'{label}' must match [A-Za-z0-9][A-Za-z0-9._+~-]* (at most 128 characters; it "
            f"becomes part of an image name and KMODVER), got {show(value)}"
        )
    return value


def valid_module_names(values: list[object], label: str) -> tuple[str, ...]:
    if not values:
        raise Invalid(f"'{label}' must not be empty: name the modules in load order")
    if len(values) > MAX_MODULES:
        raise Invalid(f"'{label}' lists {len(values)} modules; at most {MAX_MODULES}")
    seen: dict[str, str] = {}
    for value in values:
        if not isinstance(value, str):
            raise Invalid(f"'{label}' entries must be strings, got {show(value)}")
        if not MODULE_NAME.fullmatch(value):
            raise Invalid(
                f"'{label}' entry {show(value)} is not a module name: use [A-Za-z0-9_-], at "
                "most 55 characters, not starting with '-'"
            )
        kernel_name = value.replace("-", "_")
        if kernel_name in seen:
            first = seen[kernel_name]
            same = (
                "" if first == value else f" (same as {first!r}: the kernel treats - and _ alike)"
            )
            raise Invalid(f"duplicate module {value!r} in '{label}'{same}")
        seen[kernel_name] = value
    return tuple(seen.values())


def valid_context(value: object, label: str) -> str:
    if not isinstance(value, str) or not value:
        raise Invalid(f"'{label}' must be a non-empty string, got {show(value)}")
    if has_control(value):
        raise Invalid(f"'{label}' must not contain control characters, got {show(value)}")
    scheme = value.split("://", 1)[0] if "://" in value else ""
    if scheme in CONTEXT_SCHEMES:
        try:
            parts = urlsplit(value)
            host = parts.hostname
        except ValueError:
            parts, host = None, None
        if parts is None or not host or any(c.isspace() for c in value):
            raise Invalid(f"'{label}' is not a valid {scheme}:// URL, got {show(value)}")
        if parts.password is not None:
            raise Invalid(
                f"'{label}' must not carry a password in the URL (it would be logged and kept "
                f"in image labels); got {scheme}://{parts.username}:…@{host}"
            )
        if scheme != "https" and not parts.path.strip("/"):
            raise Invalid(f"'{label}' names no repository, got {show(value)}")
        return value
    if scheme:
        raise Invalid(
            f"'{label}': {scheme}:// is not a build context kvcd can use; use "
            f"{', '.join(s + '://' for s in CONTEXT_SCHEMES)} or an absolute path, "
            f"got {show(value)}"
        )
    if not value.startswith("/"):
        raise Invalid(
            f"'{label}' must be an absolute path (a directory or a tarball) or a URL "
            f"(https:// git or tarball, git://, git+https://), got {show(value)}"
        )
    if ".." in value.split("/"):
        raise Invalid(f"'{label}' must not contain '..', got {show(value)}")
    return value


def valid_containerfile(value: object, label: str) -> str:
    if not isinstance(value, str) or not value:
        raise Invalid(f"'{label}' must be a non-empty string, got {show(value)}")
    if value.startswith("/") or ".." in value.split("/") or has_control(value):
        raise Invalid(
            f"'{label}' must be a relative path inside the build context, without '..', "
            f"got {show(value)}"
        )
    return value


def check_placeholders(value: str, label: str, allowed: tuple[str, ...]) -> str:
    """Check the {placeholders} of value; return it with them replaced by a plain word."""
    for found in PLACEHOLDER.finditer(value):
        if found.group(1) not in allowed:
            only = " and ".join("{" + a + "}" for a in allowed)
            raise Invalid(
                f"unknown placeholder {found.group(0)!r} in '{label}' (only {only}), "
                f"got {show(value)}"
            )
    plain = PLACEHOLDER.sub("x", value)
    if "{" in plain or "}" in plain:
        raise Invalid(f"'{label}' has an unmatched '{{' or '}}', got {show(value)}")
    return plain


def valid_image(value: object, label: str) -> str:
    if not isinstance(value, str) or not value:
        raise Invalid(f"'{label}' must be a non-empty string, got {show(value)}")
    plain = check_placeholders(value, label, ("kernel", "version"))
    if not IMAGE_REF.fullmatch(plain):
        raise Invalid(f"'{label}' is not an image reference, got {show(value)}")
    return value


def valid_modules_path(value: object, label: str) -> str:
    if not isinstance(value, str) or not value.startswith("/"):
        raise Invalid(f"'{label}' must be an absolute path, got {show(value)}")
    check_placeholders(value, label, ("kernel",))
    if ".." in value.split("/") or has_control(value):
        raise Invalid(f"'{label}' must not contain '..' or control characters")
    return value


def valid_archive(value: object, label: str) -> str:
    """An image archive on the node: an absolute, normalized file path; {kernel} and {version}
    may name the archive of each kernel and version."""
    if not isinstance(value, str) or not value:
        raise Invalid(f"'{label}' must be a non-empty string, got {show(value)}")
    plain = check_placeholders(value, label, ("kernel", "version"))
    if not plain.startswith("/") or plain.endswith("/") or has_control(value):
        raise Invalid(f"'{label}' must be an absolute file path, got {show(value)}")
    if posixpath.normpath(plain) != plain:
        raise Invalid(f"'{label}' must be a normalized path (no '.' or '..'), got {show(value)}")
    return value


def valid_firmware_path(value: object, label: str) -> str:
    """A directory of the image holding firmware files only: not its root."""
    path = valid_modules_path(value, label)
    if not path.strip("/"):
        raise Invalid(f"'{label}' must name the image's firmware directory, not its root")
    return path


# Upper bounds on what an instance may ask for: far above any real driver, low enough that a
# typo or a generated file cannot make kvcd keep thousands of images or hand the kernel a
# megabyte of parameters (README: "Limits").
MAX_MODULES = 1000
MAX_KEEP_IMAGES = 100
MAX_PARAM_VALUE = 4096  # characters: one sysfs page, what the kernel shows of a parameter
# A KVC conf value after $NAME expansion, and all expansions of one conf together: a few
# lines of A="$A$A" would otherwise double a value into gigabytes (kvcd/config/kvcconf.py).
MAX_KVC_VALUE = 1 << 16  # characters
MAX_KVC_EXPANDED = MAX_CONFIG_BYTES  # characters
# A conf's variables reach its library as environment strings (and, in daemon mode, as
# systemd-run --setenv= arguments): the kernel takes at most 128 KiB for one such string
# (MAX_ARG_STRLEN) and ARG_MAX (2 MiB with the default stack) for all of them with kvcd's own.
MAX_KVC_VARIABLE = 128000  # bytes of NAME=VALUE in UTF-8: room left for "--setenv="
MAX_KVC_ENVIRONMENT = 1 << 18  # bytes of one conf's NAME=VALUE strings, each with its NUL


def valid_param_value(value: object, label: str) -> str:
    if isinstance(value, bool):  # before int: bool is an int in Python
        return "1" if value else "0"  # the kernel accepts 1/0 (and y/n) for bool params
    if isinstance(value, int):
        return str(value)
    if not isinstance(value, str):
        raise Invalid(f"'{label}' must be a string, integer or boolean, got {show(value)}")
    if "\n" in value or "\0" in value:
        raise Invalid(f"'{label}' must not contain a newline or NUL, got {show(value)}")
    if len(value) > MAX_PARAM_VALUE:
        raise Invalid(
            f"'{label}' is {len(value)} characters long; a parameter value may have at most "
            f"{MAX_PARAM_VALUE}"
        )
    if any(c.isspace() for c in value) or '"' in value or has_control(value):
        raise Invalid(
            f"'{label}' must not contain whitespace, double quotes or control characters "
            f"(modprobe gets each parameter as one name=value argument), got {show(value)}"
        )
    return value


EXTERNAL_UNLOAD_POLICIES = ("degrade", "reload")
DRIFT_INTERVAL_MIN = 10  # a re-check is a full re-hash: never let it become a busy poll
DRIFT_INTERVAL_MAX = 86400


def valid_external_unload(value: object, label: str) -> str:
    if value not in EXTERNAL_UNLOAD_POLICIES:
        raise Invalid(
            f"'{label}' must be one of {', '.join(map(json.dumps, EXTERNAL_UNLOAD_POLICIES))}, "
            f"got {show(value)}"
        )
    return str(value)


def valid_drift_interval(value: object, label: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise Invalid(f"'{label}' must be an integer number of seconds, got {show(value)}")
    if not DRIFT_INTERVAL_MIN <= value <= DRIFT_INTERVAL_MAX:
        raise Invalid(
            f"'{label}' must be between {DRIFT_INTERVAL_MIN} and {DRIFT_INTERVAL_MAX} seconds, "
            f"got {value}"
        )
    return value


def valid_podman_socket(value: object, label: str) -> str:
    if not isinstance(value, str) or has_control(value) or " " in value:
        raise Invalid(f"'{label}' must be a URL string, got {show(value)}")
    try:
        url = urlsplit(value)
        host = url.hostname
    except ValueError:
        raise Invalid(f"'{label}' is not a valid URL, got {show(value)}") from None
    if (url.scheme == "unix" and not url.netloc and url.path.startswith("/")) or (
        url.scheme == "tcp" and host
    ):
        return value
    if url.scheme == "ssh":  # a host that is not the build host could hand kvcd its modules
        raise Invalid(
            f"'{label}' cannot be ssh:// (podman-py's ssh does not check the host's key, and "
            f"kvcd@.service hides ~/.ssh): forward it to a unix socket (ssh -L), got {show(value)}"
        )
    raise Invalid(f"'{label}' must be unix:///absolute/path or tcp://host:port, got {show(value)}")


def valid_dns_subdomain(value: object, label: str) -> str:
    if (
        isinstance(value, str)
        and 0 < len(value) <= 253
        and all(DNS_LABEL.fullmatch(part) for part in value.split("."))
    ):
        return value
    raise Invalid(
        f"'{label}' must be a DNS subdomain (lower-case labels [a-z0-9-] of at most 63 "
        f"characters joined by '.', at most 253 in all), got {show(value)}"
    )


def valid_choice(value: object, label: str, allowed: tuple[str, ...]) -> str:
    if isinstance(value, str) and value in allowed:
        return value
    raise Invalid(f"'{label}' must be one of {', '.join(map(repr, allowed))}, got {show(value)}")


# The environment variable that names the node where kvcd.toml's node_name does not
# (packaging/README.md: a kvcd@.service drop-in with the kubelet's name where it is not the
# host name). kvcd.node.backend reads it; kvcd.host.pylibs refuses one the API would not take.
NODE_NAME_ENV = "KVCD_NODE_NAME"


def valid_node_name(value: object, label: str) -> str:
    if isinstance(value, str) and (value == "" or valid_dns_subdomain(value, label)):
        return value
    raise Invalid(f"'{label}' must be a node name (a DNS subdomain), got {show(value)}")


def valid_abs_path(value: object, label: str, *, secret: bool = False) -> str:
    """An absolute path (or ""); a `secret` one (sign_key's) is not repeated in the error."""
    if isinstance(value, str) and (
        value == "" or (value.startswith("/") and not has_control(value))
    ):
        return value
    got = "" if secret and isinstance(value, str) else f", got {show(value)}"
    raise Invalid(f"'{label}' must be an absolute path{got}")


def valid_directory(value: object, label: str) -> str:
    """An absolute, normalized directory path ("" allowed: off)."""
    path = valid_abs_path(value, label)
    if path and (path != posixpath.normpath(path) or path == "/"):
        raise Invalid(f"'{label}' must be a normalized directory path, got {show(value)}")
    return path


def valid_bool(value: object, label: str) -> bool:
    if isinstance(value, bool):
        return value
    raise Invalid(f"'{label}' must be true or false, got {show(value)}")


def valid_seconds(value: object, label: str) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= 86400:
        return float(value)
    raise Invalid(f"'{label}' must be a number of seconds in (0, 86400], got {show(value)}")


def qualified_name(value: object, label: str) -> str:
    """A Kubernetes label key: [DNS-subdomain '/'] name, the name at most 63 characters."""
    if isinstance(value, str):
        prefix, _, name = value.rpartition("/")
        if QNAME.fullmatch(name) and (not prefix or is_dns_subdomain(prefix)):
            return value
    raise Invalid(
        f"'{label}' must be a label key ([prefix/]name, the name at most 63 characters of "
        f"[A-Za-z0-9-_.], alphanumeric at both ends), got {show(value)}"
    )


def is_dns_subdomain(value: str) -> bool:
    return 0 < len(value) <= 253 and all(DNS_LABEL.fullmatch(p) for p in value.split("."))


def unknown_keys(
    table: Mapping[str, Any],
    allowed: tuple[str, ...],
    where: str,
    fail: Callable[..., ConfigError],
    prefix: tuple[str, ...] = (),
) -> None:
    for key in table:
        if key not in allowed:
            import difflib  # only for a misspelt key

            close = difflib.get_close_matches(key, allowed, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise fail(f"unknown key {key!r} in [{where}]{hint}", *prefix, key)
