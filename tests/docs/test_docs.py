"""Docs are tests: what README.md, packaging/ and docs/ tell an admin to paste is fed to kvcd's own
code.

Every fenced block of the Markdown files, and every file payload of the Butane and MachineConfig
examples, is classified and checked:

- TOML: its first line names the file it is for (`# /etc/kvcd/kvcd.toml`,
  `# /etc/kvcd/instances/NAME.toml`); it goes through the real loader, and the settings it
  shows are asserted where the docs promise an effect (EXPECT).
- systemd drop-ins (ini): first line names the drop-in; sections and keys must be ones systemd
  has, and every Environment= name must be one kvcd reads.
- shell (sh): every `kvcd ...` line is parsed by kvcd's own argument parser; every
  MESSAGE_ID=... is one kvcd logs.
- the command synopsis: every verb and option exists.
- Anywhere in the docs, every KVCD_* name must be one the code (or the harness) uses.

A block the walker cannot classify fails, naming its file and line: new docs stay checkable.
"""

from __future__ import annotations

import argparse
import ast
import base64
import configparser
import re
import shlex
import tempfile
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvcd import cli
from kvcd.config.loader import parse_instance_toml, parse_settings_toml
from kvcd.config.model import ConfigError, InstanceConfig, Settings
from kvcd.host import journal

REPO = Path(__file__).resolve().parents[2]
DOCS = [
    REPO / "README.md",
    *sorted((REPO / "packaging").rglob("*.md")),
    *sorted((REPO / "docs").rglob("*.md")),
]
PAYLOAD_FILES = [
    REPO / "packaging/rpm-ostree/99-kvcd-machineconfig.yaml",
    REPO / "packaging/rpm-ostree/kvcd-fcos.bu",
]
# Blocks that show output or are not for pasting: (file name, first line of the block).
OUTPUT_BLOCKS = {
    ("internals.md", "<module_root>/lib/modules/<k>/"),  # a directory layout, drawn
    ("README.md", "drift: watching 12 files"),
    (
        "README.md",
        "last attempt: LoadFailed, 1 try; tried again on reload, restart or a config change",
    ),
}
# Placeholders the docs use, and what stands for them when a line is parsed.
PLACEHOLDERS = {"<name>": "foo", "<driver>": "foo", "NAME": "foo", "<version>": "1.0"}
SYSTEMD_SECTIONS = {"Unit", "Service", "Install"}
# The systemd keys the docs may set in a drop-in (extend when a doc needs another real one).
SYSTEMD_KEYS = {
    "Environment",
    "EnvironmentFile",
    "ReadWritePaths",
    "ExecStart",
    "ExecStartPre",
    "Restart",
    "RestartSec",
    "TimeoutStartSec",
    "WatchdogSec",
    "Description",
    "After",
    "Before",
    "Wants",
    "Requires",
    "ConditionPathExists",
    "Type",
    "RemainAfterExit",
    "WantedBy",
}
# Environment names a drop-in may set that kvcd does not read itself but its tools do.
TOOL_ENV = {"HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy"}


@dataclass(frozen=True)
class Block:
    doc: Path
    line: int  # of the opening fence
    lang: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.doc.relative_to(REPO)}:{self.line}"

    @property
    def first(self) -> str:
        return self.text.splitlines()[0] if self.text.strip() else ""


def blocks(doc: Path) -> Iterator[Block]:
    lines = doc.read_text().splitlines()
    fence = re.compile(r"^\s*```(\S*)\s*$")
    i = 0
    while i < len(lines):
        m = fence.match(lines[i])
        if not m:
            i += 1
            continue
        start, lang, body = i + 1, m.group(1), []
        i += 1
        while i < len(lines) and not fence.match(lines[i]):
            body.append(lines[i])
            i += 1
        i += 1
        yield Block(doc, start, lang, "\n".join(body) + "\n")


ALL_BLOCKS = [b for d in DOCS for b in blocks(d)]


# --- what the code reads ---------------------------------------------------------------------


def _literals(paths: list[Path]) -> set[str]:
    out: set[str] = set()
    for path in paths:
        tree = ast.parse(path.read_text())
        out |= {
            n.value
            for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str)
        }
    return out


KVCD_LITERALS = _literals(sorted((REPO / "kvcd").rglob("*.py")))
ENV_NAME = re.compile(r"^[A-Z][A-Z0-9_]+$")
HARNESS_TEXT = "\n".join(
    p.read_text()
    for p in [
        REPO / "Makefile",
        *sorted((REPO / "scripts").rglob("*.sh")),
        *sorted((REPO / "tests/e2e").rglob("*.py")),
        *sorted((REPO / "tests/e2e").rglob("*.sh")),
    ]
)
MESSAGE_IDS = {v for k, v in vars(journal).items() if k.startswith("MSG_")}


# --- checks ------------------------------------------------------------------------------------


def check_toml(where: str, text: str) -> Settings | InstanceConfig:
    caption = text.splitlines()[0] if text.strip() else ""
    m = re.fullmatch(r"#\s*(/etc/kvcd/(?:kvcd\.toml|instances/([^/\s]+)\.toml))\s*", caption)
    if not m:
        pytest.fail(f"{where}: a TOML block must start with '# /etc/kvcd/...' naming its file")
    path, name = m.group(1), m.group(2)
    try:
        if name is None:
            return parse_settings_toml(path, text)
        return parse_instance_toml(name, path, text)
    except ConfigError as exc:
        pytest.fail(f"{where}: kvcd refuses this block: {exc}")


def check_dropin(where: str, text: str, caption_required: bool = True) -> None:
    caption = text.splitlines()[0] if text.strip() else ""
    if caption_required and not re.fullmatch(
        r"#\s*/etc/systemd/system/\S+\.d/\S+\.conf\s*", caption
    ):
        pytest.fail(f"{where}: a drop-in block must start with '# /etc/systemd/system/...d/X.conf'")
    parser = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    try:
        parser.read_string(text)
    except configparser.Error as exc:
        pytest.fail(f"{where}: not a unit file: {exc}")
    for section in parser.sections():
        assert section in SYSTEMD_SECTIONS, f"{where}: [{section}] is not a unit section"
        for key, value in parser.items(section):
            assert key in SYSTEMD_KEYS, f"{where}: {key}= is not a key this test knows systemd has"
            if key == "Environment":
                for assignment in shlex.split(value):
                    env = assignment.split("=", 1)[0]
                    assert env in KVCD_LITERALS or env in TOOL_ENV, (
                        f"{where}: Environment={env}=: kvcd does not read {env}"
                    )


def _words(line: str) -> list[str]:
    line = line.split(" #", 1)[0].strip()
    for placeholder, value in PLACEHOLDERS.items():
        line = line.replace(placeholder, value)
    try:
        words = shlex.split(line)
    except ValueError:
        return []
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
        words.pop(0)  # VAR=value before a command
    if words[:1] == ["sudo"]:
        words.pop(0)
    return words


def check_kvcd_argv(where: str, argv: list[str]) -> None:
    try:
        cli._parser(argv).parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"{where}: `kvcd {' '.join(argv)}` is refused by kvcd's parser (exit {exc})")


def check_shell(block: Block) -> None:
    for n, line in enumerate(block.text.splitlines(), start=block.line + 1):
        words = _words(line)
        if words[:1] == ["kvcd"]:
            check_kvcd_argv(f"{block.doc.name}:{n}", words[1:])
        for mid in re.findall(r"MESSAGE_ID=([0-9a-f]{32})", line):
            assert mid in MESSAGE_IDS, f"{block.doc.name}:{n}: kvcd logs no MESSAGE_ID={mid}"


def check_synopsis(block: Block) -> None:
    """`kvcd [--root DIR] VERB ARGS...  comment`: each verb and option exists."""
    parser = cli._parser()
    verbs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for n, line in enumerate(block.text.splitlines(), start=block.line + 1):
        m = re.match(r"\s*kvcd \[--root DIR\] (\S+)(.*?)(?:\s{2,}.*)?$", line)
        assert m, f"{block.doc.name}:{n}: not a synopsis line: {line!r}"
        verb, rest = m.group(1), m.group(2)
        assert verb in verbs.choices, f"{block.doc.name}:{n}: no verb {verb!r}"
        sub = verbs.choices[verb]
        nested = [a for a in sub._actions if isinstance(a, argparse._SubParsersAction)]
        if nested:  # `kvcd image import …`: the second word is the verb's own verb
            word, _, rest = rest.strip().partition(" ")
            assert word in nested[0].choices, f"{block.doc.name}:{n}: no `kvcd {verb} {word}`"
            sub = nested[0].choices[word]
        options = {s for a in sub._actions for s in a.option_strings}
        for opt in re.findall(r"--[a-z][a-z-]*", rest):
            assert opt in options, f"{block.doc.name}:{n}: `kvcd {verb}` has no {opt}"


def classify(block: Block) -> str:
    if block.lang == "toml":
        return "toml"
    if block.lang == "ini":
        return "dropin"
    if block.lang == "sh":
        return "shell"
    if block.first.lstrip().startswith("kvcd [--root DIR]"):
        return "synopsis"
    if (block.doc.name, block.first.split("  #")[0].strip()) in OUTPUT_BLOCKS:
        return "output"
    return "unknown"


@pytest.mark.parametrize("block", ALL_BLOCKS, ids=[b.where for b in ALL_BLOCKS])
def test_every_block_is_what_kvcd_accepts(block: Block) -> None:
    kind = classify(block)
    if kind == "toml":
        check_toml(block.where, block.text)
    elif kind == "dropin":
        check_dropin(block.where, block.text)
    elif kind == "shell":
        check_shell(block)
    elif kind == "synopsis":
        check_synopsis(block)
    elif kind == "unknown":
        pytest.fail(
            f"{block.where}: a ```{block.lang} block this test cannot check; tag it toml, ini or "
            "sh (with a caption line naming the file), or list it in OUTPUT_BLOCKS"
        )


# What the docs promise a block does, asserted on what the loader made of it: (doc, the file the
# block's caption names, the fields); the block is the one of that file that sets every field.
EXPECT: list[tuple[str, str, dict[str, Any]]] = [
    (
        "README.md",
        "/etc/kvcd/kvcd.toml",
        {"sign_key": "/etc/kvcd/keys/signing.key", "sign_cert": "/etc/kvcd/keys/signing.crt"},
    ),
    ("README.md", "/etc/kvcd/kvcd.toml", {"inhibit_reboot": True}),
    (
        "packaging/README.md",
        "/etc/kvcd/kvcd.toml",
        {"node_backend": "kubernetes", "kubeconfig": "/etc/kvcd/kubeconfig"},
    ),
    ("README.md", "/etc/kvcd/instances/foo.toml", {"version": "1.0", "unload_policy": "if-idle"}),
    ("README.md", "/etc/kvcd/instances/ice.toml", {"in_tree_modules_to_remove": ("irdma", "ice")}),
    ("README.md", "/etc/kvcd/instances/nic.toml", {"version": "2.4", "unload_policy": "never"}),
    ("README.md", "/etc/kvcd/instances/qat.toml", {"firmware_path": "/firmware"}),
    (
        "README.md",
        "/etc/kvcd/instances/gpu.toml",
        {"auth_file": "/etc/kvcd/auth/gpu.json", "tls_verify": True},
    ),
    ("README.md", "/etc/kvcd/kvcd.toml", {"pull_secret": "/var/lib/kubelet/config.json"}),
    (
        "README.md",
        "/etc/kvcd/instances/gpu-airgap.toml",
        {"image_archive": "/var/lib/driver-archives/nvidia-{version}-{kernel}.tar"},
    ),
]


@pytest.mark.parametrize(
    ("doc", "path", "fields"), EXPECT, ids=[f"{d}:{p}:{','.join(f)}" for d, p, f in EXPECT]
)
def test_the_documented_settings_take_effect(doc: str, path: str, fields: dict[str, Any]) -> None:
    (block,) = [
        b
        for b in ALL_BLOCKS
        if str(b.doc.relative_to(REPO)) == doc
        and b.lang == "toml"
        and path in b.first
        and all(re.search(rf"^{f}\s*=", b.text, re.M) for f in fields)
    ]
    got = check_toml(block.where, block.text)
    for field, want in fields.items():
        assert getattr(got, field) == want, f"{block.where}: {field} = {getattr(got, field)!r}"


def test_every_kvcd_name_in_the_docs_is_used_by_the_code() -> None:
    for doc in [*DOCS, *PAYLOAD_FILES, REPO / "config/kvcd.toml"]:
        text = doc.read_text()
        for m in re.finditer(r"\bKVCD_[A-Z0-9_]*[A-Z0-9]\b", text):
            name = m.group(0)
            line = text.count("\n", 0, m.start()) + 1
            assert name in KVCD_LITERALS or name in HARNESS_TEXT, (
                f"{doc.relative_to(REPO)}:{line}: nothing in kvcd reads or writes {name}"
            )


# --- Butane and MachineConfig payloads -------------------------------------------------------


def _data_url(source: str) -> str:
    head, _, data = source.partition(",")
    if head.endswith(";base64"):
        return base64.b64decode(data).decode()
    return urllib.parse.unquote(data)


def payloads() -> Iterator[tuple[str, str, str]]:
    """(where, path on the node, contents) of every file and unit the examples write."""
    for doc in PAYLOAD_FILES:
        for obj in yaml.safe_load_all(doc.read_text()):
            config = obj.get("spec", {}).get("config", obj) if isinstance(obj, dict) else {}
            for f in config.get("storage", {}).get("files", []):
                contents = f.get("contents", {})
                text = contents.get("inline")
                if text is None and "source" in contents:
                    text = _data_url(contents["source"])
                if text is not None:
                    yield f"{doc.name}:{f['path']}", f["path"], text
            for unit in config.get("systemd", {}).get("units", []):
                if "contents" in unit:
                    yield (
                        f"{doc.name}:{unit['name']}",
                        f"/etc/systemd/system/{unit['name']}",
                        (unit["contents"]),
                    )


PAYLOADS = list(payloads())


def test_the_examples_carry_the_files_they_describe() -> None:
    paths = {path for _w, path, _t in PAYLOADS}
    assert "/etc/kvcd/instances/simple-kmod.toml" in paths
    assert "/etc/kvcd/kvcd.toml" in paths
    # A pool-wide MachineConfig carries no per-node name, and %H would freeze an early-boot
    # host name (systemd fills it in at unit load): kvcd reads the host name when it reports.
    assert not [p for p in paths if "node-name" in p]


def check_kubeconfig(where: str, text: str) -> None:
    """What the kubernetes client kvcd uses (KubeBackend.api) loads, with a token."""
    kube_config = pytest.importorskip("kubernetes.config")
    from kubernetes import client

    cfg = client.Configuration()
    with tempfile.NamedTemporaryFile("w", suffix=".kubeconfig") as f:
        f.write(text)
        f.flush()
        try:
            kube_config.load_kube_config(config_file=f.name, client_configuration=cfg)
        except Exception as exc:
            pytest.fail(f"{where}: the kubernetes client refuses this kubeconfig: {exc}")
    assert cfg.host.startswith("https://"), where
    assert any(v.startswith("Bearer ") for v in cfg.api_key.values()), f"{where}: no token"


def test_the_machineconfig_reports_to_the_node_object() -> None:
    """Its comments say kvcd reports to the Node object: that takes the
    kubernetes backend (the default, "file", reaches no Node) and a kubeconfig it can read,
    root's alone (mode 0600), on the path kvcd.toml names."""
    doc = REPO / "packaging/rpm-ostree/99-kvcd-machineconfig.yaml"
    files = {
        f["path"]: f
        for obj in yaml.safe_load_all(doc.read_text())
        for f in obj.get("spec", {}).get("config", {}).get("storage", {}).get("files", [])
    }
    text = _data_url(files["/etc/kvcd/kvcd.toml"]["contents"]["source"])
    settings = check_toml(f"{doc.name}:/etc/kvcd/kvcd.toml", f"# /etc/kvcd/kvcd.toml\n{text}")
    assert isinstance(settings, Settings)
    assert settings.node_backend == "kubernetes"
    kubeconfig = files[settings.kubeconfig]
    assert kubeconfig["mode"] == 0o600
    check_kubeconfig(
        f"{doc.name}:{settings.kubeconfig}", _data_url(kubeconfig["contents"]["source"])
    )


@pytest.mark.parametrize(("where", "path", "text"), PAYLOADS, ids=[w for w, _p, _t in PAYLOADS])
def test_every_payload_is_what_kvcd_accepts(where: str, path: str, text: str) -> None:
    if path.startswith("/etc/kvcd/") and path.endswith(".toml"):
        check_toml(where, f"# {path}\n{text}")
    elif re.search(r"\.(service|conf)$", path) and "/systemd/" in path:
        check_dropin(where, text, caption_required=False)
    elif path == "/etc/kvcd/kubeconfig":
        check_kubeconfig(where, text)
    elif path.startswith("/etc/yum.repos.d/"):
        parser = configparser.ConfigParser(interpolation=None)
        parser.read_string(text)
        assert parser.sections(), where
    else:
        pytest.fail(f"{where}: a payload this test cannot check ({path})")


# --- the walker itself finds what is wrong ----------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "text", "fragment"),
    [
        ("toml", '# /etc/kvcd/kvcd.toml\n[extra]\nnode_backend = "kubernetes"\n', "[extra]"),
        ("toml", 'version = "1.0"\n', "must start with '# /etc/kvcd/"),
        ("toml", '# /etc/kvcd/instances/x.toml\nversion = "1.0"\nmodulez = ["a"]\n', "modulez"),
        (
            "dropin",
            "# /etc/systemd/system/kvcd@.service.d/1.conf\n[Service]\nEnvironment=NODE_NAME=%H\n",
            "kvcd does not read NODE_NAME",
        ),
        ("dropin", "[Service]\nEnvironment=KVCD_NODE_NAME=%H\n", "must start with"),
        ("shell", "kvcd check-config --everything\n", "refused by kvcd's parser"),
        ("shell", "journalctl MESSAGE_ID=00000000000000000000000000000000\n", "no MESSAGE_ID"),
    ],
)
def test_the_checks_catch_a_drifted_doc(kind: str, text: str, fragment: str) -> None:
    block = Block(REPO / "README.md", 1, {"dropin": "ini", "shell": "sh"}.get(kind, kind), text)
    with pytest.raises((pytest.fail.Exception, AssertionError)) as err:
        test_every_block_is_what_kvcd_accepts(block)
    assert fragment in str(err.value)


def test_the_attempt_lines_are_what_status_prints() -> None:
    """README's `last attempt:` lines, rendered by kvcd status from the ledger they describe."""
    import time

    from kvcd.daemon.status import render_attempt

    readme = (REPO / "README.md").read_text()
    at = time.mktime(time.strptime("2026-11-25 18:22:05", "%Y-%m-%d %H:%M:%S"))
    for ledger in (
        {"outcome": "permanent", "code": "LoadFailed", "tries": 1},
        {"outcome": "transient", "code": "PodmanUnavailable", "tries": 3, "not_before": at},
    ):
        assert f"\n  {render_attempt(ledger)}\n" in readme


def test_the_documented_event_reasons_are_the_ones_kvcd_posts() -> None:
    """README's Events bullet names reasons an operator filters on: each one is a reason kvcd
    can post, and each reason kvcd adds to the state codes is named there."""
    from kvcd.core import nodeevents, state

    text = (REPO / "README.md").read_text()
    bullet = text[text.index("- **Events**") :]
    bullet = bullet[: bullet.index("\n- **", 1)]
    named = set(re.findall(r"`([A-Z][A-Za-z]+)`", bullet))
    assert named, "no reasons found in README's Events bullet"
    assert named <= set(nodeevents.REASONS) | set(state.REASONS), named
    assert set(nodeevents.REASONS) <= named


def test_the_unit_leaves_the_host_name_live() -> None:
    """packaging/README.md promises that a host name set after kvcd started is seen (kvcd's
    default node name is the host name, and kvcd starts early at boot, before DHCP or
    cloud-init may set it): the unit must not give kvcd a private UTS namespace."""
    text = (REPO / "packaging/README.md").read_text()
    assert "deliberately has no `ProtectHostname=`" in " ".join(text.split())
    unit = (REPO / "systemd/kvcd@.service").read_text()
    assert not re.search(r"^\s*ProtectHostname\s*=", unit, re.M), "kvcd@.service: ProtectHostname="


def test_every_mention_of_protectsystem_is_the_units() -> None:
    """Docs, the shipped config and kvcd's own messages (modtree's "add a drop-in" error) tell
    the admin what the unit's ProtectSystem= is: it must be the value the unit has."""
    (shipped,) = re.findall(
        r"^ProtectSystem=(\S+)$", (REPO / "systemd/kvcd@.service").read_text(), re.M
    )
    sources = [
        *DOCS,
        *sorted((REPO / "config").glob("*.toml")),
        *sorted((REPO / "kvcd").rglob("*.py")),
    ]
    for path in sources:
        for m in re.finditer(r"ProtectSystem=(\w+)", path.read_text()):
            assert m.group(1) == shipped, f"{path.relative_to(REPO)}: {m.group(0)}, unit: {shipped}"


def test_every_key_kvcd_accepts_is_in_the_shipped_examples() -> None:
    """README: "Every key is documented in config/example-instance.toml"; config/kvcd.toml
    shows every setting. A key the loader accepts must appear there, set or commented out
    (`key = ...`, or as a `[table]`), so a new key cannot ship undocumented."""
    from kvcd.config import capsconf, rules

    def missing(path: Path, keys: tuple[str, ...]) -> list[str]:
        text = path.read_text()
        return [
            k for k in keys if not re.search(rf"(?<![\w.-]){k}\s*=|\[(?:[\w.<>]*\.)?{k}[.\]]", text)
        ]

    instance = (
        *rules.TOP_KEYS,
        *rules.BUILD_KEYS,
        *capsconf._VARIANT_KEYS,
        *capsconf._LINK_KEYS,
    )
    assert missing(REPO / "config/example-instance.toml", instance) == []
    assert missing(REPO / "config/kvcd.toml", rules.SETTINGS_KEYS) == []


def test_the_shipped_kvcd_toml_sets_each_setting_to_its_default() -> None:
    """config/kvcd.toml is installed as the node's file and read as its documentation: each
    value it sets is kvcd's default (the README quotes them, e.g. hook_timeout's 1200)."""
    import dataclasses

    path = REPO / "config/kvcd.toml"
    shipped, default = parse_settings_toml(str(path), path.read_text()), Settings()
    differ = [
        f.name
        for f in dataclasses.fields(Settings)
        if getattr(shipped, f.name) != getattr(default, f.name)
    ]
    assert differ == []
    readme = " ".join((REPO / "README.md").read_text().split())
    for key in ("hook_timeout", "image_timeout"):
        value = getattr(default, key)
        assert f"`{key}` seconds (`/etc/kvcd/kvcd.toml`, default {value:g})" in readme
    assert f"within image_timeout = {default.image_timeout:g} s (kvcd.toml)" in readme


def test_every_documented_instance_name_rule_is_the_code_s() -> None:
    """The instance-name grammar, wherever a doc or shipped config spells it out, is
    kvcd.core.names.INSTANCE_RULE (and INSTANCE_NAME checks exactly that)."""
    from kvcd.core import names

    assert names.INSTANCE_NAME.pattern == names.INSTANCE_RULE
    spelled = re.compile(r"\[A-Za-z0-9\]\[A-Za-z0-9_[^\]]*\]\{0,127\}")
    found = {
        str(path.relative_to(REPO)): spelled.findall(path.read_text())
        for path in [*DOCS, *sorted((REPO / "config").glob("*.toml"))]
    }
    assert found["README.md"] and found["config/example-instance.toml"]
    wrong = {p: rules for p, rules in found.items() if set(rules) - {names.INSTANCE_RULE}}
    assert wrong == {}


def test_the_synopsis_names_every_verb_and_option() -> None:
    """The reverse of check_synopsis: a verb or option kvcd has is in README's synopsis."""
    (block,) = [b for b in ALL_BLOCKS if classify(b) == "synopsis" and b.doc.name == "README.md"]
    parser = cli._parser()
    verbs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    lines: dict[str, str] = {}
    for line in block.text.splitlines():
        words = line.split()
        verb = " ".join(words[3:5]) if words[3] == "image" else words[3]
        lines[verb] = lines.get(verb, "") + line
    for verb, sub in verbs.choices.items():
        nested = [a for a in sub._actions if isinstance(a, argparse._SubParsersAction)]
        subs = {f"{verb} {w}": p for w, p in nested[0].choices.items()} if nested else {verb: sub}
        for name, p in subs.items():
            assert name in lines, f"README's synopsis has no `kvcd {name}`"
            for opt in {a.option_strings[-1] for a in p._actions if a.option_strings} - {"--help"}:
                assert opt in lines[name], f"README's synopsis: `kvcd {name}` lacks {opt}"


def test_the_signal_refusals_are_what_kvcd_says(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """README's "Signals" bullet quotes kvcd reload's refusals: each is what kvcd prints for a
    pid file holding a bad pid, a gone process or another process, and for no pid file."""
    import json
    import os

    text = " ".join((REPO / "README.md").read_text().split())
    bullet = text[text.index("- **Signals.**") : text.index("- **Names and kernels.**")]
    forms = [f for f in re.findall(r"`([^`]+)`", bullet) if f.endswith("nothing signalled")]

    def pattern(form: str) -> str:
        out = re.escape(form).replace("/run/kvcd/NAME\\.pid", ".*/run/kvcd/foo\\.pid")
        return out.replace("NAME", "foo").replace("N", "-?[0-9]+").replace("…", ".+")

    (tmp_path / "run/kvcd").mkdir(parents=True)
    pid_file = tmp_path / "run/kvcd/foo.pid"
    said = []
    gone = next(p for p in range(999_999, 0, -1) if not os.path.exists(f"/proc/{p}"))
    for content in (None, "0", "-5", json.dumps({"pid": gone, "start": 1}), str(os.getpid())):
        if content is None:
            pid_file.unlink(missing_ok=True)
        else:
            pid_file.write_text(content + "\n")
        assert cli.main(["--root", str(tmp_path), "reload", "foo"]) == 1
        said.append(capsys.readouterr().err.strip().removeprefix("kvcd: "))
    for line in said:
        assert any(re.fullmatch(pattern(f), line) for f in forms), (line, forms)
    for form in forms:
        assert any(re.fullmatch(pattern(form), line) for line in said), (form, said)


def test_the_quoted_next_kernel_line_is_what_kvcd_logs() -> None:
    """README quotes the first start's journal line on a prepared kernel: the placeholders
    (<kver>, <how>) stand for the %s of the format kvcd logs with."""
    text = " ".join((REPO / "README.md").read_text().split())
    (quoted,) = re.findall(r"`(modules for <kver> were prepared before the reboot[^`]*)`", text)
    assert re.sub(r"<[a-z ]+>", "%s", quoted) in KVCD_LITERALS, quoted


def test_the_install_table_lists_what_the_rpm_installs() -> None:
    """packaging/README.md's "What the package installs" names each path of kvcd's %files."""
    macros = {
        "_bindir": "/usr/bin",
        "_unitdir": "/usr/lib/systemd/system",
        "_systemdgeneratordir": "/usr/lib/systemd/system-generators",
        "_kernel_install_dir": "/usr/lib/kernel/install.d",
        "_tmpfilesdir": "/usr/lib/tmpfiles.d",
        "_sysconfdir": "/etc",
        "kvcd_vendordir": "/usr/lib/kvcd",
        "_sharedstatedir": "/var/lib",
        "_rundir": "/run",
        "name": "kvcd",
    }
    spec = (REPO / "rpm.spec").read_text()
    section = spec.split("\n%files -f")[1].split("\n%files ")[0]
    paths = []
    for line in section.splitlines()[1:]:
        words = line.split()
        if not words or words[0] in ("%license", "%doc"):
            continue
        path = re.sub(r"%\{(\w+)\}", lambda m: macros[m.group(1)], words[-1])
        if path != "/usr/lib/kernel/install.d":  # a directory every kernel-install plugin shares
            paths.append(path)
    assert paths, "no %files in rpm.spec"
    doc = (REPO / "packaging/README.md").read_text()
    table = doc[doc.index("## What the package installs") :].split("\n\n")[1]
    listed = {p.rstrip("/") for p in re.findall(r"^\| `([^`]+)`", table, re.M)}
    # A directory is listed by its own row or by the rows of what it holds.
    assert [p for p in paths if not any(x == p or x.startswith(p + "/") for x in listed)] == []


def test_the_image_names_the_readme_shows_are_the_names_kvcd_gives() -> None:
    """`podman save … localhost/kvcd/gpu/550.54:…` on a connected node, and the name of an
    instance whose name is not written as it is (`Foo`)."""
    from kvcd.core.names import image_tag

    text = (REPO / "README.md").read_text()
    save = re.search(r"^podman save -o \S+ (\S+)", text, re.M)
    assert save is not None
    assert save[1] == image_tag("gpu", None, "550.54", "6.1.0-18-amd64")
    foo = re.search(r"instance `Foo` is `(localhost/kvcd/[^/`]+)/…`", text)
    assert foo is not None
    assert image_tag("Foo", None, "1.0", "6.1.0").startswith(f"{foo[1]}/")


MAKEFILE = (REPO / "Makefile").read_text()
MAKE_TARGETS = set(re.findall(r"^([a-z][a-z0-9-]*):", MAKEFILE, re.M))
MAKE_VARIABLES = set(re.findall(r"^([A-Z][A-Z0-9_]*) *[?:]?=", MAKEFILE, re.M))
# Another project's make, quoted: kmods-via-containers' `make install` (packaging/README.md).
OTHERS_MAKE = {"make install"}


def _make_commands() -> list[tuple[str, list[str]]]:
    """Every `make …` the docs show (in a sh block, or in backquotes in the prose): where, and
    its words after `make` (the VAR=value before it included)."""
    found = []
    for doc in DOCS:
        for n, line in enumerate(doc.read_text().splitlines(), start=1):
            for cmd in re.findall(r"`((?:[A-Z][A-Z0-9_]*=\S* )*make(?: [^`]*)?)`", line):
                if cmd not in OTHERS_MAKE:
                    found.append((f"{doc.relative_to(REPO)}:{n}", cmd))
    for block in ALL_BLOCKS:
        if block.lang == "sh":
            for n, line in enumerate(block.text.splitlines(), start=block.line + 1):
                if re.match(r"\s*(?:[A-Z][A-Z0-9_]*=\S* )*make\b", line):
                    found.append((f"{block.doc.relative_to(REPO)}:{n}", line.split(" #", 1)[0]))
    return [(where, shlex.split(cmd)) for where, cmd in found]


def test_every_make_command_in_the_docs_is_the_makefile_s() -> None:
    """`make demo`, `make check`, `TEST_JOBS=0 make test`: each target the Makefile has, each
    variable one it sets (a renamed target or variable fails here, not for a reader)."""
    commands = _make_commands()
    assert len(commands) >= 8, commands  # the finder still finds them
    for where, words in commands:
        for word in words:
            if word == "make":
                continue
            name, is_var, _ = word.partition("=")
            if is_var:
                assert name in MAKE_VARIABLES, f"{where}: the Makefile has no variable {name}"
            else:
                assert word in MAKE_TARGETS, f"{where}: the Makefile has no target {word!r}"
