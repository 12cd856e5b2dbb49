"""`kvcd status`: the recorded state of each instance, checked against /sys/module and the boot id.

Reads files only (no podman, no D-Bus), so it is fast and works while the daemon is busy.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvcd.config.loader import list_instances
from kvcd.core import state
from kvcd.daemon.record import Record, boot_id
from kvcd.host import files, kmod
from kvcd.host.paths import HostRoot
from kvcd.node.keys import stem


def _recorded_names(root: HostRoot) -> set[str]:
    base = root.state / "instances"
    if not base.is_dir():
        return set()
    return {p.stem for p in base.glob("*.json")}


def _annotation_prefix(root: HostRoot) -> str:
    from kvcd.config.loader import load_settings
    from kvcd.config.model import ConfigError, Settings

    try:
        return load_settings(root).annotation_prefix
    except ConfigError:
        return Settings().annotation_prefix


def _processes(root: HostRoot, module: str) -> list[str]:
    from kvcd.host import procs

    try:
        devices = procs.module_devices(root, module)
        return [h.describe() for h in procs.processes_with_open(root, devices)]
    except Exception:  # a diagnosis only: status must always print
        return []


def collect(root: HostRoot, only: str | None = None) -> list[dict[str, Any]]:
    names = sorted(set(list_instances(root)) | _recorded_names(root))
    if only is not None:
        names = [only]
    current_boot = boot_id(root)
    prefix = _annotation_prefix(root)
    out = []
    for name in names:
        try:
            rec = Record.load(root, name)
        except OSError as exc:  # damaged, not a regular file, unreadable: say so, show the rest
            out.append(_unreadable(name, exc))
            continue
        entry: dict[str, Any] = (
            asdict(rec)
            if rec
            else {"instance": name, "state": "Unknown", "reason": "never started"}
        )
        live: dict[str, Any] = {}
        for mod in entry.get("modules") or []:
            lm = kmod.read_module(root, mod)
            live[mod] = {
                "loaded": lm is not None,
                "refcnt": lm.refcnt if lm else 0,
                "holders": list(lm.holders) if lm else [],
            }
            if lm is not None and lm.refcnt > 0:  # who has its device nodes open (psutil)
                live[mod]["processes"] = _processes(root, mod)
        entry["live"] = live
        # The node annotation keys of this instance (names over 51 characters are hashed).
        entry["node_keys"] = f"{prefix}/{stem(name)}.*"
        stale = rec is not None and rec.boot_id is not None and rec.boot_id != current_boot
        entry["stale"] = stale
        loaded = [m for m, v in live.items() if v["loaded"]]
        problems = []
        if stale:
            problems.append("recorded during an earlier boot")
        # Done with "no device" (device gating) means idle on purpose: nothing should be loaded.
        idle = rec is not None and rec.reason == "no device"
        if (
            rec
            and rec.goal == "loaded"
            and rec.state == "Done"
            and len(loaded) != len(live)
            and not idle
        ):
            missing = sorted(set(live) - set(loaded))
            problems.append(f"recorded Done but not loaded now: {', '.join(missing)}")
        if rec and rec.goal == "unloaded" and loaded:
            problems.append(f"recorded unloaded but loaded now: {', '.join(loaded)}")
        entry["warnings"] = problems
        # The links the instance provides (expect_links; kvcd/daemon/links.py).
        links = _runtime_note(root.runtime / f"{name}.links.json", problems)
        if isinstance(links, dict) and (links.get("provided") or links.get("missing")):
            entry["links"] = links
        # The drift monitor's line, while a `kvcd run` writes it (kvcd/daemon/drift.py).
        monitor = _runtime_note(root.runtime / f"{name}.drift.json", problems)
        if isinstance(monitor, dict) and isinstance(monitor.get("line"), str):
            entry["drift"] = monitor
        out.append(entry)
    return out


def _unreadable(name: str, exc: OSError) -> dict[str, Any]:
    """The entry of an instance whose record cannot be read: one clear line, `kvcd status`
    exits 1. The daemon sets a damaged record aside and rebuilds it."""
    text = str(exc) if isinstance(exc, files.FileError) else f"{exc.strerror or exc}"
    return {
        "instance": name,
        "state": "Unknown",
        "reason": state.reason_text(state.STATE_DAMAGED, text),
        "unreadable": True,
    }


def _runtime_note(path: Path, problems: list[str]) -> Any:
    """A runtime file a daemon writes for `kvcd status`; its problems become warnings."""
    try:
        return files.read_json(path)
    except OSError as exc:
        problems.append(str(exc) if isinstance(exc, files.FileError) else f"{path}: {exc}")
        return None


def failed(entries: list[dict[str, Any]]) -> bool:
    """True when some instance's record could not be read (`kvcd status` exits 1)."""
    return any(e.get("unreadable") for e in entries)


def render(entries: list[dict[str, Any]]) -> str:
    if not entries:
        return "no instances configured"
    lines = []
    for e in entries:
        head = f"{e['instance']}: {e['state']}"
        if e.get("goal") and e["goal"] != "loaded":
            head += f" ({e['goal']})"
        if e.get("version"):
            head += f"  version {e['version']}"
        if e.get("kernel"):
            head += f"  kernel {e['kernel']}"
        lines.append(head)
        if e.get("reason"):
            lines.append(f"  reason: {e['reason']}")
        if e.get("next_kernel"):  # the kernel that boots next (kvcd/daemon/nextkernel.py)
            nk = f"  next kernel {e['next_kernel']}: {e.get('next_kernel_state') or 'unknown'}"
            if e.get("next_kernel_reason"):
                nk += f" ({e['next_kernel_reason']})"
            lines.append(nk)
        for mod, v in (e.get("live") or {}).items():
            if v["loaded"]:
                held = f", held by {', '.join(v['holders'])}" if v["holders"] else ""
                if v.get("processes"):
                    held += f", open by {', '.join(v['processes'])}"
                lines.append(f"  {mod}: loaded (refcnt {v['refcnt']}{held})")
            else:
                lines.append(f"  {mod}: not loaded")
        if e.get("drift"):
            lines.append(f"  drift: {e['drift']['line']}")
        for link in (e.get("links") or {}).get("provided") or []:
            updown = "up" if link.get("up") else "down"
            lines.append(f"  link {link.get('name')}: driver {link.get('driver')}, {updown}")
        for spec in (e.get("links") or {}).get("missing") or []:
            lines.append(f"  link missing: {spec}")
        keys = e.get("node_keys", "")
        if keys and not keys.endswith(f"/{e['instance']}.*"):
            lines.append(f"  node keys: {keys} (hashed: the name does not fit a key)")
        for w in e.get("warnings") or []:
            lines.append(f"  warning: {w}")
    return "\n".join(lines)
