"""Config keys of issue #6: node backend settings and the instance's ordered_upgrade/drain."""

from __future__ import annotations

import pytest

from kvcd.config.loader import parse_instance_toml, parse_settings_toml
from kvcd.config.model import ConfigError, Settings

BASE = 'version = "1.0"\nmodules = ["m"]\nimage = "quay.io/x:{kernel}"\n'


@pytest.mark.parametrize(
    ("text", "field", "value"),
    [
        ('node_backend = "kubernetes"\n', "node_backend", "kubernetes"),
        ('node_name = "worker-1.example"\n', "node_name", "worker-1.example"),
        ('kubeconfig = "/etc/kvcd/kubeconfig"\n', "kubeconfig", "/etc/kvcd/kubeconfig"),
        ('drain = "cluster"\n', "drain", "cluster"),
        ("drain_timeout = 90\n", "drain_timeout", 90.0),
        ("hook_timeout = 90\n", "hook_timeout", 90.0),
        ("", "hook_timeout", 1200.0),
        ("image_timeout = 3600\n", "image_timeout", 3600.0),
        ("", "image_timeout", 3600.0),
        ('module_tree = "system"\n', "module_tree", "system"),
        ("", "module_tree", "kvcd"),
    ],
)
def test_settings_keys(text: str, field: str, value: object) -> None:
    assert getattr(parse_settings_toml("/etc/kvcd/kvcd.toml", text), field) == value


def test_settings_defaults() -> None:
    s = Settings()
    assert (s.node_backend, s.node_name, s.kubeconfig, s.drain, s.drain_timeout) == (
        "file",
        "",
        "",
        "none",
        600.0,
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('\nnode_backend = "etcd"\n', ":2: 'node_backend' must be one of 'file', 'kubernetes'"),
        ('node_name = "Bad Name"\n', ":1: 'node_name' must be a DNS subdomain"),
        ('kubeconfig = "relative/path"\n', ":1: 'kubeconfig' must be an absolute path"),
        ('drain = "always"\n', ":1: 'drain' must be one of 'none', 'cluster'"),
        ("drain_timeout = 0\n", ":1: 'drain_timeout' must be a number of seconds"),
        ("drain_timeout = true\n", ":1: 'drain_timeout' must be a number of seconds"),
        ("hook_timeout = -1\n", ":1: 'hook_timeout' must be a number of seconds"),
        ("image_timeout = 86401\n", ":1: 'image_timeout' must be a number of seconds"),
        ("drain_timout = 5\n", "unknown key 'drain_timout' in [top level] (did you mean "),
        ('\n\nmodule_tree = "lib"\n', ":3: 'module_tree' must be one of 'kvcd', 'system'"),
    ],
)
def test_settings_errors_name_file_line_key(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_settings_toml("/etc/kvcd/kvcd.toml", text)
    assert str(exc.value).startswith("/etc/kvcd/kvcd.toml")
    assert message in str(exc.value)


@pytest.mark.parametrize(
    ("extra", "field", "value"),
    [
        ("ordered_upgrade = true\n", "ordered_upgrade", True),
        (
            "ordered_upgrade = true\n"
            'upgrade_label = "kmm.node.kubernetes.io/version-module.ns.nic"\n',
            "upgrade_label",
            "kmm.node.kubernetes.io/version-module.ns.nic",
        ),
        ('drain = "cluster"\n', "drain", "cluster"),
        ("", "drain", None),
        ("", "ordered_upgrade", False),
    ],
)
def test_instance_keys(extra: str, field: str, value: object) -> None:
    cfg = parse_instance_toml("nic", "/etc/kvcd/instances/nic.toml", BASE + extra)
    assert getattr(cfg, field) == value


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ('ordered_upgrade = "yes"\n', ":4: 'ordered_upgrade' must be true or false"),
        ('upgrade_label = "has space"\n', ":4: 'upgrade_label' must be a label key"),
        (f'upgrade_label = "p.io/{"x" * 64}"\n', ":4: 'upgrade_label' must be a label key"),
        ('upgrade_label = "UPPER.io/x"\n', ":4: 'upgrade_label' must be a label key"),
        ('drain = "sometimes"\n', ":4: 'drain' must be one of 'none', 'cluster'"),
    ],
)
def test_instance_errors_name_file_line_key(extra: str, message: str) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_instance_toml("nic", "/etc/kvcd/instances/nic.toml", BASE + extra)
    assert str(exc.value).startswith("/etc/kvcd/instances/nic.toml")
    assert message in str(exc.value)
