"""Guest-side scenarios for registries as users have them, and air-gapped nodes (issue #18,
part 4). Debian's docker-registry (the reference distribution server) listens on
localhost:5443 with TLS (a CA and certificate run-guest.sh made on the host, payload/registry/)
and basic auth (htpasswd, bcrypt). The instance e2e-reg ships kvcd_base in FROM-scratch images.

(r1) An image behind basic auth, no credentials configured: Degraded PullFailed, the registry's
     refusal in the reason.
(r2) `auth_file` (containers-auth.json, mode 600): pulled over verified TLS and loaded; the
     journal names the file, never the password.
(r3) TLS is verified by default: the CA taken out of /etc/containers/certs.d, a new version's
     pull fails on the certificate while the loaded version stays; the CA back, the back-off
     timer's retry loads it, untouched by hand.
(r4) Pinned to an image archive (`image_archive`), the registry stopped: the archive is loaded,
     its modules loaded.
(r5) `kvcd image import NAME ARCHIVE` for an instance that pulls from a registry that is down:
     the imported image is used, nothing pulled.

Everything is put back: the registry's config, certs.d, e2e-kmod.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import shutil
import socket
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

with warnings.catch_warnings():  # deprecated in 3.11; Debian 12's python has it, bcrypt too
    warnings.simplefilter("ignore", DeprecationWarning)
    import crypt
from kvcdguest import (
    BUILD_TIMEOUT,
    DRIVER_DIR,
    PAYLOAD,
    STATE_DIR,
    core_instance_aside,
    kvcd_status,
    not_yet,
    proc_modules,
    sh,
    wait_for,
)

KVER = os.uname().release
NAME = "e2e-reg"
UNIT = f"kvcd@{NAME}.service"
CONF = Path(f"/etc/kvcd/instances/{NAME}.toml")
AUTH = Path(f"/etc/kvcd/auth/{NAME}.json")
PORT = 5443
REGISTRY = f"localhost:{PORT}"
REPO = f"{REGISTRY}/kvcd/{NAME}"
CERTS_D = Path(f"/etc/containers/certs.d/{REGISTRY}")
REGISTRY_DIR = Path("/etc/docker/registry")
REGISTRY_CONF = REGISTRY_DIR / "config.yml"
ARCHIVES = STATE_DIR / "archives"
USER, PASSWORD = "kvcd", secrets.token_hex(12)
CONTAINERFILE = "FROM scratch\nARG KVER\nCOPY kvcd_base.ko /lib/modules/${KVER}/extra/\n"


def registry_config() -> str:
    return (
        "version: 0.1\n"
        "storage:\n  filesystem:\n    rootdirectory: /var/lib/docker-registry\n"
        f"http:\n  addr: 127.0.0.1:{PORT}\n"
        f"  tls:\n    certificate: {REGISTRY_DIR}/tls.crt\n    key: {REGISTRY_DIR}/tls.key\n"
        f"auth:\n  htpasswd:\n    realm: kvcd-e2e\n    path: {REGISTRY_DIR}/htpasswd\n"
    )


def listening() -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", PORT)) == 0


def build(tag: str) -> None:
    """A FROM-scratch image of kvcd_base for the running kernel, tagged `tag`."""
    ctx = STATE_DIR / "registry-ctx"
    shutil.rmtree(ctx, ignore_errors=True)
    ctx.mkdir(parents=True)
    shutil.copy2(DRIVER_DIR / "prebuilt" / KVER / "1.0" / "kvcd_base.ko", ctx)
    (ctx / "Containerfile").write_text(CONTAINERFILE)
    sh(["podman", "build", "-q", "-t", tag, "--build-arg", f"KVER={KVER}", str(ctx)], timeout=600)


def push(version: str) -> None:
    ref = f"{REPO}:{version}-{KVER}"
    build(ref)
    sh(["podman", "push", "-q", "--creds", f"{USER}:{PASSWORD}", ref], timeout=600)
    sh(["podman", "rmi", ref])


def save(version: str, archive: Path) -> None:
    tag = f"localhost/e2e-reg-src:{version}"
    build(tag)
    archive.parent.mkdir(parents=True, exist_ok=True)
    archive.unlink(missing_ok=True)
    sh(["podman", "save", "-q", "-o", str(archive), tag], timeout=600)
    sh(["podman", "rmi", tag])


def write_instance(version: str, **keys: Any) -> None:
    lines = [f'version = "{version}"', 'modules = ["kvcd_base"]']
    lines += [f"{k} = {json.dumps(v)}" for k, v in keys.items()]
    CONF.write_text("\n".join(lines) + "\n")
    CONF.chmod(0o644)


def pulled_from_registry(version: str) -> None:
    write_instance(version, image=f"{REPO}:{{version}}-{{kernel}}", auth_file=str(AUTH))


def degraded(code: str, timeout: float = 300) -> dict[str, Any]:
    def pred() -> dict[str, Any] | None:
        if not_yet(NAME, state="Degraded"):
            return None
        st = kvcd_status(NAME)
        return st if st and st.get("state") == "Degraded" else None

    st = wait_for(pred, timeout, f"{NAME} Degraded ({code})", interval=1)
    assert st.get("code") == code, st
    return st


def done_at(version: str, timeout: float = 300) -> dict[str, Any]:
    def pred() -> dict[str, Any] | None:
        if not_yet(NAME, state="Done", version=version):
            return None
        st = kvcd_status(NAME)
        ok = st and (st.get("state"), st.get("version")) == ("Done", version)
        return st if ok and "kvcd_base" in proc_modules() else None

    st: dict[str, Any] = wait_for(pred, timeout, f"{NAME} Done at {version}", interval=1)
    return st


def journal(since: str) -> str:
    return sh(["journalctl", "-o", "cat", "--since", since, "-u", UNIT], check=False).stdout


def now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(time.time() - 1))


@pytest.fixture(scope="module", autouse=True)
def registry() -> Iterator[None]:
    tls = PAYLOAD / "registry"
    assert (tls / "ca.crt").is_file(), "run-guest.sh made no registry certificates"
    saved_conf = REGISTRY_CONF.read_bytes() if REGISTRY_CONF.exists() else None
    for name in ("tls.crt", "tls.key"):
        shutil.copy2(tls / name, REGISTRY_DIR / name)
        shutil.chown(REGISTRY_DIR / name, "docker-registry", "docker-registry")
        (REGISTRY_DIR / name).chmod(0o600)
    salt = crypt.mksalt(crypt.METHOD_BLOWFISH)
    (REGISTRY_DIR / "htpasswd").write_text(f"{USER}:{crypt.crypt(PASSWORD, salt)}\n")
    (REGISTRY_DIR / "htpasswd").chmod(0o644)
    REGISTRY_CONF.write_text(registry_config())
    CERTS_D.mkdir(parents=True, exist_ok=True)
    shutil.copy2(tls / "ca.crt", CERTS_D / "ca.crt")
    sh(["systemctl", "restart", "docker-registry.service"])
    wait_for(listening, 60, "the registry to listen", interval=0.5)
    AUTH.parent.mkdir(parents=True, exist_ok=True)
    AUTH.unlink(missing_ok=True)
    try:
        with core_instance_aside():  # e2e-kmod ships kvcd_base too: one owner per module
            yield
            sh(["systemctl", "stop", UNIT], check=False, timeout=600)
            CONF.unlink(missing_ok=True)
    finally:
        sh(["systemctl", "stop", "docker-registry.service"], check=False)
        if saved_conf is not None:
            REGISTRY_CONF.write_bytes(saved_conf)
        shutil.rmtree(CERTS_D, ignore_errors=True)
        shutil.rmtree(ARCHIVES, ignore_errors=True)
        AUTH.unlink(missing_ok=True)


def test_r1_no_credentials_is_pull_failed() -> None:
    push("1.0")
    write_instance("1.0", image=f"{REPO}:{{version}}-{{kernel}}")
    sh(["systemctl", "start", "--no-block", UNIT])
    st = degraded("PullFailed")
    assert f"{REPO}:1.0-{KVER}" in st["detail"], st
    assert any(w in st["detail"] for w in ("unauthorized", "authentication required")), st
    assert "kvcd_base" not in proc_modules()


def test_r2_auth_file_pulls_over_verified_tls() -> None:
    since = now()
    token = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
    AUTH.write_text(json.dumps({"auths": {REGISTRY: {"auth": token}}}))
    AUTH.chmod(0o600)
    pulled_from_registry("1.0")
    sh(["systemctl", "restart", UNIT], timeout=BUILD_TIMEOUT)
    done_at("1.0")
    logged = journal(since)
    assert f"with the credentials of {AUTH}" in logged, logged[-2000:]
    assert PASSWORD not in logged and token not in logged


def test_r3_tls_is_verified_by_default() -> None:
    push("1.1")
    (CERTS_D / "ca.crt").unlink()
    pulled_from_registry("1.1")
    sh(["systemctl", "reload", UNIT], check=False, timeout=600)
    st = degraded("PullFailed")
    assert "certificate" in st["detail"] or "x509" in st["detail"], st
    assert (st.get("attempt") or {}).get("outcome") == "transient", st
    assert "kvcd_base" in proc_modules()  # the loaded version stays in service
    shutil.copy2(PAYLOAD / "registry" / "ca.crt", CERTS_D / "ca.crt")
    done_at("1.1", timeout=600)  # the back-off timer's retry, nothing done by hand


def test_r4_pinned_archive_needs_no_registry() -> None:
    sh(["systemctl", "stop", "docker-registry.service"])
    save("2.0", ARCHIVES / f"{NAME}-2.0-{KVER}.tar")
    write_instance("2.0", image_archive=f"{ARCHIVES}/{NAME}-{{version}}-{{kernel}}.tar")
    out = sh(["kvcd", "check-config", NAME, "--kernel", KVER]).stdout
    assert f"load {ARCHIVES}/{NAME}-2.0-{KVER}.tar as localhost/kvcd/{NAME}/2.0:" in out, out
    since = now()
    sh(["systemctl", "reload", UNIT], timeout=BUILD_TIMEOUT)
    done_at("2.0")
    assert f"loaded {ARCHIVES}/{NAME}-2.0-{KVER}.tar" in journal(since)


def test_r5_image_import_for_a_registry_that_is_down() -> None:
    archive = ARCHIVES / "hand-carried.tar"
    save("2.1", archive)
    pulled_from_registry("2.1")  # the registry is stopped (r4): a pull cannot succeed
    out = sh(["kvcd", "image", "import", NAME, str(archive)]).stdout
    assert f"is localhost/kvcd/{NAME}/2.1:" in out and f"kvcd@{NAME} 2.1 on {KVER}" in out, out
    since = now()
    sh(["systemctl", "reload", UNIT], timeout=BUILD_TIMEOUT)
    done_at("2.1")
    logged = journal(since)
    assert "is cached; no build" in logged and "pulling" not in logged, logged[-2000:]
