"""rpm.spec built by scripts/build-rpm.sh with this machine's rpmbuild, then inspected.

One build per session (the unit tests run inside it, in %check): the file lists are compared
with exactly what the tree should give, the scriptlets with the systemd macros' expansions,
the payload with the tree's files, and rpmlint must report no errors (warnings are printed).
The build runs with this interpreter (make setup's venv, where kvcd is installed in editable
mode), whose environment must come out of it exactly as it went in.
Without rpmbuild the module is skipped, unless CI is set: then that is a failure.
"""

from __future__ import annotations

import os
import re
import sys
import sysconfig
import time
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import NamedTuple

import pytest

from kvcd.host.run import run, which

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
SITELIB = re.compile(r"^/usr/lib/python3\.\d+/site-packages$")


class PythonEnv(NamedTuple):
    """What a build could change in the build python's environment (its venv)."""

    distributions: frozenset[tuple[str, str]]
    files: dict[str, tuple[int, int]]  # path -> (size, mtime_ns), under bin/ and site-packages


def python_env() -> PythonEnv:
    paths = sysconfig.get_paths()
    roots = sorted({paths["scripts"], paths["purelib"], paths["platlib"]})
    dists = frozenset((d.metadata["Name"], d.version) for d in metadata.distributions(path=roots))
    files = {}
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            # Imports (this session's or anyone's) may write bytecode; a build must not do more.
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            for name in [*dirnames, *filenames]:
                path = os.path.join(dirpath, name)
                st = os.lstat(path)
                files[path] = (st.st_size, st.st_mtime_ns)
    return PythonEnv(dists, files)


class Built(NamedTuple):
    main: Path
    compat: Path
    srpm: Path
    seconds: float
    env_before: PythonEnv
    env_after: PythonEnv


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Built]:
    missing = [t for t in ("rpmbuild", "rpmspec", "rpmlint", "rpm2cpio", "cpio") if not which(t)]
    if missing:
        msg = f"{', '.join(missing)} not installed (apt-get install -y rpm rpmlint cpio)"
        if os.environ.get("CI"):
            pytest.fail(f"{msg}, and CI is set")
        pytest.skip(msg)
    out = tmp_path_factory.mktemp("rpm")
    # The build python is this one (scripts/build-rpm.sh's default is .venv/bin/python, which
    # `make test` runs): the build reads its environment and must leave it as it was.
    env = {**os.environ, "PYTHON": sys.executable}
    before = python_env()
    start = time.monotonic()
    done = run([str(REPO / "scripts/build-rpm.sh"), str(out)], env=env, check=False, timeout=900)
    seconds = time.monotonic() - start
    after = python_env()
    assert done.rc == 0, done.stderr
    sys.stderr.write(f"\nrpm build (with %check) took {seconds:.1f}s\n")
    (compat,) = out.glob("kvcd-kvc-compat-*.noarch.rpm")
    (main,) = set(out.glob("kvcd-*.noarch.rpm")) - {compat}
    (srpm,) = out.glob("kvcd-*.src.rpm")
    yield Built(main, compat, srpm, seconds, before, after)


def test_build_leaves_the_build_python_environment_alone(built: Built) -> None:
    scripts = Path(sysconfig.get_paths()["scripts"])
    # The case that matters: kvcd itself is installed there (make setup: pip install -e), and
    # a build that installs its wheel with that pip must not replace or remove it.
    assert "kvcd" in {name for name, _version in built.env_before.distributions}, (
        f"kvcd is not installed in {sys.prefix} (run scripts/setup.sh)"
    )
    assert str(scripts / "kvcd") in built.env_before.files, f"no {scripts}/kvcd (scripts/setup.sh)"
    assert built.env_after.distributions == built.env_before.distributions
    before, after = built.env_before.files, built.env_after.files
    changed = {p for p in before.keys() & after.keys() if before[p] != after[p]}
    assert (sorted(before.keys() - after.keys()), sorted(after.keys() - before.keys())) == ([], [])
    assert sorted(changed) == []


def rpmq(pkg: Path, *args: str) -> str:
    return run(["rpm", "-qp", *args, str(pkg)], timeout=60).stdout


def files(pkg: Path) -> list[str]:
    return rpmq(pkg, "-l").splitlines()


def attrs(pkg: Path) -> dict[str, tuple[str, str, str, str]]:
    """path -> (mode in octal, user, group, rpm file flags)."""
    fmt = (
        "[%{FILENAMES}\t%{FILEMODES:octal}\t%{FILEUSERNAME}\t%{FILEGROUPNAME}"
        "\t%{FILEFLAGS:fflags}\n]"
    )
    result = {}
    for line in rpmq(pkg, "--qf", fmt).splitlines():
        path, mode, user, group, flags = line.split("\t")
        result[path] = (mode, user, group, flags)
    return result


def payload(pkg: Path, path: str, tmp_path: Path) -> bytes:
    dest = tmp_path / "payload"
    dest.mkdir(exist_ok=True)
    cpio = run(
        ["sh", "-c", 'rpm2cpio "$1" | cpio -id --quiet "./${2#/}"', "sh", str(pkg), path],
        cwd=str(dest),
        timeout=60,
    )
    assert cpio.rc == 0
    return (dest / path.lstrip("/")).read_bytes()


def source_package_files() -> set[str]:
    """Paths, relative to site-packages, that the kvcd package installs from the tree."""
    pkg = REPO / "kvcd"
    found = {f"kvcd/{p.relative_to(pkg)}" for p in pkg.rglob("*.py")}
    found |= {"kvcd/py.typed", "kvcd/host/kvc-hook.sh"}
    return found


def test_version_and_names_come_from_pyproject(built: Built) -> None:
    for pkg, name in ((built.main, "kvcd"), (built.compat, "kvcd-kvc-compat")):
        assert rpmq(pkg, "--qf", "%{NAME} %{VERSION} %{ARCH}") == f"{name} {VERSION} noarch"
    assert rpmq(built.srpm, "--qf", "%{NAME} %{VERSION}") == f"kvcd {VERSION}"


def test_main_package_file_list_is_exact(built: Built) -> None:
    listed = files(built.main)
    sitelibs = {p.split("/kvcd", 1)[0] for p in listed if "/site-packages/kvcd" in p}
    assert len(sitelibs) == 1, sitelibs
    sitelib = sitelibs.pop()
    assert SITELIB.match(sitelib), sitelib

    python: set[str] = set()
    other = set()
    for path in listed:
        if path.startswith(sitelib + "/"):
            rel = path[len(sitelib) + 1 :]
            if "__pycache__" not in rel:  # byte-compiled on Fedora, not on Debian
                python.add(rel)
        else:
            other.add(path)

    # Bytecode is shipped (Fedora's brp-python-bytecompile; the fallback macros do the same):
    # the sandboxed unit cannot write __pycache__, so without it every start compiles kvcd.
    compiled = {
        str(Path(p).parent.parent / Path(p).name.split(".", 1)[0]) + ".py"
        for p in listed
        if p.startswith(sitelib + "/kvcd/") and p.endswith(".pyc")
    }
    sources = {f"{sitelib}/{p}" for p in python if p.startswith("kvcd/") and p.endswith(".py")}
    assert sources <= compiled, sorted(sources - compiled)[:5]

    dist_info = f"kvcd-{VERSION}.dist-info"
    code = {p for p in python if p.startswith("kvcd/") and not p.endswith("/")}
    dirs = {str(Path(p).parent) for p in source_package_files()}
    assert code - dirs == source_package_files()
    meta = {p for p in python if p.startswith(dist_info)}
    assert {f"{dist_info}/{f}" for f in ("METADATA", "RECORD", "entry_points.txt")} <= meta
    assert python == code | dirs | {"kvcd"} | meta

    docs = {p for p in other if p.startswith("/usr/share/doc/")}
    # Fedora names the directory kvcd, rpm's default (Debian) kvcd-VERSION.
    (doc,) = {d for d in docs if d in ("/usr/share/doc/kvcd", f"/usr/share/doc/kvcd-{VERSION}")}
    assert docs == {doc, f"{doc}/README.md", f"{doc}/example-instance.toml"}
    licenses = {p for p in other if p.startswith("/usr/share/licenses/")}
    (lic,) = {d for d in licenses if not d.endswith("/LICENSE")}
    assert licenses == {lic, f"{lic}/LICENSE"}
    assert other - docs - licenses == {
        "/usr/bin/kvcd",
        "/usr/lib/systemd/system/kvcd@.service",
        "/usr/lib/systemd/system-generators/kvcd-generator",
        "/usr/lib/kernel/install.d",
        "/usr/lib/kernel/install.d/50-kvcd.install",
        "/usr/lib/tmpfiles.d/kvcd.conf",
        "/etc/kvcd",
        "/etc/kvcd/kvcd.toml",
        "/etc/kvcd/instances",
        "/usr/lib/kvcd",
        "/usr/lib/kvcd/kvcd.toml",
        "/usr/lib/kvcd/instances",
        "/var/lib/kvcd",
        "/run/kvcd",
    }


def test_file_attributes(built: Built) -> None:
    a = attrs(built.main)
    # Everything root's; kvcd refuses configuration that anyone else can write.
    assert {(user, group) for _mode, user, group, _flags in a.values()} == {("root", "root")}
    assert {p: m for p, (m, *_rest) in a.items() if int(m, 8) & 0o022} == {}
    assert a["/etc/kvcd/kvcd.toml"] == ("100644", "root", "root", "cn")  # config(noreplace)
    assert a["/usr/lib/kvcd/kvcd.toml"][3] == ""  # vendor defaults: replaced on update
    assert a["/run/kvcd"] == ("40755", "root", "root", "g")  # ghost: tmpfiles.d creates it
    for d in ("/etc/kvcd", "/etc/kvcd/instances", "/usr/lib/kvcd/instances", "/var/lib/kvcd"):
        assert a[d][0] == "40755", d
    assert a["/usr/bin/kvcd"][0] == "100755"
    assert a["/usr/lib/systemd/system/kvcd@.service"][0] == "100644"
    assert a["/usr/lib/systemd/system-generators/kvcd-generator"][0] == "100755"
    assert a["/usr/lib/kernel/install.d/50-kvcd.install"][0] == "100755"


def test_payload_is_the_tree(built: Built, tmp_path: Path) -> None:
    for path, source in (
        ("/usr/lib/systemd/system/kvcd@.service", "systemd/kvcd@.service"),
        ("/etc/kvcd/kvcd.toml", "config/kvcd.toml"),
        ("/usr/lib/kvcd/kvcd.toml", "config/kvcd.toml"),
        ("/usr/lib/tmpfiles.d/kvcd.conf", "packaging/kvcd.tmpfiles"),
        ("/usr/lib/systemd/system-generators/kvcd-generator", "systemd/kvcd-generator"),
        ("/usr/lib/kernel/install.d/50-kvcd.install", "packaging/kernel-install/50-kvcd.install"),
    ):
        assert payload(built.main, path, tmp_path) == (REPO / source).read_bytes(), path
    script = payload(built.main, "/usr/bin/kvcd", tmp_path).decode()
    # The entry point runs the system python, never the interpreter that built the package.
    assert script.splitlines()[0] == "#!/usr/bin/python3"
    assert "from kvcd.cli import main" in script
    shim = payload(built.compat, "/usr/bin/kmods-via-containers", tmp_path)
    assert shim == (REPO / "packaging/kmods-via-containers").read_bytes()


def test_compat_package(built: Built) -> None:
    listed = set(files(built.compat))
    docs = {p for p in listed if p.startswith(("/usr/share/doc/", "/usr/share/licenses/"))}
    assert listed - docs == {"/usr/bin/kmods-via-containers"}
    assert {Path(p).name for p in docs} >= {"LICENSE"}
    assert {Path(p).name for p in docs} >= {"README.md", "kvc-wrapper.sh"}
    assert attrs(built.compat)["/usr/bin/kmods-via-containers"][:3] == ("100755", "root", "root")
    requires = rpmq(built.compat, "-R").splitlines()
    evr = rpmq(built.main, "--qf", "%{VERSION}-%{RELEASE}")
    assert f"kvcd = {evr}" in requires
    assert "/bin/sh" in requires


def test_dependencies(built: Built) -> None:
    requires = set(rpmq(built.main, "-R").splitlines())
    assert {
        "podman",
        "kmod",
        "bash",
        "python3-podman",
        "python3-pyelftools",
        "python3-pyudev",
        "python3-pyroute2",
        "python3-inotify_simple",
        "python3-psutil",
        "/usr/bin/python3",
    } <= requires
    # Optional: only a setting needs each, and says so (kvcd/host/pylibs.py; openssl for
    # sign_key/sign_cert, kvcd/host/modsign.py).
    assert not {"python3-pydbus", "python3-kubernetes", "openssl"} & requires
    assert any(r.startswith("python(abi) = 3.") for r in requires)
    # Nothing may point into the build machine (a venv, the build root, this checkout).
    assert not [r for r in requires if re.search(r"venv|BUILDROOT|/work/|/tmp/|/root/", r)]
    assert sorted(rpmq(built.main, "--recommends").split()) == [
        "openssl",
        "python3-kubernetes",
        "python3-pydbus",
    ]


def scriptlets(pkg: Path) -> dict[str, str]:
    text = rpmq(pkg, "--qf", "%{POSTIN}\n@@\n%{PREUN}\n@@\n%{POSTUN}\n")
    post, preun, postun = (s.strip() for s in text.split("\n@@\n"))
    return {"post": post, "preun": preun, "postun": postun}


def test_scriptlets_are_the_systemd_macros(built: Built) -> None:
    s = scriptlets(built.main)
    helper = "/usr/lib/systemd/systemd-update-helper"
    # systemd >= 250's macros (Fedora, RHEL 9), or the same from packaging/rpm-fallback.macros.
    assert "[ $1 -eq 1 ]" in s["post"]
    assert f"{helper} install-system-units kvcd@.service || :" in s["post"]
    assert "systemd-tmpfiles --create /usr/lib/tmpfiles.d/kvcd.conf" in s["post"]
    assert "[ $1 -eq 0 ]" in s["preun"]
    assert f"{helper} remove-system-units kvcd@.service || :" in s["preun"]
    assert "systemctl stop 'kvcd@*.service' || :" in s["preun"]
    # Erase purges every instance (README "Remove an instance, or kvcd"), never failing it.
    assert "kvcd purge --all || echo" in s["preun"]
    assert s["preun"].index("systemctl stop 'kvcd@*.service'") < s["preun"].index("kvcd purge")
    # Enabled instances are disabled by name (the macro's '%%f' expanded to find's '%f').
    assert "-name 'kvcd@?*.service' -printf '%f\\n'" in s["preun"], s["preun"]
    assert "xargs -r systemctl --no-reload disable || :" in s["preun"]
    assert "rm -rf /var/lib/kvcd /run/kvcd" in s["postun"]
    assert "ls -A /var/lib/kvcd/instances" in s["postun"]
    assert "[ $1 -ge 1 ]" in s["postun"]
    assert f"{helper} mark-restart-system-units kvcd@.service || :" in s["postun"]
    # Every scriptlet runs with /bin/sh and can never fail the transaction on its own.
    for body in s.values():
        for line in body.splitlines():
            if re.match(r"\s*(/usr/lib/systemd/|systemctl|command -v)", line):
                assert line.rstrip().endswith("|| :"), line
    assert rpmq(built.compat, "--qf", "%{POSTIN}%{PREUN}%{POSTUN}") == "(none)(none)(none)"


def test_rpmlint_reports_no_errors(built: Built) -> None:
    done = run(
        [
            "rpmlint",
            "-r",
            str(REPO / "packaging/rpmlintrc"),
            str(built.main),
            str(built.compat),
            str(built.srpm),
        ],
        check=False,
        timeout=300,
    )
    report = done.stdout + done.stderr
    findings = [ln for ln in report.splitlines() if re.search(r": [EW]: ", ln)]
    sys.stderr.write("\nrpmlint:\n" + "\n".join(findings) + "\n")
    assert [f for f in findings if ": E: " in f] == []
    assert re.search(r"\b0 errors\b", report), report
    assert done.rc == 0, report
