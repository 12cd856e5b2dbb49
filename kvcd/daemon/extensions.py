"""The extensions a `kvcd run` process runs for one instance, in verdict order.

Order matters: the first verdict wins. Drift (hold everything until the disk is right again)
comes before the cluster's ordered-upgrade label, which comes before device gating.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

from kvcd.config.model import InstanceConfig, Settings
from kvcd.daemon.events import Context, Extension
from kvcd.host import files

if TYPE_CHECKING:
    from kvcd.daemon.record import Record
    from kvcd.daemon.report import NodeLink
    from kvcd.host.paths import HostRoot

log = logging.getLogger(__name__)


def build(cfg: InstanceConfig, settings: Settings) -> list[Extension]:
    """A fresh set for this config; imports are local so unused features cost nothing."""
    out: list[Extension] = []
    # Drift (issue #5) goes FIRST: while kvcd's files differ from what it left, nothing else
    # may change the instance.
    from kvcd.daemon.drift import DriftMonitor

    out.append(DriftMonitor(cfg, settings))
    # Node state (issue #6): one NodeLink (backend + writer + watch) shared by the three.
    from kvcd.daemon.drain import Drain, LeftOverClaim, mode_of
    from kvcd.daemon.report import NodeLink

    link = NodeLink(settings)
    # Drain holds a reconcile only while its own request waits for DrainComplete; it goes
    # before ordered-upgrade so that a label change cannot bypass a pending drain.
    drain = Drain(link)
    out.append(drain)
    if mode_of(cfg, settings) != "cluster":  # a claim an earlier config left (deferred)
        out.append(LeftOverClaim(drain))
    if cfg.ordered_upgrade:
        from kvcd.daemon.upgrade import OrderedUpgrade

        out.append(OrderedUpgrade(link))
    # Capabilities (issue #7), after drift and ordered-upgrade: no fitting image variant
    # (Degraded), then dependencies not loaded yet (Working), then device gating (Done,
    # "no device"). Link readiness is an after-hook only.
    if cfg.variants:
        from kvcd.daemon.variants import VariantGate

        out.append(VariantGate())
    if cfg.depends_on:
        from kvcd.daemon.depends import DependsGate

        out.append(DependsGate())
    if cfg.requires_device:
        from kvcd.daemon.devices import DeviceGate

        out.append(DeviceGate())
    if cfg.expect_links:
        from kvcd.daemon.links import LinkReadiness

        out.append(LinkReadiness())
    # ... other verdict extensions go here ...
    # Every required library imported for real (the start only looked them up): its idle work,
    # which only starts a thread, comes before the next kernel's, which may build for minutes.
    from kvcd.daemon.libraries import LibraryProof

    out.append(LibraryProof())
    # Next kernel (issue #4): holds only the cycles its own events cause (the instance stays as
    # recorded while its after-hook prepares the next kernel and fills the record's next_kernel
    # fields), so it goes last among the verdicts and before the reporter.
    from kvcd.daemon.nextkernel import NextKernel

    out.append(NextKernel(settings))
    return out + reporters(link)


def reporters(link: NodeLink) -> list[Extension]:
    """The extensions that only publish the record (`reports`), in their order: the metrics
    (the counts kept on disk, the textfile rewritten in a child after READY=1), then the node
    reporter, whose after-hook runs LAST: it publishes what the other after-hooks set."""
    from kvcd.daemon.metrics import MetricsFile
    from kvcd.daemon.report import Reporter

    return [MetricsFile(), Reporter(link)]


def last_words(
    root: HostRoot,
    name: str,
    kernel: str,
    fields: Mapping[str, str],
    cfg: InstanceConfig | None = None,
) -> str | None:
    """The record, as the reporters' last word, where no extension set runs: a first start that
    cannot use its instance file (it exits 2 before any started; `cfg` None), or `kvcd load` /
    `kvcd unload` with no daemon. Else the node and the metrics textfile keep what the last
    daemon left (Done, `.ready`) beside a record that says otherwise. The reporters run on
    `kvcd.toml`'s settings; when those cannot be used, where the node is cannot be known: the
    reason is returned (the record, the journal and `kvcd status` still say the state)."""
    from kvcd.config.loader import load_settings
    from kvcd.config.model import ConfigError
    from kvcd.daemon.report import NodeLink
    from kvcd.host import pylibs

    try:
        settings = load_settings(root)
        pylibs.check_settings(root, settings)
    except ConfigError as exc:
        return str(exc)
    # No usable instance config: what the reporters read of one (ordered_upgrade, for
    # `.ready`, which a record that is not Done never has) is the default.
    source = root.instance_dirs()[0] / f"{name}.toml"
    cfg = cfg or InstanceConfig(name=name, source=source, version="", modules=())
    ctx = Context(root, name, kernel, settings, cfg, post=lambda _e: None, fields=dict(fields))
    # A "preparing" the record kept from a killed daemon: nobody prepares it now.
    from kvcd.daemon.nextkernel import Unfinished

    said = [Unfinished(), *reporters(NodeLink(settings, watch=False))]
    stop(start(said, ctx), fields, exiting=ctx)
    return None


def start(exts: list[Extension], ctx: Context) -> list[Extension]:
    """Start each in order; those that started (one broken watcher must not take the instance
    down: it is logged and left out)."""
    started = []
    for ext in exts:
        try:
            ext.start(ctx)
        except files.FileError as exc:  # expected: kvcd's own file is a FIFO, a symlink, garbage
            log.error("extension %s did not start: %s", ext.name, exc, extra=ctx.fields)
            continue
        except Exception:
            log.exception("extension %s did not start", ext.name, extra=ctx.fields)
            continue
        started.append(ext)
    return started


def stop(exts: list[Extension], fields: Mapping[str, str], exiting: Context | None = None) -> None:
    """Stop each, the last started first. `exiting`: the daemon exits, and each first has its
    last word (`at_exit`, in the order they were started, with the record on disk now) while
    what it reports through (the node link) is still open."""
    if exiting is not None:
        record = last_record(exiting)
        for ext in exts:
            try:
                ext.at_exit(exiting, record)
            except Exception:
                log.exception("extension %s: its last report failed", ext.name, extra=fields)
    for ext in reversed(exts):
        try:
            ext.stop()
        except Exception:
            log.exception("extension %s did not stop cleanly", ext.name, extra=fields)


def report(exts: list[Extension], ctx: Context, fields: Mapping[str, str]) -> None:
    """A record no cycle's hooks see (a config kvcd cannot use: Degraded, ConfigInvalid) to
    the extensions that report it (`reports`: the node, the metrics textfile)."""
    record = last_record(ctx)
    if record is None:
        return
    for ext in exts:
        if not ext.reports:
            continue
        try:
            ext.after(ctx, record)
        except Exception:  # one reporter's failure must not take the instance down
            log.exception("extension %s: its report failed", ext.name, extra=fields)


def last_record(ctx: Context) -> Record | None:
    """The record as the daemon leaves it; None: none, or one that cannot be read (said here)."""
    from kvcd.daemon.record import Record

    try:
        return Record.load(ctx.root, ctx.name)
    except OSError as exc:  # files.Damaged / files.Refused: the last words say Unknown
        log.warning("the record cannot be read: %s", files.os_error(exc), extra=ctx.fields)
        return None
