"""The file node backend on the real filesystem: real inotify (kvcd.host.fswatch) and several
processes writing node.json at once (flock + atomic replace), as many `kvcd@` processes on one
node do."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvcd.host.paths import HostRoot
from kvcd.node.backend import NodeView
from kvcd.node.filebackend import FileBackend, node_file

REPO = Path(__file__).resolve().parents[2]
WRITER = r"""
import sys
from pathlib import Path
from kvcd.host.paths import HostRoot
from kvcd.node.filebackend import FileBackend
root, who, n = HostRoot(Path(sys.argv[1])), sys.argv[2], int(sys.argv[3])
fb = FileBackend(root, "n1")
print("ready", flush=True)
sys.stdin.readline()  # start together
for i in range(n):
    # read-modify-write of a per-writer counter and a key per write: a lost update shows as a
    # missing key or a counter below n.
    fb.update(lambda v: {
        f"kvcd.io/{who}.count": str(int(v.annotations.get(f"kvcd.io/{who}.count", "0")) + 1),
        f"kvcd.io/{who}.n{i}": "x",
    })
"""


def spawn(root: HostRoot, who: str, n: int) -> subprocess.Popen[str]:
    p = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(root.root), who, str(n)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return p


@pytest.mark.parametrize("writers", [2, 4])
def test_processes_writing_at_once_lose_nothing(tmp_path: Path, writers: int) -> None:
    root = HostRoot(tmp_path)
    FileBackend(root, "n1").edit(labels=lambda _v: {"keep/me": "1"}, annotations=lambda _v: {})
    n = 150
    procs = [spawn(root, f"w{k}", n) for k in range(writers)]
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    for p in procs:
        assert p.wait(timeout=120) == 0
    data = json.loads(node_file(root).read_text())
    assert data["labels"] == {"keep/me": "1"}
    for k in range(writers):
        ann = data["annotations"]
        assert ann[f"kvcd.io/w{k}.count"] == str(n)
        assert all(f"kvcd.io/w{k}.n{i}" in ann for i in range(n))
    assert data["generation"] == writers * n + 1  # + the labels edit above
    assert not list(node_file(root).parent.glob(".node.json.*"))  # no temp files left


def test_inotify_sees_another_process_label_the_node(tmp_path: Path) -> None:
    root = HostRoot(tmp_path)
    fb = FileBackend(root, "n1")
    fb.update(lambda _v: {"kvcd.io/x.state": "Done"})
    seen: list[NodeView] = []
    got = threading.Event()

    def changed(view: NodeView) -> None:
        seen.append(view)
        if view.labels.get("kvcd.io/version.x") == "2.0":
            got.set()

    fb.watch(changed)
    try:
        # Unrelated files in the same directory do not count as node changes.
        (root.state / "instances").mkdir()
        (root.state / "instances" / "x.json").write_text("{}")
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "kvcd.cli",
                "--root",
                str(root.root),
                "label",
                "kvcd.io/version.x=2.0",
            ],
            env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert out.returncode == 0, out.stderr
        assert got.wait(timeout=30), seen
        assert all(v.annotations.get("kvcd.io/x.state") == "Done" for v in seen)
    finally:
        fb.stop()


def test_watch_survives_the_node_file_appearing_later(tmp_path: Path) -> None:
    root = HostRoot(tmp_path)
    fb = FileBackend(root, "n1")  # /var/lib/kvcd does not exist yet
    got = threading.Event()
    fb.watch(lambda v: got.set() if v.annotations.get("a/b") == "c" else None)
    try:
        FileBackend(root, "n1").update(lambda _v: {"a/b": "c"})
        assert got.wait(timeout=30)
    finally:
        fb.stop()
