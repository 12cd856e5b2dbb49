"""The CLI contract: verbs, exit codes (0 ok, 1 failed, 2 usage/config), --root, --dry-run."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from pathlib import Path

import pytest

from kvcd import cli
from kvcd.cli import main
from kvcd.host.paths import HostRoot
from tests import fakehost

K = "6.1.0-56-amd64"
GOOD = 'version = "1.0"\nmodules = ["kvcd_base", "kvcd_user"]\n[build]\ncontext = "/src"\n'


@pytest.fixture
def root(tmp_path: Path) -> HostRoot:
    r = HostRoot(tmp_path)
    fakehost.make_host(r, K)
    return r


def write_record(root: HostRoot, **fields: object) -> None:
    """An instance state file as the daemon leaves it (defaults: Done, loaded, this boot)."""
    record = {
        "instance": "e2e",
        "state": "Done",
        "goal": "loaded",
        "version": "1.0",
        "kernel": K,
        "boot_id": "0b5e6c4e-0000-4000-8000-000000000001",
        **fields,
    }
    root.state_file("e2e").parent.mkdir(parents=True, exist_ok=True)
    root.state_file("e2e").write_text(json.dumps(record))


def run(root: HostRoot, *args: str) -> int:
    return main(["--root", str(root.root), *args])


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["bogus"],
        ["load"],
        ["status", "--bad-flag"],
        ["check-config"],
        ["check-config", "x", "--all"],
    ],
)
def test_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "kvcd: error:" in capsys.readouterr().err


def test_root_from_environment(
    root: HostRoot, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fakehost.write_config(root, "e2e", GOOD)
    monkeypatch.setenv("KVCD_ROOT", str(root.root))
    assert main(["status"]) == 0
    assert capsys.readouterr().out.startswith("e2e: Unknown")


def test_status_with_nothing_configured(root: HostRoot, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(root, "status") == 0
    assert capsys.readouterr().out.strip() == "no instances configured"
    assert run(root, "status", "--json") == 0
    assert json.loads(capsys.readouterr().out) == {"instances": []}


def test_dry_run_prints_the_plan_and_changes_nothing(
    root: HostRoot, capsys: pytest.CaptureFixture[str]
) -> None:
    fakehost.write_config(root, "e2e", GOOD)
    before = sorted(p.relative_to(root.root) for p in root.root.rglob("*"))
    assert run(root, "load", "e2e", "--dry-run") == 0
    assert capsys.readouterr().out.splitlines() == [
        f"build localhost/kvcd/e2e/1.0:{K} from /src",
        f"extract /lib/modules/{K}/ of localhost/kvcd/e2e/1.0:{K} into the store (1.0, {K})",
        "remove all but the newest 3 images of this instance",
        f"activate version 1.0 in the module root for {K} and run depmod",
        "load kvcd_base and verify it in /sys/module",
        "load kvcd_user and verify it in /sys/module",
        "verify kvcd_base, kvcd_user loaded",
    ]
    assert run(root, "unload", "e2e", "--dry-run") == 0
    assert capsys.readouterr().out.strip() == "verify kvcd_base, kvcd_user gone"
    assert sorted(p.relative_to(root.root) for p in root.root.rglob("*")) == before


def test_kernel_flag_overrides_the_running_kernel(
    root: HostRoot, capsys: pytest.CaptureFixture[str]
) -> None:
    fakehost.write_config(root, "e2e", GOOD)
    assert run(root, "build", "e2e", "--kernel", "6.1.0-99-amd64", "--dry-run") == 0
    assert "localhost/kvcd/e2e/1.0:6.1.0-99-amd64" in capsys.readouterr().out


def test_check_config_all_reports_each_and_exits_2_on_any_bad(
    root: HostRoot, capsys: pytest.CaptureFixture[str]
) -> None:
    fakehost.write_config(root, "good", GOOD)
    fakehost.write_config(root, "bad", GOOD + "modlues = []\n")
    assert run(root, "check-config", "--all") == 2
    out = capsys.readouterr().out
    assert "good: ok" in out and f"plan for {K}:" in out
    assert "bad: INVALID:" in out and "bad.toml:5" in out and "modlues" in out


def test_bad_config_on_a_verb_is_exit_2_naming_the_file(
    root: HostRoot, capsys: pytest.CaptureFixture[str]
) -> None:
    fakehost.write_config(root, "e2e", GOOD.replace('"1.0"', "1.0"))
    assert run(root, "load", "e2e") == 2
    assert "e2e.toml:1" in capsys.readouterr().err


def test_unknown_instance_names_where_it_looked(
    root: HostRoot, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(root, "load", "nope") == 2
    err = capsys.readouterr().err
    assert "nope" in err and "/etc/kvcd/instances" in err and "/etc/kvc" in err


def test_status_warns_when_record_and_kernel_disagree(
    root: HostRoot, capsys: pytest.CaptureFixture[str]
) -> None:
    fakehost.write_config(root, "e2e", GOOD)
    write_record(root, boot_id="an-earlier-boot", modules=["kvcd_base", "kvcd_user"])
    (root.sys_module / "kvcd_base").mkdir()
    assert run(root, "status") == 0
    out = capsys.readouterr().out
    assert "kvcd_base: loaded" in out and "kvcd_user: not loaded" in out
    assert "warning: recorded during an earlier boot" in out
    assert "warning: recorded Done but not loaded now: kvcd_user" in out


def test_status_says_when_the_goal_was_to_unload(
    root: HostRoot, capsys: pytest.CaptureFixture[str]
) -> None:
    fakehost.write_config(root, "e2e", GOOD)
    write_record(root, goal="unloaded", modules=["kvcd_base"])
    assert run(root, "status") == 0
    out = capsys.readouterr().out
    assert out.startswith("e2e: Done (unloaded)  version 1.0")
    assert "warning" not in out


def test_status_of_a_name_no_instance_has_says_so_and_fails(
    root: HostRoot, capsys: pytest.CaptureFixture[str]
) -> None:
    """A mistyped name is not an instance that was never started."""
    fakehost.write_config(root, "e2e", GOOD)
    assert run(root, "status", "e2x") == 1
    out = capsys.readouterr().out
    assert out.startswith("e2x: Unknown\n  reason: no such instance (not configured, no record)\n")
    assert run(root, "status", "e2x", "--json") == 1
    entry = json.loads(capsys.readouterr().out)["instances"][0]
    assert (entry["state"], entry["code"], entry["absent"]) == ("Unknown", "", True)
    assert run(root, "status", "e2e") == 0


def test_status_warns_of_a_config_a_start_would_refuse(
    root: HostRoot, capsys: pytest.CaptureFixture[str]
) -> None:
    fakehost.write_config(root, "e2e", GOOD + "modlues = []\n")
    assert run(root, "status", "e2e") == 0
    out = capsys.readouterr().out
    assert out.startswith("e2e: Unknown\n  reason: never started\n"), out
    path = root.instance_dirs()[0] / "e2e.toml"
    assert f"  warning: config not usable: {path}:" in out
    assert "unknown key 'modlues'" in out
    fakehost.write_config(root, "e2e", GOOD)
    fakehost.write(root.main_config, "frobnicate = 1\n")  # not the defaults in silence
    assert run(root, "status", "e2e") == 0
    out = capsys.readouterr().out
    assert f"  warning: config not usable: {root.main_config}:1: unknown key 'frobnicate'" in out


@pytest.mark.parametrize("since", ["1e400", "NaN", "-1e300", "1" + "0" * 400, '"noon"'])
def test_status_says_an_unreachable_node_without_a_time_no_clock_gives(
    root: HostRoot, capsys: pytest.CaptureFixture[str], since: str
) -> None:
    """The daemon's node note (a runtime file) with a time time.localtime refuses: the warning,
    without its time (it was an OverflowError, exit 70, no instance shown)."""
    fakehost.write_config(root, "e2e", GOOD)
    fakehost.write(root.node_note("e2e"), f'{{"failing": "x", "since": {since}}}')
    assert run(root, "status", "e2e") == 0
    assert "  warning: node not updated: x; retrying\n" in capsys.readouterr().out


def test_check_config_says_no_image_for_an_archive_not_there_yet_and_exits_1(
    root: HostRoot, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A valid config whose archive is not there (still being copied: the daemon waits for it)
    is not a bad configuration (exit 2): NO IMAGE, exit 1; once it is there, ok."""
    archive = tmp_path / "drv.tar"
    fakehost.write_config(
        root, "e2e", f'version = "1.0"\nmodules = ["kvcd_base"]\nimage_archive = "{archive}"\n'
    )
    assert run(root, "check-config", "e2e", "--kernel", K) == 1
    out = capsys.readouterr().out
    assert out.startswith("e2e: ok (")
    assert f"  e2e: NO IMAGE: {archive}: No such file or directory\n" in out
    fakehost.write_config(root, "bad", "version = 1\n")
    assert run(root, "check-config", "--all", "--kernel", K) == 2  # the worst of the two
    capsys.readouterr()
    (root.instance_dirs()[0] / "bad.toml").unlink()
    archive.mkdir()  # no file: a path to mend
    assert run(root, "check-config", "e2e", "--kernel", K) == 2
    archive.rmdir()
    archive.write_bytes(b"an archive")
    assert run(root, "check-config", "e2e", "--kernel", K) == 0


def test_status_json_says_never_started_with_an_empty_code(
    root: HostRoot, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every entry carries `code` and `detail` (README: script against `code`); an instance
    without a record yet is Unknown, no code (nothing failed), detail "never started"."""
    fakehost.write_config(root, "e2e", GOOD)
    assert run(root, "status", "--json") == 0
    entry = json.loads(capsys.readouterr().out)["instances"][0]
    assert {k: entry[k] for k in ("state", "code", "detail", "reason")} == {
        "state": "Unknown",
        "code": "",
        "detail": "never started",
        "reason": "never started",
    }


@pytest.mark.parametrize(
    ("fields", "shown"),
    [
        (
            {"state": "Degraded", "code": "LoadFailed", "detail": "\x1b]0;pwn\x07x\ny"},
            "  reason: LoadFailed: \\x1b]0;pwn\\x07x\\ny\n",
        ),
        ({"detail": "a\rb\tc\x7fd\x9be"}, "  reason: a\\rb\\tc\\x7fd\\x9be\n"),
        (
            {"next_kernel": "6.2.0", "next_kernel_state": "failed\x1b[2J"},
            "  next kernel 6.2.0: failed\\x1b[2J\n",
        ),
        (
            {"next_kernel": "6.2.0", "next_kernel_reason": "x\n  warning: fake"},
            "(x\\n  warning: fake)\n",
        ),
        ({"goal": "\x1b[8mhidden"}, "e2e: Done (\\x1b[8mhidden)"),
    ],
    ids=["osc-and-newline", "cr-tab-del-c1", "next-kernel-state", "next-kernel-reason", "goal"],
)
def test_status_escapes_control_characters_from_the_record(
    root: HostRoot, capsys: pytest.CaptureFixture[str], fields: dict[str, str], shown: str
) -> None:
    """A record's text reaches a terminal: no escape sequence, no line of its own making."""
    fakehost.write_config(root, "e2e", GOOD)
    write_record(root, **fields)
    run(root, "status")
    out = capsys.readouterr().out
    assert shown in out
    assert not [c for c in out if c != "\n" and (ord(c) < 32 or 127 <= ord(c) < 160)]
    assert "\nwarning" not in out and "\n  warning: fake" not in out


@pytest.mark.parametrize(("verb", "how"), [("load", "reload"), ("unload", "stop")])
def test_load_and_unload_refuse_while_the_daemon_runs(
    root: HostRoot,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    verb: str,
    how: str,
) -> None:
    """A hand-run load or unload behind a running kvcd@NAME would be drift to it; the CLI points
    to systemctl instead, and changes nothing (no record written)."""
    import os

    fakehost.write_config(root, "e2e", GOOD)
    fakehost.pretend_daemon(root, "e2e", monkeypatch)
    assert run(root, verb, "e2e") == 1
    err = capsys.readouterr().err
    assert f"kvcd@e2e is running (pid {os.getpid()}" in err
    assert f"use `systemctl {how} kvcd@e2e`" in err
    assert not root.state_file("e2e").exists()


@pytest.mark.parametrize(
    ("argv", "env", "traceback"),
    [
        (["status"], {}, False),
        (["-v", "status"], {}, True),
        (["status"], {"KVCD_DEBUG": "1"}, True),
        (["run", "e2e"], {}, True),  # the daemon's stderr is the journal: the traceback goes there
    ],
)
def test_a_bug_is_one_line_and_exit_70_unless_the_traceback_is_asked_for(
    root: HostRoot,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    env: dict[str, str],
    traceback: bool,
) -> None:
    import kvcd.cli

    def bug(*_a: object, **_k: object) -> int:
        raise KeyError("slot")

    monkeypatch.setattr(kvcd.cli, "_status", bug)
    monkeypatch.setattr("kvcd.daemon.service.Service.run", bug)
    monkeypatch.delenv("KVCD_DEBUG", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    if traceback:
        with pytest.raises(KeyError):
            main(["--root", str(root.root), *argv])
        return
    assert main(["--root", str(root.root), *argv]) == 70
    err = capsys.readouterr().err
    assert err == (
        "kvcd: internal error: KeyError: 'slot' "
        "(a bug in kvcd; run again with -v or KVCD_DEBUG=1 for the traceback)\n"
    )


# Parsing with the named verb's parser alone (#20) must be parsing with all of them: the same
# namespace, or the same exit code and the same words on stderr.
PARSES = [
    ["status"],
    ["status", "e2e", "--json"],
    ["--root", "/x", "-v", "status"],
    ["--root=/x", "check-config", "--all"],
    ["--root", "status", "status"],  # a root named like a verb
    ["--verbose", "--root=/x", "load", "e2e", "--dry-run"],
    ["check-config", "e2e", "--kernel", K],
    ["check-config"],  # its group is required
    ["check-config", "e2e", "--all"],
    ["capabilities", "--json", "--explain", "e2e"],
    ["kabi", "x.ko"],  # --kernel is required
    ["kabi", "e2e", "--kernel", K, "--json"],
    ["run", "e2e"],
    ["build", "e2e", "--dry-run", "--kernel", K],
    ["load", "e2e", "--bogus"],
    ["unload", "e2e", "--dry-run"],
    ["reload", "e2e", "--timeout", "5"],
    ["reload", "e2e", "--timeout", "soon"],
    ["label", "a=b", "c-"],
    ["annotate"],
    ["purge", "--all"],
    ["prepare", "e2e", "--kernel", K],
    ["prepare", "--all"],
    ["metrics", "--write"],
    ["image", "import", "e2e", "/a.tar", "--kernel", K],
    ["image"],
    ["wrapper", "e2e", "modinfo", "-F", "version", "x"],
    ["status", "--help"],
    ["image", "import", "--help"],
]


def _parse(argv: list[str], parser: argparse.ArgumentParser) -> object:
    err = io.StringIO()
    out = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            return vars(parser.parse_args(argv))
    except SystemExit as exc:
        return (exc.code, err.getvalue(), out.getvalue())


@pytest.mark.parametrize("argv", PARSES, ids=" ".join)
def test_the_named_verbs_parser_alone_parses_as_the_whole_one(argv: list[str]) -> None:
    assert cli._named_verb(argv) is not None
    assert _parse(argv, cli._parser(argv)) == _parse(argv, cli._parser())


@pytest.mark.parametrize(
    ("argv", "verb"),
    [
        (["status"], "status"),
        (["-v", "--root", "/r", "status"], "status"),
        (["--root", "status", "load", "x"], "load"),
        (["--root=/r", "purge", "--all"], "purge"),
        (["stauts"], None),  # a typo: the whole parser, so the error lists every verb
        (["--help", "status"], None),
        (["--ro", "status", "load", "x"], None),  # argparse takes --ro for --root
        (["-vh", "status"], None),
        (["-h"], None),
        ([], None),
    ],
)
def test_named_verb(argv: list[str], verb: str | None) -> None:
    assert cli._named_verb(argv) == verb


def test_usage_without_a_verb_lists_every_verb(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["stauts"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'stauts'" in err
    for verb in cli._VERBS:
        assert f"'{verb}'" in err


@pytest.mark.parametrize("value", ["nan", "-1", "0", "inf", "-inf", "1e400", "soon"])
def test_reload_timeout_must_be_positive_and_finite(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A usage error before anything is signalled (it used to wait 'within nans')."""
    with pytest.raises(SystemExit) as exc:
        cli.main(["reload", "e2e", f"--timeout={value}"])
    assert exc.value.code == cli.EXIT_USAGE
    err = capsys.readouterr().err.splitlines()[-1]
    assert err == f"kvcd: error: argument --timeout: {value!r} is not a positive number of seconds"


def test_reload_timeout_takes_fractions() -> None:
    assert cli._parser().parse_args(["reload", "e2e", "--timeout", "0.5"]).timeout == 0.5


@pytest.mark.parametrize("stdout", ["kept", "closed"])
@pytest.mark.parametrize("columns", ["50", "200", "0", "-3", "wide", None])
def test_help_is_as_wide_as_argparse_would_make_it(
    columns: str | None, stdout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kvcd tells argparse the width itself, as shutil would ($COLUMNS, else the terminal, else
    80), because importing shutil costs every start ~2 ms. "closed": started with no stdout
    (`kvcd --help >&-`), where Python sets sys.__stdout__ to None."""
    import shutil

    if columns is None:
        monkeypatch.delenv("COLUMNS", raising=False)
    else:
        monkeypatch.setenv("COLUMNS", columns)
    if stdout == "closed":
        monkeypatch.setattr(sys, "__stdout__", None)
    width = shutil.get_terminal_size().columns - 2  # what argparse does when not told
    parser = cli._parser()
    assert parser._get_formatter()._width == width
    assert max(map(len, parser.format_help().splitlines())) <= width
