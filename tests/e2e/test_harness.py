"""The VM harness's own logic, on the host, without a VM (runs in a plain `pytest tests/e2e`).

- entry.sh's e2e mode with a fake payload: steps each in their own pytest session, a failing
  scenarios file not hiding the next, a reboot requested in the middle and the run continued in
  the next "boot" (entry.sh run again on the same state, as after run-guest.sh's reboot);
- the guest conftest's @pytest.mark.boot(N) selection;
- the host side: junit files parsed into one result per guest test, and guest test names read
  from the guest files with ast.
Real bash, python and pytest; systemctl, journalctl & co. are small fakes on PATH that answer
what entry.sh asks of them (this host has no systemd).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from kvcd.host import journal
from tests.e2e.conftest import GuestRun, parse_results
from tests.e2e.test_vm import guest_tests

GUEST = Path(__file__).resolve().parent / "guest"

FAKES = {
    # entry.sh reads multi-user.target's timestamp and lists the blame; artifacts call the rest.
    "systemctl": 'case "$*" in show*) echo 12345678 ;; esac\n',
    "systemd-analyze": "exit 0\n",
    "journalctl": 'echo "fake journal $*"\n',
    "podman": "exit 0\n",
    "dmesg": "exit 0\n",
}

GUEST_FILES = {
    "guest_smoke.py": "def test_smoke_ok():\n    pass\n",
    "guest_scenarios.py": "def test_core_ok():\n    pass\n",
    "guest_kvc_shim.py": "def test_shim_ok():\n    pass\n",
    "scenarios_a.py": "def test_a_fails():\n    assert False, 'scenario a is broken'\n",
    "scenarios_b.py": "import no_such_module_in_the_guest\n",
    "scenarios_c.py": "def test_c_ok():\n    pass\n",
    "reboot_x.py": textwrap.dedent(
        """
        import os
        from pathlib import Path

        import pytest
        from kvcdguest import boot_number, request_reboot

        @pytest.mark.boot(1)
        def test_before():
            assert boot_number() == 1
            Path(os.environ["KVCD_E2E_STATE_DIR"], "was-here").write_text("1")
            request_reboot("9.9.9-e2e")

        @pytest.mark.boot(2)
        def test_after():
            assert boot_number() == 2
            assert Path(os.environ["KVCD_E2E_STATE_DIR"], "was-here").read_text() == "1"
        """
    ),
}


@pytest.fixture
def fake_guest(tmp_path: Path) -> dict[str, Path]:
    payload, state, boot, fakebin = (tmp_path / d for d in ("mnt", "state", "boot", "bin"))
    guest = payload / "guest"
    for d in (guest, state, boot, fakebin):
        d.mkdir(parents=True)
    shutil.copy(GUEST / "entry.sh", guest)
    shutil.copy(GUEST / "kvcdguest.py", guest)
    shutil.copy(GUEST / "conftest.py", guest)
    for name, text in GUEST_FILES.items():
        (guest / name).write_text(text)
    (payload / "mode").write_text("e2e\n")
    (payload / "kver").write_text("1.0.0-e2e\n")
    (boot / "vmlinuz-9.9.9-e2e").write_text("kernel")
    (boot / "initrd.img-9.9.9-e2e").write_text("initrd")
    for name, body in FAKES.items():
        p = fakebin / name
        p.write_text("#!/bin/bash\n" + body)
        p.chmod(0o755)
    # python3 -m pytest in entry.sh: this interpreter, which has pytest. Run by its own path:
    # a venv's python reached through a symlink elsewhere does not find its pyvenv.cfg, and is
    # then the bare base interpreter (no pytest unless the base has it).
    py = fakebin / "python3"
    py.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
    py.chmod(0o755)
    return {"payload": payload, "state": state, "boot": boot, "bin": fakebin}


def run_entry(g: dict[str, Path]) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PATH": f"{g['bin']}{os.pathsep}{os.environ['PATH']}",
        "KVCD_E2E_PAYLOAD_DIR": str(g["payload"]),
        "KVCD_E2E_STATE_DIR": str(g["state"]),
        "KVCD_E2E_BOOT_DIR": str(g["boot"]),
    }
    env.pop("KVCD_E2E_BOOT", None)
    env.pop("PYTEST_ADDOPTS", None)
    return subprocess.run(
        ["bash", str(g["payload"] / "guest" / "entry.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def junit_cases(path: Path) -> dict[str, str]:
    out = {}
    for tc in ET.parse(path).getroot().iter("testcase"):
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            if tc.find(tag) is not None:
                outcome = tag
        out[tc.get("name", "")] = outcome
    return out


def test_entry_steps_and_reboot(fake_guest: dict[str, Path]) -> None:
    res = fake_guest["payload"] / "results"
    first = run_entry(fake_guest)
    assert first.returncode == 0, first.stdout + first.stderr
    # Boot 1 ran every step up to the reboot request, then stopped without results/done.
    assert (res / "reboot").read_text().strip() == "9.9.9-e2e", first.stdout
    assert not (res / "done").exists()
    assert (res / "boot" / "vmlinuz-9.9.9-e2e").read_text() == "kernel"
    assert (res / "boot" / "initrd.img-9.9.9-e2e").read_text() == "initrd"
    assert (res / "journal-boot1.txt").exists()
    assert junit_cases(res / "junit-guest.xml") == {
        "test_smoke_ok": "passed",
        "test_core_ok": "passed",
        "test_shim_ok": "passed",
    }
    assert junit_cases(res / "junit-scenarios_a.xml") == {"test_a_fails": "failure"}
    assert "error" in junit_cases(res / "junit-scenarios_b.xml").values()
    assert junit_cases(res / "junit-scenarios_c.xml") == {"test_c_ok": "passed"}
    assert junit_cases(res / "junit-reboot_x-boot1.xml") == {"test_before": "passed"}

    second = run_entry(fake_guest)  # the next boot of the same run
    assert second.returncode == 0, second.stdout + second.stderr
    assert (res / "done").exists(), second.stdout
    assert not (res / "reboot").exists() and not (res / "boot").exists()
    assert junit_cases(res / "junit-reboot_x-boot2.xml") == {"test_after": "passed"}
    # Steps done in boot 1 did not run again; the failures of boot 1 are in the final rc.
    assert "step scenarios_c" not in second.stdout and "step reboot_x (boot 2)" in second.stdout
    assert (res / "rc").read_text().strip() != "0"
    assert (fake_guest["state"] / "boot").read_text().strip() == "2"

    # The host side reads every junit file: one result per guest test.
    run = GuestRun(outs=[fake_guest["payload"]], mode="e2e", cases=parse_results(res))
    assert [c.name for c in run.check("test_after", "reboot_x")] == ["test_after"]
    assert run.check("test_c_ok", "scenarios_c")[0].outcome == "passed"
    assert run.file_errors("scenarios_b"), "the import error of scenarios_b.py was not reported"
    with pytest.raises(pytest.fail.Exception, match="scenario a is broken"):
        run.check("test_a_fails", "scenarios_a")
    with pytest.raises(pytest.fail.Exception, match="did not report"):
        run.check("test_core_ok", "scenarios_a")


RESET_FILE = textwrap.dedent(
    """
    import os
    from pathlib import Path

    from kvcdguest import request_reset

    STATE = Path(os.environ["KVCD_E2E_STATE_DIR"])

    def test_phase():
        phase = int((STATE / "phase").read_text()) if (STATE / "phase").exists() else 0
        (STATE / "phase").write_text(str(phase + 1))
        if phase == 0:
            # The fake "reset": the trigger kills entry.sh where it waits, as the kernel would.
            request_reset(
                ["sh", "-c", "echo fired > $KVCD_E2E_STATE_DIR/fired; kill -9 $PPID"],
                "1.0.0-e2e",
            )
    """
)


def test_a_hard_reset_runs_the_trigger_and_the_next_boot_goes_on(
    fake_guest: dict[str, Path],
) -> None:
    guest = fake_guest["payload"] / "guest"
    (guest / "reboot_x.py").unlink()
    (guest / "reboot_reset.py").write_text(RESET_FILE)
    res = fake_guest["payload"] / "results"
    first = run_entry(fake_guest)
    assert first.returncode != 0  # killed by its trigger, as a reset ends it
    assert "hard reset expected after boot 1" in first.stdout, first.stdout
    assert (fake_guest["state"] / "fired").read_text().strip() == "fired"
    assert (res / "reboot").read_text().strip() == "1.0.0-e2e" and not (res / "done").exists()
    assert junit_cases(res / "junit-reboot_reset-boot1.xml") == {"test_phase": "passed"}
    assert not (fake_guest["state"] / "reset-trigger").exists()  # fired once, never again

    second = run_entry(fake_guest)  # the host booted the guest again
    assert second.returncode == 0, second.stdout + second.stderr
    assert (res / "done").exists() and not (res / "reboot").exists()
    assert junit_cases(res / "junit-reboot_reset-boot2.xml") == {"test_phase": "passed"}
    assert "hard reset expected" not in second.stdout


def test_a_reset_that_does_not_happen_fails_the_run(fake_guest: dict[str, Path]) -> None:
    guest = fake_guest["payload"] / "guest"
    (guest / "reboot_x.py").unlink()
    (guest / "reboot_reset.py").write_text(RESET_FILE.replace("kill -9 $PPID", "true"))
    res = fake_guest["payload"] / "results"
    env_wait = os.environ.get("KVCD_E2E_RESET_WAIT")
    os.environ["KVCD_E2E_RESET_WAIT"] = "0"
    try:
        done = run_entry(fake_guest)
    finally:
        if env_wait is None:
            del os.environ["KVCD_E2E_RESET_WAIT"]
        else:
            os.environ["KVCD_E2E_RESET_WAIT"] = env_wait
    assert "no hard reset within 0s" in done.stdout, done.stdout
    assert (res / "done").exists() and not (res / "reboot").exists()
    assert (res / "rc").read_text().strip() != "0"


@pytest.mark.parametrize(
    ("boot", "ran"),
    [
        ("1", {"test_any", "test_one"}),
        ("2", {"test_any", "test_two"}),
        ("3", {"test_any"}),
    ],
)
def test_guest_conftest_boot_marker(tmp_path: Path, boot: str, ran: set[str]) -> None:
    shutil.copy(GUEST / "conftest.py", tmp_path)
    (tmp_path / "t_boot.py").write_text(
        "import pytest\n"
        "def test_any(): pass\n"
        "@pytest.mark.boot(1)\ndef test_one(): pass\n"
        "@pytest.mark.boot(2)\ndef test_two(): pass\n"
    )
    junit = tmp_path / "j.xml"
    env = {**os.environ, "KVCD_E2E_BOOT": boot}
    env.pop("PYTEST_ADDOPTS", None)
    p = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--rootdir={tmp_path}",
         "-c", os.devnull, f"--junitxml={junit}", "t_boot.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    assert set(junit_cases(junit)) == ran


@pytest.mark.parametrize(
    ("source", "names"),
    [
        ("def test_a(): pass\ndef helper(): pass\n", ["test_a"]),
        ("class TestX:\n    def test_m(self): pass\n    def f(self): pass\n", ["TestX::test_m"]),
        ("class Helper:\n    def test_m(self): pass\n", []),
        ("async def test_b(): pass\n", ["test_b"]),
    ],
)
def test_guest_tests_names(tmp_path: Path, source: str, names: list[str]) -> None:
    f = tmp_path / "scenarios_t.py"
    f.write_text(source)
    assert guest_tests(f) == names


def test_guest_files_have_tests() -> None:
    """Every guest file the host reports on parses and names tests."""
    for f in [GUEST / "guest_smoke.py", GUEST / "guest_scenarios.py", GUEST / "guest_kvc_shim.py",
              *GUEST.glob("scenarios_*.py"), *GUEST.glob("reboot_*.py")]:  # fmt: skip
        assert guest_tests(f), f


@pytest.fixture
def kvcdguest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The guest helpers, imported on the host, their record directories under tmp_path."""
    monkeypatch.syspath_prepend(str(GUEST))
    import kvcdguest as kg

    monkeypatch.setattr(kg, "RECORDS", tmp_path / "instances")
    monkeypatch.setattr(kg, "UNSAVED", tmp_path / "run")
    kg.RECORDS.mkdir()
    kg.UNSAVED.mkdir()
    return kg


def test_not_yet_reads_the_record_and_asks_kvcd_status_when_it_cannot_tell(
    kvcdguest: Any,
) -> None:
    kg = kvcdguest
    # No record anywhere: `kvcd status` says Unknown ("never started"), so not there yet...
    assert kg.not_yet("x", state="Degraded")
    assert kg.not_yet("x", state=("Done", "Degraded"), version="1.0")
    # ...unless Unknown is what is waited for.
    assert not kg.not_yet("x", state="Unknown")
    # A record: its fields decide.
    record = kg.RECORDS / "x.json"
    record.write_text(json.dumps({"state": "Working", "version": "1.0"}))
    assert kg.not_yet("x", state="Degraded")
    assert not kg.not_yet("x", state=("Working", "Done"), version="1.0")
    assert kg.not_yet("x", state="Working", version="2.0")
    # It cannot tell (ask kvcd status): a record that does not parse, or one kept in /run.
    record.write_text("{not json")
    assert not kg.not_yet("x", state="Degraded")
    record.unlink()
    (kg.UNSAVED / "x.unsaved.json").write_text("{}")
    assert not kg.not_yet("x", state="Degraded")


def test_sharded_guests_boot_side_by_side_and_merge(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """KVCD_E2E_SHARDS: the guest is built once, then one run-guest.sh per step group runs at
    the same time, each with its own out directory, KVCD_E2E_ONLY and KVCD_E2E_SMP; their junit
    results are read as one run, and a guest that did not finish is named."""
    from tests.e2e import conftest

    log = tmp_path / "calls.log"
    build = tmp_path / "build-guest.sh"
    build.write_text(f"#!/bin/bash\necho build >>{log}\necho /cache/guest\n")
    run = tmp_path / "run-guest.sh"
    # Each fake guest waits until both have started: the groups must run side by side.
    run.write_text(
        textwrap.dedent(
            f"""\
            #!/bin/bash
            out=$4
            echo "run $out only=$KVCD_E2E_ONLY smp=$KVCD_E2E_SMP" >>{log}
            touch "{tmp_path}/started-$(basename "$out")"
            for _ in $(seq 100); do
                [ "$(ls {tmp_path}/started-* | wc -l)" -ge 2 ] && break
                sleep 0.05
            done
            mkdir -p "$out/results" "$out/payload"
            echo e2e >"$out/payload/mode"
            step=${{KVCD_E2E_ONLY%% *}}
            printf '<testsuite><testcase classname="%s" name="test_ok" time="1"/></testsuite>' \\
                "$step" >"$out/results/junit-$step.xml"
            [ "$step" = scenarios_b ] && exit 3
            touch "$out/results/done"
            """
        )
    )
    for f in (build, run):
        f.chmod(0o755)
    monkeypatch.setattr(conftest, "RUN_GUEST", run)
    monkeypatch.setattr(conftest, "BUILD_GUEST", build)
    monkeypatch.delenv("KVCD_E2E_RESULTS", raising=False)
    monkeypatch.delenv("KVCD_E2E_SHARD_SMP", raising=False)

    got = conftest.boot_guests("e2e", tmp_path / "e2e", ["core scenarios_a", "scenarios_b"])

    calls = log.read_text().splitlines()
    assert calls[0] == "build" and len(calls) == 3, calls
    assert sorted(calls[1:]) == [
        f"run {tmp_path}/e2e-1 only=core scenarios_a smp=1",
        f"run {tmp_path}/e2e-2 only=scenarios_b smp=1",
    ]
    assert got.outs == [tmp_path / "e2e-1", tmp_path / "e2e-2"]
    assert sorted(c.classname for c in got.cases) == ["core", "scenarios_b"]
    assert [p.name for p in got.result_files("junit-*.xml")] == [
        "junit-core.xml",
        "junit-scenarios_b.xml",
    ]
    assert "rc 3" in got.harness_error and "e2e-2" in got.harness_error
    assert "e2e-1" not in got.harness_error


DEMO_FAKES = {
    "systemctl": textwrap.dedent(
        """\
        echo "$*" >>"$FAKE_LOG/systemctl"
        case "$1" in
        start) exit "${FAKE_START_RC:-0}" ;;
        status)
            echo "● kvcd@e2e-kmod.service - kvcd kernel module delivery for e2e-kmod"
            echo "     Active: active (running) since Wed 2026-11-25 02:16:49 UTC; 3s ago"
            echo '     Status: "Done (loaded)"' ;;
        esac
        """
    ),
    "lsmod": 'printf "Module Size Used by\\nkvcd_user 16384 0\\nkvcd_base 16384 1 kvcd_user\\n"\n'
    'echo "ext4 1 0"\n',
    "kvcd": 'echo "e2e-kmod: Done (loaded)  version 1.0  kernel 6.1.0-e2e"\n'
    'echo "  kvcd_base: loaded"\n',
    "journalctl": 'case "$*" in *json*) cat "$FAKE_JOURNAL" ;;\n'
    '*) echo "the whole journal" ;; esac\n',
}


def journal_json(build_lines: int, build_end: str) -> str:
    def rec(msg: str, mid: str = "", ident: str = "kvcd") -> str:
        r = {"__REALTIME_TIMESTAMP": "1795573708000000", "SYSLOG_IDENTIFIER": ident,
             "_PID": "404", "MESSAGE": msg}  # fmt: skip
        if mid:
            r["MESSAGE_ID"] = mid
        return json.dumps(r)

    end = {"finished": journal.MSG_BUILD_FINISHED, "failed": journal.MSG_BUILD_FAILED}[build_end]
    recs = [
        rec("Starting kvcd@e2e-kmod.service...", ident="systemd"),
        rec("step: build localhost/kvcd/e2e-kmod/1.0:6.1.0-e2e"),
        rec("build of localhost/kvcd/e2e-kmod/1.0 started", journal.MSG_BUILD_STARTED),
        *(rec(f"BUILD OUTPUT {i}") for i in range(build_lines)),
        rec(f"build of localhost/kvcd/e2e-kmod/1.0 {build_end}", end),
        rec("loaded kvcd_base", journal.MSG_LOADED),
        rec("state Done (loaded)"),
    ]
    return "\n".join(recs) + "\n"


def run_demo(
    tmp_path: Path, *, start_rc: int = 0, build_end: str = "finished"
) -> tuple[subprocess.CompletedProcess[str], Path]:
    fakebin, results, log = (tmp_path / d for d in ("bin", "results", "log"))
    for d in (fakebin, results, log):
        d.mkdir()
    for name, body in DEMO_FAKES.items():
        p = fakebin / name
        p.write_text("#!/bin/bash\n" + body)
        p.chmod(0o755)
    py = fakebin / "python3"
    py.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
    py.chmod(0o755)
    (tmp_path / "journal.json").write_text(journal_json(400, build_end))
    env = {
        **os.environ,
        "PATH": f"{fakebin}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(GUEST.parents[2]),  # demo_journal.py imports kvcd, as in the guest
        "FAKE_LOG": str(log),
        "FAKE_JOURNAL": str(tmp_path / "journal.json"),
        "FAKE_START_RC": str(start_rc),
    }
    p = subprocess.run(
        ["bash", str(GUEST / "demo.sh"), str(results)],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    return p, results


def test_demo_shows_the_four_sections_in_one_screen(tmp_path: Path) -> None:
    p, results = run_demo(tmp_path)
    out = p.stdout
    assert p.returncode == 0, out + p.stderr
    sections = [ln for ln in out.splitlines() if ln.startswith("===== ")]
    assert sections == [
        "===== systemctl status kvcd@e2e-kmod.service",
        "===== lsmod | grep kvcd",
        "===== kvcd status e2e-kmod",
        "===== journalctl -u kvcd@e2e-kmod.service (image build output folded)",
        "===== systemctl stop kvcd@e2e-kmod.service",
    ]
    assert '     Status: "Done (loaded)"' in out
    assert "kvcd_base 16384 1 kvcd_user" in out and "ext4" not in out
    assert "e2e-kmod: Done (loaded)  version 1.0  kernel 6.1.0-e2e" in out
    # The journal: kvcd's own records, the 400 lines of build output as one line.
    assert "... 400 lines of image build output ..." in out
    assert "BUILD OUTPUT" not in out
    assert "kvcd[404]: loaded kvcd_base" in out
    assert len(out.splitlines()) <= 60, out
    # The unit's status without its log lines (the journal section has them, folded).
    assert (
        "status kvcd@e2e-kmod.service --no-pager --full --lines=0"
        in (tmp_path / "log" / "systemctl").read_text()
    )
    assert (results / "kvcd@e2e-kmod.service.journal.txt").read_text() == "the whole journal\n"


def test_demo_failed_start_and_build_say_why(tmp_path: Path) -> None:
    p, _results = run_demo(tmp_path, start_rc=1, build_end="failed")
    assert p.returncode == 1, p.stdout + p.stderr
    assert "systemctl start kvcd@e2e-kmod.service: rc 1" in p.stdout
    # A failed build shows its last lines, where the error is.
    shown = [ln for ln in p.stdout.splitlines() if "BUILD OUTPUT" in ln]
    assert [ln.rsplit(" ", 1)[1] for ln in shown] == [str(i) for i in range(390, 400)]
