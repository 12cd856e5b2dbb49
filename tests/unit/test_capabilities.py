"""GEP-33 capability matching (pure), device and link matching, and the config keys for them."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcd.config.loader import parse_instance_toml, parse_settings_toml
from kvcd.config.model import BuildSource, ConfigError, LinkSpec, Variant, is_kvcd_tag
from kvcd.core.capabilities import (
    Exclusion,
    LinkView,
    check,
    decide,
    device_matches,
    links_ready,
    matching_devices,
)
from tests.fakehost import doc

SRC = Path("/etc/kvcd/instances/foo.toml")

# --- GEP-33's own CloudProfile example -------------------------------------------------------

# spec.capabilities: the full list, in order of preference, and the default set.
GEP_TABLE = {
    "architecture": ["amd64", "arm64"],
    "hypervisorType": ["gen2", "gen1"],
    "network": ["accelerated", "standard"],
}
# gardenlinux 1592.2.0's capabilitySets, one per image reference.
GEP_IMAGES = [
    (
        "arm64-gen2",
        {
            "architecture": ["arm64"],
            "hypervisorType": ["gen2"],
            "network": ["accelerated", "standard"],
        },
    ),
    ("amd64-gen2", {"architecture": ["amd64"], "hypervisorType": ["gen2"]}),
    ("amd64-gen1", {"architecture": ["amd64"], "hypervisorType": ["gen1"]}),
]
# Standard_S896om overrides hypervisorType and architecture; Standard_S896 has the defaults.
S896OM = {"hypervisorType": ["gen2"], "architecture": ["amd64"]}
S896: dict[str, list[str]] = {}


@pytest.mark.parametrize(
    ("node", "variants", "table", "picked", "excluded"),
    [
        # S896om: only amd64+gen2 fits; arm64 falls on architecture, gen1 on hypervisorType.
        (
            S896OM,
            GEP_IMAGES,
            GEP_TABLE,
            "amd64-gen2",
            {"arm64-gen2": "architecture", "amd64-gen1": "hypervisorType"},
        ),
        # A machine type with the default set supports everything: preference decides
        # (architecture first in the table: amd64, then hypervisorType: gen2).
        (S896, GEP_IMAGES, GEP_TABLE, "amd64-gen2", {}),
        # "A machine supports gen2 AND gen1 and an image version offers gen1 OR gen2. Then the
        # image with gen2 will be preferred" - whatever the order the variants are listed in.
        (
            {"hypervisorType": ["gen1", "gen2"]},
            [("g1", {"hypervisorType": ["gen1"]}), ("g2", {"hypervisorType": ["gen2"]})],
            GEP_TABLE,
            "g2",
            {},
        ),
        # Architecture is a capability: an arm64 machine gets the arm64 image.
        (
            {"architecture": ["arm64"]},
            GEP_IMAGES,
            GEP_TABLE,
            "arm64-gen2",
            {"amd64-gen2": "architecture", "amd64-gen1": "architecture"},
        ),
        # An image version without capabilitySets gets the default set: it fits any machine
        # whose values the table lists.
        (S896OM, [("1592.1.0", {})], GEP_TABLE, "1592.1.0", {}),
        # No fit: an arm64 gen1-only machine; every variant says why.
        (
            {"architecture": ["arm64"], "hypervisorType": ["gen1"]},
            GEP_IMAGES,
            GEP_TABLE,
            None,
            {
                "arm64-gen2": "hypervisorType",
                "amd64-gen2": "architecture",
                "amd64-gen1": "architecture",
            },
        ),
        # A network-standard-only machine and an image that is accelerated-only.
        (
            {"network": ["standard"]},
            [("accel", {"network": ["accelerated"]})],
            GEP_TABLE,
            None,
            {"accel": "network"},
        ),
    ],
    ids=[
        "gep-S896om",
        "gep-S896-defaults",
        "gep-gen2-preferred",
        "gep-arch-arm64",
        "gep-no-capabilitySets",
        "gep-no-fit",
        "gep-network-no-fit",
    ],
)
def test_gep33_examples(
    node: dict[str, list[str]],
    variants: list[tuple[str, dict[str, list[str]]]],
    table: dict[str, list[str]],
    picked: str | None,
    excluded: dict[str, str],
) -> None:
    d = decide(node, variants, table)
    assert d.picked == picked
    got = {c.name: c.excluded.capability for c in d.candidates if c.excluded is not None}
    assert got == excluded


# --- kvcd's own cases -------------------------------------------------------------------------

KVCD_TABLE = {
    "architecture": ["amd64", "arm64"],
    "kernel_flavor": ["rt", "64k", "generic"],
    "secure_boot": ["enabled", "disabled"],
}


@pytest.mark.parametrize(
    ("node", "variants", "picked"),
    [
        # An -rt kernel takes the rt build; a generic kernel the generic one.
        (
            {"architecture": ["amd64"], "kernel_flavor": ["rt"]},
            [("generic", {"kernel_flavor": ["generic"]}), ("rt", {"kernel_flavor": ["rt"]})],
            "rt",
        ),
        (
            {"architecture": ["amd64"], "kernel_flavor": ["generic"]},
            [("rt", {"kernel_flavor": ["rt"]}), ("generic", {"kernel_flavor": ["generic"]})],
            "generic",
        ),
        # A variant that supports both flavors loses to the specific one only by config order
        # (same best rank): the first listed wins a full tie.
        (
            {"kernel_flavor": ["rt"]},
            [("any", {}), ("rt", {"kernel_flavor": ["rt"]})],
            "any",
        ),
        (
            {"kernel_flavor": ["rt"]},
            [("rt", {"kernel_flavor": ["rt"]}), ("any", {})],
            "rt",
        ),
        # Secure Boot on: only the signed variant; off: both fit and both would run with
        # "disabled", a full tie, so the one listed first wins.
        (
            {"secure_boot": ["enabled"]},
            [("unsigned", {"secure_boot": ["disabled"]}), ("signed", {})],
            "signed",
        ),
        (
            {"secure_boot": ["disabled"]},
            [("unsigned", {"secure_boot": ["disabled"]}), ("signed", {})],
            "unsigned",
        ),
        # A capability outside the table (cpu_flags): the node's set must contain one value.
        (
            {"cpu_flags": ["avx2", "sse4_2"]},
            [("avx512", {"cpu_flags": ["avx512f"]}), ("avx2", {"cpu_flags": ["avx2"]})],
            "avx2",
        ),
        # The node reports no value for an untabled capability the variant needs: excluded.
        ({}, [("needs-gpu", {"pci_devices": ["10de:20b0"]})], None),
        # A node value the table does not list: a silent variant (table default) cannot take it.
        ({"kernel_flavor": ["debug"]}, [("any", {})], None),
        # ...but a variant that names it explicitly can, and ranks after listed values.
        (
            {"kernel_flavor": ["debug", "generic"]},
            [("debug", {"kernel_flavor": ["debug"]}), ("gen", {"kernel_flavor": ["generic"]})],
            "gen",
        ),
    ],
    ids=[
        "rt-kernel",
        "generic-kernel",
        "tie-first-listed-any",
        "tie-first-listed-rt",
        "secureboot-on",
        "secureboot-off-tie",
        "cpu-flags",
        "node-lacks-capability",
        "node-value-not-in-table",
        "untabled-value-ranks-last",
    ],
)
def test_kvcd_matching(
    node: dict[str, list[str]],
    variants: list[tuple[str, dict[str, list[str]]]],
    picked: str | None,
) -> None:
    assert decide(node, variants, KVCD_TABLE).picked == picked


def test_decision_is_deterministic_for_every_variant_order() -> None:
    import itertools

    node = {"architecture": ["amd64", "arm64"], "hypervisorType": ["gen1", "gen2"]}
    for perm in itertools.permutations(GEP_IMAGES):
        assert decide(node, list(perm), GEP_TABLE).picked == "amd64-gen2"


def test_exclusion_and_explanation_text() -> None:
    d = decide({"architecture": ["arm64"], "hypervisorType": ["gen1"]}, GEP_IMAGES, GEP_TABLE)
    assert d.explain() == [
        "arm64-gen2: excluded, hypervisorType: wants [gen2], node has [gen1]",
        "amd64-gen2: excluded, architecture: wants [amd64], node has [arm64]",
        "amd64-gen1: excluded, architecture: wants [amd64], node has [arm64]",
    ]
    assert d.no_fit_message() == (
        "no image variant fits this node: arm64-gen2 (hypervisorType: wants [gen2], node has "
        "[gen1]); amd64-gen2 (architecture: wants [amd64], node has [arm64]); amd64-gen1 "
        "(architecture: wants [amd64], node has [arm64])"
    )
    ok = decide({}, GEP_IMAGES, GEP_TABLE)
    assert ok.explain()[1] == (
        "amd64-gen2: PICKED (architecture=amd64, hypervisorType=gen2, network=accelerated)"
    )
    assert ok.explain()[0].startswith("arm64-gen2: fits (architecture=arm64")
    assert check({}, {"pci_devices": ["10de:20b0"]}, {}) == Exclusion(
        "pci_devices", ("10de:20b0",), ()
    )
    assert "node reports no value" in Exclusion("x", ("a",), ()).describe()


# --- devices ----------------------------------------------------------------------------------

VIRTIO_NET_PCI = "pci:v00001AF4d00001000sv00001AF4sd00000001bc02sc00i00"
VIRTIO_NET = "virtio:d00000001v00001AF4"
USB_HUB = "usb:v1D6Bp0002d0601dc09dsc00dp03ic09isc00ip00in00"


@pytest.mark.parametrize(
    ("pattern", "modalias", "vd", "match"),
    [
        ("1af4:1000", VIRTIO_NET_PCI, "1af4:1000", True),
        ("1AF4:1000", VIRTIO_NET_PCI, "1af4:1000", True),  # ids are case-insensitive
        ("1af4:*", VIRTIO_NET_PCI, "1af4:1000", True),
        ("*:1000", VIRTIO_NET_PCI, "1af4:1000", True),
        ("1af4:1001", VIRTIO_NET_PCI, "1af4:1000", False),
        ("8086:1521", VIRTIO_NET_PCI, "1af4:1000", False),
        ("1af4:1000", VIRTIO_NET, None, False),  # no ids: a vendor:device pattern cannot match
        ("pci:v00001AF4d00001000*", VIRTIO_NET_PCI, "1af4:1000", True),
        ("pci:v00001AF4d00001001*", VIRTIO_NET_PCI, "1af4:1000", False),
        ("virtio:d00000001v*", VIRTIO_NET, None, True),
        ("virtio:d00000002v*", VIRTIO_NET, None, False),
        ("usb:v1D6Bp0002*", USB_HUB, "1d6b:0002", True),
        ("1d6b:0002", USB_HUB, "1d6b:0002", True),
        ("pci:v00001af4*", VIRTIO_NET_PCI, "1af4:1000", False),  # modalias globs: exact case
    ],
)
def test_device_matches(pattern: str, modalias: str, vd: str | None, match: bool) -> None:
    assert device_matches(pattern, modalias, vd) is match


def test_matching_devices_lists_modaliases_in_order() -> None:
    devs = [(VIRTIO_NET_PCI, "1af4:1000"), (USB_HUB, "1d6b:0002"), (VIRTIO_NET, None)]
    assert matching_devices(["1af4:*", "virtio:*"], devs) == [VIRTIO_NET_PCI, VIRTIO_NET]
    assert matching_devices(["8086:*"], devs) == []


# --- links ------------------------------------------------------------------------------------

ETH0 = LinkView("eth0", "virtio_net", True)
DUMMY_DOWN = LinkView("kvcd0", "dummy", False)
DUMMY_UP = LinkView("kvcd0", "dummy", True)
VETH = LinkView("v0", "veth", True)


@pytest.mark.parametrize(
    ("specs", "links", "missing", "provided"),
    [
        ([LinkSpec(driver="dummy")], [ETH0, DUMMY_DOWN], [], ["kvcd0"]),
        ([LinkSpec(driver="dummy", up=True)], [ETH0, DUMMY_DOWN], ["driver=dummy up"], []),
        ([LinkSpec(driver="dummy", up=True)], [ETH0, DUMMY_UP], [], ["kvcd0"]),
        ([LinkSpec(driver="dummy")], [ETH0], ["driver=dummy"], []),
        ([LinkSpec(name="kvcd*")], [DUMMY_DOWN], [], ["kvcd0"]),
        ([LinkSpec(name="eth*", driver="virtio*")], [ETH0, VETH], [], ["eth0"]),
        ([LinkSpec(name="eth*", driver="dummy")], [ETH0], ["driver=dummy name=eth*"], []),
        (
            [LinkSpec(driver="dummy"), LinkSpec(driver="veth")],
            [DUMMY_UP, VETH, ETH0],
            [],
            ["kvcd0", "v0"],
        ),
        ([LinkSpec(driver="dummy"), LinkSpec(driver="veth")], [VETH], ["driver=dummy"], ["v0"]),
        ([LinkSpec(driver="virtio_net")], [LinkView("x", None, True)], ["driver=virtio_net"], []),
    ],
)
def test_links_ready(
    specs: list[LinkSpec], links: list[LinkView], missing: list[str], provided: list[str]
) -> None:
    got_missing, got_provided = links_ready(specs, links)
    assert [s.describe() for s in got_missing] == missing
    assert [link.name for link in got_provided] == provided


# --- config -----------------------------------------------------------------------------------

HEAD = ('version = "1.0"', 'modules = ["foo"]')

VARIANTS = doc(
    *HEAD,
    'requires_device = ["1af4:1000", "virtio:d00000001v*"]',
    "unload_on_device_removal = true",
    'expect_links = [{ driver = "dummy", up = true }, { name = "kvcd*" }]',
    "expect_links_timeout = 30",
    "[capabilities]",
    'architecture = ["amd64", "arm64"]',
    'kernel_flavor = ["rt", "generic"]',
    "[variants.rt]",
    'image = "reg.example/foo:{version}-rt"',
    "[variants.rt.capabilities]",
    'kernel_flavor = ["rt"]',
    "[variants.generic]",
    'capabilities = { kernel_flavor = "generic" }',
    "[variants.generic.build]",
    'context = "/srv/foo"',
    'containerfile = "Containerfile.generic"',
)


def test_variants_and_gating_keys_parse() -> None:
    cfg = parse_instance_toml("foo", SRC, VARIANTS)
    assert cfg.capabilities == (
        ("architecture", ("amd64", "arm64")),
        ("kernel_flavor", ("rt", "generic")),
    )
    assert cfg.variants == (
        Variant("rt", (("kernel_flavor", ("rt",)),), image="reg.example/foo:{version}-rt"),
        Variant(
            "generic",
            (("kernel_flavor", ("generic",)),),
            build=BuildSource("/srv/foo", "Containerfile.generic"),
        ),
    )
    assert cfg.image is None and cfg.build is None and cfg.variant is None
    assert cfg.requires_device == ("1af4:1000", "virtio:d00000001v*")
    assert cfg.unload_on_device_removal is True
    assert cfg.expect_links == (
        LinkSpec(driver="dummy", up=True),
        LinkSpec(name="kvcd*"),
    )
    assert cfg.expect_links_timeout == 30.0


def test_variant_image_tag_names_the_variant() -> None:
    import dataclasses

    cfg = parse_instance_toml("foo", SRC, VARIANTS)
    plain = dataclasses.replace(cfg, variant=None)
    rt = dataclasses.replace(cfg, variant="rt")
    assert plain.image_tag("6.1.0") == "localhost/kvcd/foo/1.0:6.1.0"
    assert rt.image_tag("6.1.0") == "localhost/kvcd/foo/rt/1.0:6.1.0"
    for tag in (plain.image_tag("6.1.0"), rt.image_tag("6.1.0")):
        assert is_kvcd_tag(tag)


@pytest.mark.parametrize(
    ("lines", "line", "fragment"),
    [
        (("[variants.a]",), 4, "needs an 'image' or a [variants.a.build] table"),
        (("[variants.a]", 'image = "x"', "bogus = 1"), 6, "unknown key 'bogus' in [variants.a]"),
        (("[variants.a]", "image = 3"), 5, "'variants.a.image' must be a non-empty string"),
        (
            ("[variants.a]", 'image = "x"', "[variants.a.build]", 'context = "rel"'),
            7,
            "'variants.a.build.context' must be an absolute path",
        ),
        (
            (
                "[capabilities]",
                'arch = ["amd64"]',
                "[variants.a]",
                'image = "x"',
                "[variants.a.capabilities]",
                'arch = ["amd65"]',
            ),
            9,
            "'amd65' is not one of the values [capabilities] lists for 'arch' (amd64)",
        ),
        (
            ("[variants.a]", 'image = "x"', "[variants.a.capabilities]", "arch = []"),
            7,
            "'variants.a.capabilities.arch' must be a non-empty array of strings",
        ),
        (
            ("[variants.a]", 'image = "x"', "[variants.a.capabilities]", 'arch = ["a", "a"]'),
            7,
            "lists 'a' twice",
        ),
        (
            ("[variants.a]", 'image = "x"', "[variants.a.capabilities]", '"9bad" = ["a"]'),
            7,
            "bad capability name '9bad'",
        ),
        (("[capabilities]", 'arch = ["x"]'), 4, "there is no [variants.*]"),
        (("[variants]",), 4, "'variants' must be tables [variants.<name>]"),
        (('requires_device = ["1af4:10"]',), 4, "a vendor:device id is two 4-digit hex"),
        # Too long an id is no modalias glob either (it would never match: "no device" for good).
        (('requires_device = ["80861:1521"]',), 4, "a vendor:device id is two 4-digit hex"),
        (('requires_device = ["8086:15211"]',), 4, "a vendor:device id is two 4-digit hex"),
        (('requires_device = ["8086:*1521"]',), 4, "a vendor:device id is two 4-digit hex"),
        (('requires_device = ["pci v*"]',), 4, "neither a vendor:device id nor a modalias glob"),
        (("requires_device = []",), 4, "'requires_device' must be a non-empty array"),
        (("unload_on_device_removal = true",), 4, "'unload_on_device_removal' needs"),
        (
            ('requires_device = ["1af4:*"]', 'unload_on_device_removal = "yes"'),
            5,
            "'unload_on_device_removal' must be true or false",
        ),
        (("expect_links = [{ up = true }]",), 4, "entry 1 needs a 'driver' or a 'name'"),
        (('expect_links = [{ driver = "a b" }]',), 4, "entry 1: 'driver' must be a name or glob"),
        (('expect_links = [{ driver = "x", speed = 1 }]',), 4, "unknown key 'speed'"),
        (('expect_links = [{ driver = "x", up = 1 }]',), 4, "'up' must be true or false"),
        (('expect_links = ["eth0"]',), 4, "entry 1 must be a table"),
        (("expect_links_timeout = 0",), 4, "'expect_links_timeout' must be a number of seconds"),
        (("expect_links_timeout = 30",), 4, "'expect_links_timeout' needs 'expect_links'"),
        (('depends_on = "base"',), 4, "'depends_on' must be an array of instance names"),
        (('depends_on = ["-x"]',), 4, "'depends_on' entry '-x' is not an instance name"),
        (('depends_on = ["a", "a"]',), 4, "'depends_on' lists an instance twice"),
    ],
)
def test_bad_keys_name_file_line_and_value(
    lines: tuple[str, ...], line: int, fragment: str
) -> None:
    text = doc(*HEAD, 'image = "x"', *lines)
    with pytest.raises(ConfigError) as exc:
        parse_instance_toml("foo", SRC, text)
    assert exc.value.line == line, str(exc.value)
    assert fragment in exc.value.detail, str(exc.value)
    assert str(exc.value).startswith(f"{SRC}:{line}: ")


def test_node_capability_pins_in_settings() -> None:
    text = doc("[node_capabilities]", 'kernel_flavor = "rt"', 'secure_boot = ["enabled"]')
    s = parse_settings_toml("/etc/kvcd/kvcd.toml", text)
    assert s.node_capabilities == (("kernel_flavor", ("rt",)), ("secure_boot", ("enabled",)))
    with pytest.raises(ConfigError) as exc:
        parse_settings_toml("/etc/kvcd/kvcd.toml", doc("[node_capabilities]", "x = [1]"))
    assert exc.value.line == 2
    assert "'node_capabilities.x' values must be non-empty strings" in exc.value.detail


def test_commented_examples_in_the_shipped_files_parse() -> None:
    """The commented-out examples of config/example-instance.toml and config/kvcd.toml, once
    uncommented, are valid and mean what their comments say."""
    import re

    repo = Path(__file__).resolve().parents[2]
    toml_line = re.compile(r"^# (\[[A-Za-z0-9_.]+\]|[A-Za-z_][A-Za-z0-9_.]* = .*)$")

    def uncomment(text: str, start: str, stop: str | None) -> str:
        block = text[text.index(start) : text.index(stop) if stop else len(text)]
        return "\n".join(m.group(1) for m in map(toml_line.match, block.splitlines()) if m)

    example = (repo / "config" / "example-instance.toml").read_text()
    top = uncomment(example, "# --- Device gating", "# Optional table, but at least one")
    tables = uncomment(example, "# --- Image variants", None)
    head = 'version = "1.0"\nmodules = ["kvcd_base"]\nimage = "r/x"\n'
    cfg = parse_instance_toml("example", SRC, head + top.replace('"mlx5-core"', '"x"') + "\n")
    assert cfg.requires_device == ("8086:1521", "pci:v00008086d00001522*")
    assert cfg.unload_on_device_removal is True
    assert cfg.expect_links == (LinkSpec(driver="ixgbe", up=True), LinkSpec(name="ens*f1"))
    assert cfg.expect_links_timeout == 120.0
    assert cfg.depends_on == ("x",)
    cfg = parse_instance_toml("example", SRC, head + tables + "\n")
    assert [v.name for v in cfg.variants] == ["rt", "generic"]
    node = {"architecture": ["amd64"], "kernel_flavor": ["generic"], "secure_boot": ["disabled"]}
    variants = [(v.name, dict(v.capabilities)) for v in cfg.variants]
    assert decide(node, variants, dict(cfg.capabilities)).picked == "generic"
    settings = (repo / "config" / "kvcd.toml").read_text()
    pins = uncomment(settings, "# Optional table of capability", None)
    s = parse_settings_toml("/etc/kvcd/kvcd.toml", pins + "\n")
    assert s.node_capabilities == (("kernel_flavor", ("rt",)), ("gpu", ("a100",)))
