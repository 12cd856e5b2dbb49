"""Install and erase kvcd's RPMs in the Debian guest as rpm does, from what run-guest.sh took out
of them on the host (the guest has no rpm): payload/rpm/root (the payload, rpm2cpio | cpio),
<name>.files.tsv (each file's path, mode, digest and flags, from the header), and the header's
scriptlets <name>.post, .preun, .postun.

    python3 rpmpayload.py install DIR   the files, with the header's modes and mtimes; %post 1
    python3 rpmpayload.py erase DIR     %preun 0; the files (a %config file changed since the
                                        install is kept as FILE.rpmsave); %postun 0

Erase goes in rpm's order: dependents first (kvcd-kvc-compat before kvcd), each package's
%preun before its files go and %postun after; an owned directory goes when it is empty.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

# rpm -e removes a package that others require after them: kvcd-kvc-compat requires kvcd.
ERASE_ORDER = ("kvcd-kvc-compat", "kvcd")


def entries(tsv: Path) -> list[tuple[str, int, str, str]]:
    """(path, mode, digest, flags) of each entry of a package's file list."""
    out = []
    for line in tsv.read_text().splitlines():
        path, mode_s, digest, flags = [*line.split("\t"), "", "", ""][:4]
        out.append((path, int(mode_s, 8), digest, flags))
    return out


def _scriptlet(rpm: Path, name: str, which: str, arg: int) -> None:
    script = rpm / f"{name}.{which}"
    if script.is_file() and script.read_text().strip():
        print(f"running %{which} of {name} ($1 = {arg})", flush=True)
        subprocess.run(["sh", "-e", str(script), str(arg)], check=True)


def install(rpm: Path) -> None:
    root = rpm / "root"
    sitelibs = set()
    for tsv in sorted(rpm.glob("*.files.tsv")):
        n = 0
        for path, mode, _digest, flags in entries(tsv):
            if "g" in flags:  # %ghost: owned by the package, not in its payload
                continue
            src, dst = root / path.lstrip("/"), Path(path)
            if stat.S_ISDIR(mode):
                dst.mkdir(parents=True, exist_ok=True)
                os.chmod(dst, stat.S_IMODE(mode))
            elif stat.S_ISLNK(mode):
                dst.parent.mkdir(parents=True, exist_ok=True)
                if dst.is_symlink() or dst.exists():
                    dst.unlink()
                os.symlink(os.readlink(src), dst)
            else:
                dst.parent.mkdir(parents=True, exist_ok=True)
                tmp = dst.with_name(dst.name + ".rpmnew-e2e")
                shutil.copyfile(src, tmp)
                os.chmod(tmp, stat.S_IMODE(mode))
                # rpm keeps the payload's mtimes: the shipped bytecode is checked against them.
                st = os.stat(src)
                os.utime(tmp, ns=(st.st_atime_ns, st.st_mtime_ns))
                os.replace(tmp, dst)
            n += 1
            if path.endswith("/kvcd/__init__.py"):
                sitelibs.add(str(Path(path).parent.parent))
        print(f"installed {n} entries of {tsv.name.removesuffix('.files.tsv')}")
    # Fedora's python3 has /usr/lib/python3.X/site-packages (the RPM's %{python3_sitelib}) on
    # sys.path; Debian's python3 does not, so point it there with a .pth file.
    want = f"/usr/lib/python{sys.version_info[0]}.{sys.version_info[1]}/site-packages"
    if sitelibs != {want}:
        sys.exit(f"the RPM puts kvcd in {sorted(sitelibs)}, this guest's python3 reads {want}")
    pth = Path("/usr/lib/python3/dist-packages/kvcd-rpm-sitelib.pth")
    pth.write_text(want + "\n")
    print(f"{pth}: {want}")
    for tsv in sorted(rpm.glob("*.files.tsv")):
        _scriptlet(rpm, tsv.name.removesuffix(".files.tsv"), "post", 1)


def _changed(path: Path, digest: str, algo: str) -> bool:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return False
    return hashlib.new(algo, data).hexdigest() != digest


def erase(rpm: Path) -> None:
    for name in ERASE_ORDER:
        tsv = rpm / f"{name}.files.tsv"
        if not tsv.is_file():
            continue
        algo = {"8": "sha256", "10": "sha512"}.get(
            (rpm / f"{name}.digestalgo").read_text().strip(), "sha256"
        )
        _scriptlet(rpm, name, "preun", 0)
        dirs = []
        for path, mode, digest, flags in entries(tsv):
            p = Path(path)
            if stat.S_ISDIR(mode):
                dirs.append(p)
            elif "c" in flags and digest and _changed(p, digest, algo):
                os.replace(p, p.with_name(p.name + ".rpmsave"))
                print(f"warning: {p} saved as {p}.rpmsave")
            elif p.is_symlink() or p.exists():
                p.unlink()
        for d in sorted(dirs, key=lambda x: len(x.parts), reverse=True):
            with contextlib.suppress(OSError):  # not empty (another's, the admin's): as rpm
                d.rmdir()
        _scriptlet(rpm, name, "postun", 0)
        print(f"erased {name}")
    Path("/usr/lib/python3/dist-packages/kvcd-rpm-sitelib.pth").unlink(missing_ok=True)
    # What systemd's file trigger does after a transaction that removed unit files (Fedora).
    subprocess.run(["systemctl", "daemon-reload"], check=True)


if __name__ == "__main__":
    verb, where = sys.argv[1], Path(sys.argv[2])
    {"install": install, "erase": erase}[verb](where)
