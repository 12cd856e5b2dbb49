"""The file node backend: /var/lib/kvcd/node.json, the standalone default.

{"labels": {...}, "annotations": {...}, "generation": N}. Every `kvcd@` process on the node (and
`kvcd label` / `kvcd annotate`) reads and writes it under one flock on a separate lock file
(node.json.lock; the JSON file itself is replaced atomically, so a lock on its inode would be
lost with the rename), so read-modify-write cycles never lose each other's keys. Readers that do
not lock still see a whole file (tmp + fsync + rename). Changes are noticed by inotify on the
directory (kvcd.host.fswatch), filtered to node.json.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvcd.core import state
from kvcd.host import files
from kvcd.host.paths import HostRoot
from kvcd.node.backend import (
    Backend,
    NodeView,
    Patch,
    Unavailable,
    apply_patch,
    changes,
    string_map,
)

if TYPE_CHECKING:
    from kvcd.host.fswatch import DirWatch

log = logging.getLogger(__name__)


def node_file(root: HostRoot) -> Path:
    return root.state / "node.json"


def empty_node() -> dict[str, Any]:
    return {"labels": {}, "annotations": {}, "generation": 0}


def parse_node(path: Path, raw: bytes) -> dict[str, Any]:
    """node.json's content; files.Damaged when it is not JSON or not the node file's shape.
    Never guess over a damaged file: a label read wrong could unload a driver."""
    data = files.parse_json(path, raw)
    if not isinstance(data, dict):
        raise files.Damaged(path, "must hold a JSON object")
    for part in ("labels", "annotations"):
        try:
            data[part] = string_map(part, data.get(part, {}))
        except ValueError as exc:
            raise files.Damaged(path, str(exc)) from None
    generation = data.get("generation", 0)
    if not isinstance(generation, int) or isinstance(generation, bool) or generation < 0:
        raise files.Damaged(path, f"'generation' must be a count, not {generation!r:.40}")
    return data


class FileBackend(Backend):
    kind = "file"

    def __init__(self, root: HostRoot, name: str) -> None:
        self.root = root
        self.name = name
        self.path = node_file(root)
        self.lock = self.path.with_name(self.path.name + ".lock")
        self._watch: DirWatch | None = None

    # --- reading -------------------------------------------------------------------------------
    def _parse(self, *, new_labels: bool = False) -> dict[str, Any]:
        raw = files.read_bytes(self.path)
        if raw is not None:
            return parse_node(self.path, raw)
        copies = sorted(p.name for p in self.path.parent.glob(self.path.name + ".damaged-*"))
        if copies and not new_labels:
            # No node file since one was set aside: "no labels" would be a guess (an absent
            # version label unloads the driver). Until an admin sets the labels again (kvcd
            # label) or removes the copy, the node store is unavailable: modules are kept.
            raise Unavailable(
                f"{state.STATE_DAMAGED}: {self.path} was damaged and set aside as {copies[-1]}; "
                f"set the labels again with `kvcd label` (or remove the copy) to start anew"
            )
        return empty_node()

    def _load(self, *, holding_lock: bool = False, new_labels: bool = False) -> dict[str, Any]:
        try:
            return self._parse(new_labels=new_labels)
        except files.Damaged as exc:
            # Set aside under the node lock (a writer may have just replaced it with a good one)
            # and start again empty: the daemons write their annotations again; labels set with
            # `kvcd label` are in the copy set aside and must be set again.
            with contextlib.nullcontext() if holding_lock else files.locked(self.lock):
                try:
                    return self._parse(new_labels=new_labels)
                except files.Damaged:
                    aside = files.set_aside(self.path, exc)
            where = f"; set aside as {aside.name}" if aside else ""
            raise Unavailable(
                f"{state.STATE_DAMAGED}: {exc}{where}; set the labels again with `kvcd label` "
                "(or remove the copy) to start anew"
            ) from None
        except OSError as exc:  # files.Refused (a symlink, a FIFO …) or an I/O error
            raise Unavailable(
                str(exc)
                if isinstance(exc, files.FileError)
                else f"cannot read {self.path}: {exc.strerror or exc}"
            ) from None

    def _view(self, data: Mapping[str, Any]) -> NodeView:
        return NodeView(
            self.name,
            dict(data["labels"]),
            dict(data["annotations"]),
            str(data.get("generation", 0)),
        )

    def read(self) -> NodeView:
        return self._view(self._load())

    # --- writing -------------------------------------------------------------------------------
    def update(
        self,
        change: Callable[[NodeView], Patch],
        labels: Callable[[NodeView], Patch] | None = None,
    ) -> NodeView:
        # The daemon's own labels (the OS-update gate) are not the admin's: they do not make a
        # node file that was set aside count as labelled again.
        return self.edit(annotations=change, labels=labels, by_admin=False)

    def edit(
        self,
        *,
        labels: Callable[[NodeView], Patch] | None = None,
        annotations: Callable[[NodeView], Patch] | None = None,
        by_admin: bool = True,
    ) -> NodeView:
        """Atomic read-modify-write of labels and/or annotations under the node lock. Writes
        nothing when nothing changes. `by_admin`: labels set with `kvcd label`."""
        try:
            with files.locked(self.lock):
                new_labels = by_admin and labels is not None
                data = self._load(holding_lock=True, new_labels=new_labels)
                view = self._view(data)
                dirty = False
                for part, change in (("labels", labels), ("annotations", annotations)):
                    if change is None:
                        continue
                    patch = changes(data[part], change(view))
                    if patch:
                        data[part] = apply_patch(data[part], patch)
                        dirty = True
                if not dirty:
                    return view
                data["generation"] = int(data.get("generation", 0)) + 1
                files.write_json(self.path, data)
                return self._view(data)
        except OSError as exc:
            raise Unavailable(f"cannot write {self.path}: {exc.strerror or exc}") from None

    # --- watching ------------------------------------------------------------------------------
    def watch(
        self, on_change: Callable[[NodeView], None], on_lost: Callable[[], None] = lambda: None
    ) -> None:
        """inotify (kvcd.host.fswatch) on the state directory, filtered to node.json. Each
        change is re-read whole; the caller compares what it cares about."""
        from kvcd.host.fswatch import DirWatch

        target = Path(os.path.abspath(self.path))

        def changed(path: Path) -> None:
            if path != target:
                return
            try:
                view = self.read()
            except Unavailable as exc:
                log.warning("node file changed but cannot be read: %s", exc)
                on_lost()
                return
            on_change(view)

        # kvcd owns /var/lib/kvcd: create it so the watch never has to follow it appearing.
        files.ensure_dir(self.path.parent)
        watch = DirWatch([target.parent], changed)
        watch.start()
        self._watch = watch

    def stop(self) -> None:
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.stop()

    def event(self, reason: str, message: str, *, warning: bool = False) -> None:
        # Standalone: the journal is the event log (the daemon logs every state change already).
        log.debug("node event %s: %s", reason, message)
