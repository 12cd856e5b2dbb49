"""Node keys: the 63-character name limit, hashed stems for long or unusual instance names."""

from __future__ import annotations

import pytest

from kvcd.node import keys
from kvcd.node.keys import Keys

LONG = "a" * 60


@pytest.mark.parametrize(
    ("instance", "stem"),
    [
        ("e2e-kmod", "e2e-kmod"),
        ("nic_v2.1", "nic_v2.1"),
        ("a" * keys.STEM_MAX, "a" * keys.STEM_MAX),  # exactly fits: kept
        (LONG, "a" * 40 + "-11ee391211"),  # too long: prefix + hash
        ("gpu@card0", "gpu-card0-121d6c15f8"),  # '@' is not allowed in a key name
        ("-x", "x-a420962426"),  # must start alphanumeric
    ],
)
def test_stem(instance: str, stem: str) -> None:
    got = keys.stem(instance)
    assert got == stem
    assert len(got) <= keys.STEM_MAX
    assert keys.valid_name(got + ".next-kernel")
    if got != instance:
        # The hash part is the instance's SHA-256 prefix: stable across processes and restarts.
        import hashlib

        assert got.endswith(hashlib.sha256(instance.encode()).hexdigest()[: keys.HASH_LEN])


@pytest.mark.parametrize("suffix", keys.SUFFIXES)
@pytest.mark.parametrize("instance", ["x", LONG, "weird@name:1", "ü" * 70])
def test_every_key_name_fits_63(instance: str, suffix: str) -> None:
    key = Keys("kvcd.io", instance).of(suffix)
    prefix, _, name = key.partition("/")
    assert prefix == "kvcd.io"
    assert len(name) <= keys.NAME_MAX
    assert keys.valid_name(name), name


def test_distinct_long_names_do_not_collide() -> None:
    a, b = "x" * 60 + "1", "x" * 60 + "2"
    assert keys.stem(a) != keys.stem(b)


def test_keys_of_one_instance() -> None:
    k = Keys("kvcd.io", "nic")
    assert (k.state, k.reason, k.ready, k.drain_request) == (
        "kvcd.io/nic.state",
        "kvcd.io/nic.reason",
        "kvcd.io/nic.ready",
        "kvcd.io/nic.drain",
    )
    assert k.version_label == "kvcd.io/version.nic"
    assert k.ours("kvcd.io/nic.kernel") and not k.ours("kvcd.io/other.kernel")
    assert not k.hashed and Keys("kvcd.io", LONG).hashed
    with pytest.raises(ValueError):
        k.of("bogus")
    assert keys.kmm_label("ns", "mod") == "kmm.node.kubernetes.io/version-module.ns.mod"
    assert keys.drain_key("p.io") == "p.io/drain"
    assert keys.drain_current_key("p.io") == "p.io/drain-current"
