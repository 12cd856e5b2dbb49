"""Registry credentials (issue #18): containers-auth.json(5) files, the most specific key, the
refusals check-config and the start make, and the pull that carries them (never the log)."""

from __future__ import annotations

import base64
import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest

from kvcd.config.loader import load_instance, load_settings
from kvcd.config.model import ConfigError
from kvcd.core import state
from kvcd.core.state import StepFailed
from kvcd.host import regauth
from kvcd.host.paths import HostRoot
from kvcd.host.regauth import AuthFileError, Credentials
from tests import fakehost
from tests.unit.test_instance import FakePodman, K, instance_host


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def auth_file(path: Path, auths: object, mode: int = 0o600) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"auths": auths}))
    path.chmod(mode)
    return path


AUTHS = {
    "reg.example": Credentials("any", "p0"),
    "reg.example/team": Credentials("team", "p1"),
    "reg.example/team/driver": Credentials("driver", "p2"),
    "reg.example:5000": Credentials("port", "p3"),
}
LOOKUP = [
    ("reg.example/team/driver:1.0", "driver"),
    ("reg.example/team/other:1.0", "team"),
    ("reg.example/else/x", "any"),
    ("reg.example/team/driver@sha256:" + "a" * 64, "driver"),
    ("reg.example:5000/team/driver:2", "port"),  # a port is not a tag
    ("quay.io/team/driver:1", None),
]


@pytest.mark.parametrize(("ref", "user"), LOOKUP, ids=[r for r, _ in LOOKUP])
def test_the_most_specific_key_wins(ref: str, user: str | None) -> None:
    found = regauth.lookup(AUTHS, ref)
    assert (found.username if found else None) == user


def test_entries_in_every_form_podman_and_docker_write(tmp_path: Path) -> None:
    path = auth_file(
        tmp_path / "auth.json",
        {
            "https://index.docker.io/v1/": {"auth": b64("hub:pass:with:colons")},
            "reg.example": {"username": "u", "password": "p"},
            "quay.io": {"identitytoken": "tok"},
        },
    )
    got = regauth.read(path)
    assert got["index.docker.io"].username == "hub"
    assert got["index.docker.io"].password == "pass:with:colons"
    assert (got["reg.example"].username, got["reg.example"].password) == ("u", "p")
    assert got["quay.io"].identitytoken == "tok"
    header = json.loads(base64.urlsafe_b64decode(got["reg.example"].header()))
    assert header == {"username": "u", "password": "p"}
    assert json.loads(base64.urlsafe_b64decode(got["quay.io"].header())) == {"identitytoken": "tok"}


BAD = [
    (
        "others can read it",
        {"r": {"auth": b64("u:p")}},
        0o644,
        "mode 0644: others can read its passwords (chmod 600 it)",
    ),
    ("not base64", {"r": {"auth": "!!!"}}, 0o600, 'r: "auth" is not base64 of user:password'),
    (
        "no colon",
        {"r": {"auth": b64("justuser")}},
        0o600,
        'r: "auth" is not base64 of user:password',
    ),
    (
        "nothing usable",
        {"r": {"email": "x"}},
        0o600,
        'r: neither "auth", "username"/"password" nor "identitytoken"',
    ),
    ("not an object", {"r": "u:p"}, 0o600, "r: not an object"),
]


@pytest.mark.parametrize(("why", "auths", "mode", "said"), BAD, ids=[b[0] for b in BAD])
def test_a_file_kvcd_cannot_use_is_named_without_its_secrets(
    tmp_path: Path, why: str, auths: object, mode: int, said: str
) -> None:
    path = auth_file(tmp_path / "auth.json", auths, mode)
    with pytest.raises(AuthFileError) as exc:
        regauth.read(path)
    assert str(exc.value) == f"{path}: {said}"
    assert "s3cret-pw" not in str(exc.value)


def test_a_file_that_refuses_its_read_is_named() -> None:
    """A path that opens but cannot be read (/proc/self/mem: EIO at offset 0) is an
    AuthFileError naming it (check-config: file, line, exit 2), not a bare errno."""
    with pytest.raises(AuthFileError) as exc:
        regauth.read(Path("/proc/self/mem"))
    assert str(exc.value) == "/proc/self/mem: Input/output error"


def test_not_json_a_fifo_and_a_missing_file_are_refused_without_blocking(tmp_path: Path) -> None:
    (tmp_path / "bad.json").write_text("{")
    (tmp_path / "bad.json").chmod(0o600)
    (tmp_path / "noauths.json").write_text("{}")
    (tmp_path / "noauths.json").chmod(0o600)
    os.mkfifo(tmp_path / "fifo.json", 0o600)
    for name, said in (
        ("bad.json", "not JSON"),
        ("noauths.json", 'no "auths" object'),
        ("fifo.json", "not a regular file"),
        ("missing.json", "No such file or directory"),
    ):
        with pytest.raises(AuthFileError, match=said):
            regauth.read(tmp_path / name)


# --- configuration: refused at check-config and at the start, naming the file and line ----------


@pytest.fixture
def host(tmp_path: Path, fake_commands: Any, monkeypatch: pytest.MonkeyPatch) -> HostRoot:
    return instance_host(tmp_path, fake_commands, monkeypatch)


def test_check_names_the_setting_line_for_an_unusable_file(host: HostRoot) -> None:
    secret = auth_file(host("/etc/kvcd/auth/e2e.json"), {"r": {"auth": b64("u:p")}}, 0o644)
    fakehost.write_config(
        host,
        "e2e",
        f'version = "1"\nmodules = ["kvcd_base"]\nimage = "r/x:1"\nauth_file = "{secret}"\n',
    )
    cfg = load_instance(host, "e2e")
    with pytest.raises(ConfigError) as exc:
        regauth.check(host, cfg, load_settings(host))
    assert str(exc.value) == (
        f"{cfg.source}:4: 'auth_file': {secret}: mode 0644: others can read its passwords "
        "(chmod 600 it)"
    )
    secret.chmod(0o600)
    regauth.check(host, cfg, load_settings(host))


def test_auth_file_without_an_image_is_refused(host: HostRoot) -> None:
    fakehost.write_config(
        host,
        "e2e",
        'version = "1"\nmodules = ["kvcd_base"]\nauth_file = "/a.json"\n'
        '[build]\ncontext = "/src"\n',
    )
    with pytest.raises(ConfigError, match="'auth_file' holds credentials for pulling 'image'"):
        load_instance(host, "e2e")


# --- the pull ------------------------------------------------------------------------------------


def test_the_pull_carries_the_instances_credentials_and_the_log_does_not(
    host: HostRoot, caplog: pytest.LogCaptureFixture
) -> None:
    from dataclasses import replace

    from kvcd.config.model import Settings
    from kvcd.daemon.instance import Instance
    from tests.unit.test_instance import config

    secret = auth_file(
        host("/etc/kvcd/auth/e2e.json"), {"reg.example": {"auth": b64("robot:s3cret")}}
    )
    node = auth_file(
        host("/var/lib/kubelet/config.json"), {"reg.example": {"auth": b64("node:n0de")}}
    )
    pod = FakePodman(host, K)
    image = "reg.example/drv:{kernel}"
    cfg = replace(config(host, image=image, auth_file=str(secret), tls_verify=False), build=None)
    settings = Settings(pull_secret=str(node))
    with caplog.at_level(logging.INFO), pytest.raises(StepFailed) as exc:
        Instance(host, settings, cfg, K, podman=lambda: pod).apply("load")
    assert exc.value.code == state.PULL_FAILED  # the fake registry has no such image
    sent = json.loads(base64.urlsafe_b64decode(pod.pulled_with["auth"]))
    assert (
        sent == {"username": "robot", "password": "s3cret"}
        and pod.pulled_with["tls_verify"] is False
    )
    assert f"with the credentials of {secret}: reg.example" in caplog.text
    assert "s3cret" not in caplog.text and "n0de" not in caplog.text
    # Without an auth_file of its own, the node's pull secret.
    cfg = replace(config(host, image="reg.example/drv:{kernel}"), build=None)
    with pytest.raises(StepFailed):
        Instance(host, settings, cfg, K, podman=lambda: pod).apply("load")
    assert json.loads(base64.urlsafe_b64decode(pod.pulled_with["auth"]))["username"] == "node"
    assert pod.pulled_with["tls_verify"] is True
