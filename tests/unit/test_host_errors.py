"""Host errors (read-only /run, a full /var, EACCES) end a verb with one line naming the path
and the cause, exit 1 — never a traceback — and deep TOML is a config error, not a crash."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import pytest

from kvcd import cli
from kvcd.config.loader import parse_instance_toml, parse_settings_toml
from kvcd.config.model import ConfigError
from kvcd.host import files
from kvcd.host.paths import HostRoot

ERRORS = [
    (errno.EROFS, "Read-only file system"),
    (errno.ENOSPC, "No space left on device"),
    (errno.EACCES, "Permission denied"),
]


@pytest.mark.parametrize(("code", "text"), ERRORS, ids=["erofs", "enospc", "eacces"])
@pytest.mark.parametrize(
    ("argv", "where"),
    [
        (["label", "kvcd.io/x=1"], "write"),
        (["annotate", "kvcd.io/x=1"], "write"),
        (["status"], "read"),
        (["label"], "read"),
    ],
    ids=["label", "annotate", "status", "label-list"],
)
def test_a_host_error_is_one_line_and_exit_1(
    root: HostRoot,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    code: int,
    text: str,
    argv: list[str],
    where: str,
) -> None:
    (root.state / "instances").mkdir(parents=True)
    (root.state / "instances" / "e2e.json").write_text('{"instance": "e2e", "state": "Done"}')
    (root.state / "node.json").write_text('{"labels": {}, "annotations": {}}')

    def fail(path: Path, *_a: Any, **_k: Any) -> Any:
        raise OSError(code, text, str(path))

    monkeypatch.setattr(files, "atomic_write" if where == "write" else "read_bytes", fail)
    rc = cli.main(["--root", str(root.root), *argv])
    out, err = capsys.readouterr()
    assert rc == 1, err
    assert "Traceback" not in out + err
    if argv == ["status"]:  # status still shows what it can: the instance's line says why not
        (line,) = [x for x in out.splitlines() if text in x]
    else:
        assert out == ""
        (line,) = err.strip().splitlines()
        assert line.startswith("kvcd")
    assert str(root.state) in line and line.endswith(text), line


@pytest.mark.parametrize("opening", ["[" * 3000, "{a = " * 3000])
def test_deep_toml_is_a_config_error(opening: str) -> None:
    closing = "]" * 3000 if opening.startswith("[") else "}" * 3000
    text = f'version = "1"\nx = {opening}1{closing}\n'
    with pytest.raises(ConfigError, match="nested too deeply"):
        parse_instance_toml("x", "/etc/kvcd/instances/x.toml", text)
    with pytest.raises(ConfigError, match="nested too deeply"):
        parse_settings_toml("/etc/kvcd/kvcd.toml", text)
