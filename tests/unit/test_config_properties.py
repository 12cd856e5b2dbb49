"""For any input, the config readers give a valid value or kvcd's own ConfigError (which names
the file and, where there is one, the line) — never another exception. Hypothesis drives the
instance TOML, the node-wide kvcd.toml, a KVC conf and KVC's global conf, both as raw text and
as a good file with one key given an arbitrary value (where a crash would hide: the
per-key checks)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcd.config import loader, rules
from kvcd.config.model import ConfigError, InstanceConfig, Settings

PATH = Path("/etc/kvcd/instances/nic.toml")
FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

TOP = ['version = "1.0"', 'modules = ["kvcd_base", "kvcd_user"]']

# TOML values of every type, odd shapes included (dates, nesting, huge numbers, control bytes).
_SCALARS = st.sampled_from(
    [
        '"x"',
        '""',
        '"../../etc"',
        '"a\\u0000b"',
        '"{kernel}"',
        '"{nope}"',
        '"' + "a" * 5000 + '"',
        "0",
        "-1",
        "1",
        "9" * 40,
        "1e309",
        "nan",
        "inf",
        "true",
        "1979-05-27T07:32:00Z",
        "07:32:00",
        "[]",
        "{}",
        '["a", 1]',
        '[["a"]]',
        "{ a = 1 }",
        '{ driver = "x", up = "yes" }',
        '[{ driver = "eth0" }]',
        '["kvcd_base", "kvcd_base"]',
        '["Bad-Name"]',
    ]
)
TOP_KEYS = st.sampled_from([*rules.TOP_KEYS, "build.context", "build.args", "params.kvcd_user"])
SETTINGS_KEYS = st.sampled_from(rules.SETTINGS_KEYS)
TEXT = st.text(max_size=400)


def _one_key(key: str, value: str) -> str:
    """A good instance file with `key` set to `value` (a build.* key replaces [build])."""
    top = [ln for ln in TOP if not ln.startswith(f"{key} =")]
    build = [] if key.startswith("build.") else ["[build]", 'context = "/src"']
    return "\n".join([f"{key} = {value}", *top, *build]) + "\n"


def _value_or_error(path: Path, read: Callable[[Path], object]) -> object:
    """What `read(path)` gives, or None when it raised a ConfigError naming `path`; any other
    exception fails the test."""
    try:
        return read(path)
    except ConfigError as exc:
        assert exc.path == path and str(exc)
        return None


def _instance(text: str) -> None:
    cfg = _value_or_error(PATH, lambda p: loader.parse_instance_toml("nic", p, text))
    assert cfg is None or (isinstance(cfg, InstanceConfig) and cfg.name == "nic")


def _settings(text: str) -> None:
    s = _value_or_error(Path("/etc/kvcd/kvcd.toml"), lambda p: loader.parse_settings_toml(p, text))
    assert s is None or isinstance(s, Settings)


@FAST
@given(TEXT)
def test_any_instance_text(text: str) -> None:
    _instance(text)


@FAST
@given(TOP_KEYS, _SCALARS)
def test_any_value_for_an_instance_key(key: str, value: str) -> None:
    _instance(_one_key(key, value))


@FAST
@given(TEXT)
def test_any_settings_text(text: str) -> None:
    _settings(text)


@FAST
@given(SETTINGS_KEYS, _SCALARS)
def test_any_value_for_a_setting(key: str, value: str) -> None:
    _settings(f"{key} = {value}\n")


# KVC confs are shell-like assignments; the parts a hostile conf would combine.
_KVC_PARTS = st.sampled_from(
    [
        "KMOD_CONTAINER_BUILD_CONTEXT=",
        "KMOD_CONTAINER_BUILD_FILE=",
        "KMOD_SOFTWARE_VERSION=",
        "KMOD_NAMES=",
        "KVC_CONTAINER_RUNTIME=",
        "KVC_SOFTWARE_NAME=",
        "X=",
        "export ",
        '"',
        "'",
        "$",
        "${X}",
        "$(id)",
        "`id`",
        "\\",
        "#",
        ";",
        "\n",
        " ",
        "1.0",
        "git://example.com/x.git",
        "kvcd_base kvcd_user",
        "podman",
        "docker",
    ]
)
KVC_TEXT = st.lists(_KVC_PARTS, max_size=30).map("".join) | TEXT


@FAST
@given(KVC_TEXT)
def test_any_kvc_conf(text: str) -> None:
    cfg = _value_or_error(
        Path("/etc/kvc/nic.conf"), lambda p: loader.parse_kvc_conf("nic", p, text)
    )
    assert cfg is None or isinstance(cfg, InstanceConfig)


@FAST
@given(KVC_TEXT)
def test_any_kvc_global_conf(text: str) -> None:
    path = Path("/etc/kvc/kmods-via-containers.conf")
    runtime = _value_or_error(path, lambda p: loader.check_kvc_global(p, text))
    assert runtime in (None, "podman")
