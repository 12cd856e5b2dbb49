"""Instance names and kernel releases are checked at the edge (kvcd/core/names.py): every verb
refuses a bad one with one line and exit 2, before any file is made or read."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcd import cli
from kvcd.core.names import instance_problem, kernel_problem
from kvcd.daemon.record import KernelUnknown, running_kernel
from kvcd.host.paths import HostRoot

BAD_NAMES = [
    "",
    ".",
    "..",
    "../x",
    "../../etc/evil",
    "a/b",
    "a@b",
    "kvcd@x",
    "-x",
    "--root",
    ".hidden",
    "a b",
    "a\nb",
    "a\x00b",
    "x" * 129,
    "é",
    "a:b",
    "a\\b",
]
BAD_KERNELS = ["", ".", "..", "6.1/../x", "6.1\n", "-rc1", "6.1 0", "k" * 129, "6.1;id", "a/b"]
VERBS = [
    ["run"],
    ["build"],
    ["load"],
    ["unload"],
    ["reload", "--timeout", "1"],
    ["status"],
    ["check-config"],
    ["wrapper", "{name}", "true"],
]
KERNEL_VERBS = [["build", "e2e"], ["load", "e2e"], ["check-config", "e2e"], ["capabilities"]]


def tree(base: Path) -> list[str]:
    return sorted(str(p.relative_to(base)) for p in base.rglob("*"))


def argv(verb: list[str], name: str) -> list[str]:
    if "{name}" in verb:
        return [verb[0], *(name if a == "{name}" else a for a in verb[1:])]
    return [verb[0], name, *verb[1:]]


@pytest.mark.parametrize("name", BAD_NAMES, ids=[repr(n)[:24] for n in BAD_NAMES])
@pytest.mark.parametrize("verb", VERBS, ids=[v[0] for v in VERBS])
def test_every_verb_refuses_a_bad_name_before_touching_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], verb: list[str], name: str
) -> None:
    root = tmp_path / "root"
    root.mkdir()
    before = tree(tmp_path)
    try:
        rc = cli.main(["--root", str(root), *argv(verb, name)])
    except SystemExit as exc:  # argparse: a name that looks like an option is a usage error
        rc = exc.code
    err = capsys.readouterr().err
    assert rc == 2, err
    if name.startswith("-"):
        assert "kvcd: error:" in err, err
    else:
        assert err.count("\n") == 1 and err.startswith(f"kvcd: bad instance name {name!r}"), err
    assert tree(tmp_path) == before


@pytest.mark.parametrize("kernel", BAD_KERNELS, ids=[repr(k)[:24] for k in BAD_KERNELS])
@pytest.mark.parametrize("verb", KERNEL_VERBS, ids=[v[0] for v in KERNEL_VERBS])
def test_every_verb_refuses_a_bad_kernel_before_touching_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], verb: list[str], kernel: str
) -> None:
    root = tmp_path / "root"
    root.mkdir()
    before = tree(tmp_path)
    assert cli.main(["--root", str(root), *verb, f"--kernel={kernel}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvcd: bad kernel release {kernel!r}") and err.count("\n") == 1, err
    assert tree(tmp_path) == before


@pytest.mark.parametrize("text", ["6.1.0-56-amd64\n", "5.14.0-427.el9.x86_64", "6.5.6-300.fc39"])
def test_the_running_kernel_is_read_and_checked(root: HostRoot, text: str) -> None:
    root.osrelease.parent.mkdir(parents=True, exist_ok=True)
    root.osrelease.write_text(text)
    assert running_kernel(root) == text.strip()


@pytest.mark.parametrize("text", ["../../x\n", "6.1 evil\n", "", "-x\n"])
def test_a_running_kernel_kvcd_cannot_use_is_a_host_error(root: HostRoot, text: str) -> None:
    root.osrelease.parent.mkdir(parents=True, exist_ok=True)
    root.osrelease.write_text(text)
    with pytest.raises(KernelUnknown) as err:
        running_kernel(root)
    assert err.value.filename == str(root.osrelease)


def _safe_component(text: str) -> bool:
    return (
        text not in ("", ".", "..")
        and "/" not in text
        and "@" not in text
        and not text.startswith("-")
        and all(c.isprintable() and not c.isspace() for c in text)
    )


@given(st.text(max_size=140))
def test_an_accepted_name_is_a_safe_path_component_and_unit_instance(text: str) -> None:
    if instance_problem(text) is None:
        assert _safe_component(text) and len(text) <= 128
    else:
        assert repr(text) in str(instance_problem(text))


@given(st.text(max_size=140))
def test_an_accepted_kernel_is_a_safe_path_component(text: str) -> None:
    if kernel_problem(text) is None:
        assert _safe_component(text) and len(text) <= 128


# --- no instance can name another instance's file, or a node-wide one ------------------------

K = "6.1.0-56-amd64"


def instance_files(root: HostRoot, name: str) -> set[Path]:
    """Every file or directory kvcd keeps under the instance's name."""
    from kvcd.daemon import driftstore

    return {*root.instance_files(name), root.store(name), driftstore.baseline_path(root, name)}


def node_files(root: HostRoot) -> set[Path]:
    from kvcd.daemon import driftstore
    from kvcd.node.filebackend import node_file

    return {
        root.owners_lock,
        root.module_lock,
        root.firmware_lock,
        root.libraries_proof,
        root.libraries_lock,
        driftstore.depmod_record_path(root, K),
        node_file(root),
    }


# Names made of kvcd's own suffixes and node-wide names: where a collision would come from.
PARTS = ["a", "modules", "depmod", "node", "reload", "reloaded", "lock", "drift", "links", "json"]
PARTS += ["metrics", "libraries", "firmware"]
PARTS += ["pid", "force", "unsaved", "-", ".", K]


@pytest.mark.parametrize(
    ("one", "other"),
    [
        ("a", "a.reload"),  # a.reload.lock was both a's reload lock and a.reload's lock
        ("a", "a.drift"),
        ("a", "a.links"),
        ("a", "a.reloaded"),
        ("a", "a.unsaved"),
        ("a", "a.node"),
        ("a", "a.metrics"),
        ("modules", "x"),  # /run/kvcd/modules.lock was the node-wide owners lock
        (f"depmod-{K}", "x"),  # drift/depmod-<kernel>.json was the node-wide depmod record
        ("node", "x"),
    ],
)
def test_known_collisions_are_gone(one: str, other: str) -> None:
    root = HostRoot(Path("/r"))
    assert instance_problem(one) is None and instance_problem(other) is None
    assert not instance_files(root, one) & instance_files(root, other)
    assert not instance_files(root, one) & node_files(root)


@given(
    st.lists(st.sampled_from(PARTS), min_size=1, max_size=5),
    st.lists(st.sampled_from(PARTS), min_size=1, max_size=5),
)
def test_no_two_instance_names_share_a_file(one: list[str], other: list[str]) -> None:
    a, b = "".join(one), "".join(other)
    root = HostRoot(Path("/r"))
    for name in (a, b):
        if instance_problem(name) is None:
            assert not instance_files(root, name) & node_files(root), name
    if a != b and instance_problem(a) is None and instance_problem(b) is None:
        assert not instance_files(root, a) & instance_files(root, b), (a, b)
