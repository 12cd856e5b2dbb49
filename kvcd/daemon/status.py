"""`kvcd status`: the recorded state of each instance, checked against /sys/module and the boot id.

Reads files only (no podman, no D-Bus), so it is fast and works while the daemon is busy.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from kvcd.config.loader import list_instances
from kvcd.daemon.record import Record, boot_id
from kvcd.host import kmod
from kvcd.host.paths import HostRoot


def _recorded_names(root: HostRoot) -> set[str]:
    base = root.state / "instances"
    if not base.is_dir():
        return set()
    return {p.stem for p in base.glob("*.json")}


def collect(root: HostRoot, only: str | None = None) -> list[dict[str, Any]]:
    names = sorted(set(list_instances(root)) | _recorded_names(root))
    if only is not None:
        names = [only]
    current_boot = boot_id(root)
    out = []
    for name in names:
        rec = Record.read(root, name)
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
        entry["live"] = live
        stale = rec is not None and rec.boot_id is not None and rec.boot_id != current_boot
        entry["stale"] = stale
        loaded = [m for m, v in live.items() if v["loaded"]]
        problems = []
        if stale:
            problems.append("recorded during an earlier boot")
        if rec and rec.goal == "loaded" and rec.state == "Done" and len(loaded) != len(live):
            missing = sorted(set(live) - set(loaded))
            problems.append(f"recorded Done but not loaded now: {', '.join(missing)}")
        if rec and rec.goal == "unloaded" and loaded:
            problems.append(f"recorded unloaded but loaded now: {', '.join(loaded)}")
        entry["warnings"] = problems
        out.append(entry)
    return out


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
        for mod, v in (e.get("live") or {}).items():
            if v["loaded"]:
                held = f", held by {', '.join(v['holders'])}" if v["holders"] else ""
                lines.append(f"  {mod}: loaded (refcnt {v['refcnt']}{held})")
            else:
                lines.append(f"  {mod}: not loaded")
        for w in e.get("warnings") or []:
            lines.append(f"  warning: {w}")
    return "\n".join(lines)
