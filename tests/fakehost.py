"""A fake host for kvcd: a HostRoot tree plus modprobe/rmmod/depmod stand-ins that change a fake
/sys/module under it. Used where the real kernel cannot load modules (this machine): unit tests
of the instance flow, and the integration test of the `kvcd run` process and its signals.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path
from typing import Any

from kvcd.host.paths import HostRoot
from kvcd.host.systemd import Notifier

# Loads <name>: a directory in the fake /sys/module. Names listed in $FAKE_ROOT/fail-load fail
# the way modprobe does when the kernel refuses a module.
MODPROBE = r"""
set -e
sys="$FAKE_ROOT/sys/module"
args=("$@"); names=(); base=/; kver=""; show=""; all=""
for ((i=0; i<${#args[@]}; i++)); do
  case "${args[$i]}" in
    -d) base="${args[$((i+1))]}"; i=$((i+1));;
    -S) kver="${args[$((i+1))]}"; i=$((i+1));;
    --show-depends) show=1;;
    -a|--all) all=1;;
    -*) ;;
    *) names+=("${args[$i]}"); [ -n "$all" ] || break;;
  esac
done
name="${names[0]}"
if [ -n "$show" ]; then  # where the module tree resolves each, as the real one says
  d="$base/lib/modules/$kver"; rc=0
  for name in "${names[@]}"; do
    path=$(cd "$d" 2>/dev/null && find -L extra weak-updates -name "$name.ko" 2>/dev/null | head -1)
    if [ -z "$path" ]; then  # modprobe -a goes on to the next name
      fatal="modprobe: FATAL: Module $name not found in directory $d"
      [ -n "$all" ] || { echo "$fatal" >&2; exit 1; }
      echo "modprobe: WARNING: Module $name not found in directory $d" >&2; rc=1; continue
    fi
    echo "insmod $d/${path#./}"
  done
  exit $rc
fi
if grep -qx "$name" "$FAKE_ROOT/fail-load" 2>/dev/null; then
  echo "modprobe: ERROR: could not insert '$name': Unknown symbol in module (see dmesg)" >&2
  exit 1
fi
mkdir -p "$sys/$name/holders"
echo live > "$sys/$name/initstate"; echo 0 > "$sys/$name/refcnt"
"""
# Unloads <name>, and drops it as a holder of the modules it used, as the kernel does. Names
# listed in $FAKE_ROOT/fail-unload fail as rmmod does when the kernel refuses.
RMMOD = r"""
sys="$FAKE_ROOT/sys/module"
if grep -qx "$1" "$FAKE_ROOT/fail-unload" 2>/dev/null; then
  echo "rmmod: ERROR: could not remove module $1: Operation not permitted" >&2
  exit 1
fi
rm -r "$sys/$1"
for h in "$sys"/*/holders/"$1"; do
  [ -d "$h" ] || continue
  rmdir "$h"; m="${h%/holders/*}"
  echo $(( $(cat "$m/refcnt") - 1 )) > "$m/refcnt"
done
"""
# Writes a modules.dep naming every module under extra/, as the real depmod would.
DEPMOD = r"""
base=/; args=("$@")
for ((i=0; i<${#args[@]}; i++)); do [ "${args[$i]}" = -b ] && base="${args[$((i+1))]}"; done
d="$base/lib/modules/${args[-1]}"
(cd "$d" && find -L extra -name "*.ko" | sed "s/$/:/") > "$d/modules.dep"
"""
SCRIPTS = {"modprobe": MODPROBE, "rmmod": RMMOD, "depmod": DEPMOD}


def write_command(bindir: Path, name: str, body: str, log: Path | None = None) -> Path:
    path = bindir / name
    record = f"{{ printf '%s\\x1f' {name} \"$@\"; printf '\\x1e'; }} >> '{log}'\n" if log else ""
    path.write_text("#!/bin/bash\n" + record + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def fake_host(root: HostRoot, kernel: str, fake_commands: Any, monkeypatch: Any) -> HostRoot:
    """make_host, plus the fake modprobe/rmmod/depmod (tests/conftest.py's fake_commands) acting
    on its /sys/module: what a unit test of the instance flow or the run loop starts from."""
    make_host(root, kernel)
    monkeypatch.setenv("FAKE_ROOT", str(root.root))
    for name, script in SCRIPTS.items():
        fake_commands.add(name, script)
    return root


def instance_host(
    root: HostRoot,
    kernel: str,
    fake_commands: Any,
    monkeypatch: Any,
    config: str,
    modules: list[str],
    versions: tuple[str, ...] = ("1.0", "2.0"),
) -> HostRoot:
    """fake_host with instance "e2e": `config` written, each version already in the store."""
    fake_host(root, kernel, fake_commands, monkeypatch)
    for v in versions:
        store_version(root, "e2e", v, kernel, modules)
    write_config(root, "e2e", config)
    return root


class RecordingNotifier(Notifier):
    """A Notifier without a socket that keeps what it would send (watchdog pings left out)."""

    def __init__(self) -> None:
        super().__init__(None)
        self.sent: list[str] = []

    def notify(self, *assignments: str) -> bool:
        self.sent.extend(a for a in assignments if not a.startswith("WATCHDOG"))
        return True


def make_host(root: HostRoot, kernel: str) -> None:
    """The parts of a host kvcd reads: kernel release, boot id, /sys/module, /lib/modules."""
    root.sys_module.mkdir(parents=True, exist_ok=True)
    (root.system_modules(kernel) / "kernel").mkdir(parents=True, exist_ok=True)
    (root.system_modules(kernel) / "modules.builtin").write_text("")
    root.osrelease.parent.mkdir(parents=True, exist_ok=True)
    root.osrelease.write_text(kernel + "\n")
    root.boot_id.parent.mkdir(parents=True, exist_ok=True)
    root.boot_id.write_text("0b5e6c4e-0000-4000-8000-000000000001\n")


def store_version(
    root: HostRoot,
    instance: str,
    version: str,
    kernel: str,
    modules: list[str],
    image: str = "test",
) -> Path:
    """An already extracted version in kvcd's store, as the executor leaves it."""
    d = root.store(instance) / version / kernel
    d.mkdir(parents=True, exist_ok=True)
    entries = {}
    for name in modules:
        (d / f"{name}.ko").write_bytes(f"{name} {version}".encode())
        entries[name] = {"file": f"{name}.ko", "srcversion": f"{name}-{version}"}
    manifest = {"version": version, "kernel": kernel, "image": image, "modules": entries}
    (d / ".kvcd-manifest.json").write_text(json.dumps(manifest))
    return d


def write_config(root: HostRoot, name: str, text: str) -> Path:
    return write(root(f"/etc/kvcd/instances/{name}.toml"), text)


def write(path: Path, text: str, mode: int = 0o644) -> Path:
    """Write a file with an exact mode, creating its directories (config files are mode-checked)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)
    return path


def doc(*lines: str) -> str:
    """A file's text from its lines, so tables can say which line a row breaks."""
    return "\n".join(lines) + "\n"


def pretend_daemon(root: HostRoot, name: str, monkeypatch: Any) -> int:
    """Make this test process pass as `kvcd run NAME`: its pid in the pid file (with its real
    start time) and its command line seen as kvcd's, so `kvcd reload` may signal it."""
    import os

    from kvcd.host import procs

    pid = os.getpid()
    procs.write_pid_file(root.pid_file(name), pid)
    real = procs.inspect

    def inspect(p: int) -> procs.ProcInfo | None:
        info = real(p)
        if info is None or p != pid:
            return info
        argv = ("/usr/bin/python3", "/usr/bin/kvcd", "--root", str(root.root), "run", name)
        return procs.ProcInfo(p, argv, info.start, "", None)

    monkeypatch.setattr(procs, "inspect", inspect)
    return pid
