"""Fixtures for integration tests: the real tools of this machine.

Podman: one private rootful `podman system service` per test session (scripts/podman-service.sh,
its own store under the session's tmp dir, so the host's images are never seen or touched), a
`Podman` client on it, a raw podman-py APIClient for assertions behind kvcd's back, and a tiny
busybox base image made with scripts/make-base-image.sh. Without podman the podman tests are
skipped, unless CI is set: then that is a failure.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from podman.api import APIClient

from kvcd.host.podman import Podman
from kvcd.host.run import run

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts"


@dataclass(frozen=True)
class PodmanService:
    dir: Path
    url: str
    # CONTAINERS_CONF, CONTAINERS_STORAGE_CONF and CONTAINER_HOST of this service
    env: dict[str, str]


@pytest.fixture(scope="session")
def podman_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PodmanService]:
    if shutil.which("podman") is None:
        if os.environ.get("CI"):
            pytest.fail("podman is not installed, and CI is set (apt-get install -y podman runc)")
        pytest.skip("podman is not installed (apt-get install -y podman runc; CI=1 makes it fail)")
    sdir = tmp_path_factory.mktemp("podman")
    script = str(SCRIPTS / "podman-service.sh")
    url = run([script, "start", str(sdir)], timeout=60).stdout.strip()
    env = {
        "CONTAINERS_CONF": str(sdir / "containers.conf"),
        "CONTAINERS_STORAGE_CONF": str(sdir / "storage.conf"),
        "CONTAINER_HOST": url,
    }
    try:
        yield PodmanService(sdir, url, env)
    finally:
        run([script, "stop", str(sdir)], timeout=60)


@pytest.fixture(scope="session")
def podman(podman_service: PodmanService) -> Iterator[Podman]:
    """A kvcd Podman client of the session's service."""
    with Podman(podman_service.url, timeout=30) as client:
        yield client


@pytest.fixture(scope="session")
def podman_api(podman_service: PodmanService) -> Iterator[Any]:
    """podman-py's low-level client of the same service, to check what kvcd did."""
    client = APIClient(base_url=podman_service.url, timeout=30)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture(scope="session")
def base_image(podman_service: PodmanService) -> str:
    """A busybox-static base image in the session's store."""
    name = "localhost/kvcd-test/busybox:latest"
    env = {**os.environ, **podman_service.env, "TMPDIR": str(podman_service.dir / "tmp")}
    run([str(SCRIPTS / "make-base-image.sh"), name], env=env, timeout=300)
    return name
