"""The instance's recorded state: /var/lib/kvcd/instances/<name>.json, what `kvcd status` shows.

Kept apart from the instance machinery so `kvcd status` imports only this (it must be fast).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvcd.config.rules import MODULE_NAME, VERSION
from kvcd.core import names, state
from kvcd.core.attempts import OUTCOMES, Attempt
from kvcd.host import files
from kvcd.host.paths import HostRoot

log = logging.getLogger(__name__)

# A record is a few kilobytes (its reason is capped, MAX_REASON): a bigger file is damaged.
MAX_BYTES = 4 << 20
# The states a record holds (`kvcd status` says Unknown for an instance without a usable one).
STATES = (state.DONE, state.WORKING, state.DEGRADED)


def recorded_names(root: HostRoot) -> list[str]:
    """The instances with a state record (/var/lib/kvcd/instances/<name>.json), sorted."""
    try:
        return sorted(p.stem for p in (root.state / "instances").glob("*.json"))
    except OSError:
        return []


def known_names(root: HostRoot) -> list[str]:
    """Every instance configured or recorded, sorted (`kvcd status`, `metrics`, `purge --all`).
    ConfigError when the configured ones cannot be listed."""
    from kvcd.config.loader import list_instances

    return sorted(set(list_instances(root)) | set(recorded_names(root)))


class KernelUnknown(OSError):
    """The running kernel's release cannot be read, or is not one kvcd can use."""


def running_kernel(root: HostRoot) -> str:
    """The running kernel's release, checked like every kernel string (kvcd/core/names.py)."""
    text = files.read_host_text(root.osrelease)
    if not text or not text.strip():
        raise KernelUnknown(0, "cannot read the running kernel release", str(root.osrelease))
    problem = names.kernel_problem(text.strip())
    if problem is not None:
        raise KernelUnknown(0, problem, str(root.osrelease))
    return text.strip()


def boot_id(root: HostRoot) -> str | None:
    text = files.read_host_text(root.boot_id)
    return text.strip() if text else None


@dataclass
class Record:
    """The instance's state file (/var/lib/kvcd/instances/<name>.json): what kvcd status shows."""

    instance: str
    state: str
    # Why the state is what it is: a reason code (kvcd/core/state.py REASONS, "" for a note
    # without one) and its detail. The file also holds `reason`, the two as one line (what
    # `kvcd status` and the node show); nothing reads the code back out of that text.
    code: str = ""
    detail: str = ""
    goal: str = "loaded"
    version: str = ""
    kernel: str = ""
    boot_id: str | None = None
    modules: list[str] = field(default_factory=list)
    # The modules this instance put in the kernel in this boot (`boot_id`) and has not taken
    # out: what it owns (kvcd.daemon.instance.held_modules). None: written by an earlier
    # kvcd, whose record owned its `modules` in the kernel while the goal was loaded.
    held: list[str] | None = None
    updated: float = 0.0
    generation: int = 0
    pid: int | None = None
    # The kernel that boots next (staged rpm-ostree deployment or default boot entry), when it
    # differs from `kernel`: its release, kvcd.core.ahead's "ready" | "preparing" | "failed",
    # and why it failed.
    next_kernel: str = ""
    next_kernel_state: str = ""
    next_kernel_reason: str = ""
    # The attempt ledger (kvcd/core/attempts.py): what was last attempted and how it ended.
    attempt: Attempt = field(default_factory=Attempt)

    @property
    def reason(self) -> str:
        return state.reason_text(self.code, self.detail)

    def at_boot(self, boot: str | None) -> None:
        """The record is written in boot `boot` from now on: what it held in an earlier boot
        went with that boot."""
        if boot != self.boot_id:
            self.held = []
        self.boot_id = boot

    def says(self, new_state: str, code: str, detail: str) -> bool:
        return (self.state, self.code, self.detail) == (new_state, code, detail)

    @classmethod
    def parse(cls, path: Path, raw: bytes, instance: str) -> Record:
        """Instance `instance`'s record in `raw`; files.Damaged when it is not one (garbage,
        truncated JSON, a field of the wrong type, another instance's record, a state or a name
        kvcd does not write: see `_problem`). Unknown keys are ignored (a newer kvcd may add
        some)."""
        data = files.parse_json(path, raw)
        if not isinstance(data, dict):
            raise files.Damaged(path, f"holds a JSON {type(data).__name__}, not an object")
        if "code" not in data and isinstance(data.get("reason"), str):
            data = {**data, **_from_reason(data["reason"])}  # written by an earlier kvcd
        known: dict[str, Any] = {}
        for name, f in cls.__dataclass_fields__.items():
            if name not in data:
                if name in ("instance", "state"):
                    raise files.Damaged(path, f"has no {name!r}")
                continue
            value = data[name]
            if not _FIELD_TYPES[str(f.type)](value):
                raise files.Damaged(path, f"has {name!r} of the wrong type: {value!r:.40}")
            known[name] = (
                list(value)
                if name in ("modules", "held") and value is not None
                else Attempt(**value)
                if name == "attempt"
                else value
            )
        record = cls(**known)
        problem = record._problem(instance)
        if problem is not None:
            raise files.Damaged(path, problem)
        return record

    def _problem(self, instance: str) -> str | None:
        """Why this is not a record kvcd wrote for `instance` (None: it is one). Each name
        in it becomes a path or an argument (its own file, /sys/module/<module>, the store's
        <version>/<kernel>): checked here, before anything reads or writes by them."""
        if self.instance != instance:
            return f"holds the record of {self.instance!r:.80}, not of {instance!r}"
        if self.state not in STATES:
            return f"has the unknown state {self.state!r:.40}"
        bad = [m for m in self.modules + (self.held or []) if not MODULE_NAME.fullmatch(m)]
        if bad:
            return f"lists {bad[0]!r:.80}, which is not a module name"
        for key, value, ok in (
            ("kernel", self.kernel, names.kernel_problem(self.kernel) is None),
            ("next_kernel", self.next_kernel, names.kernel_problem(self.next_kernel) is None),
            ("version", self.version, VERSION.fullmatch(self.version) is not None),
        ):
            if value and not ok:
                what = "a version" if key == "version" else "a kernel release"
                return f"has {key!r} {value!r:.80}, which is not {what}"
        return None

    @classmethod
    def load(cls, root: HostRoot, name: str) -> Record | None:
        """The record as it is on disk (None: none yet); files.Damaged / files.Refused when it
        cannot be used. For readers that change nothing (`kvcd status`). While the state
        directory cannot be written, the daemon's copy in the runtime directory is newer and
        is the one read (`unsaved`)."""
        kept = unsaved(root, name)
        if kept is not None:
            return kept[0]
        path = root.state_file(name)
        raw = files.read_bytes(path, MAX_BYTES)
        return None if raw is None else cls.parse(path, raw, name)

    @classmethod
    def read(cls, root: HostRoot, name: str) -> Record | None:
        """The daemon's reader: a damaged record is set aside (`<name>.json.damaged-<time>`) and
        replaced by a Degraded one whose reason says so (StateDamaged), which the next reconcile
        replaces with what it finds on the host. files.Refused when the file is not a regular
        file (kvcd does not remove what someone else put there)."""
        try:
            return cls.load(root, name)
        except files.Damaged as exc:
            aside = files.set_aside(root.state_file(name), exc)
            where = f"; set aside as {aside.name}" if aside else ""
            rec = cls(
                instance=name,
                state=state.DEGRADED,
                code=state.STATE_DAMAGED,
                detail=f"{exc.path} {exc.what}{where}; rebuilding from the host",
                updated=time.time(),
            )
            rec.write(root)
            log.error(
                "degraded: %s",
                rec.reason,
                extra={"KVCD_INSTANCE": name, "KVCD_STATE": state.DEGRADED},
            )
            return rec

    def to_json(self) -> dict[str, Any]:
        """The file's (and `kvcd status --json`'s) object: the fields and the reason line."""
        return {**asdict(self), "reason": self.reason}

    def write(self, root: HostRoot) -> None:
        """Write the record to the state directory. When the host refuses (a full or read-only
        /var), keep it in the runtime directory with the cause, so `kvcd status` and the next
        write start from what the daemon knows, and raise: the caller says HostError. The
        first write that succeeds again removes the runtime copy."""
        kept = root.unsaved_record(self.instance)
        try:
            files.write_json(root.state_file(self.instance), self.to_json())
        except files.Refused:
            raise  # someone's file where kvcd's belongs: not the host's refusal
        except OSError as exc:
            with contextlib.suppress(OSError):  # a read-only /run as well: nowhere to keep it
                files.write_json(kept, {"cause": files.os_error(exc), "record": self.to_json()})
            raise
        with contextlib.suppress(FileNotFoundError):
            kept.unlink()


def unsaved(root: HostRoot, name: str) -> tuple[Record, str] | None:
    """The record the daemon keeps in the runtime directory while the state directory cannot
    be written, and why it cannot (None: there is none, or it is not usable)."""
    path = root.unsaved_record(name)
    try:
        data = files.read_json(path)
        if not isinstance(data, dict) or not isinstance(data.get("cause"), str):
            return None
        raw = json.dumps(data.get("record")).encode()
        return Record.parse(path, raw, name), data["cause"]
    except (OSError, ValueError):  # a damaged copy: the file in the state directory stands
        return None


def _from_reason(line: str) -> dict[str, str]:
    """A record from before the code had its own field: the code is the reason's first word
    when it is one of REASONS (the only reading of reason text, for files kvcd wrote itself)."""
    code, _, detail = line.partition(": ")
    if code in state.REASONS:
        return {"code": code, "detail": detail}
    return {"code": "", "detail": line}


class Writer:
    """The one writer of an instance's record, used under its instance lock (`writing`): each
    change reads the record (a damaged one set aside), edits its section, and writes the whole
    file atomically, so the sections (instance, attempt, next kernel) never overwrite each
    other. (Record.read's repair of a damaged file is the only other write.)"""

    def __init__(self, root: HostRoot, name: str) -> None:
        self.root = root
        self.name = name

    def read(self) -> Record | None:
        return Record.read(self.root, self.name)

    def update(
        self, edit: Callable[[Record], bool], *, create: bool = True, record: Record | None = None
    ) -> Record | None:
        """Apply `edit` (False: nothing changed, nothing written) to the record; a new one
        (Working) when there is none and `create`, else None. `record`: the record as this
        writer read it under the lock held now (not read again)."""
        if record is None:
            record = self.read()
        if record is None:
            if not create:
                return None
            record = Record(instance=self.name, state=state.WORKING)
        if edit(record):
            record.write(self.root)
        return record


@contextlib.contextmanager
def writing(root: HostRoot, name: str) -> Iterator[Writer]:
    """The instance lock, and the record's one writer while it is held."""
    with files.locked(root.instance_lock(name)):
        yield Writer(root, name)


def _opt(check: Callable[[object], bool]) -> Callable[[object], bool]:
    return lambda v: v is None or check(v)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_str(v: object) -> bool:
    return isinstance(v, str)


def is_time(v: object) -> bool:
    """A wall-clock time kvcd wrote (every float a record holds is one): a number from 0 up to
    the year 36812, so time.localtime takes it (no inf, NaN or 400-digit integer)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1 << 40


def _is_attempt(v: object) -> bool:
    if not isinstance(v, dict) or not set(v) <= set(Attempt.__dataclass_fields__):
        return False
    return (
        all(_is_str(v.get(k, "")) for k in ("intent", "code"))
        and v.get("outcome", "") in OUTCOMES
        and _is_int(v.get("tries", 0))
        and _FIELD_TYPES["float"](v.get("not_before", 0.0))
    )


_FIELD_TYPES: dict[str, Callable[[object], bool]] = {
    "Attempt": _is_attempt,
    "str": _is_str,
    "str | None": _opt(_is_str),
    "int": _is_int,
    "int | None": _opt(_is_int),
    "float": is_time,
    "list[str]": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
}
_FIELD_TYPES["list[str] | None"] = _opt(_FIELD_TYPES["list[str]"])


def status_text(root: HostRoot, name: str, record: Record | None, retry_at: float | None) -> str:
    """systemd's STATUS= for a cycle's outcome. None: a bad config or a failure, which the
    record on disk says (`retry_at`: a transient one's next try, on the wall clock)."""
    if record is None:
        try:
            recorded = Record.load(root, name)
        except OSError:
            recorded = None
        if recorded is not None and recorded.state == state.DEGRADED and recorded.reason:
            text = f"{state.DEGRADED}: {recorded.reason}"
        else:
            text = "Degraded; see kvcd status"
        if retry_at is not None:  # a transient failure: say when it is tried again
            text = f"{text[:160]}; retrying in {max(0.0, retry_at - time.time()):.0f}s"
        return text[:200]
    if record.state == state.DONE:
        return f"Done: {name} " + (record.reason or record.goal)
    return f"{record.state}: {record.reason}"[:200]
