"""Real test kernel modules (tests/kmods) for integration tests, compiled once and cached.

`build_test_kmods()` runs scripts/build-test-kmods.sh against the newest installed Debian
`linux-headers-*-amd64` and caches the result under a key of (kernel version, hash of the
sources + build script + headers' Module.symvers stamp, KMODVER), so a session compiles each
KMODVER at most once and a later session reuses it while nothing changed.

Cache: $KVCD_TEST_KMOD_CACHE, else ${XDG_CACHE_HOME:-~/.cache}/kvcd/test-kmods.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvcd.host.run import run

REPO = Path(__file__).resolve().parents[2]
SOURCES = REPO / "tests" / "kmods"
BUILD_SCRIPT = REPO / "scripts" / "build-test-kmods.sh"
HEADERS_GLOB = "linux-headers-*-amd64"


@dataclass(frozen=True)
class BuiltKmods:
    kernel: str
    """the kernel version the modules were built for (their vermagic)"""
    kmodver: str
    """MODULE_VERSION of every module"""
    dir: Path
    base: Path
    user: Path
    bad: Path
    symvers: Path
    """Module.symvers of kvcd_base + kvcd_user (exports kvcd_base_greet)"""
    kernel_symvers: Path
    """the kernel's Module.symvers from the headers (vmlinux + in-tree exports)"""


def _version_key(kernel: str) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", kernel))


def newest_headers(src: Path = Path("/usr/src")) -> str | None:
    """Kernel version of the newest installed linux-headers-*-amd64 with a build tree."""
    found = [
        p.name[len("linux-headers-") :]
        for p in src.glob(HEADERS_GLOB)
        if (p / "Makefile").is_file() and (p / "Module.symvers").is_file()
    ]
    return max(found, key=_version_key) if found else None


def missing_tools() -> list[str]:
    return [t for t in ("make", "depmod", "modprobe") if shutil.which(t) is None]


def require(what: str, missing: list[str], hint: str) -> None:
    """Skip a test whose tools or headers this machine lacks; under CI (which installs them
    all) that is a failure, never a silent skip."""
    if not missing:
        return
    why = f"cannot {what}, missing {', '.join(missing)} ({hint})"
    if os.environ.get("CI"):
        pytest.fail(why + ", and CI is set")
    pytest.skip(why)


def compiled_kmods_or_skip(hint: str, kmodver: str = "1.0") -> BuiltKmods:
    """The test modules compiled for the newest installed headers (see `require`)."""
    missing = missing_tools()
    if newest_headers() is None:
        missing.append("linux-headers-*-amd64")
    require("build test modules", missing, hint)
    return build_test_kmods(kmodver)


def _sources_hash(headers: Path) -> str:
    h = hashlib.sha256()
    for path in sorted([*SOURCES.iterdir(), BUILD_SCRIPT]):
        if path.is_file():
            h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    st = (headers / "Module.symvers").stat()
    h.update(f"{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def _cache_root() -> Path:
    env = os.environ.get("KVCD_TEST_KMOD_CACHE")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "kvcd" / "test-kmods"


def build_test_kmods(kmodver: str = "1.0", kernel: str | None = None) -> BuiltKmods:
    """Compile (or reuse) the test modules; raises LookupError when no headers are installed."""
    kernel = kernel or newest_headers()
    if kernel is None:
        raise LookupError(f"no /usr/src/{HEADERS_GLOB} installed")
    headers = Path(f"/usr/src/linux-headers-{kernel}")
    out = _cache_root() / f"{kernel}-{kmodver}-{_sources_hash(headers)}"
    if not (out / "kvcd_bad.ko").is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
        try:
            run([str(BUILD_SCRIPT), kernel, str(scratch), kmodver], timeout=600)
            try:
                scratch.rename(out)  # atomic; a concurrent session may have won the race
            except OSError:
                if not (out / "kvcd_bad.ko").is_file():
                    raise
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return BuiltKmods(
        kernel=kernel,
        kmodver=kmodver,
        dir=out,
        base=out / "kvcd_base.ko",
        user=out / "kvcd_user.ko",
        bad=out / "kvcd_bad.ko",
        symvers=out / "Module.symvers",
        kernel_symvers=headers / "Module.symvers",
    )
