"""kABI check on real modules compiled against two Debian 6.1 linux-headers ABI versions.

Kernel A is the newest installed `linux-headers-6.1.0-*-amd64`, kernel B the oldest other one
(CI installs linux-headers-6.1.0-56-amd64 and linux-headers-6.1.0-50-amd64). The test modules
(tests/kmods) are compiled for A and checked against A's and B's Module.symvers, both found on
the real host (HostRoot "/": /usr/src/linux-headers-<k>/Module.symvers, read only). Each verdict
is cross-checked with what `weak-modules` does: `modprobe --dump-modversions X.ko`, every
(CRC, symbol) pair looked up in the kernel's Module.symvers.
"""

from __future__ import annotations

import gzip
import json
import re
import shutil
from pathlib import Path

import pytest

from kvcd.core.kabi import Mismatch
from kvcd.daemon import kabi as daemon_kabi
from kvcd.host import elf, symvers
from kvcd.host.paths import HostRoot
from kvcd.host.run import run
from tests.integration.kmods import BuiltKmods, build_test_kmods, missing_tools, require

pytestmark = pytest.mark.integration

HOST = HostRoot(Path("/"))
APT_HINT = (
    "apt-get install -y make kmod gcc linux-headers-6.1.0-56-amd64 linux-headers-6.1.0-50-amd64"
)


def _installed_6_1() -> list[str]:
    found = [
        p.name[len("linux-headers-") :]
        for p in Path("/usr/src").glob("linux-headers-6.1.0-*-amd64")
        if (p / "Makefile").is_file() and (p / "Module.symvers").is_file()
    ]
    return sorted(found, key=lambda k: int(re.findall(r"\d+", k)[3]))


@pytest.fixture(scope="module")
def kernels() -> tuple[str, str]:
    installed = _installed_6_1()
    missing = missing_tools()
    if len(installed) < 2:
        missing.append(f"two linux-headers-6.1.0-*-amd64 ABI versions (have {installed})")
    require("run the kABI tests", missing, APT_HINT)
    return installed[-1], installed[0]


@pytest.fixture(scope="module")
def built_a(kernels: tuple[str, str]) -> BuiltKmods:
    return build_test_kmods("1.0", kernel=kernels[0])


@pytest.fixture(scope="module")
def built_b(kernels: tuple[str, str]) -> BuiltKmods:
    return build_test_kmods("1.0", kernel=kernels[1])


def dump_modversions(ko: Path) -> dict[str, int]:
    """What `modprobe --dump-modversions` (kmod) reads from __versions."""
    out = run(["modprobe", "--dump-modversions", str(ko)]).stdout
    pairs = (line.split("\t") for line in out.splitlines() if line.strip())
    return {sym: int(crc, 16) for crc, sym in pairs}


def weak_modules_rejects(ko: Path, symvers_file: Path) -> set[str]:
    """weak-modules' method: the module's (CRC, symbol) pairs absent from the kernel's symvers.

    Same comparison as its `comm -23 modvers symvers` over "0xCRC<TAB>symbol" lines.
    """
    kernel_pairs = {
        tuple(line.split("\t")[:2]) for line in symvers_file.read_text().splitlines() if line
    }
    out = run(["modprobe", "--dump-modversions", str(ko)]).stdout
    rejected = set()
    for line in out.splitlines():
        crc, sym = line.split("\t")
        if (f"0x{int(crc, 16):08x}", sym) not in kernel_pairs:
            rejected.add(sym)
    return rejected


def kvcd_rejects(report: daemon_kabi.KabiReport) -> set[str]:
    (m,) = report.modules
    return set(m.verdict.missing) | {x.symbol for x in m.verdict.mismatched}


@pytest.mark.parametrize("module", ["base", "user", "bad"])
def test_versions_read_like_modprobe(built_a: BuiltKmods, module: str) -> None:
    ko: Path = getattr(built_a, module)
    abi = elf.read_module_abi(ko)
    assert dict(abi.crcs) == dump_modversions(ko)
    assert abi.kernel_release == built_a.kernel
    assert abi.arch == "x86_64"
    assert not abi.signed


def test_exports_match_the_build_symvers(built_a: BuiltKmods) -> None:
    built = symvers.load_symvers(built_a.symvers).crcs
    assert dict(elf.read_module_abi(built_a.base).exports) == dict(built)
    assert elf.read_module_abi(built_a.user).exports == {}


@pytest.mark.parametrize("module", ["base", "user", "bad"])
@pytest.mark.parametrize("which", ["same", "other"])
def test_verdicts_agree_with_weak_modules(
    built_a: BuiltKmods, kernels: tuple[str, str], module: str, which: str
) -> None:
    kernel = kernels[0] if which == "same" else kernels[1]
    ko: Path = getattr(built_a, module)
    report = daemon_kabi.check_modules(HOST, [ko], kernel)
    assert report.symvers == Path(f"/usr/src/linux-headers-{kernel}/Module.symvers")
    (m,) = report.modules

    rejected = weak_modules_rejects(ko, report.symvers)
    if module == "bad":
        # weak-modules only sees __versions; modpost wrote no entry for the unresolved symbol,
        # so only kvcd (which also reads the undefined symbols) knows it cannot load.
        assert "kvcd_no_such_symbol" in m.verdict.missing
        assert kvcd_rejects(report) - {"kvcd_no_such_symbol"} == rejected
    else:
        assert kvcd_rejects(report) == rejected
    # Every CRC kvcd reports is the module's own and the one in the kernel's Module.symvers.
    exported = symvers.load_symvers(report.symvers).exports
    modvers = dump_modversions(ko)
    for x in m.verdict.mismatched:
        assert (x.want, x.have) == (modvers[x.symbol], exported[x.symbol].crc)


def test_same_kernel(built_a: BuiltKmods) -> None:
    k = built_a.kernel
    (base,) = daemon_kabi.check_modules(HOST, [built_a.base], k).modules
    assert base.verdict.compatible
    assert base.verdict.checked == len(dump_modversions(built_a.base))
    # kvcd_user alone needs kvcd_base_greet, which the kernel does not export ...
    (user,) = daemon_kabi.check_modules(HOST, [built_a.user], k).modules
    assert user.verdict.missing == ("kvcd_base_greet",)
    assert user.verdict.mismatched == ()
    # ... as a set with its sibling it is compatible.
    pair = daemon_kabi.check_modules(HOST, [built_a.base, built_a.user], k)
    assert pair.compatible


def test_other_abi_is_incompatible(built_a: BuiltKmods, built_b: BuiltKmods) -> None:
    """Debian bumps the ABI number when exported CRCs change: module_layout always does."""
    a_syms = symvers.load_symvers(built_a.kernel_symvers).crcs
    b_syms = symvers.load_symvers(built_b.kernel_symvers).crcs
    assert a_syms["module_layout"] != b_syms["module_layout"]
    for built, kernel, want in (
        (built_a, built_b.kernel, a_syms),
        (built_b, built_a.kernel, b_syms),
    ):
        report = daemon_kabi.check_modules(HOST, [built.base, built.user], kernel)
        assert not report.compatible
        have = b_syms if want is a_syms else a_syms
        for m in report.modules:
            needed = dict(m.abi.crcs)
            expected = sorted(
                Mismatch(s, c, have[s])
                for s, c in needed.items()
                if s in have and have[s] != c and s != "kvcd_base_greet"
            )
            assert list(m.verdict.mismatched) == expected
            assert Mismatch("module_layout", want["module_layout"], have["module_layout"]) in (
                m.verdict.mismatched
            )
            assert m.verdict.missing == ()


def hand_made_kernel(tmp_path: Path, built: BuiltKmods, symbol: str, *, rhel: bool) -> HostRoot:
    """A HostRoot whose kernel exports `built.kernel`'s symvers with `symbol`'s CRC changed."""
    root = HostRoot(tmp_path / "host")
    lines = built.kernel_symvers.read_text().splitlines(keepends=True)
    changed = 0
    for i, line in enumerate(lines):
        crc, name, rest = line.split("\t", 2)
        if name == symbol:
            lines[i] = f"0x{int(crc, 16) ^ 0x1:08x}\t{name}\t{rest}"
            changed += 1
    assert changed == 1
    text = "".join(lines)
    if rhel:
        target = root(f"/boot/symvers-{built.kernel}.gz")
        target.parent.mkdir(parents=True)
        target.write_bytes(gzip.compress(text.encode()))
    else:
        target = root(f"/usr/src/linux-headers-{built.kernel}/Module.symvers")
        target.parent.mkdir(parents=True)
        target.write_text(text)
    return root


@pytest.mark.parametrize("rhel", [False, True], ids=["debian", "rhel-gz"])
def test_hand_made_crc_change_is_incompatible(
    tmp_path: Path, built_a: BuiltKmods, rhel: bool
) -> None:
    root = hand_made_kernel(tmp_path, built_a, "proc_create_single_data", rhel=rhel)
    report = daemon_kabi.check_modules(root, [built_a.base, built_a.user], built_a.kernel)
    base, user = report.modules
    assert base.verdict.compatible
    want = dump_modversions(built_a.user)["proc_create_single_data"]
    assert user.verdict.mismatched == (Mismatch("proc_create_single_data", want, want ^ 0x1),)
    assert user.verdict.missing == ()
    assert not report.compatible
    # weak-modules' method agrees, given the hand-made symvers plus the sibling's exports.
    text = report.symvers.read_bytes()
    if rhel:
        text = gzip.decompress(text)
    plain = tmp_path / "Module.symvers"
    plain.write_bytes(text + built_a.symvers.read_bytes())
    assert weak_modules_rejects(built_a.user, plain) == {"proc_create_single_data"}


def make_instance(root: HostRoot, built: BuiltKmods, version: str = "1.0") -> Path:
    store = root.store("demo") / version / built.kernel
    store.mkdir(parents=True)
    modules = {}
    for ko in (built.base, built.user):
        shutil.copy(ko, store / ko.name)
        modules[ko.stem] = {"file": ko.name}
    manifest = {"version": version, "kernel": built.kernel, "modules": modules}
    (store / ".kvcd-manifest.json").write_text(json.dumps(manifest))
    return store


def test_command_on_an_instance(
    tmp_path: Path,
    built_a: BuiltKmods,
    built_b: BuiltKmods,
    capsys: pytest.CaptureFixture[str],
) -> None:
    root = HostRoot(tmp_path / "host")
    make_instance(root, built_a)
    for built in (built_a, built_b):
        dest = root(f"/usr/src/linux-headers-{built.kernel}/Module.symvers")
        dest.parent.mkdir(parents=True)
        shutil.copy(built.kernel_symvers, dest)

    assert daemon_kabi.kabi_command(root, "demo", built_a.kernel, as_json=True) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["compatible"] is True
    assert [m["module"] for m in doc["modules"]] == ["kvcd_base", "kvcd_user"]

    assert daemon_kabi.kabi_command(root, "demo", built_b.kernel, as_json=False) == 1
    out = capsys.readouterr().out
    assert "CRC      module_layout: module wants 0x" in out
    assert out.rstrip().endswith(": incompatible")


def test_signed_and_compressed(tmp_path: Path, built_a: BuiltKmods) -> None:
    sign_file = Path(f"/usr/src/linux-headers-{built_a.kernel}/scripts/sign-file")
    if not sign_file.exists() or shutil.which("openssl") is None or shutil.which("xz") is None:
        pytest.skip("needs the headers' scripts/sign-file, openssl and xz")
    key = tmp_path / "key.pem"
    run(
        ["openssl", "req", "-new", "-nodes", "-utf8", "-sha256", "-days", "2", "-batch", "-x509",
         "-subj", "/CN=kvcd-test", "-outform", "PEM", "-out", str(key), "-keyout", str(key)]
    )  # fmt: skip
    ko = tmp_path / "kvcd_base.ko"
    shutil.copy(built_a.base, ko)
    run([str(sign_file), "sha256", str(key), str(key), str(ko)])
    run(["xz", "-k", "--check=crc32", str(ko)])
    plain = elf.read_module_abi(built_a.base)
    for path in (ko, tmp_path / "kvcd_base.ko.xz"):
        abi = elf.read_module_abi(path)
        assert abi.signed
        assert abi.crcs == plain.crcs
        assert abi.exports == plain.exports
    report = daemon_kabi.check_modules(HOST, [tmp_path / "kvcd_base.ko.xz"], built_a.kernel)
    assert report.compatible


def test_bad_real_files(tmp_path: Path, built_a: BuiltKmods) -> None:
    k = built_a.kernel
    data = built_a.user.read_bytes()
    half = tmp_path / "half.ko"
    half.write_bytes(data[: len(data) // 2])
    with pytest.raises(elf.Truncated):
        daemon_kabi.check_modules(HOST, [half], k)

    stripped = tmp_path / "stripped.ko"
    run(["strip", "--strip-all", "-o", str(stripped), str(built_a.user)])
    with pytest.raises(elf.NotAModule, match="strip-all"):
        daemon_kabi.check_modules(HOST, [stripped], k)
    # weak-modules' method still reads __versions and would call it compatible.
    assert dump_modversions(stripped) == dump_modversions(built_a.user)

    with pytest.raises(symvers.KernelNotFound, match=r"6\.1\.0-9999-amd64"):
        daemon_kabi.check_modules(HOST, [built_a.base], "6.1.0-9999-amd64")
    with pytest.raises(elf.WrongMachine, match="but the kernel is aarch64"):
        root = HostRoot(tmp_path / "arm")
        fake = root("/usr/src/linux-headers-6.1.0-56-arm64/Module.symvers")
        fake.parent.mkdir(parents=True)
        shutil.copy(built_a.kernel_symvers, fake)
        daemon_kabi.check_modules(root, [built_a.base], "6.1.0-56-arm64")
