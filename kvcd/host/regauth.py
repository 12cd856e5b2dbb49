"""Registry credentials for pulls (issue #18): an instance's `auth_file` and the node's
`pull_secret`, both in the containers-auth.json(5) format (what `podman login` writes, and a
Kubernetes pull secret's `.dockerconfigjson`, which the kubelet keeps in its config.json).

It may touch: those two files (the admin's, outside kvcd's directories: read without following a
FIFO). Credentials go to the podman service in the pull request's X-Registry-Auth header, never to
a log line: errors name the file and the key, not the secret.

Lookup, as containers-auth.json(5) says: for `registry.example.com/team/driver:tag` the most
specific key wins: `registry.example.com/team/driver`, then `registry.example.com/team`, then
`registry.example.com`. Docker-style keys (`https://index.docker.io/v1/`) are read as their host.
The instance's file is asked first, then the node's.
"""

from __future__ import annotations

import base64
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvcd.config.model import ConfigLocations, InstanceConfig, Settings

MAX_SIZE = 1 << 20  # an auth file is a few hundred bytes; a megabyte is not one


class AuthFileError(Exception):
    """The file cannot be used: one line naming it (never its secrets)."""


@dataclass(frozen=True)
class Credentials:
    username: str = ""
    password: str = ""
    identitytoken: str = ""
    source: str = ""  # "<file>: <key>", for messages

    def header(self) -> str:
        """The X-Registry-Auth value podman's API takes: base64url of the JSON auth config."""
        data = (
            {"identitytoken": self.identitytoken}
            if self.identitytoken
            else {"username": self.username, "password": self.password}
        )
        return base64.urlsafe_b64encode(json.dumps(data).encode()).decode()


def _key(raw: str) -> str:
    """An auths key as a registry path: no scheme, no trailing slash, no Docker's /v1."""
    key = raw.split("://", 1)[-1].rstrip("/")
    return key[: -len("/v1")] if key.endswith("/v1") else key


def read(path: Path) -> dict[str, Credentials]:
    """The credentials of an auth file by registry path; AuthFileError naming what is wrong."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise AuthFileError(f"{path}: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise AuthFileError(f"{path}: not a regular file")
        problem = _mode_problem(st)
        if problem:
            raise AuthFileError(f"{path}: {problem}")
        raw = os.read(fd, MAX_SIZE + 1)
    except OSError as exc:  # a file that refuses its read (/proc/self/mem: EIO)
        raise AuthFileError(f"{path}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if len(raw) > MAX_SIZE:
        raise AuthFileError(f"{path}: larger than {MAX_SIZE} bytes: not an auth file")
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise AuthFileError(f"{path}: not JSON ({exc})") from None
    auths = data.get("auths") if isinstance(data, dict) else None
    if not isinstance(auths, dict):
        raise AuthFileError(f'{path}: no "auths" object (containers-auth.json(5))')
    out: dict[str, Credentials] = {}
    for key, entry in auths.items():
        out[_key(str(key))] = _entry(path, str(key), entry)
    return out


def _mode_problem(st: os.stat_result) -> str | None:
    if st.st_uid not in (0, os.geteuid()):
        return f"owned by uid {st.st_uid}, not by root"
    if st.st_mode & 0o077:
        return f"mode {stat.S_IMODE(st.st_mode):04o}: others can read its passwords (chmod 600 it)"
    return None


def _entry(path: Path, key: str, entry: object) -> Credentials:
    where = f"{path}: {key}"
    if not isinstance(entry, dict):
        raise AuthFileError(f"{where}: not an object")
    token = entry.get("identitytoken")
    if isinstance(token, str) and token:
        return Credentials(identitytoken=token, source=where)
    auth = entry.get("auth")
    if isinstance(auth, str) and auth:
        try:
            user, sep, password = base64.b64decode(auth, validate=True).decode().partition(":")
        except (ValueError, UnicodeDecodeError):
            raise AuthFileError(f'{where}: "auth" is not base64 of user:password') from None
        if not sep or not user:
            raise AuthFileError(f'{where}: "auth" is not base64 of user:password')
        return Credentials(user, password, source=where)
    name, secret = entry.get("username"), entry.get("password")
    if isinstance(name, str) and name and isinstance(secret, str):
        return Credentials(name, secret, source=where)
    raise AuthFileError(f'{where}: neither "auth", "username"/"password" nor "identitytoken"')


def lookup(auths: dict[str, Credentials], ref: str) -> Credentials | None:
    """The credentials for image reference `ref` (most specific key first), or None."""
    name = ref.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    if ":" in last:  # a tag, not a registry port
        name = name[: len(name) - len(last)] + last.split(":", 1)[0]
    parts = name.split("/")
    for n in range(len(parts), 0, -1):
        found = auths.get("/".join(parts[:n]))
        if found is not None:
            return found
    return None


def credentials(ref: str, paths: list[Path]) -> Credentials | None:
    """The first file's credentials for `ref`, in order; AuthFileError when a file is bad."""
    for path in paths:
        found = lookup(read(path), ref)
        if found is not None:
            return found
    return None


def check(root: ConfigLocations, cfg: InstanceConfig | None, settings: Settings) -> None:
    """check-config and the start: each credentials file the configuration names must be one
    kvcd can use (ConfigError naming the setting's file and line), before any pull needs it."""
    from kvcd.config.loader import setting_line, settings_source
    from kvcd.config.model import ConfigError

    named: list[tuple[Path, str, str]] = []
    if cfg is not None and cfg.auth_file:
        named.append((Path(cfg.source), "auth_file", cfg.auth_file))
    if settings.pull_secret:
        named.append(
            (settings_source(root) or root.main_config, "pull_secret", settings.pull_secret)
        )
    for where, key, value in named:
        try:
            read(Path(value))
        except AuthFileError as exc:
            raise ConfigError(where, f"'{key}': {exc}", setting_line(where, key)) from None


def files_for(cfg: InstanceConfig, settings: Settings | None) -> list[Path]:
    """The credentials files of an instance's pulls, in the order they are asked."""
    secret = settings.pull_secret if settings is not None else ""
    return [Path(p) for p in (cfg.auth_file, secret) if p]
