"""The next-kernel preparation and its extension on a fake host.

Podman is test_instance's recording fake; depmod/modprobe are fake commands (tests/fakehost.py).
The kABI check itself runs on real modules in tests/integration/test_weak_updates.py; here its
verdict is a row of the table, so every branch of the decision is reachable.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest

from kvcd.config.model import BuildSource, InstanceConfig, ModuleSpec, Settings
from kvcd.core.attempts import RETRY
from kvcd.daemon import ahead, driftstore, nextkernel, status, store, storegc
from kvcd.daemon.events import SKIP, Context, Event, Verdict
from kvcd.daemon.nextkernel import FAILED, NONE, PREPARING, READY, NextKernel, Outcome
from kvcd.daemon.record import Record
from kvcd.host import files, journal, kmod, modfiles, modtree
from kvcd.host.bootloader import NextBoot
from kvcd.host.paths import HostRoot
from tests import fakehost
from tests.unit.test_instance import FakePodman

A = "6.1.0-56-amd64"
B = "6.1.0-57-amd64"
NAME = "e2e"
# fakehost's depmod, also indexing weak-updates/ as the real one does.
DEPMOD = fakehost.DEPMOD.replace("find -L extra", "find -L extra weak-updates")


@pytest.fixture
def host(tmp_path: Path, fake_commands: Any, monkeypatch: pytest.MonkeyPatch) -> HostRoot:
    root = fakehost.fake_host(HostRoot(tmp_path / "root"), A, fake_commands, monkeypatch)
    (root.system_modules(B) / "kernel").mkdir(parents=True)
    (root.system_modules(B) / "modules.builtin").write_text("")
    fake_commands.add("depmod", DEPMOD)

    def fake_modinfo(path: Path) -> dict[str, list[str]]:
        # FakePodman writes "<module> <image ref>"; the ref's tag is the kernel it was built for.
        data = path.read_bytes().decode()
        return {"vermagic": [f"{data.rsplit(':', 1)[-1]} SMP"], "srcversion": ["abc"]}

    monkeypatch.setattr(modfiles, "modinfo", fake_modinfo)
    return root


def config(root: HostRoot, **kw: Any) -> InstanceConfig:
    return InstanceConfig(
        name=NAME,
        source=root("/etc/kvcd/instances/e2e.toml"),
        version="1.0",
        modules=(ModuleSpec("kvcd_base"), ModuleSpec("kvcd_user")),
        build=BuildSource("/src"),
        **kw,
    )


def next_boot(root: HostRoot, kernel: str | None = B) -> NextBoot:
    if kernel is None:
        return NextBoot(None, "unknown", "no boot entries")
    return NextBoot(kernel, "grubenv", "saved_entry", root.system_modules(kernel))


def running_extraction(root: HostRoot) -> Path:
    return fakehost.store_version(root, NAME, "1.0", A, ["kvcd_base", "kvcd_user"])


def weak_verdict(compatible: bool) -> Any:
    def check(root: HostRoot, cfg: InstanceConfig, running: str, nb: NextBoot) -> Any:
        if compatible:
            return store.tree(root, cfg.name, cfg.version, running), ""
        return None, f"kABI-incompatible with {nb.kernel}: kvcd_base: 0 missing, 1 with another CRC"

    return check


def builds(pod: FakePodman) -> list[str]:
    return [spec.build_args["KVER"] for what, spec in pod.calls if what == "build"]


# --- prepare(): the decision table ---------------------------------------------------------

ROWS = [
    # (case, kabi knob, kABI verdict, next kernel, expected state, reason starts with, built for)
    ("same-kernel", "weak-updates-first", True, A, "", "", []),
    ("unknown", "weak-updates-first", True, None, "", "", []),
    (
        "not-installed",
        "weak-updates-first",
        True,
        "6.1.0-99-amd64",
        FAILED,
        "kernel 6.1.0-99-amd64 is not installed",
        [],
    ),
    ("weak", "weak-updates-first", True, B, READY, "weak-updates from", []),
    (
        "incompatible",
        "weak-updates-first",
        False,
        B,
        READY,
        f"built for {B} (kABI-incompatible",
        [B],
    ),
    ("rebuild-knob", "rebuild", True, B, READY, f"built for {B} (kabi = rebuild)", [B]),
]


@pytest.mark.parametrize(
    ("case", "kabi", "compatible", "kernel", "want", "reason", "built"),
    ROWS,
    ids=[r[0] for r in ROWS],
)
def test_prepare(
    host: HostRoot,
    monkeypatch: pytest.MonkeyPatch,
    case: str,
    kabi: str,
    compatible: bool,
    kernel: str | None,
    want: str,
    reason: str,
    built: list[str],
) -> None:
    running_extraction(host)
    monkeypatch.setattr(ahead, "check_weak", weak_verdict(compatible))
    pod = FakePodman(host, B)
    cfg = config(host, kabi=kabi)
    out = ahead.prepare(host, Settings(), cfg, A, next_boot(host, kernel), lambda: pod)
    assert out.state == want
    assert out.reason.startswith(reason), out.reason
    assert builds(pod) == built
    if want != READY:
        if kernel and kernel != A:
            assert not store.tree(host, NAME, "1.0", kernel).exists()
        return
    assert kernel is not None
    target = store.tree(host, NAME, "1.0", kernel)
    linked = modtree.weak_updates_store(host, kernel, NAME) if case == "weak" else None
    active = modtree.active_store(host, kernel, NAME)
    assert (linked or active) == target
    manifest = store.read_manifest(target)
    assert manifest is not None and manifest.kernel == kernel
    assert manifest.weak_updates_from == (A if case == "weak" else "")
    # Ready means prepared: asking again changes nothing and builds nothing.
    again = ahead.prepare(host, Settings(), cfg, A, next_boot(host, kernel), lambda: pod)
    assert again.state == READY and builds(pod) == built
    assert again.reason == (
        f"weak-updates from {A} (kABI-compatible)" if case == "weak" else f"built for {B}"
    )


def test_failed_build_leaves_no_link_for_the_next_kernel(
    host: HostRoot, monkeypatch: pytest.MonkeyPatch
) -> None:
    running_extraction(host)
    monkeypatch.setattr(ahead, "check_weak", weak_verdict(False))
    pod = FakePodman(host, B)
    pod.fail_build = True
    out = ahead.prepare(host, Settings(), config(host), A, next_boot(host), lambda: pod)
    assert out.state == FAILED
    assert out.reason.startswith("BuildFailed: build failed at STEP 2/2")
    assert "kABI-incompatible" in out.reason
    assert modtree.active_store(host, B, NAME) is None
    assert not store.tree(host, NAME, "1.0", B).exists()


def test_depmod_failure_undoes_the_weak_link(
    host: HostRoot, fake_commands: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The weak link and its store tree go again; then the build path fails the same way."""
    running_extraction(host)
    monkeypatch.setattr(ahead, "check_weak", weak_verdict(True))
    fake_commands.add("depmod", "echo 'depmod: FATAL: could not open modules.order' >&2; exit 1\n")
    pod = FakePodman(host, B)
    out = ahead.prepare(host, Settings(), config(host), A, next_boot(host), lambda: pod)
    assert out.state == FAILED
    assert "weak-updates failed: depmod -b" in out.reason
    assert modtree.weak_updates_store(host, B, NAME) is None
    assert modtree.active_store(host, B, NAME) is None
    assert not list(host.store(NAME).glob(f"1.0/.{B}*"))


def test_kvc_hook_instance_cannot_prepare_ahead(host: HostRoot) -> None:
    lib = host("/usr/lib/kvc/e2e-lib.sh")
    out = ahead.prepare(host, Settings(), config(host, kvc_lib=lib), A, next_boot(host), FakePodman)
    assert out == Outcome(B, FAILED, f"{lib} (a KVC hook library) builds at boot, not ahead")


# --- the extension ------------------------------------------------------------------------


class FakeWatch:
    def __init__(self, dirs: Any, on_change: Any, fail: bool = False) -> None:
        self.dirs = list(dirs)
        self.on_change = on_change
        self.fail = fail
        self.stopped = False

    def start(self) -> None:
        if self.fail:
            raise OSError(28, "inotify watch limit reached")

    def stop(self) -> None:
        self.stopped = True


def context(root: HostRoot, cfg: InstanceConfig, kernel: str = A) -> tuple[Context, list[Event]]:
    posted: list[Event] = []
    ctx = Context(
        root=root,
        name=NAME,
        kernel=kernel,
        settings=Settings(),
        cfg=cfg,
        post=posted.append,
        fields={"KVCD_INSTANCE": NAME},
    )
    return ctx, posted


def record(root: HostRoot, kernel: str = A, **kw: Any) -> Record:
    rec = Record(instance=NAME, state="Done", version="1.0", kernel=kernel, **kw)
    rec.write(root)
    return rec


def test_extension_prepares_on_start_and_on_watch_events(
    host: HostRoot, monkeypatch: pytest.MonkeyPatch
) -> None:
    running_extraction(host)
    monkeypatch.setattr(ahead, "check_weak", weak_verdict(False))
    answers = [next_boot(host, None), next_boot(host, B)]
    asked: list[int] = []

    def detector(root: HostRoot) -> NextBoot:
        asked.append(1)
        return answers[min(len(asked), len(answers)) - 1]

    pod = FakePodman(host, B)
    watches: list[FakeWatch] = []

    def watch(dirs: Any, cb: Any) -> FakeWatch:
        watches.append(FakeWatch(dirs, cb))
        return watches[-1]

    ext = NextKernel(Settings(), detector=detector, podman=lambda: pod, watch=watch)
    ctx, posted = context(host, config(host))
    ext.start(ctx)
    assert host("/boot/loader/entries") in watches[0].dirs
    assert ext.interval() is None  # inotify, no timer

    def cycle(events: list[Event]) -> Any:
        """What the service does with a batch: verdict, then the after-hook on the record; then,
        with no event waiting, the idle work it wants."""
        got = ext.verdict(ctx, events)
        assert ext.after(ctx, rec) is None
        if ext.wants_idle():
            ext.idle(ctx)
        return got

    # Start: no detection inside the start's reconcile (READY=1 would wait): idle work after it.
    rec = record(host)
    assert ext.verdict(ctx, [Event("start", kind=RETRY)]) is None
    assert ext.after(ctx, rec) is None and asked == [] and ext.wants_idle()
    ext.idle(ctx)
    assert len(asked) == 1 and not ext.wants_idle()
    assert posted == [Event("next-kernel", "next kernel none")]  # the outcome, to be reported
    skip = cycle(posted[:])  # its cycle changes nothing and does not look again
    assert skip is not None and skip.verb == SKIP and len(asked) == 1
    # A reconcile without a reason to look does not look again.
    cycle([Event("drift", "timer")])
    assert len(asked) == 1 and len(posted) == 1

    # A kernel is installed: the watch fires; its cycle SKIPs, the idle work prepares it.
    watches[0].on_change(host("/boot/initrd.img-6.1.0-57-amd64"))  # not a boot-config change
    assert len(posted) == 1 and not ext.wants_idle()
    watches[0].on_change(host("/boot/loader/entries/x.conf"))
    assert posted[-1] == Event("next-kernel", str(host("/boot/loader/entries/x.conf")))
    assert cycle(posted[-1:]).verb == SKIP
    # "preparing" is announced first, and the build waits for the announcement's cycle, whose
    # record (the one the node reporter gets) says it: for minutes, the node knows.
    assert builds(pod) == [] and len(asked) == 2 and ext.wants_idle()
    saved = Record.read(host, NAME)
    assert saved is not None and (saved.next_kernel, saved.next_kernel_state) == (B, PREPARING)
    assert posted[-1] == Event("next-kernel", f"next kernel {B}")
    assert ext.verdict(ctx, posted[-1:]) == Verdict(SKIP)
    assert ext.after(ctx, rec) is None
    assert (rec.next_kernel, rec.next_kernel_state) == (B, PREPARING)
    ext.idle(ctx)
    assert builds(pod) == [B] and len(asked) == 3 and not ext.wants_idle()
    saved = Record.read(host, NAME)
    assert saved is not None
    assert (saved.next_kernel, saved.next_kernel_state) == (B, READY)
    assert saved.next_kernel_reason.startswith(f"built for {B}")
    assert saved.state == "Done"  # the running instance is untouched
    assert posted[-1] == Event("next-kernel", f"next kernel {B}")
    # The reported cycle: the record the node reporter gets carries the outcome.
    cycle(posted[-1:])
    assert (rec.next_kernel, rec.next_kernel_state) == (B, READY) and len(asked) == 3
    # `kvcd status` shows it.
    text = status.render(status.collect(host, NAME))
    assert f"  next kernel {B}: ready (built for {B}" in text
    ext.stop()
    assert watches[0].stopped


def test_watch_limit_falls_back_to_a_slow_timer(host: HostRoot) -> None:
    ext = NextKernel(
        Settings(),
        detector=lambda _r: NONE_BOOT,
        watch=lambda dirs, cb: FakeWatch(dirs, cb, fail=True),
    )
    ctx, _ = context(host, config(host))
    ext.start(ctx)
    assert ext.interval() == nextkernel.FALLBACK_INTERVAL


NONE_BOOT = NextBoot(None, "unknown", "nothing")


def test_rpm_ostree_dirs_are_watched_only_on_ostree_hosts(host: HostRoot) -> None:
    ext = NextKernel(Settings())
    assert host("/run/ostree") not in ext.watch_dirs(host)
    host("/run").mkdir(exist_ok=True)
    host("/run/ostree-booted").write_text("")
    (host("/ostree/deploy/fedora/deploy")).mkdir(parents=True)
    dirs = ext.watch_dirs(host)
    assert host("/run/ostree") in dirs and host("/ostree/deploy/fedora/deploy") in dirs


BOOT_ROWS = [
    # (case, recorded next kernel, its state, store for B kept, message expected)
    ("prepared", B, READY, True, "no build"),
    ("prepared-but-gone", B, READY, False, "but are gone"),
    ("failed-before", B, FAILED, True, None),
    ("other-kernel", "6.1.0-58-amd64", READY, True, None),
]


@pytest.mark.parametrize(
    ("case", "recorded", "rstate", "keep", "says"), BOOT_ROWS, ids=[r[0] for r in BOOT_ROWS]
)
def test_first_start_on_the_prepared_kernel_says_no_build(
    host: HostRoot,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    case: str,
    recorded: str,
    rstate: str,
    keep: bool,
    says: str | None,
) -> None:
    """Boot 1 prepared B (weak-updates); boot 2 runs B: the start says whether it will build."""
    running_extraction(host)
    monkeypatch.setattr(ahead, "check_weak", weak_verdict(True))
    out = ahead.prepare(host, Settings(), config(host), A, next_boot(host), FakePodman)
    assert out.state == READY
    if not keep:
        import shutil

        shutil.rmtree(store.tree(host, NAME, "1.0", B))
    record(host, kernel=A, next_kernel=recorded, next_kernel_state=rstate, next_kernel_reason="x")
    ext = NextKernel(Settings(), detector=lambda _r: next_boot(host, B))
    ctx, _ = context(host, config(host), kernel=B)
    caplog.set_level(logging.INFO, logger="kvcd.daemon.nextkernel")
    ext.verdict(ctx, [Event("start", kind=RETRY)])
    said = [r for r in caplog.records if "prepared before the reboot" in r.getMessage()]
    if says is None:
        assert said == []
        return
    assert len(said) == 1 and says in said[0].getMessage()
    if case == "prepared":
        assert said[0].getMessage() == (
            f"modules for {B} were prepared before the reboot (x); no build"
        )
        assert said[0].MESSAGE_ID == journal.MSG_NEXT_KERNEL_PREPARED  # type: ignore[attr-defined]
        assert said[0].levelno == logging.INFO
    else:
        assert said[0].levelno == logging.WARNING
    # After the reconcile on B, the next kernel is the running one: the fields are cleared.
    rec = Record.read(host, NAME)
    assert rec is not None
    ext.after(ctx, rec)
    saved = json.loads(host.state_file(NAME).read_text())
    assert (saved["next_kernel"], saved["next_kernel_state"]) == ("", "")


def test_outcome_none_is_empty() -> None:
    assert Outcome("", "", "") == NONE


VERDICT_ROWS = [
    # (case, events, verdict)
    ("only-ours", [Event("next-kernel", "/boot/loader/entries/x.conf")], SKIP),
    ("ours-and-udev", [Event("next-kernel", "/boot"), Event("udev", "add")], None),
    ("start", [Event("start", kind=RETRY)], None),
    ("reload", [Event("signal", "reload", kind=RETRY)], None),
    ("none", [], None),
]


@pytest.mark.parametrize(("case", "events", "want"), VERDICT_ROWS, ids=[r[0] for r in VERDICT_ROWS])
def test_boot_configuration_events_do_not_redo_the_instance(
    host: HostRoot, case: str, events: list[Event], want: str | None
) -> None:
    """A kernel install must not retry a Degraded load: our events alone hold the state."""
    Record(instance=NAME, state="Degraded", code="LoadFailed", detail="x", kernel=A).write(host)
    ext = NextKernel(Settings(), detector=lambda _r: NONE_BOOT)
    ctx, _ = context(host, config(host))
    got = ext.verdict(ctx, events)
    if want is None:
        assert got is None
    else:
        assert got is not None and got.verb == want


RELEVANT_ROWS = [
    ("/vmlinuz", True),
    ("/vmlinuz.old", True),
    ("/boot", True),
    ("/tmp", False),
    ("/fail-load", False),
    ("/boot/vmlinuz-6.1.0-57-amd64", True),
    ("/boot/symvers-5.14.0-70.el9.x86_64.gz", True),
    ("/boot/grub2", True),
    ("/boot/loader", True),
    ("/boot/initrd.img-6.1.0-57-amd64", False),
    ("/boot/loader/entries/x.conf", True),
    ("/boot/grub2/grubenv", True),
    ("/run/ostree/staged-deployment", True),
]


@pytest.mark.parametrize(("path", "want"), RELEVANT_ROWS, ids=[r[0] for r in RELEVANT_ROWS])
def test_relevant_changes(root: HostRoot, path: str, want: bool) -> None:
    assert nextkernel.relevant(root, root(path)) is want


# --- RHEL's weak-modules, for modules installed in the system's /lib/modules ----------------

WM_ROWS = [
    # (case, add, initramfs, argv after the command name)
    ("add", True, False, ["--add-modules", "--no-initramfs"]),
    ("remove", False, False, ["--remove-modules", "--no-initramfs"]),
    ("add-with-initramfs", True, True, ["--add-modules"]),
]


@pytest.mark.parametrize(("case", "add", "initramfs", "argv"), WM_ROWS, ids=[r[0] for r in WM_ROWS])
def test_weak_modules_command(
    tmp_path: Path, fake_commands: Any, case: str, add: bool, initramfs: bool, argv: list[str]
) -> None:
    stdin = tmp_path / "stdin"
    fake_commands.add("weak-modules", f"cat > '{stdin}'\n")
    mods = [Path(f"/lib/modules/{A}/extra/e2e/kvcd_base.ko"), Path(f"/lib/modules/{A}/x y.ko")]
    assert modtree.weak_modules_command() == str(fake_commands.bindir / "weak-modules")
    modtree.weak_modules(mods, add=add, initramfs=initramfs)
    assert fake_commands.calls() == [["weak-modules", *argv]]
    assert stdin.read_text() == "".join(f"{m}\n" for m in mods)


def test_weak_modules_errors(fake_commands: Any) -> None:
    fake_commands.add("weak-modules", "echo 'weak-modules: no symvers for 5.14.0' >&2; exit 1\n")
    with pytest.raises(kmod.KmodError, match=r"could not add /x.ko: .*no symvers for 5.14.0"):
        modtree.weak_modules([Path("/x.ko")], add=True)
    with pytest.raises(ValueError, match="newline"):
        modtree.weak_modules([Path("/x\n.ko")], add=False)
    modtree.weak_modules([], add=True)  # nothing to do: not run
    assert len(fake_commands.calls()) == 1


# --- the instance knob ----------------------------------------------------------------------

KNOB_ROWS = [
    # (case, line in the file, kabi or the error)
    ("default", "", "weak-updates-first"),
    ("weak-first", 'kabi = "weak-updates-first"', "weak-updates-first"),
    ("rebuild", 'kabi = "rebuild"', "rebuild"),
    ("typo", 'kabi = "weak"', "e2e.toml:4: 'kabi' must be one of 'weak-updates-first', "
     "'rebuild', got \"weak\""),
    ("not-a-string", "kabi = true", "e2e.toml:4: 'kabi' must be one of"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "line", "want"), KNOB_ROWS, ids=[r[0] for r in KNOB_ROWS])
def test_kabi_knob(case: str, line: str, want: str) -> None:
    from kvcd.config.loader import parse_instance_toml
    from kvcd.config.model import ConfigError

    text = fakehost.doc(
        'version = "1.0"', 'modules = ["kvcd_base"]', 'image = "x/y:{kernel}"', line
    )
    if "'kabi'" not in want:
        assert parse_instance_toml(NAME, "/etc/kvcd/instances/e2e.toml", text).kabi == want
        return
    with pytest.raises(ConfigError) as err:
        parse_instance_toml(NAME, "/etc/kvcd/instances/e2e.toml", text)
    assert str(err.value).startswith(f"/etc/kvcd/instances/{want}")


def test_idle_work_is_wanted_again_on_start_reload_and_the_fallback_timer(host: HostRoot) -> None:
    """Other cycles (drift, udev, the node) never ask for a look; start, reload, the fallback
    timer and a watch event (set by the watcher itself) do."""
    ext = NextKernel(Settings(), detector=lambda _r: NONE_BOOT)
    ctx, _ = context(host, config(host))
    record(host)
    for events, wanted in (
        ([Event("start", kind=RETRY)], True),
        ([Event("drift", "resolved"), Event("udev", "add")], False),
        ([Event("signal", "reload", kind=RETRY)], True),
        ([Event("next-kernel", "next kernel none")], False),
        ([Event("next-kernel", "timer")], True),
    ):
        ext.dirty = False
        ext.verdict(ctx, events)
        assert ext.wants_idle() is wanted, events


# --- store clean-up (kvcd/daemon/storegc.py; the rule: tests/unit/test_storegc.py) ----------

C = "6.1.0-58-amd64"


def prepared_weak(root: HostRoot, kernel: str, instance: str = NAME) -> Path:
    """A weak-updates tree for `kernel` linked in kvcd's module root, as link_weak leaves it."""
    tree = fakehost.store_version(root, instance, "1.0", kernel, ["kvcd_base", "kvcd_user"])
    root.kernel_dir(kernel).mkdir(parents=True, exist_ok=True)
    modtree.link_weak_updates(root, kernel, instance, tree)
    return tree


def test_clean_up_removes_what_kernel_updates_left(host: HostRoot) -> None:
    running = running_extraction(host)
    modtree.prepare_kernel_tree(host, A)
    modtree.activate(host, A, NAME, running)
    old_version = fakehost.store_version(host, NAME, "0.9", A, ["kvcd_base"])  # kept
    next_tree = prepared_weak(host, B)
    gone_tree = prepared_weak(host, C)  # was the next kernel; its package is gone now
    (host.state / "drift").mkdir(parents=True)
    driftstore.depmod_record_path(host, C).parent.mkdir(parents=True, exist_ok=True)
    driftstore.depmod_record_path(host, C).write_text("{}")

    removed = storegc.collect(host, config(host), A, B)

    assert removed == [
        f"{gone_tree} (kernel {C} not installed)",
        f"{host.kernel_dir(C)} (kernel {C} not installed)",
    ]
    assert old_version.is_dir()  # going back to 0.9 needs no podman
    assert running.is_dir() and modtree.active_store(host, A, NAME) == running
    assert next_tree.is_dir() and modtree.weak_updates_store(host, B, NAME) == next_tree
    assert not host.kernel_dir(C).exists()
    assert not driftstore.depmod_record_path(host, C).exists()
    assert storegc.collect(host, config(host), A, B) == []  # idempotent


def test_clean_up_gives_back_the_images_of_the_trees_it_removes(host: HostRoot) -> None:
    """A pulled or loaded image carries no kvcd label: only the removed tree's manifest names
    it, so the clean-up hands that name to `release` (imagelabels.release, podman), once."""
    running_extraction(host)
    fakehost.store_version(host, NAME, "0.9", A, ["kvcd_base"], image="localhost/kvcd/e2e/0.9:a")
    gone = fakehost.store_version(host, NAME, "1.0", C, ["kvcd_base"], image="localhost/x:c")
    asked: list[set[str]] = []

    def release(tags: set[str]) -> list[str]:
        asked.append(tags)
        return [f"removed image {t}" for t in sorted(tags)]

    removed = storegc.collect(host, config(host), A, None, release)
    assert asked == [{"localhost/x:c"}]
    assert removed == [f"{gone} (kernel {C} not installed)", "removed image localhost/x:c"]
    assert storegc.collect(host, config(host), A, None, release) == []
    assert len(asked) == 1  # nothing removed, nothing to give back


def test_clean_up_keeps_trees_other_instances_link(host: HostRoot) -> None:
    running_extraction(host)
    prepared_weak(host, C)
    theirs = prepared_weak(host, C, instance="other")
    removed = storegc.collect(host, config(host), A, None)
    assert removed == [f"{store.tree(host, NAME, '1.0', C)} (kernel {C} not installed)"]
    assert modtree.weak_updates_store(host, C, "other") == theirs  # not this instance's to drop
    assert host.kernel_dir(C).is_dir()


def test_clean_up_keeps_the_next_kernel_even_before_it_is_installed(host: HostRoot) -> None:
    tree = prepared_weak(host, C)
    assert storegc.collect(host, config(host), A, C) == []
    assert tree.is_dir()


@pytest.mark.parametrize("linked", ["tree", "version"])
def test_clean_up_leaves_a_symlink_in_the_store_and_names_it(
    host: HostRoot, tmp_path: Path, caplog: pytest.LogCaptureFixture, linked: str
) -> None:
    """A symlink where a stale tree (or its version directory) should be is refused like every
    symlink in kvcd's own directories: named in one line, left in place, nothing it points to
    read or removed; the other stale trees go all the same."""
    outside = tmp_path / "outside"
    (outside / C).mkdir(parents=True)
    (outside / C / "keep.ko").write_bytes(b"x")
    gone = fakehost.store_version(host, NAME, "1.0", C, ["kvcd_base"])
    link = store.tree(host, NAME, "0.8", C)
    if linked == "tree":
        link.parent.mkdir(parents=True)
        link.symlink_to(outside / C)
    else:
        link = link.parent
        link.symlink_to(outside)
    with caplog.at_level(logging.INFO):
        removed = storegc.collect(host, config(host), A, None)
    assert removed == [f"{gone} (kernel {C} not installed)"]
    assert link.is_symlink() and (outside / C / "keep.ko").is_file()
    left = [r for r in caplog.records if "left" in r.getMessage()]
    assert [r.getMessage() for r in left] == [f"store clean-up: left {link}: is a symlink"]
    assert left[0].exc_info is None


def test_a_refused_file_in_the_clean_up_is_one_line(
    host: HostRoot, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An expected refusal (a symlink or FIFO where kvcd keeps its files) is logged as one line
    naming the path; a bug keeps its traceback."""
    ext = NextKernel(Settings(), detector=lambda _r: NONE_BOOT)
    ctx, _ = context(host, config(host))
    fifo = host.instance_lock(NAME)
    for raised, exc_info in (
        (files.Refused(fifo, "is a FIFO"), False),
        (RuntimeError("a bug"), True),
    ):

        def collect(*_a: Any, raised: Exception = raised) -> list[str]:
            raise raised

        monkeypatch.setattr(storegc, "collect", collect)
        caplog.clear()
        ext.collect(ctx)
        (rec,) = [r for r in caplog.records if "store clean-up failed" in r.getMessage()]
        assert (rec.exc_info is not None) is exc_info
        if not exc_info:
            assert rec.getMessage() == f"store clean-up failed: {fifo}: is a FIFO"


def test_clean_up_removes_nothing_when_rpm_ostree_cannot_tell(
    host: HostRoot, fake_commands: Any
) -> None:
    fakehost.write(host("/run/ostree-booted"), "")
    fake_commands.add("rpm-ostree", "echo 'error: Connection refused' >&2; exit 1\n")
    tree = prepared_weak(host, C)
    assert storegc.installed_kernels(host) is None
    assert storegc.collect(host, config(host), A, None) == []
    assert tree.is_dir()


def test_clean_up_removes_nothing_without_lib_modules(host: HostRoot) -> None:
    tree = prepared_weak(host, C)
    shutil.rmtree(host("/lib/modules"))
    assert storegc.collect(host, config(host), A, None) == []
    assert tree.is_dir()


def test_clean_up_on_rpm_ostree_keeps_every_deployment_kernel(
    host: HostRoot, fake_commands: Any
) -> None:
    fakehost.write(host("/run/ostree-booted"), "")
    status_json = json.dumps(
        {
            "deployments": [
                {"id": "fedora-1", "osname": "fedora", "checksum": "b" * 64, "serial": 0,
                 "booted": True, "base-commit-meta": {"ostree.linux": A}},
                {"id": "fedora-0", "osname": "fedora", "checksum": "c" * 64, "serial": 0,
                 "base-commit-meta": {"ostree.linux": C}},
            ]
        }
    )  # fmt: skip
    fake_commands.add("rpm-ostree", f"cat <<'J'\n{status_json}\nJ\n")
    rollback = prepared_weak(host, C)  # the rollback deployment's kernel: not in /lib/modules
    assert storegc.installed_kernels(host) == {A, B, C}
    assert storegc.collect(host, config(host), A, None) == []
    assert rollback.is_dir()


def test_a_new_set_finds_a_prepared_kernel_ready_without_announcing_it(
    host: HostRoot, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restart (or a reload's new set) with the next kernel prepared already: one look says
    ready, and neither the record nor the node goes through "preparing" (the gate would close
    for a moment at every start). A reload that changes the version has to prepare it: that is
    announced."""
    running_extraction(host)
    monkeypatch.setattr(ahead, "check_weak", weak_verdict(False))
    pod = FakePodman(host, B)

    def fresh_set(cfg: InstanceConfig) -> tuple[NextKernel, Context, list[Event]]:
        ext = NextKernel(Settings(), detector=lambda _r: next_boot(host, B), podman=lambda: pod)
        ctx, posted = context(host, cfg)
        ext.start(ctx)
        return ext, ctx, posted

    record(host)
    first, ctx, _ = fresh_set(config(host))
    while first.wants_idle():
        first.idle(ctx)
    assert builds(pod) == [B]
    first.stop()

    again, ctx, posted = fresh_set(config(host))
    again.idle(ctx)
    saved = Record.read(host, NAME)
    assert saved is not None and (saved.next_kernel, saved.next_kernel_state) == (B, READY)
    assert not again.wants_idle() and len(posted) == 1 and builds(pod) == [B]

    fakehost.store_version(host, NAME, "2.0", A, ["kvcd_base", "kvcd_user"])
    bumped, ctx, posted = fresh_set(dataclasses.replace(config(host), version="2.0"))
    bumped.idle(ctx)
    saved = Record.read(host, NAME)
    assert saved is not None and (saved.next_kernel, saved.next_kernel_state) == (B, PREPARING)
    bumped.idle(ctx)
    assert builds(pod) == [B, B]


@pytest.mark.parametrize("cut", ["build", "between"])
def test_a_stop_during_a_preparation_does_not_leave_it_preparing(
    host: HostRoot, monkeypatch: pytest.MonkeyPatch, cut: str
) -> None:
    """SIGTERM cuts into the next kernel's build (kvcd.host.interrupt: said at once, before the
    stop's unload or drain), or comes between the announcement and the build (said by the last
    word, at_exit, before the Reporter's): the record says why the next kernel is not ready,
    not "preparing" for as long as the unit is stopped."""
    from kvcd.host.interrupt import Interrupted

    running_extraction(host)
    monkeypatch.setattr(ahead, "check_weak", weak_verdict(False))

    class Stopped(FakePodman):
        def build(self, spec: Any, on_line: Any) -> Any:
            raise Interrupted

    ext = NextKernel(
        Settings(), detector=lambda _r: next_boot(host, B), podman=lambda: Stopped(host, B)
    )
    ctx, _ = context(host, config(host))
    ext.start(ctx)
    record(host)
    ext.idle(ctx)  # announced
    if cut == "build":
        with pytest.raises(Interrupted):
            ext.idle(ctx)
    saved = Record.read(host, NAME)
    assert saved is not None
    at_once = FAILED if cut == "build" else PREPARING
    assert (saved.next_kernel, saved.next_kernel_state) == (B, at_once)
    ext.at_exit(ctx, saved)
    assert (saved.next_kernel, saved.next_kernel_state) == (B, FAILED)  # what the node gets
    saved = Record.read(host, NAME)
    assert saved is not None and (saved.next_kernel, saved.next_kernel_state) == (B, FAILED)
    assert saved.next_kernel_reason == (
        "stopped before preparing finished; the next start prepares it again"
    )


def test_a_boot_configuration_change_during_the_build_is_looked_at_again(
    host: HostRoot, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The watch fires while the build for B runs (C is made the default): the next idle work
    looks again, and the record does not stay "B ready" while C boots next."""
    running_extraction(host)
    monkeypatch.setattr(ahead, "check_weak", weak_verdict(False))
    nxt = {"kernel": B}
    watches: list[FakeWatch] = []

    def watch(dirs: Any, cb: Any) -> FakeWatch:
        watches.append(FakeWatch(dirs, cb))
        return watches[-1]

    class Switching(FakePodman):
        def build(self, spec: Any, on_line: Any) -> Any:
            nxt["kernel"] = C
            watches[0].on_change(host("/boot/loader/entries/x-C.conf"))
            return super().build(spec, on_line)

    ext = NextKernel(
        Settings(),
        detector=lambda _r: next_boot(host, nxt["kernel"]),
        podman=lambda: Switching(host, B),
        watch=watch,
    )
    ctx, _ = context(host, config(host))
    ext.start(ctx)
    record(host)
    ext.idle(ctx)  # B announced
    ext.idle(ctx)  # B built; C became the default meanwhile
    assert ext.wants_idle()
    ext.idle(ctx)
    saved = Record.read(host, NAME)
    assert saved is not None and saved.next_kernel == C, saved


def test_a_detection_that_fails_after_the_announcement_does_not_stay_preparing(
    host: HostRoot, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing would wake the build again (no event is posted for an unchanged outcome): the
    record says the look failed, and the event publishes it."""
    running_extraction(host)
    answers: list[Any] = [next_boot(host, B), OSError("grubenv: Permission denied")]

    def detector(_root: HostRoot) -> NextBoot:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer  # type: ignore[no-any-return]

    ext = NextKernel(Settings(), detector=detector, podman=lambda: FakePodman(host, B))
    ctx, posted = context(host, config(host))
    ext.start(ctx)
    record(host)
    ext.idle(ctx)
    ext.idle(ctx)
    saved = Record.read(host, NAME)
    assert saved is not None and (saved.next_kernel, saved.next_kernel_state) == (B, FAILED)
    assert saved.next_kernel_reason == "detection failed: grubenv: Permission denied"
    assert len(posted) == 2


def test_extension_cleans_up_after_a_kernel_is_removed(
    host: HostRoot, monkeypatch: pytest.MonkeyPatch
) -> None:
    """B was prepared as the next kernel; then its package is removed and the boot loader's
    default goes back to A: the tree prepared for B goes with it."""
    running_extraction(host)
    monkeypatch.setattr(ahead, "check_weak", weak_verdict(True))
    answers = [next_boot(host, B)]
    watches: list[FakeWatch] = []

    def watch(dirs: Any, cb: Any) -> FakeWatch:
        watches.append(FakeWatch(dirs, cb))
        return watches[-1]

    ext = NextKernel(Settings(), detector=lambda _r: answers[-1], podman=FakePodman, watch=watch)
    ctx, posted = context(host, config(host))
    ext.start(ctx)
    rec = record(host)
    ext.idle(ctx)  # "preparing" announced
    ext.idle(ctx)  # built
    ext.after(ctx, rec)
    assert (rec.next_kernel, rec.next_kernel_state) == (B, READY)
    prepared = store.tree(host, NAME, "1.0", B)
    assert prepared.is_dir()

    shutil.rmtree(host.system_modules(B))  # dnf remove kernel-core-B
    answers.append(next_boot(host, None))
    watches[0].on_change(host("/boot/loader/entries/x-B.conf"))
    assert ext.verdict(ctx, posted[-1:]) == Verdict(SKIP) and ext.wants_idle()
    ext.idle(ctx)
    ext.after(ctx, rec)
    assert not prepared.exists() and not host.kernel_dir(B).exists()
    assert rec.next_kernel == ""


def test_clean_up_in_the_system_tree_never_removes_a_lib_modules_directory(
    host: HostRoot,
) -> None:
    """module_tree = "system": a kernel's /lib/modules/<k> is the system's, even when its
    package is gone (it may hold other packages' files); only kvcd's own copy there goes."""
    system = dataclasses.replace(host, system_tree=True)
    running_extraction(host)
    gone = fakehost.store_version(host, NAME, "1.0", C, ["kvcd_base"])
    (host.system_modules(C) / "extra").mkdir(parents=True)  # no modules.builtin: not installed
    (host.system_modules(C) / "extra" / "dkms-leftover.ko").write_bytes(b"x")
    modtree.activate(system, C, NAME, gone)
    assert (host.system_modules(C) / "extra" / NAME / ".kvcd-store").is_file()
    removed = storegc.collect(system, config(host), A, None)
    assert removed == [f"{gone} (kernel {C} not installed)"]
    assert not (host.system_modules(C) / "extra" / NAME).exists()
    assert (host.system_modules(C) / "extra" / "dkms-leftover.ko").is_file()


class RecordingInhibitor:
    """The Inhibitor's interface, recording (D-Bus: tests/integration/test_inhibit_dbus.py)."""

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[str] = []
        self.why = ""
        self.fail = fail

    @property
    def held(self) -> bool:
        return bool(self.why)

    def hold(self, why: str) -> bool:
        from kvcd.host.inhibit import InhibitError

        if self.fail:
            raise InhibitError("logind refused or could not be reached: no such name")
        new = why != self.why
        self.why = why
        self.calls.append(f"hold {why}")
        return new

    def release(self) -> bool:
        held, self.why = bool(self.why), ""
        if held:
            self.calls.append("release")
        return held


HOLD = [
    (
        "failed: held, with the reason logind shows",
        [Outcome(B, FAILED, "BuildFailed: make exited 2")],
        [f"hold kvcd@e2e is not ready for kernel {B}: BuildFailed: make exited 2"],
    ),
    (
        "failed, then ready: held, then released",
        [Outcome(B, FAILED, "BuildFailed"), Outcome(B, READY, "built")],
        [f"hold kvcd@e2e is not ready for kernel {B}: BuildFailed", "release"],
    ),
    ("ready, or no next kernel: nothing held", [Outcome(B, READY, "built"), NONE], []),
    (
        "failed again with another reason: held with the new one",
        [Outcome(B, FAILED, "BuildFailed"), Outcome(B, FAILED, "kABI")],
        [
            f"hold kvcd@e2e is not ready for kernel {B}: BuildFailed",
            f"hold kvcd@e2e is not ready for kernel {B}: kABI",
        ],
    ),
]


@pytest.mark.parametrize(("why", "outcomes", "calls"), HOLD, ids=[h[0] for h in HOLD])
def test_inhibit_reboot_holds_while_the_next_kernel_failed(
    host: HostRoot, why: str, outcomes: list[Outcome], calls: list[str]
) -> None:
    inh = RecordingInhibitor()
    ext = NextKernel(Settings(inhibit_reboot=True), inhibitor=inh)  # type: ignore[arg-type]
    ctx = Context(host, NAME, A, Settings(), config(host), lambda _e: None)
    for outcome in outcomes:
        ext.hold_reboot(ctx, outcome)
    assert inh.calls == calls
    ext.stop()
    assert not inh.why  # a stopping daemon holds nothing


AGAIN = "it failed before this start; kvcd status says why"
CUT = "its preparation had not finished before this start"


@pytest.mark.parametrize(
    ("recorded", "calls"),
    [
        (
            (B, FAILED, "BuildFailed: make exited 2"),
            [f"hold kvcd@e2e is not ready for kernel {B}: {AGAIN}"],
        ),
        (
            (B, FAILED, "BuildFailed; reboot not held (inhibit_reboot = true): no logind"),
            [f"hold kvcd@e2e is not ready for kernel {B}: {AGAIN}"],
        ),
        # A daemon killed while it built (SIGKILL, the OOM killer, a power cut) writes no
        # "stopped before preparing finished": the record still says preparing.
        ((B, PREPARING, ""), [f"hold kvcd@e2e is not ready for kernel {B}: {CUT}"]),
        ((B, READY, "built"), []),
        ((A, FAILED, "recorded before the reboot into it"), []),
        ((A, PREPARING, ""), []),
        (("", "", ""), []),
        (None, []),
    ],
    ids=[
        "failed: held from the start",
        "the last daemon's not-held note is not the reason",
        "preparing when the daemon before was killed: held from the start",
        "ready: nothing",
        "the running kernel: nothing",
        "the running kernel, preparing: nothing",
        "none",
        "a refused record (a symlink): nothing held, and the extension starts",
    ],
)
def test_a_recorded_failure_holds_the_reboot_from_the_start(
    host: HostRoot, recorded: tuple[str, str, str] | None, calls: list[str]
) -> None:
    """A reload that changes the config (the fix) starts a new set: the failure the record
    keeps holds the reboot at once, not only once the rebuild has failed again, so the reboot
    is not let through while the mended driver is built."""
    inh = RecordingInhibitor()
    ext = NextKernel(
        Settings(inhibit_reboot=True),
        detector=lambda _r: next_boot(host, None),
        inhibitor=inh,  # type: ignore[arg-type]
        watch=FakeWatch,
    )
    ctx, _ = context(host, config(host))
    rec = record(host)
    if recorded is None:
        path = host.state_file(NAME)
        path.rename(path.with_name("elsewhere.json"))
        path.symlink_to("elsewhere.json")
    else:
        rec.next_kernel, rec.next_kernel_state, rec.next_kernel_reason = recorded
        rec.write(host)
    ext.start(ctx)  # raises nothing: extensions.start would leave it out
    assert inh.calls == calls
    ext.stop()


def test_an_inhibitor_logind_refuses_is_said_and_the_instance_goes_on(
    host: HostRoot, caplog: pytest.LogCaptureFixture
) -> None:
    ext = NextKernel(Settings(inhibit_reboot=True), inhibitor=RecordingInhibitor(fail=True))  # type: ignore[arg-type]
    ctx = Context(host, NAME, A, Settings(), config(host), lambda _e: None)
    with caplog.at_level(logging.ERROR):
        ext.hold_reboot(ctx, Outcome(B, FAILED, "BuildFailed"))
    assert f"cannot hold the reboot into {B}: logind refused" in caplog.text


NOT_HELD = (
    "; reboot not held (inhibit_reboot = true): "
    "logind refused or could not be reached: no such name"
)
UNHELD = [
    # (case, whether logind refuses on each look, the note the last look leaves, ERROR lines)
    ("held: the reason alone", [False], "", 0),
    ("logind refuses: the record says the reboot is not held", [True], NOT_HELD, 1),
    ("refused on every look: said once in the journal", [True, True], NOT_HELD, 1),
    ("logind answers again: the note goes", [True, False], "", 1),
    ("a lock taken before still holds: no note", [False, True], "", 1),
]


@pytest.mark.parametrize(("case", "refuses", "note", "errors"), UNHELD, ids=[u[0] for u in UNHELD])
def test_a_reboot_inhibit_reboot_cannot_hold_is_said_where_the_user_looks(
    host: HostRoot,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    case: str,
    refuses: list[bool],
    note: str,
    errors: int,
) -> None:
    """Not only a journal line: `kvcd status`, its --json and the node's next-kernel annotation
    (so the OS-update gate's reason too) say that the reboot is not held, and why."""
    from kvcd.daemon.report import node_patch
    from kvcd.node.keys import Keys

    running_extraction(host)
    monkeypatch.setattr(ahead, "check_weak", weak_verdict(False))
    pod = FakePodman(host, B)
    pod.fail_build = True
    inh = RecordingInhibitor()
    ext = NextKernel(
        Settings(inhibit_reboot=True),
        detector=lambda _root: next_boot(host, B),
        podman=lambda: pod,
        inhibitor=inh,  # type: ignore[arg-type]
    )
    ctx, posted = context(host, config(host))
    rec = record(host)
    with caplog.at_level(logging.WARNING):
        for refused in refuses:
            inh.fail = refused
            ext.dirty = True
            while ext.wants_idle():  # "preparing" announced, then the build
                ext.idle(ctx)
            ext.after(ctx, rec)  # the cycle its event causes: what the node reporter gets
    failed = (
        "BuildFailed: build failed at STEP 2/2: RUN make: exit status 2 "
        f"(kABI-incompatible with {B}: kvcd_base: 0 missing, 1 with another CRC)"
    )
    saved = Record.read(host, NAME)
    assert saved is not None and saved.next_kernel_state == FAILED
    assert saved.next_kernel_reason == failed + note
    (entry,) = status.collect(host, NAME)
    assert entry["next_kernel_reason"] == saved.next_kernel_reason  # status --json
    line = f"  next kernel {B}: failed ({saved.next_kernel_reason})"
    assert line in status.render([entry]).splitlines()
    annotation = node_patch(Keys("kvcd.io", NAME), rec)[f"kvcd.io/{NAME}.next-kernel"]
    assert annotation == f"{B} failed: {saved.next_kernel_reason}"
    said = [
        r.getMessage()
        for r in caplog.records
        if "reboot" in r.getMessage() and r.levelno >= logging.ERROR
    ]
    assert len(said) == errors and all(m.startswith("cannot hold the reboot") for m in said)
    # Each look is news for the node reporter: "preparing" announced, then the outcome (with
    # the note as it is now); the journal says the same failure once, not at every look.
    assert len(posted) == 2 * len(refuses)
    told = [r for r in caplog.records if r.getMessage().startswith(f"next kernel {B}: not ready")]
    assert len(told) == 1


def test_without_inhibit_reboot_no_inhibitor_exists() -> None:
    assert NextKernel(Settings()).inhibitor is None
    assert NextKernel(Settings(inhibit_reboot=True)).inhibitor is not None


# --- `kvcd prepare` (what the kernel-install plugin runs) ----------------------------------------


@pytest.mark.parametrize("fail", [False, True], ids=["ready", "build-failed"])
def test_prepare_command_readies_every_instance_or_says_which_is_not(
    host: HostRoot, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], fail: bool
) -> None:
    fakehost.write_config(
        host,
        NAME,
        'version = "1.0"\nmodules = ["kvcd_base", "kvcd_user"]\n'
        'kabi = "rebuild"\n[build]\ncontext = "/src"\n',
    )
    pod = FakePodman(host, B)
    pod.fail_build = fail
    monkeypatch.setattr("kvcd.daemon.record.running_kernel", lambda _root: A)
    assert ahead.prepare_command(host, None, B, podman=lambda: pod) == (1 if fail else 0)
    out, err = capsys.readouterr()
    if fail:
        assert out == "" and err.startswith(f"kvcd: {NAME}: not ready for {B}: BuildFailed: ")
        assert not store.tree(host, NAME, "1.0", B).exists()
    else:
        assert out == f"{NAME}: ready for {B}: built for {B} (kabi = rebuild)\n" and err == ""
        assert modtree.active_store(host, B, NAME) == store.tree(host, NAME, "1.0", B)
    # The running kernel is its daemon's: nothing is built for it here.
    assert ahead.prepare_command(host, NAME, A, podman=lambda: pod) == 0
    assert (
        capsys.readouterr().out
        == f"{NAME}: ready for {A}: the running kernel: its daemon loads it\n"
    )


@pytest.mark.parametrize(
    ("ordered", "loaded", "state", "ready"),
    [
        (True, "1.0", "Done", False),  # the label keeps 1.0; only 2.0 is prepared
        (True, "2.0", "Done", True),  # the label moved: 2.0 is what the next boot loads
        (True, "1.0", "Degraded", True),  # nothing pinned loaded: nothing to keep after a reboot
        (False, "1.0", "Done", True),  # no ordered upgrade: the config says what boots
    ],
)
def test_a_next_kernel_is_not_ready_while_an_ordered_upgrade_keeps_the_old_version(
    host: HostRoot,
    monkeypatch: pytest.MonkeyPatch,
    ordered: bool,
    loaded: str,
    state: str,
    ready: bool,
) -> None:
    fakehost.store_version(host, NAME, "2.0", A, ["kvcd_base", "kvcd_user"])
    monkeypatch.setattr(ahead, "check_weak", weak_verdict(True))
    cfg = dataclasses.replace(config(host), version="2.0", ordered_upgrade=ordered)
    ext = NextKernel(
        Settings(), detector=lambda r: next_boot(r, B), podman=lambda: FakePodman(host, B)
    )
    ctx, _posted = context(host, cfg)
    rec = dataclasses.replace(record(host), state=state, version=loaded)
    ext.outcome = ext.refresh(ctx, rec)  # "preparing" announced
    outcome = ext.refresh(ctx, rec)
    assert (outcome.state == READY) is ready, outcome
    if not ready:
        assert outcome.state == FAILED
        assert "the node label keeps 1.0 loaded" in outcome.reason, outcome.reason
