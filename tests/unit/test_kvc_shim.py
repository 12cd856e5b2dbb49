"""The KVC compatibility shim (packaging/kmods-via-containers) and the wrapper-symlink template.

Both are POSIX sh. Each test copies the script into the `fake_commands` bin directory (so the
unit-test guard lets it start) next to a recording fake `kvcd`, runs it, and checks the kvcd
calls it made. Every recorded call is also parsed by kvcd's real argument parser, so the shim
cannot drift from the CLI it drives.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from kvcd.cli import _parser
from kvcd.host.run import Completed, run
from tests.conftest import FakeCommands

PACKAGING = Path(__file__).resolve().parents[2] / "packaging"
SHIM = PACKAGING / "kmods-via-containers"
TEMPLATE = PACKAGING / "kvc-wrapper.sh"
K = "5.14.0-427.13.1.el9_4.x86_64"

# The fake kvcd: exit status per verb from FAKE_RC_<verb>; `wrapper` prints like a tool would.
FAKE_KVCD = """\
case "$1" in
  build) exit "${FAKE_RC_build:-0}" ;;
  load) exit "${FAKE_RC_load:-0}" ;;
  unload) exit "${FAKE_RC_unload:-0}" ;;
  wrapper) echo "tool output root=${KVCD_ROOT-unset}"; exit "${FAKE_RC_wrapper:-0}" ;;
esac
exit 99
"""


@pytest.fixture
def shim(fake_commands: FakeCommands) -> Path:
    fake_commands.add("kvcd", FAKE_KVCD)
    dest = fake_commands.bindir / "kmods-via-containers"
    shutil.copy2(SHIM, dest)
    return dest


def call(exe: Path, *args: str, **env: str) -> Completed:
    return run([str(exe), *args], check=False, env={**os.environ, **env}, timeout=30)


def kvcd_calls(fakes: FakeCommands) -> list[list[str]]:
    return [c[1:] for c in fakes.calls() if c[0] == "kvcd"]


def parsed(argv: list[str]) -> dict[str, object]:
    """What kvcd itself makes of argv (without the global --root/-v)."""
    ns = vars(_parser().parse_args(argv))
    return {k: v for k, v in ns.items() if k not in ("root", "verbose")}


@pytest.mark.parametrize(
    ("argv", "calls"),
    [
        (["build", "simple-kmod", K], [["build", "simple-kmod", "--kernel", K]]),
        (["load", "simple-kmod", K], [["load", "simple-kmod", "--kernel", K]]),
        (["unload", "simple-kmod", K], [["unload", "simple-kmod"]]),
        (
            ["reload", "simple-kmod", K],
            [
                ["build", "simple-kmod", "--kernel", K],
                ["unload", "simple-kmod"],
                ["load", "simple-kmod", "--kernel", K],
            ],
        ),
        (
            ["wrapper", "simple-kmod", K, "spkut"],
            [["wrapper", "--kernel", K, "simple-kmod", "spkut"]],
        ),
    ],
)
def test_every_verb_maps_to_kvcd(
    shim: Path, fake_commands: FakeCommands, argv: list[str], calls: list[list[str]]
) -> None:
    done = call(shim, *argv)
    assert done.rc == 0, done.stderr
    assert kvcd_calls(fake_commands) == calls


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["build", "simple-kmod", K],
            [{"verb": "build", "instance": "simple-kmod", "kernel": K, "dry_run": False}],
        ),
        (
            ["load", "nvidia_gpu", K],
            [{"verb": "load", "instance": "nvidia_gpu", "kernel": K, "dry_run": False}],
        ),
        (["unload", "a.b@c", K], [{"verb": "unload", "instance": "a.b@c", "dry_run": False}]),
        (
            ["wrapper", "simple-kmod", K, "spkut", "--kernel", "x", "-h", "--", "a b"],
            [
                {
                    "verb": "wrapper",
                    "instance": "simple-kmod",
                    "kernel": K,
                    "command": ["spkut", "--kernel", "x", "-h", "--", "a b"],
                }
            ],
        ),
    ],
)
def test_kvcd_reads_the_calls_as_meant(
    shim: Path, fake_commands: FakeCommands, argv: list[str], expected: list[dict[str, object]]
) -> None:
    # The tool's own options (even --kernel, -h and --) belong to the tool, not to kvcd.
    assert call(shim, *argv).rc == 0
    assert [parsed(c) for c in kvcd_calls(fake_commands)] == expected


def test_reload_calls_parse_as_build_unload_load(shim: Path, fake_commands: FakeCommands) -> None:
    assert call(shim, "reload", "simple-kmod", K).rc == 0
    assert [parsed(c)["verb"] for c in kvcd_calls(fake_commands)] == ["build", "unload", "load"]


@pytest.mark.parametrize(("failing", "made"), [("build", 1), ("unload", 2), ("load", 3)])
def test_reload_stops_at_the_first_failure(
    shim: Path, fake_commands: FakeCommands, failing: str, made: int
) -> None:
    # A failed build must not unload the running modules; a refused unload must not load.
    done = call(shim, "reload", "simple-kmod", K, **{f"FAKE_RC_{failing}": "1"})
    assert done.rc == 1
    assert len(kvcd_calls(fake_commands)) == made


@pytest.mark.parametrize("verb", ["build", "load", "unload", "wrapper"])
@pytest.mark.parametrize("rc", ["1", "2"])
def test_kvcd_exit_status_passes_through(
    shim: Path, fake_commands: FakeCommands, verb: str, rc: str
) -> None:
    extra = ["spkut"] if verb == "wrapper" else []
    done = call(shim, verb, "simple-kmod", K, *extra, **{f"FAKE_RC_{verb}": rc})
    assert done.rc == int(rc)


def test_wrapper_keeps_stdin_stdout_for_the_tool(shim: Path, fake_commands: FakeCommands) -> None:
    done = call(shim, "wrapper", "simple-kmod", K, "spkut", KVCD_ROOT="/tmp/r")
    # Only the tool's output on stdout (KVC's "KVC: ..." line went there; kvcd's does not).
    assert done.stdout == "tool output root=/tmp/r\n"
    assert done.stderr == ""


def test_other_verbs_log_what_they_do_on_stderr(shim: Path, fake_commands: FakeCommands) -> None:
    done = call(shim, "load", "simple-kmod", K)
    assert done.stdout == ""
    assert f"KVC: load simple-kmod for {K} (kvcd)" in done.stderr


def test_extra_arguments_are_ignored_with_a_warning(
    shim: Path, fake_commands: FakeCommands
) -> None:
    done = call(shim, "load", "simple-kmod", K, "stray")
    assert done.rc == 0
    assert "ignoring extra arguments after KVER: stray" in done.stderr
    assert kvcd_calls(fake_commands) == [["load", "simple-kmod", "--kernel", K]]


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["bogus", "simple-kmod", K],
        ["load"],
        ["load", "simple-kmod"],
        ["wrapper", "simple-kmod"],
        ["load", "--root=/", K],
        ["load", "", K],
        ["load", "simple-kmod", "--dry-run"],
        ["wrapper", "simple-kmod", "", "spkut"],
    ],
)
def test_bad_usage_exits_2_without_calling_kvcd(
    shim: Path, fake_commands: FakeCommands, argv: list[str]
) -> None:
    done = call(shim, *argv)
    assert done.rc == 2
    assert "Usage: kmods-via-containers" in done.stderr
    assert kvcd_calls(fake_commands) == []


@pytest.mark.parametrize("flag", ["-h", "--help", "help"])
def test_help(shim: Path, fake_commands: FakeCommands, flag: str) -> None:
    done = call(shim, flag)
    assert (done.rc, done.stderr) == (0, "")
    assert done.stdout.startswith("Usage: kmods-via-containers")
    assert kvcd_calls(fake_commands) == []


def test_kvcd_missing_is_127(fake_commands: FakeCommands, tmp_path: Path) -> None:
    dest = fake_commands.bindir / "kmods-via-containers"
    shutil.copy2(SHIM, dest)
    done = run(
        [str(dest), "load", "simple-kmod", K],
        check=False,
        env={**os.environ, "PATH": str(fake_commands.bindir)},
        timeout=30,
    )
    assert done.rc == 127


# --- the wrapper-symlink template (packaging/kvc-wrapper.sh) --------------------------------


@pytest.fixture
def tools(fake_commands: FakeCommands) -> Path:
    """The template installed for instance nvidia-gpu as fakebin/nvidia-gpu-tools."""
    fake_commands.add("kvcd", FAKE_KVCD)
    script = fake_commands.bindir / "nvidia-gpu-tools"
    text = TEMPLATE.read_text()
    assert "\nINSTANCE=simple-kmod\n" in text
    script.write_text(text.replace("\nINSTANCE=simple-kmod\n", "\nINSTANCE=nvidia-gpu\n"))
    script.chmod(0o755)
    return script


def test_wrapper_symlink_runs_the_tool_of_its_name(
    tools: Path, fake_commands: FakeCommands
) -> None:
    link = fake_commands.bindir / "nvidia-smi"
    link.symlink_to(tools.name)
    done = call(link, "-q", "--id", "0")
    assert (done.rc, done.stdout) == (0, "tool output root=unset\n")
    calls = kvcd_calls(fake_commands)
    assert calls == [["wrapper", "nvidia-gpu", "nvidia-smi", "-q", "--id", "0"]]
    assert parsed(calls[0]) == {
        "verb": "wrapper",
        "instance": "nvidia-gpu",
        "kernel": None,  # kvcd takes the running kernel
        "command": ["nvidia-smi", "-q", "--id", "0"],
    }


def test_wrapper_template_refuses_to_run_as_itself(
    tools: Path, fake_commands: FakeCommands
) -> None:
    done = call(tools, "x")
    assert done.rc == 2
    assert "symlink" in done.stderr
    assert kvcd_calls(fake_commands) == []


def test_kvc_style_tool_script_still_works_through_the_shim(
    shim: Path, fake_commands: FakeCommands
) -> None:
    # KVC's own /usr/local/bin/spkut, unchanged.
    spkut = fake_commands.bindir / "spkut"
    spkut.write_text(
        '#!/bin/bash\nexec kmods-via-containers wrapper simple-kmod "$(uname -r)" spkut "$@"\n'
    )
    spkut.chmod(0o755)
    fake_commands.add("uname", f"echo {K}\n")
    assert call(spkut, "status").rc == 0
    assert kvcd_calls(fake_commands) == [
        ["wrapper", "--kernel", K, "simple-kmod", "spkut", "status"]
    ]
