"""Ordered upgrade extension (KMM protocol): the node label decides what may be loaded.

Watches the node through the shared NodeLink; a change of the instance's label posts an event.
`verdict()` reads the label fresh (or, when the node is unreachable, the last label seen), the
loaded version from /sys/module and the module root, and whether kvcd's store still has the
labelled version for this kernel, and returns LOAD (of the configured version, or of the
labelled one from the store) / UNLOAD / HOLD per the literal table in kvcd.core.upgrade. Never
seen the label and cannot read it -> HOLD (keep the modules as they are). The Reporter publishes
`<p>/<stem>.ready` = the version verified loaded, from the final record (kvcd.daemon.report).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import replace

from kvcd.config import rules
from kvcd.config.model import ConfigError, InstanceConfig, Settings
from kvcd.core import plan as planner
from kvcd.core import upgrade as table
from kvcd.daemon import store
from kvcd.daemon.events import HOLD, LOAD, UNLOAD, Context, Event, Extension, Verdict
from kvcd.daemon.observe import desired_for, observe
from kvcd.daemon.report import NodeLink
from kvcd.node.backend import NodeView
from kvcd.node.keys import Keys

log = logging.getLogger(__name__)

_VERBS = {table.LOAD: LOAD, table.LOAD_LABELED: LOAD, table.UNLOAD: UNLOAD, table.HOLD: HOLD}


def label_key(ctx: Context) -> str:
    return ctx.cfg.upgrade_label or Keys(ctx.settings.annotation_prefix, ctx.name).version_label


def check_upgrade_label(cfg: InstanceConfig, settings: Settings) -> None:
    """Under kvcd's own prefix, an instance may follow only its own version label: any other key
    there is one kvcd writes (another instance's `.ready`, `.state` …) or another instance's
    label, and following it would let one instance's state drive another. ConfigError."""
    label, prefix = cfg.upgrade_label, settings.annotation_prefix
    own = Keys(prefix, cfg.name).version_label
    if label and label.startswith(f"{prefix}/") and label != own:
        raise ConfigError(
            cfg.source,
            f"upgrade_label {label!r} is under kvcd's own prefix {prefix}/, whose keys kvcd "
            f"writes; use {own!r} (the default: leave upgrade_label out) or a key of your own",
        )


def labelled_in_store(ctx: Context, label: str | None) -> bool:
    """Whether the label names a version other than the configured one that kvcd can load from
    its store for the running kernel: nothing to pull, build or extract (the plan's own test),
    and every module the config names in its manifest. Never for a KVC hook instance, whose
    library builds and loads."""
    if not label or label == ctx.cfg.version or ctx.cfg.kvc_lib is not None:
        return False
    if not rules.VERSION.fullmatch(label):  # a hand-edited node.json: never a path part
        return False
    d = desired_for(replace(ctx.cfg, version=label), ctx.kernel)
    if planner.plan_build(d, observe(ctx.root, d)).actions:
        return False
    manifest = store.stored_versions(ctx.root, ctx.name, ctx.kernel).get(label)
    return manifest is not None and all(m.kernel_name in manifest.modules for m in d.modules)


class OrderedUpgrade(Extension):
    name = "ordered-upgrade"

    def __init__(self, link: NodeLink) -> None:
        self.link = link
        self._seen: str | None = None
        self._lock = threading.Lock()
        self._key = ""

    def start(self, ctx: Context) -> None:
        self._key = label_key(ctx)

        def changed(view: NodeView) -> None:  # watch thread: compare and post, nothing else
            value = view.labels.get(self._key, "")
            with self._lock:
                if value == self._seen:
                    return
                self._seen = value
            ctx.post(Event(self.name, f"{self._key}={value}" if value else f"{self._key} removed"))

        self.link.start(ctx, changed)
        # Seed what the watch compares with, so its first view is not news.
        view = self.link.writer.read() if self.link.writer is not None else None
        if view is not None:
            with self._lock:
                if self._seen is None:
                    self._seen = view.labels.get(self._key, "")

    def stop(self) -> None:
        self.link.stop()

    def verdict(self, ctx: Context, events: list[Event]) -> Verdict | None:
        key = label_key(ctx)
        writer = self.link.writer
        view = writer.read() if writer is not None else None
        if view is None:
            detail = writer.failing if writer is not None and writer.failing else "no node"
            d = table.unreachable(key, detail)
            return Verdict(HOLD, d.state, d.code, d.detail)
        label = view.labels.get(key)
        with self._lock:
            self._seen = label or ""
        desired = desired_for(ctx.cfg, ctx.kernel)
        observed = observe(ctx.root, desired)
        loaded = bool(observed.loaded)
        active = observed.active if loaded else None
        stored = labelled_in_store(ctx, label)
        d = table.decide(label, ctx.cfg.version, loaded, active, key, stored=stored)
        if d.verb != table.LOAD:
            log.info("ordered upgrade: %s", d.reason, extra={**ctx.fields, "KVCD_LABEL": key})
        return Verdict(_VERBS[d.verb], d.state, d.code, d.detail, d.version)
