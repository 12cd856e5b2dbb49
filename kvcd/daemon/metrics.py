"""Metrics (issue #18): the daemon counts, `kvcd metrics` writes the Prometheus text.

A `kvcd run` process counts in memory (`observe`, `count`: phase durations, drift events, image
cache hits; kvcd/core/metrics.py) and its late hook `MetricsFile` keeps them in
`/run/kvcd/<name>.metrics.json`. The Prometheus text format is written with prometheus_client by
`kvcd metrics` (`render`): to stdout, or with `--write` as `<metrics_dir>/kvcd-<name>.prom` for
node_exporter's textfile collector (atomically: a temporary file renamed). The daemon never
imports prometheus_client (its exposition module brings http.server, urllib and email: 6 MiB
resident); after a cycle that changed what the file says a child writes it (`child_main`: what
`kvcd metrics NAME --write` writes, at the daemon's own `metrics_dir`), from a thread, as the
library proof does.

Metrics, every one labelled `instance`:
- kvcd_instance_state{state}: 1 for the recorded state (Done, Working, Degraded, Unknown), 0 for
  the others.
- kvcd_instance_info{version, kernel, goal}: 1.
- kvcd_module_loaded{module}: 1 when the module is in /sys/module now.
- kvcd_next_kernel_ready{kernel}: 1 when prepared for the kernel that boots next, 0 when not
  (yet); absent when none is staged.
- kvcd_phase_duration_seconds{phase}: histogram of build, extract, depmod, load, next_kernel.
- kvcd_last_error_timestamp_seconds, kvcd_last_error_info{reason}: when the instance last went
  Degraded, and why.
- kvcd_drift_events_total, kvcd_image_cache_hits_total, kvcd_image_cache_misses_total.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kvcd.config.model import Settings
from kvcd.core import ahead
from kvcd.core import metrics as m
from kvcd.core.state import DEGRADED
from kvcd.daemon.events import Context, Extension, Verdict
from kvcd.daemon.record import Record
from kvcd.host import files, sysmodule
from kvcd.host.paths import HostRoot

log = logging.getLogger(__name__)

STATES = ("Done", "Working", "Degraded", "Unknown")
CHILD_TIMEOUT = 120.0
STOP_WAIT = 10.0

# --- the process's counts ------------------------------------------------------------------


class _Meter:
    """The counts of this process (one instance per `kvcd run`), shared by its threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = m.Counts()

    def change(self, how: Callable[[m.Counts], m.Counts]) -> m.Counts:
        with self._lock:
            self._counts = how(self._counts)
            return self._counts

    def snapshot(self) -> m.Counts:
        with self._lock:
            return self._counts


_METER = _Meter()


def observe(phase: str, seconds: float) -> None:
    _METER.change(lambda c: c.observe(phase, seconds))


def count(counter: str) -> None:
    _METER.change(lambda c: c.count(counter))


def drift_detected() -> None:
    count(m.DRIFT_EVENTS)


def snapshot() -> m.Counts:
    return _METER.snapshot()


def read_counts(root: HostRoot, name: str) -> m.Counts:
    """The counts a daemon of `name` kept; none when there are none or they are not readable
    as kvcd wrote them (a restarted count, said in the journal, is better than none)."""
    path = root.metrics_counts(name)
    try:
        data = files.read_json(path)
        return m.Counts() if data is None else m.Counts.from_json(data)
    except (OSError, ValueError) as exc:
        log.warning("metrics counts of %s start again: %s: %s", name, path, exc)
        return m.Counts()


# --- the daemon's late hook ----------------------------------------------------------------

# The child runs in the idle scheduling class: after each change it imports prometheus_client
# (seconds of CPU in a slow guest), and an operator's `kvcd status` or the daemon itself must not
# wait for it (the guest's one-vCPU status time tripled without).
_RENDER = """\
import json, os, sys
try:
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
except (AttributeError, OSError):
    pass
sys.path[:] = json.loads(sys.argv[1])
from kvcd.daemon.metrics import child_main
sys.exit(child_main(sys.argv[2:]))
"""


_UNSEEN = object()


class MetricsFile(Extension):
    """Keeps the counts on disk and has the textfile rewritten when what it says changed: by a
    child while the daemon runs, and by the daemon itself as it exits (`at_exit`)."""

    name = "metrics"
    late = True
    reports = True

    def __init__(self) -> None:
        self._saved: m.Counts | None = None
        self._shown: tuple[Any, ...] | None = None
        self._lock = threading.Lock()
        self._again = False  # a change no child has started to write (or one was cut)
        self._running = False
        self._thread: threading.Thread | None = None
        self._cut = threading.Event()  # stopped: the running child is killed, none starts
        self._degraded: str | object | None = _UNSEEN  # the Degraded code of the last record

    def start(self, ctx: Context) -> None:
        kept = read_counts(ctx.root, ctx.name)
        self._saved = _METER.change(lambda _c: kept)

    def after(self, ctx: Context, record: Record) -> Verdict | None:
        if self._note(ctx, record):
            self._write_soon(ctx)
        return None

    def stop(self) -> None:
        """A running child is killed and waited for: nothing of this hook writes after this."""
        self._cut.set()
        thread = self._thread
        if thread is not None:  # the child is killed at once (run.run's cancel)
            thread.join(STOP_WAIT)  # bounded all the same: a stop must not hang on a metric

    def at_exit(self, ctx: Context, record: Record | None) -> None:
        """The daemon exits: the textfile says what the record says now (Unknown when there is
        none to read). A stop's unload or a failure for good reaches no after-hook, and systemd
        kills what a unit leaves running, so the running child is cut and this last write is
        the daemon's own (prometheus_client is imported only now)."""
        self.stop()
        changed = record is not None and self._note(ctx, record)
        if not ctx.settings.metrics_dir or not (changed or self._again or record is None):
            return
        problems: list[str] = []
        try:
            write_textfile(ctx.root, textfile(ctx.settings, ctx.name), ctx.name, problems)
        except OSError as exc:
            problems.append(files.os_error(exc))
        for problem in problems:
            log.warning("metrics textfile: %s", problem, extra=ctx.fields)

    def _note(self, ctx: Context, record: Record) -> bool:
        """Count the record (the counts are kept on disk); whether the textfile is out of date."""
        counts = snapshot()
        # The last error is when the instance went Degraded (or its reason changed), not each
        # rewrite of a Degraded record. Right after a start, the same reason as the counts
        # kept is the same episode.
        code = record.code if record.state == DEGRADED else None
        first = self._degraded is _UNSEEN and code == counts.last_error_code
        if code is not None and code != self._degraded and not first:
            counts = _METER.change(lambda c: c.error(record.updated, record.code))
        self._degraded = code
        if counts != self._saved:
            try:
                files.write_json(ctx.root.metrics_counts(ctx.name), counts.to_json())
                self._saved = counts
            except OSError as exc:
                log.warning("metrics counts not saved: %s", files.os_error(exc), extra=ctx.fields)
        shown = (counts, record.state, record.code, record.reason, record.version,
                 record.kernel, record.goal, tuple(record.modules), record.next_kernel,
                 record.next_kernel_state)  # fmt: skip
        if not ctx.settings.metrics_dir or shown == self._shown:
            return False
        self._shown = shown
        return True

    def _write_soon(self, ctx: Context) -> None:
        """One child at a time; a change while it runs has it run once more."""
        with self._lock:
            self._again = True
            if self._running or self._cut.is_set():
                return
            self._running = True
            self._thread = threading.Thread(
                target=self._write, args=(ctx,), name="kvcd-metrics", daemon=True
            )
            self._thread.start()

    def _write(self, ctx: Context) -> None:
        while True:
            with self._lock:
                if not self._again or self._cut.is_set():
                    self._running = False
                    return
                self._again = False
            path = textfile(ctx.settings, ctx.name)
            problem = write_in_child(ctx.root, ctx.name, path, self._cut)
            if problem and self._cut.is_set():  # killed: what it was writing is still owed
                with self._lock:
                    self._again, self._running = True, False
                return
            if problem:
                log.warning("metrics textfile: %s", problem, extra=ctx.fields)


def write_in_child(root: HostRoot, name: str, path: str, cancel: threading.Event) -> str | None:
    """`name`'s textfile at `path` (where the daemon's settings put it: a kvcd.toml edited
    since, even one kvcd cannot read, does not move it) by a child of this interpreter
    (`child_main`); why it failed, or None. Setting `cancel` kills it."""
    from kvcd.host import run

    argv = [sys.executable, "-c", _RENDER, json.dumps(sys.path), str(root.root), name, path]
    try:
        run.run(argv, timeout=CHILD_TIMEOUT, cancel=cancel)
    except run.CommandError as exc:
        return str(exc)
    return None


def child_main(argv: list[str]) -> int:
    """The child of `write_in_child`: ROOT NAME PATH. Exit 1, saying why on stderr, when the
    file says Unknown for the instance or could not be written."""
    root, name, path = HostRoot(Path(argv[0])), argv[1], argv[2]
    problems: list[str] = []
    try:
        write_textfile(root, path, name, problems)
    except OSError as exc:
        problems.append(files.os_error(exc))
    for problem in problems:
        print(f"kvcd: {problem}", file=sys.stderr)
    return 1 if problems else 0


# --- `kvcd metrics`: the Prometheus text ---------------------------------------------------


def _families(root: HostRoot, name: str, problems: list[str]) -> list[Any]:
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )

    try:
        rec = Record.load(root, name)
    except OSError as exc:  # damaged or unreadable: Unknown here, said on stderr
        problems.append(files.os_error(exc))
        rec = None
    counts = read_counts(root, name)
    now_state = rec.state if rec else "Unknown"
    st = GaugeMetricFamily(
        "kvcd_instance_state", "The instance's recorded state.", labels=["instance", "state"]
    )
    for s in STATES:
        st.add_metric([name, s], 1.0 if s == now_state else 0.0)
    out: list[Any] = [st]
    if rec is not None:
        info = GaugeMetricFamily(
            "kvcd_instance_info",
            "The instance's version, kernel and goal (loaded, unloaded, built).",
            labels=["instance", "version", "kernel", "goal"],
        )
        info.add_metric([name, rec.version, rec.kernel, rec.goal], 1.0)
        loaded = GaugeMetricFamily(
            "kvcd_module_loaded",
            "Whether the module is loaded now (/sys/module).",
            labels=["instance", "module"],
        )
        for mod in rec.modules:
            present = sysmodule.read_module(root, mod) is not None
            loaded.add_metric([name, mod], 1.0 if present else 0.0)
        out += [info, loaded]
        if rec.next_kernel:
            nk = GaugeMetricFamily(
                "kvcd_next_kernel_ready",
                "Whether the instance is prepared for the kernel that boots next.",
                labels=["instance", "kernel"],
            )
            ready = rec.next_kernel_state == ahead.READY
            nk.add_metric([name, rec.next_kernel], 1.0 if ready else 0.0)
            out.append(nk)
    hist = HistogramMetricFamily(
        "kvcd_phase_duration_seconds",
        "How long each phase took (build or pull, extract, depmod, load, next kernel).",
        labels=["instance", "phase"],
    )
    for phase in m.PHASES:
        h = counts.phases.get(phase, m.Histogram())
        hist.add_metric([name, phase], h.cumulative(), h.total)
    out.append(hist)
    if counts.last_error_time:
        when = GaugeMetricFamily(
            "kvcd_last_error_timestamp_seconds",
            "When the instance last went Degraded (Unix time).",
            labels=["instance"],
        )
        when.add_metric([name], counts.last_error_time)
        why = GaugeMetricFamily(
            "kvcd_last_error_info", "Why it last went Degraded.", labels=["instance", "reason"]
        )
        why.add_metric([name, counts.last_error_code or "unknown"], 1.0)
        out += [when, why]
    for counter, help_text in (
        (m.DRIFT_EVENTS, "Drift detected in kvcd's files or modules."),
        (m.IMAGE_CACHE_HITS, "Driver images found cached."),
        (m.IMAGE_CACHE_MISSES, "Driver images built or pulled."),
    ):
        c = CounterMetricFamily(f"kvcd_{counter}", help_text, labels=["instance"])
        c.add_metric([name], float(counts.counters.get(counter, 0)))
        out.append(c)
    return out


def render(root: HostRoot, names: list[str], problems: list[str] | None = None) -> bytes:
    """The Prometheus text format (0.0.4, node_exporter's textfile format) for `names`; an
    instance whose record cannot be read is Unknown, and why goes to `problems`."""
    said: list[str] = [] if problems is None else problems
    from prometheus_client import CollectorRegistry, generate_latest

    class _Collector:
        def collect(self) -> Iterator[Any]:
            by_name: dict[str, Any] = {}
            for name in names:
                for fam in _families(root, name, said):
                    if fam.name in by_name:  # one family per metric name, all instances in it
                        by_name[fam.name].samples.extend(fam.samples)
                    else:
                        by_name[fam.name] = fam
            yield from by_name.values()

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector())
    return generate_latest(registry)


def textfile(settings: Settings, name: str) -> str:
    return f"{settings.metrics_dir}/kvcd-{name}.prom"


def write_textfile(root: HostRoot, path: str, name: str, problems: list[str]) -> None:
    """`name`'s textfile at `path` (`textfile()`), replaced whole (a temporary file renamed);
    OSError when it cannot be."""
    files.atomic_write(root(path), render(root, [name], problems))


def metrics_command(root: HostRoot, only: str | None, write: bool) -> int:
    from kvcd.config.loader import load_settings
    from kvcd.daemon.record import known_names

    names = [only] if only else known_names(root)
    problems: list[str] = []
    if not write:
        sys.stdout.write(render(root, names, problems).decode())
    else:
        settings = load_settings(root)
        if not settings.metrics_dir:
            print('kvcd: metrics_dir = "" in kvcd.toml: no textfile to write', file=sys.stderr)
            return 2
        for name in names:
            write_textfile(root, textfile(settings, name), name, problems)
    for problem in problems:
        print(f"kvcd: {problem} (its instance is Unknown in the metrics)", file=sys.stderr)
    return 1 if problems else 0
