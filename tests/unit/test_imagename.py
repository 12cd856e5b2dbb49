"""The names kvcd gives driver images (kvcd.core.names.image_tag): readable where a field can
be written as it is, one name per config and kernel always, and always a name podman takes."""

from __future__ import annotations

import itertools
import re

import pytest

from kvcd.core.names import image_tag, is_image_tag

# The distribution spec's reference grammar (name components, a tag).
COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
REFERENCE = re.compile(rf"(?P<name>localhost(?:/{COMPONENT})+):(?P<tag>[\w][\w.-]{{0,127}})")


@pytest.mark.parametrize(
    ("instance", "variant", "version", "kernel", "tag"),
    [
        ("foo", None, "1.0", "6.1.0-18-amd64", "localhost/kvcd/foo/1.0:6.1.0-18-amd64"),
        ("gpu", "rt", "550.54", "6.1.0", "localhost/kvcd/gpu/rt/550.54:6.1.0"),
        ("e2e-kmod", None, "2.0", "5.14.0_X", "localhost/kvcd/e2e-kmod/2.0:5.14.0_X"),
        ("Foo", None, "1.0", "6.1.0", "localhost/kvcd/foo--1cbec737f863/1.0:6.1.0"),
        ("a--b", None, "1", "k", "localhost/kvcd/a-b--90827a2e5636/1:k"),
    ],
    ids=["plain", "variant", "kernel-case-kept", "upper-case", "double-dash"],
)
def test_names_read_as_the_config(
    instance: str, variant: str | None, version: str, kernel: str, tag: str
) -> None:
    assert image_tag(instance, variant, version, kernel) == tag


# Pairs of configs that the old name (kvcd-<instance>[-<variant>]-<version>:<kernel>, lower
# case, other characters '_') gave one image name.
ONCE_ONE_NAME = [
    (("Foo", None, "1.0", "k"), ("foo", None, "1.0", "k")),
    (("a-1.0", None, "2", "k"), ("a", None, "1.0-2", "k")),
    (("a", "rt", "1", "k"), ("a-rt", None, "1", "k")),
    (("a", None, "1.0+x", "k"), ("a", None, "1.0_x", "k")),
    (("a", None, "1", "6.1.0+"), ("a", None, "1", "6.1.0_")),
    (("a", None, "1", "6.1.0~rc1"), ("a", None, "1", "6.1.0_rc1")),
    (("a", None, "1", "K"), ("a", None, "1", "k")),
    (("a", None, "1.0-2", "k"), ("a", None, "1.0--2", "k")),
]


@pytest.mark.parametrize(("one", "other"), ONCE_ONE_NAME)
def test_configs_the_old_name_mixed_up_have_names_of_their_own(
    one: tuple[str, str | None, str, str], other: tuple[str, str | None, str, str]
) -> None:
    assert image_tag(*one) != image_tag(*other)


FIELDS = {
    "instance": ["a", "A", "a-b", "a--b", "a.b", "a_b", "a__b", "a._b", "x" * 64, "x" * 128],
    "variant": [None, "rt", "RT", "r-t", "v" * 63],
    "version": ["1", "1.0-2", "1.0+g~1", "1-0-2", "9" * 64, "9" * 128],
    "kernel": ["6.1.0", "6.1.0+", "6.1.0_", "6.1.0--x", "K" * 128, "_k"],
}


def test_every_name_is_distinct_and_one_podman_takes() -> None:
    seen: dict[str, tuple[object, ...]] = {}
    for fields in itertools.product(*FIELDS.values()):
        tag = image_tag(*fields)  # type: ignore[arg-type]
        assert seen.setdefault(tag, fields) == fields, (tag, seen[tag], fields)
        found = REFERENCE.fullmatch(tag)
        assert found is not None, tag
        assert len(found["name"]) <= 255, tag
        assert is_image_tag(tag), tag
    assert len(seen) == len(list(itertools.product(*FIELDS.values())))


@pytest.mark.parametrize(
    ("ref", "kvcds"),
    [
        ("localhost/kvcd/foo/1.0:6.1.0", True),
        ("localhost/kvcd/foo/rt/1.0:6.1.0", True),
        ("localhost/kvcd-foo-1.0:6.1.0", False),  # the old name: released whole, not kept
        ("localhost/kvcd-test/foo:1.0", False),
        ("localhost/kvcd-e2e-base:latest", False),
        ("localhost/kvcd/foo:1.0", False),  # one component: not a name kvcd gives
        ("localhost/kvcd/a/b/c/d:1", False),
        ("quay.io/localhost/kvcd/foo/1.0:6.1.0", False),
        ("registry.example:5000/drivers/foo:1.0", False),
    ],
)
def test_is_image_tag(ref: str, kvcds: bool) -> None:
    assert is_image_tag(ref) is kvcds
