"""Metrics (issue #18): the counts as tables (kvcd/core/metrics.py), what the daemon counts, and
the Prometheus text `kvcd metrics` writes, read back with prometheus_client's own parser."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import pytest

from kvcd import cli
from kvcd.config.model import Settings
from kvcd.core import metrics as m
from kvcd.core import state
from kvcd.core.state import StepFailed
from kvcd.daemon import extensions, metrics
from kvcd.daemon.events import Context
from kvcd.daemon.record import Record
from kvcd.host.paths import HostRoot
from tests.promtext import goals, samples
from tests.unit.test_instance import FakePodman, K, instance, instance_host


@pytest.fixture(autouse=True)
def meter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test counts from zero (the daemon's counts are per process)."""
    monkeypatch.setattr(metrics, "_METER", metrics._Meter())


# --- the counts ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("seconds", "bucket"),
    [
        (0.0, 0),
        (0.01, 0),  # a bound is in its own bucket ("le")
        (0.011, 1),
        (1.0, 5),
        (1800.0, len(m.BUCKETS) - 1),
        (1800.5, len(m.BUCKETS)),  # +Inf
        (math.inf, len(m.BUCKETS)),
    ],
)
def test_an_observation_lands_in_its_bucket(seconds: float, bucket: int) -> None:
    h = m.Histogram().observe(seconds)
    assert h.buckets.index(1) == bucket and h.count == 1


def test_cumulative_buckets_end_with_inf_and_the_count() -> None:
    h = m.Histogram().observe(0.2).observe(3.0).observe(5000.0)
    cum = h.cumulative()
    assert cum[0] == ("0.01", 0)
    assert dict(cum)["0.25"] == 1 and dict(cum)["5.0"] == 2 and cum[-1] == ("+Inf", 3)
    assert [n for _, n in cum] == sorted(n for _, n in cum)
    assert h.total == pytest.approx(5003.2)


def test_counts_round_trip_through_json() -> None:
    c = m.Counts().observe(m.BUILD, 42.0).observe(m.LOAD, 0.03).count(m.DRIFT_EVENTS)
    c = c.count(m.IMAGE_CACHE_HITS, 3).error(1700000000.5, state.LOAD_FAILED)
    assert m.Counts.from_json(json.loads(json.dumps(c.to_json()))) == c


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (lambda d: [], "not a JSON object"),
        (lambda d: {**d, "buckets": [1, 2]}, "other histogram buckets"),
        (lambda d: {**d, "phases": {"bake": d["phases"]["build"]}}, "phase 'bake'"),
        (
            lambda d: {**d, "phases": {"build": {"buckets": [-1] * 16, "sum": 1.0}}},
            "phase 'build'",
        ),
        (lambda d: {**d, "phases": {"build": {"buckets": [0] * 3, "sum": 1.0}}}, "phase 'build'"),
        (lambda d: {**d, "counters": {"cats": 1}}, "counters"),
        (lambda d: {**d, "counters": {"drift_events": -1}}, "counters"),
        (lambda d: {**d, "last_error": {"time": "noon"}}, "last_error"),
        # Each was a traceback (exit 70 of `kvcd metrics`, the extension off in the daemon).
        (lambda d: {**d, "phases": [1]}, "phases are not"),
        (lambda d: {**d, "last_error": "x"}, "last_error"),
        (lambda d: {**d, "last_error": {"time": 10**400}}, "last_error"),
        (lambda d: {**d, "last_error": {"time": math.nan}}, "last_error"),
        (
            lambda d: {**d, "phases": {"build": {"buckets": [0] * 16, "sum": 10**400}}},
            "phase 'build'",
        ),
        (
            lambda d: {**d, "phases": {"build": {"buckets": [0] * 16, "sum": math.inf}}},
            "phase 'build'",
        ),
    ],
)
def test_counts_kvcd_did_not_write_are_refused(change: Any, why: str) -> None:
    good = m.Counts().observe(m.BUILD, 1.0).to_json()
    with pytest.raises(ValueError, match=why):
        m.Counts.from_json(change(good))


@pytest.mark.parametrize(
    "call",
    [lambda c: c.observe("bake", 1.0), lambda c: c.count("cats")],
    ids=["phase", "counter"],
)
def test_an_unknown_phase_or_counter_is_a_bug_said_at_once(call: Any) -> None:
    with pytest.raises(ValueError):
        call(m.Counts())


# --- what the daemon counts ------------------------------------------------------------------


@pytest.fixture
def host(tmp_path: Path, fake_commands: Any, monkeypatch: pytest.MonkeyPatch) -> HostRoot:
    return instance_host(tmp_path, fake_commands, monkeypatch)


def test_a_first_load_times_each_phase_and_counts_the_build(host: HostRoot) -> None:
    instance(host, FakePodman(host, K)).apply("load")
    c = metrics.snapshot()
    assert {p: h.count for p, h in c.phases.items()} == {
        m.BUILD: 1,
        m.EXTRACT: 1,
        m.DEPMOD: 1,
        m.LOAD: 1,  # both modules' loads: one change, one observation
    }
    assert c.counters == {m.IMAGE_CACHE_MISSES: 1}


def test_a_cached_image_is_a_hit_and_no_build_time(host: HostRoot) -> None:
    pod = FakePodman(host, K)
    instance(host, pod).apply("load")
    instance(host, pod, "2.0").apply("load")  # 2.0 built
    instance(host, pod).apply("load")  # back to 1.0: in the store, no image step at all
    for p in list(pod.calls):
        pod.calls.remove(p)
    (host.store("e2e") / "2.0").rename(host.root / "2.0-gone")  # 2.0 extracted again
    instance(host, pod, "2.0").apply("load")
    c = metrics.snapshot()
    assert c.counters == {m.IMAGE_CACHE_MISSES: 2, m.IMAGE_CACHE_HITS: 1}
    assert c.phases[m.BUILD].count == 2


def test_a_failed_change_observes_no_durations(host: HostRoot) -> None:
    pod = FakePodman(host, K)
    pod.fail_build = True
    with pytest.raises(StepFailed):
        instance(host, pod).apply("load")
    assert metrics.snapshot().phases == {}
    assert metrics.snapshot().counters == {m.IMAGE_CACHE_MISSES: 1}


# --- the Prometheus text -----------------------------------------------------------------------


def recorded(root: HostRoot, name: str, **kw: Any) -> None:
    Record(name, kw.pop("state", "Done"), modules=["mod_a", "mod_b"], **kw).write(root)


def test_the_text_says_state_modules_next_kernel_phases_and_counters(root: HostRoot) -> None:
    recorded(root, "nic", version="1.0", kernel=K, next_kernel="6.2", next_kernel_state="ready")
    (root.sys_module / "mod_a").mkdir(parents=True)
    counts = m.Counts().observe(m.BUILD, 40.0).observe(m.LOAD, 0.02).observe(m.LOAD, 0.3)
    counts = counts.count(m.DRIFT_EVENTS, 2).error(1700000000.0, state.LOAD_FAILED)
    (root.runtime).mkdir(parents=True)
    root.metrics_counts("nic").write_text(json.dumps(counts.to_json()))

    got = samples(metrics.render(root, ["nic"]).decode())

    nic = (("instance", "nic"),)
    assert got[("kvcd_instance_state", (*nic, ("state", "Done")))] == 1.0
    assert got[("kvcd_instance_state", (*nic, ("state", "Degraded")))] == 0.0
    info = (("goal", "loaded"), ("instance", "nic"), ("kernel", K), ("version", "1.0"))
    assert got[("kvcd_instance_info", info)] == 1.0
    assert got[("kvcd_module_loaded", (*nic, ("module", "mod_a")))] == 1.0
    assert got[("kvcd_module_loaded", (*nic, ("module", "mod_b")))] == 0.0
    assert got[("kvcd_next_kernel_ready", (*nic, ("kernel", "6.2")))] == 1.0
    load = (*nic, ("phase", "load"))
    assert got[("kvcd_phase_duration_seconds_count", load)] == 2.0
    assert got[("kvcd_phase_duration_seconds_sum", load)] == pytest.approx(0.32)
    assert (
        got[("kvcd_phase_duration_seconds_bucket", (*nic, ("le", "0.05"), ("phase", "load")))] == 1
    )
    assert got[("kvcd_phase_duration_seconds_count", (*nic, ("phase", "extract")))] == 0.0
    assert got[("kvcd_drift_events_total", nic)] == 2.0
    assert got[("kvcd_image_cache_hits_total", nic)] == 0.0
    assert got[("kvcd_last_error_timestamp_seconds", nic)] == 1700000000.0
    assert got[("kvcd_last_error_info", (*nic, ("reason", "LoadFailed")))] == 1.0


def test_every_instance_in_one_text_one_family_per_name(root: HostRoot) -> None:
    recorded(root, "a")
    recorded(root, "b", state="Degraded", code=state.DRIFT, detail="x")
    text = metrics.render(root, ["a", "b", "never-started"]).decode()
    assert text.count("# TYPE kvcd_instance_state gauge") == 1
    got = samples(text)
    assert got[("kvcd_instance_state", (("instance", "b"), ("state", "Degraded")))] == 1.0
    assert got[("kvcd_instance_state", (("instance", "never-started"), ("state", "Unknown")))] == 1


def test_kvcd_metrics_prints_and_writes_the_textfile(
    root: HostRoot, capsys: pytest.CaptureFixture[str]
) -> None:
    recorded(root, "nic")
    assert cli.main(["--root", str(root.root), "metrics", "nic"]) == 0
    printed = capsys.readouterr().out
    assert "kvcd_instance_state" in printed
    assert cli.main(["--root", str(root.root), "metrics", "nic", "--write"]) == 0
    written = root("/run/kvcd/metrics/kvcd-nic.prom")
    assert written.read_text() == printed  # the same text, for node_exporter
    assert not [p for p in written.parent.iterdir() if p.name.startswith(".")]  # renamed whole


def test_no_textfile_directory_is_said(root: HostRoot, capsys: pytest.CaptureFixture[str]) -> None:
    root.main_config.parent.mkdir(parents=True)
    root.main_config.write_text('metrics_dir = ""\n')
    root.main_config.chmod(0o644)
    assert cli.main(["--root", str(root.root), "metrics", "nic", "--write"]) == 2
    assert 'metrics_dir = ""' in capsys.readouterr().err


@pytest.mark.parametrize(
    ("value", "ok"),
    [
        ('"/var/lib/node_exporter/textfile_collector"', True),
        ('""', True),
        ('"relative/dir"', False),
        ('"/var/lib/../etc"', False),
        ('"/var/lib/x/"', False),
        ('"/"', False),
        ("3", False),
    ],
)
def test_the_metrics_dir_setting(root: HostRoot, value: str, ok: bool) -> None:
    from kvcd.config.loader import parse_settings_toml
    from kvcd.config.model import ConfigError

    text = f"metrics_dir = {value}\n"
    if ok:
        assert parse_settings_toml(Path("/etc/kvcd/kvcd.toml"), text).metrics_dir == json.loads(
            value
        )
    else:
        with pytest.raises(ConfigError, match="metrics_dir"):
            parse_settings_toml(Path("/etc/kvcd/kvcd.toml"), text)


# --- the daemon's late hook ------------------------------------------------------------------


def test_the_hook_keeps_counts_on_disk_records_the_last_error_and_writes_the_file(
    root: HostRoot,
) -> None:
    ctx = Context(root, "nic", K, Settings(), None, lambda _e: None)  # type: ignore[arg-type]
    kept = m.Counts().count(m.IMAGE_CACHE_HITS, 4)
    root.runtime.mkdir(parents=True)
    root.metrics_counts("nic").write_text(json.dumps(kept.to_json()))
    hook = metrics.MetricsFile()
    hook.start(ctx)  # a restarted daemon goes on counting from what its predecessor kept
    metrics.count(m.IMAGE_CACHE_HITS)
    failed = Record("nic", "Degraded", state.LOAD_FAILED, "x", updated=1700000000.0)
    failed.write(root)
    hook.after(ctx, failed)
    saved = m.Counts.from_json(json.loads(root.metrics_counts("nic").read_text()))
    assert saved.counters == {m.IMAGE_CACHE_HITS: 5}
    assert (saved.last_error_time, saved.last_error_code) == (1700000000.0, state.LOAD_FAILED)
    textfile = root("/run/kvcd/metrics/kvcd-nic.prom")
    deadline = time.monotonic() + 10
    while not textfile.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert 'kvcd_last_error_info{instance="nic",reason="LoadFailed"} 1.0' in textfile.read_text()


def test_changes_while_the_child_runs_make_one_more_run_not_one_each(
    root: HostRoot, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    release, calls = threading.Event(), []

    def child(_root: HostRoot, name: str, _path: str, _cancel: object) -> str | None:
        calls.append(name)
        release.wait(10)
        return None

    monkeypatch.setattr(metrics, "write_in_child", child)
    ctx = Context(root, "nic", K, Settings(), None, lambda _e: None)  # type: ignore[arg-type]
    hook = metrics.MetricsFile()
    hook._write_soon(ctx)
    deadline = time.monotonic() + 10
    while not calls and time.monotonic() < deadline:
        time.sleep(0.01)
    for _ in range(3):  # three changes while the first child runs
        hook._write_soon(ctx)
    release.set()
    while hook._running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert calls == ["nic", "nic"]


def test_a_damaged_record_is_unknown_named_on_stderr_and_the_others_still_print(
    root: HostRoot, capsys: pytest.CaptureFixture[str]
) -> None:
    recorded(root, "good")
    root.state_file("bad").write_text("garbage{")
    assert cli.main(["--root", str(root.root), "metrics"]) == 1
    out, err = capsys.readouterr()
    got = samples(out)
    assert got[("kvcd_instance_state", (("instance", "bad"), ("state", "Unknown")))] == 1.0
    assert got[("kvcd_instance_state", (("instance", "good"), ("state", "Done")))] == 1.0
    assert f"{root.state_file('bad')}: is not valid JSON" in err


@pytest.mark.parametrize(
    ("kept", "records", "when"),
    [
        # (state, code, updated) per cycle -> the last error's time afterwards
        pytest.param("", [("Done", "", 1.0), ("Degraded", "LoadFailed", 2.0)], 2.0, id="went"),
        pytest.param(
            "", [("Degraded", "LoadFailed", 2.0), ("Degraded", "LoadFailed", 9.0)], 2.0,
            id="a-rewrite-is-not-a-new-error",
        ),
        pytest.param(
            "", [("Degraded", "LoadFailed", 2.0), ("Degraded", "Drift", 5.0)], 5.0,
            id="another-reason-is",
        ),
        pytest.param(
            "", [("Degraded", "Drift", 2.0), ("Done", "", 3.0), ("Degraded", "Drift", 7.0)], 7.0,
            id="again-after-done",
        ),
        pytest.param("LoadFailed", [("Degraded", "LoadFailed", 8.0)], 1.0, id="restart-same"),
        pytest.param("Drift", [("Degraded", "LoadFailed", 8.0)], 8.0, id="restart-other"),
    ],
)  # fmt: skip
def test_the_last_error_is_when_it_went_degraded(
    root: HostRoot, kept: str, records: list[tuple[str, str, float]], when: float
) -> None:
    ctx = Context(root, "nic", K, Settings(metrics_dir=""), None, lambda _e: None)  # type: ignore[arg-type]
    root.runtime.mkdir(parents=True)
    before = m.Counts().error(1.0, kept) if kept else m.Counts()
    root.metrics_counts("nic").write_text(json.dumps(before.to_json()))
    hook = metrics.MetricsFile()
    hook.start(ctx)
    for st, code, updated in records:
        hook.after(ctx, Record("nic", st, code, "x" if code else "", updated=updated))
    assert metrics.snapshot().last_error_time == when


# --- the daemon's exit: the textfile says what the stop left ------------------------------------


def _hook_with_a_child_running(
    root: HostRoot, monkeypatch: pytest.MonkeyPatch
) -> tuple[metrics.MetricsFile, Context, list[str]]:
    """A hook whose child (the fake) is writing the loaded record's textfile when it is stopped;
    the fake ends only when cancelled, as run.run's cancel ends the real one."""
    import threading

    calls: list[str] = []
    started = threading.Event()

    def child(_root: HostRoot, name: str, _path: str, cancel: threading.Event) -> str | None:
        calls.append(name)
        started.set()
        return "killed" if cancel.wait(10) else None

    monkeypatch.setattr(metrics, "write_in_child", child)
    ctx = Context(root, "nic", K, Settings(), None, lambda _e: None)  # type: ignore[arg-type]
    hook = metrics.MetricsFile()
    hook.start(ctx)
    loaded = Record("nic", "Done", goal="loaded", modules=["mod_a"], updated=1.0)
    loaded.write(root)
    (root.sys_module / "mod_a").mkdir(parents=True)
    hook.after(ctx, loaded)
    assert started.wait(10)
    return hook, ctx, calls


def test_the_exit_cuts_the_running_child_and_writes_what_the_stop_left(
    root: HostRoot, monkeypatch: pytest.MonkeyPatch
) -> None:
    hook, ctx, calls = _hook_with_a_child_running(root, monkeypatch)
    # The stop's unload, which no after-hook sees.
    (root.sys_module / "mod_a").rmdir()
    Record("nic", "Done", goal="unloaded", modules=["mod_a"], updated=2.0).write(root)
    t0 = time.monotonic()
    hook.at_exit(ctx, extensions.last_record(ctx))
    assert time.monotonic() - t0 < 5  # not the fake's 10 s: it was cut
    hook.after(ctx, Record("nic", "Done", goal="unloaded", updated=3.0))  # stopped: no child
    hook.stop()
    assert calls == ["nic"]
    got = samples(root("/run/kvcd/metrics/kvcd-nic.prom").read_text())
    assert got[("kvcd_module_loaded", (("instance", "nic"), ("module", "mod_a")))] == 0.0
    assert goals(got) == ["unloaded"]


@pytest.mark.parametrize(
    ("metrics_dir", "record", "written"),
    [
        pytest.param("/run/kvcd/metrics", "same", False, id="nothing-changed-nothing-owed"),
        pytest.param("/run/kvcd/metrics", "changed", True, id="the-stop-changed-the-record"),
        pytest.param("/run/kvcd/metrics", "damaged", True, id="damaged-is-unknown"),
        pytest.param("", "changed", False, id="no-textfile-wanted"),
    ],
)
def test_what_the_exit_writes(root: HostRoot, metrics_dir: str, record: str, written: bool) -> None:
    ctx = Context(root, "nic", K, Settings(metrics_dir=metrics_dir), None, lambda _e: None)  # type: ignore[arg-type]
    hook = metrics.MetricsFile()
    hook.start(ctx)
    done = Record("nic", "Done", goal="loaded", updated=1.0)
    done.write(root)
    hook.after(ctx, done)  # the unit tests' child writes in this process, at once
    prom = root(f"{metrics_dir or '/run/kvcd/metrics'}/kvcd-nic.prom")
    deadline = time.monotonic() + 10
    while metrics_dir and not prom.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    hook.stop()
    if prom.exists():
        prom.unlink()
    if record == "changed":
        Record("nic", "Done", goal="unloaded", updated=2.0).write(root)
    elif record == "damaged":
        root.state_file("nic").write_text("garbage{")
    hook.at_exit(ctx, extensions.last_record(ctx))
    assert prom.exists() == written
    if record == "damaged":
        got = samples(prom.read_text())
        assert got[("kvcd_instance_state", (("instance", "nic"), ("state", "Unknown")))] == 1.0
