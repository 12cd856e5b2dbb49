"""`kvcd status`: the recorded state of each instance, checked against /sys/module and the boot id.

Reads files only (no podman, no D-Bus), so it is fast and works while the daemon is busy.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvcd.config.loader import load_instance, load_settings
from kvcd.config.model import ConfigError, InstanceConfig, Settings
from kvcd.core import attempts, state
from kvcd.core.text import shown
from kvcd.daemon.record import Record, boot_id, is_time, known_names, unsaved
from kvcd.host import files, intree, pylibs, sysmodule
from kvcd.host.ostreemark import is_ostree_host
from kvcd.host.paths import HostRoot
from kvcd.node.keys import stem


def _settings(root: HostRoot) -> tuple[Settings, str]:
    """kvcd.toml's settings, or the defaults and why it cannot be used (every start refuses)."""
    try:
        return load_settings(root), ""
    except ConfigError as exc:
        return Settings(), str(exc)


def _config(root: HostRoot, name: str) -> tuple[InstanceConfig | None, str]:
    """The instance's config, or None and why it cannot be used (a daemon would refuse it:
    ConfigInvalid, naming the file and line)."""
    try:
        return load_instance(root, name), ""
    except ConfigError as exc:
        return None, str(exc)


# What status says of an instance without a usable record (never started, or damaged); a
# record itself holds Done, Working or Degraded (kvcd.daemon.record.STATES).
UNKNOWN = "Unknown"

# What stopping does under each `unload_policy` (kvcd.core.drain.STOP), as status says it.
UNLOAD_POLICY_TEXT = {
    state.IF_IDLE: "unloads; refused while a module is in use",
    state.NEVER: "modules stay loaded",
    state.UNLOAD_DRAIN: "unloads; asks for a node drain while a module is in use",
}


# Capability -> its label in `kvcd status`, in the order shown.
CAPABILITY_LABELS = {
    "drift": "drift",
    "udev": "udev module events",
    "holders": "holder checks",
    "links": "links",
    "node_backend": "node backend",
    "rpm_ostree": "rpm-ostree",
    "unload": "on stop",
}


def _cap(on: bool, detail: str = "") -> dict[str, Any]:
    return {"on": on, "detail": detail}


def capabilities(
    root: HostRoot,
    name: str,
    cfg: InstanceConfig | None,
    settings: Settings,
    running: bool,
    importer: pylibs.Importer = pylibs.locate,
) -> dict[str, dict[str, Any]]:
    """What this instance's `kvcd run` can do, and why not where it cannot.

    From the runtime files the daemon writes while it runs (drift.json, links.json), the
    settings and the instance's config, and for libraries what is installed here (looked up,
    not imported: the kubernetes client alone would cost several times the verb): the daemon
    is the same installation (and refuses to start without a required library).
    """
    out: dict[str, dict[str, Any]] = {}
    not_running = f"kvcd@{name} is not running"
    monitor = files.read_json(root.drift_note(name)) if running else None
    if isinstance(monitor, dict) and isinstance(monitor.get("line"), str):
        out["drift"] = _cap(True, monitor["line"])
        why = monitor.get("udev_off")
        out["udev"] = (
            _cap(True) if monitor.get("udev") else _cap(False, str(why or "no module events"))
        )
    else:  # a monitor that did not start logged why (service.py)
        out["drift"] = out["udev"] = _cap(
            False, f"not started, see journalctl -u kvcd@{name}" if running else not_running
        )
    psutil = pylibs.import_error(pylibs.PSUTIL, importer)
    out["holders"] = _cap(True) if psutil is None else _cap(False, f"psutil: {psutil}")
    expects = None if cfg is None else bool(cfg.expect_links)
    links = files.read_json(root.links_note(name)) if running else None
    if expects is False:
        out["links"] = _cap(False, "instance has no expect_links")
    elif expects is None:
        out["links"] = _cap(False, "its config cannot be read")
    elif not running:
        out["links"] = _cap(False, not_running)
    elif not isinstance(links, dict) or links.get("watch_off") is None:
        out["links"] = _cap(False, "not started")
    elif links["watch_off"]:
        off = links["watch_off"]
        out["links"] = _cap(True, f"checked on each reconcile, no link events ({off})")
    else:
        out["links"] = _cap(True, "netlink link events")
    refused = [
        why for key, why in pylibs.settings_problems(settings, importer) if key == "node_backend"
    ]
    out["node_backend"] = _cap(False, refused[0]) if refused else _cap(True, settings.node_backend)
    if cfg is not None:
        policy = cfg.unload_policy
        out["unload"] = _cap(True, f"unload_policy = {policy} ({UNLOAD_POLICY_TEXT[policy]})")
    if is_ostree_host(root):
        dbus = pylibs.setting_problem("rpm-ostree D-Bus", pylibs.RPMOSTREE_DBUS, importer)
        out["rpm_ostree"] = _cap(True, "D-Bus" if dbus is None else f"CLI ({dbus})")
    return out


def render_capability(key: str, cap: dict[str, Any]) -> str:
    label = CAPABILITY_LABELS.get(key, key)
    detail = str(cap.get("detail") or "")
    if not cap.get("on"):
        return f"{label}: off ({detail})" if detail else f"{label}: off"
    return f"{label}: {detail}" if detail else f"{label}: on"


def _remembered(importer: pylibs.Importer) -> pylibs.Importer:
    """`importer`, asked once per module: every instance asks for the same libraries."""
    seen: dict[str, object] = {}

    def look(name: str) -> object:
        if name not in seen:
            try:
                seen[name] = importer(name)
            except ImportError as exc:
                seen[name] = exc
        got = seen[name]
        if isinstance(got, ImportError):
            raise got
        return got

    return look


def _runtime_files(root: HostRoot) -> Callable[[Path], bool]:
    """Whether a file of the runtime directory may exist: one listing instead of an open per
    file (most instances have no pid file and no notes). When the directory cannot be listed
    for another reason, every file may exist: each is opened, and says why not itself."""
    runtime = root.runtime
    try:
        present = frozenset(os.listdir(runtime))
    except FileNotFoundError:  # no runtime directory: no daemon ran since boot
        present = frozenset()
    except OSError:
        return lambda path: True
    return lambda path: path.parent != runtime or path.name in present


def _running(root: HostRoot, name: str, may_exist: Callable[[Path], bool]) -> bool:
    """Whether kvcd@NAME runs (kvcd.daemon.control.daemon_pid); without a pid file it does not,
    and the process proof is not imported."""
    if not may_exist(root.pid_file(name)):
        return False
    from kvcd.daemon.control import daemon_pid

    return daemon_pid(root, name) is not None


def _processes(root: HostRoot, module: str) -> list[str]:
    from kvcd.host import procs

    try:
        devices = procs.module_devices(root, module)
        return [h.describe() for h in procs.processes_with_open(root, devices)]
    except Exception:  # a diagnosis only: status must always print
        return []


def collect(root: HostRoot, only: str | None = None) -> list[dict[str, Any]]:
    names = known_names(root)
    unknown = only is not None and only not in names  # neither configured nor recorded
    if only is not None:
        names = [only]
    current_boot = boot_id(root)
    settings, settings_error = _settings(root)
    prefix = settings.annotation_prefix
    importer = _remembered(pylibs.locate)
    may_exist = _runtime_files(root)
    firmware_of = _firmware(root) if names else (lambda _n: None)
    out = []
    for name in names:
        try:
            rec = Record.load(root, name)
        except OSError as exc:  # damaged, not a regular file, unreadable: say so, show the rest
            out.append(_unreadable(name, exc))
            continue
        if unknown:  # a mistyped name: said, and kvcd status exits 1
            out.append({**_unknown(name, "", "no such instance (not configured, no record)"),
                        "absent": True})  # fmt: skip
            continue
        entry: dict[str, Any] = rec.to_json() if rec else _unknown(name, "", "never started")
        live: dict[str, Any] = {}
        for mod in entry.get("modules") or []:
            lm = sysmodule.read_module(root, mod)
            live[mod] = {
                "loaded": lm is not None,
                "refcnt": lm.refcnt if lm else 0,
                "holders": list(lm.holders) if lm else [],
            }
            if lm is not None and lm.refcnt > len(lm.holders):
                # References no module explains: who has its device nodes open. (A scan of
                # every device and process: not for a module its own users account for.)
                live[mod]["processes"] = _processes(root, mod)
            if lm is not None:
                live[mod]["taint"] = (
                    files.read_host_text(root.sys_module / mod / "taint") or ""
                ).strip()
        _signers(root, rec, live)
        entry["live"] = live
        _replaced(root, name, entry, may_exist)
        fw = firmware_of(name)
        if fw is not None:
            entry["firmware"] = fw
        # The node annotation keys of this instance (names over 51 characters are hashed).
        entry["node_keys"] = f"{prefix}/{stem(name)}.*"
        stale = rec is not None and rec.boot_id is not None and rec.boot_id != current_boot
        entry["stale"] = stale
        problems = _disagreements(rec, live, stale)
        cfg, config_error = _config(root, name)
        for error in (settings_error, config_error):  # what a start would refuse (ConfigInvalid)
            if error:
                problems.append(f"config not usable: {error}")
        entry["warnings"] = problems
        _runtime_notes(root, name, entry, problems, may_exist)
        running = _running(root, name, may_exist)
        entry["capabilities"] = capabilities(root, name, cfg, settings, running, importer)
        out.append(entry)
    return out


def _disagreements(rec: Record | None, live: dict[str, dict[str, Any]], stale: bool) -> list[str]:
    """Where the record and the node disagree now (`kvcd status` warns)."""
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
    return problems


def _firmware(root: HostRoot) -> Callable[[str], dict[str, Any] | None]:
    """Each instance's firmware files; the module only when there is an owners table (#20)."""
    if not os.path.lexists(root.firmware_owners):
        return lambda _name: None
    from kvcd.daemon import firmware

    return firmware.status(root)


def _replaced(
    root: HostRoot, name: str, entry: dict[str, Any], may_exist: Callable[[Path], bool]
) -> None:
    """The in-tree modules the instance keeps out and those kvcd unloaded for it."""
    try:
        noted = intree.observed(root, name) if may_exist(root.in_tree_note(name)) else None
    except OSError as exc:  # damaged or refused: say so, show the rest
        entry["in_tree"] = {"error": str(exc)}
        return
    if noted and (noted[0] or noted[1]):
        entry["in_tree"] = {"kept_out": list(noted[0]), "removed": list(noted[1])}


def _signers(root: HostRoot, rec: Record | None, live: dict[str, dict[str, Any]]) -> None:
    """Each module's signer, as the store's manifest of the recorded version says."""
    if rec is None or not rec.version or not rec.kernel or not live:
        return
    from kvcd.daemon import store

    try:
        manifest = store.read_manifest(store.tree(root, rec.instance, rec.version, rec.kernel))
    except (OSError, ValueError):
        return
    for mod, stored in (manifest.modules if manifest else {}).items():
        if mod in live and stored.signer is not None:  # None: recorded by an older kvcd
            live[mod]["signer"] = stored.signer
            live[mod]["sig_key"] = stored.sig_key
            live[mod]["sig_hash"] = stored.sig_hash


def kernel(root: HostRoot) -> dict[str, Any]:
    """The running kernel's taint flags and whether it loads only signed modules."""
    from kvcd.host import modsign

    flags = modsign.kernel_taint(root)
    return {
        "taint": [letter for letter, _ in flags],
        "taint_meaning": [meaning for _, meaning in flags],
        "signatures": modsign.enforcement(root).describe(),
    }


def render_kernel(k: dict[str, Any]) -> str:
    taint = ", ".join(f"{t} ({m})" for t, m in zip(k["taint"], k["taint_meaning"])) or "none"
    return f"kernel: taint {taint}; module signatures {k['signatures']}"


def _runtime_notes(
    root: HostRoot,
    name: str,
    entry: dict[str, Any],
    problems: list[str],
    may_exist: Callable[[Path], bool] = lambda path: True,
) -> None:
    """What the instance's daemon says beside its record: a record it could not save, the
    node it cannot reach, the links it provides, its drift monitor."""
    kept = unsaved(root, name) if may_exist(root.unsaved_record(name)) else None
    if kept is not None:
        problems.append(
            f"state not saved: {kept[1]}; kept in {root.unsaved_record(name)} until it can be"
        )
    node = _runtime_note(root.node_note(name), problems, may_exist)
    if isinstance(node, dict) and isinstance(node.get("failing"), str):
        since = node.get("since")
        when = time.strftime(" since %H:%M:%S", time.localtime(since)) if is_time(since) else ""
        then = "retrying" if node.get("retrying", True) else "not retried: kvcd run has exited"
        problems.append(f"node not updated{when}: {node['failing']}; {then}")
        entry["node_unreachable"] = node
    # The links the instance provides (expect_links; kvcd/daemon/links.py).
    links = _runtime_note(root.links_note(name), problems, may_exist)
    if isinstance(links, dict) and (links.get("provided") or links.get("missing")):
        entry["links"] = links
    # The drift monitor's line, while a `kvcd run` writes it (kvcd/daemon/drift.py).
    monitor = _runtime_note(root.drift_note(name), problems, may_exist)
    if isinstance(monitor, dict) and isinstance(monitor.get("line"), str):
        entry["drift"] = monitor


def _unreadable(name: str, exc: OSError) -> dict[str, Any]:
    """The entry of an instance whose record cannot be read: one clear line, `kvcd status`
    exits 1. The daemon sets a damaged record aside and rebuilds it."""
    return {**_unknown(name, state.STATE_DAMAGED, files.os_error(exc)), "unreadable": True}


def _unknown(name: str, code: str, detail: str) -> dict[str, Any]:
    """An instance without a usable record: state Unknown, with the code and the detail a
    record has (scripts read `code`)."""
    reason = state.reason_text(code, detail)
    return {"instance": name, "state": UNKNOWN, "code": code, "detail": detail, "reason": reason}


def _runtime_note(
    path: Path, problems: list[str], may_exist: Callable[[Path], bool] = lambda path: True
) -> Any:
    """A runtime file a daemon writes for `kvcd status`; its problems become warnings."""
    if not may_exist(path):
        return None
    try:
        return files.read_json(path)
    except OSError as exc:
        problems.append(str(exc) if isinstance(exc, files.FileError) else f"{path}: {exc}")
        return None


def failed(entries: list[dict[str, Any]]) -> bool:
    """True when some instance's record could not be read, or the one asked for does not
    exist (`kvcd status` exits 1)."""
    return any(e.get("unreadable") or e.get("absent") for e in entries)


def render_attempt(attempt: dict[str, Any]) -> str:
    """The attempt ledger, when the last try failed: the one answer to "why no retry?"."""
    outcome, tries = attempt.get("outcome"), attempt.get("tries", 0)
    what = f"{attempt.get('code') or 'failed'}, {tries} {'try' if tries == 1 else 'tries'}"
    if outcome == attempts.PERMANENT:
        return f"last attempt: {what}; tried again on reload, restart or a config change"
    if outcome == attempts.TRANSIENT:
        at = time.strftime("%H:%M:%S", time.localtime(attempt.get("not_before", 0)))
        return f"last attempt: {what}; next try at {at}"
    return ""


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
        attempt = render_attempt(e.get("attempt") or {})
        if attempt:
            lines.append(f"  {attempt}")
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
                taint = f", taint {v['taint']}" if v.get("taint") else ""
                lines.append(f"  {mod}: loaded (refcnt {v['refcnt']}{held}{taint})")
            else:
                lines.append(f"  {mod}: not loaded")
            if "signer" in v:
                signer = v["signer"]
                lines.append(
                    f"    signed by {signer} (key {v.get('sig_key')}, {v.get('sig_hash')})"
                    if signer
                    else "    unsigned"
                )
        in_tree = e.get("in_tree") or {}
        if in_tree.get("error"):
            lines.append(f"  in-tree modules: cannot tell ({in_tree['error']})")
        elif in_tree.get("kept_out") or in_tree.get("removed"):
            kept = ", ".join(in_tree.get("kept_out") or []) or "none"
            gone = ", ".join(in_tree.get("removed") or []) or "none"
            lines.append(f"  in-tree modules kept out: {kept}; unloaded by kvcd: {gone}")
        if e.get("firmware"):
            from kvcd.daemon import firmware

            lines.append(f"  {firmware.render(e['firmware'])}")
        for key, cap in (e.get("capabilities") or {}).items():
            lines.append(f"  {render_capability(key, cap)}")
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
    return "\n".join(shown(line) for line in lines)
