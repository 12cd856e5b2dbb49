"""Label values and KMM's ordered-upgrade label (kvcd/core/labels.py), and where they are
enforced: the instance config (check-config, start) and `kvcd label`."""

from __future__ import annotations

import pytest

from kvcd import cli
from kvcd.config.loader import parse_instance_toml
from kvcd.config.model import ConfigError
from kvcd.core.labels import KMM_LABEL_PREFIX, kmm_label_problem, valid_label_value
from kvcd.host.paths import HostRoot
from tests.fakehost import doc


@pytest.mark.parametrize(
    ("value", "ok"),
    [
        ("", True),
        ("1.0", True),
        ("a" * 63, True),
        ("a" * 64, False),
        ("v1_2-3.x", True),
        ("-1.0", False),
        ("1.0-", False),
        ("1.0+git", False),
        ("1.0~rc1", False),
        ("1 0", False),
        ("1/0", False),
        ("é", False),
        (".", False),
        ("a", True),
    ],
)
def test_label_values(value: str, ok: bool) -> None:
    assert valid_label_value(value) is ok


@pytest.mark.parametrize(
    ("key", "problem"),
    [
        ("kvcd.io/version.e2e", None),  # not KMM's
        (f"{KMM_LABEL_PREFIX}ns.mod", None),
        (f"{KMM_LABEL_PREFIX}{'n' * 20}.{'m' * 19}", None),  # 39: KMM's limit
        (f"{KMM_LABEL_PREFIX}{'n' * 20}.{'m' * 20}", "at most 39 characters"),
        (f"{KMM_LABEL_PREFIX}ns", "must be kmm.node.kubernetes.io/version-module.<namespace>"),
        (f"{KMM_LABEL_PREFIX}.mod", "must be"),
    ],
)
def test_kmm_labels(key: str, problem: str | None) -> None:
    got = kmm_label_problem(key)
    assert (got is None) if problem is None else (got is not None and problem in got)


HEAD = ('modules = ["a"]', 'image = "r/x"')


@pytest.mark.parametrize(
    ("lines", "line", "fragment"),
    [
        (
            ('version = "1.0+git"', *HEAD, "ordered_upgrade = true"),
            1,
            "'version' '1.0+git' cannot be an ordered-upgrade label value",
        ),
        (
            (f'version = "{"1" * 64}"', *HEAD, "ordered_upgrade = true"),
            1,
            "at most 63 characters",
        ),
        (
            (
                'version = "1.0"',
                *HEAD,
                "ordered_upgrade = true",
                f'upgrade_label = "{KMM_LABEL_PREFIX}{"n" * 30}.{"m" * 10}"',
            ),
            5,
            "KMM allows at most 39 characters of namespace and module name together, this has 40",
        ),
        (
            ('version = "1.0"', *HEAD, f'upgrade_label = "kvcd.io/{"x" * 64}"'),
            4,
            "'upgrade_label' must be a label key",
        ),
    ],
    ids=["plus", "long-version", "kmm-too-long", "long-key"],
)
def test_config_refuses_labels_kubernetes_or_kmm_would_refuse(
    lines: tuple[str, ...], line: int, fragment: str
) -> None:
    with pytest.raises(ConfigError) as err:
        parse_instance_toml("nic", "/etc/kvcd/instances/nic.toml", doc(*lines))
    assert err.value.line == line
    assert fragment in str(err.value)
    assert str(err.value).startswith(f"/etc/kvcd/instances/nic.toml:{line}: ")


def test_a_version_with_plus_is_fine_without_ordered_upgrade() -> None:
    cfg = parse_instance_toml("nic", "/e/nic.toml", doc('version = "1.0+git"', *HEAD))
    assert cfg.version == "1.0+git"


@pytest.mark.parametrize(
    ("edit", "rc", "fragment"),
    [
        ("kvcd.io/version.e2e=1.0", 0, ""),
        ("kvcd.io/version.e2e=1.0+git", 2, "a label value is empty or at most 63 characters"),
        (f"kvcd.io/version.e2e={'a' * 64}", 2, "a label value is empty"),
        ("kvcd.io/version.e2e=", 0, ""),
        (f"kvcd.io/{'x' * 64}=1", 2, "must be a label key"),
    ],
)
def test_kvcd_label_refuses_what_a_cluster_would(
    root: HostRoot, capsys: pytest.CaptureFixture[str], edit: str, rc: int, fragment: str
) -> None:
    assert cli.main(["--root", str(root.root), "label", edit]) == rc
    assert fragment in capsys.readouterr().err


@pytest.mark.parametrize(
    ("label", "rc"),
    [
        ("kvcd.io/version.nic", 0),  # its own: the default spelled out
        ("example.com/nic-version", 0),  # a key of the admin's own
        ("kvcd.io/other.ready", 2),  # another instance's readiness, written by kvcd
        ("kvcd.io/version.other", 2),  # another instance's label
        ("kvcd.io/nic.state", 2),  # its own state annotation
    ],
)
def test_an_upgrade_label_under_kvcds_prefix_must_be_its_own(
    root: HostRoot, capsys: pytest.CaptureFixture[str], label: str, rc: int
) -> None:
    from tests import fakehost

    fakehost.write_config(
        root,
        "nic",
        doc('version = "1.0"', *HEAD, "ordered_upgrade = true", f'upgrade_label = "{label}"'),
    )
    assert cli.main(["--root", str(root.root), "check-config", "nic"]) == rc
    out = capsys.readouterr().out
    if rc:
        assert f"nic: INVALID: {root('/etc/kvcd/instances/nic.toml')}: upgrade_label" in out
        assert "under kvcd's own prefix kvcd.io/" in out
