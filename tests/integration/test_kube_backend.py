"""The Kubernetes node backend through the real `kubernetes` client library.

No kube-apiserver can be installed on these machines (it is in neither Debian nor PyPI), so the
client talks to a small HTTP server in this test that implements the API paths kvcd uses, with
the API's semantics where they matter: GET and JSON-merge-PATCH of a Node (a PATCH carrying a
stale metadata.resourceVersion is a 409 Conflict), list + watch of one node by fieldSelector
(resourceVersion, bookmarks, 410 Gone as an ERROR event once history is compacted), and POST of
core/v1 Events. Faults are injected per request: 409, 410, 429, 500, dropped connections, and
a 200 whose body is not this Node (a proxy's page, a Status, another node's object).
"""

from __future__ import annotations

import copy
import json
import logging
import re
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
import yaml

from kvcd.config.model import InstanceConfig, Settings
from kvcd.core.types import ModuleSpec
from kvcd.daemon.events import HOLD, Context
from kvcd.daemon.record import Record
from kvcd.daemon.report import NodeLink, Reporter
from kvcd.daemon.upgrade import OrderedUpgrade
from kvcd.host.paths import HostRoot
from kvcd.node.backend import NodeView, NodeWriter, Unavailable
from kvcd.node.kube import KubeBackend

NODE = "worker-1"
EVENTS = "/api/v1/namespaces/default/events"


class FakeAPI:
    """The state behind the server: one Node, its history (for watches), events, faults."""

    def __init__(self) -> None:
        self.lock = threading.Condition()
        self.rv = 100
        self.node: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": NODE,
                "uid": "uid-1",
                "resourceVersion": "100",
                "labels": {"kubernetes.io/hostname": NODE},
                "annotations": {"other.io/keep": "yes"},
            },
        }
        self.history: list[tuple[int, dict[str, Any]]] = []
        self.compacted = 0  # watches from a resourceVersion below this get 410 Gone
        self.events: list[dict[str, Any]] = []  # every Event created, in order
        self.stored: dict[str, dict[str, Any]] = {}  # the Events the server holds, by name
        self.requests: list[tuple[str, str, str, Any]] = []  # method, path, content-type, body
        self.faults: dict[str, list[Any]] = {}  # "GET node" | "PATCH node" | "WATCH" | "POST event"
        self.closed = False
        self.watching = 0  # watch handlers streaming now

    def change(self, fn: Any) -> None:
        """Another client changes the node (the admin, a drain controller)."""
        with self.lock:
            fn(self.node["metadata"])
            self._bump()

    def _bump(self) -> None:
        self.rv += 1
        self.node["metadata"]["resourceVersion"] = str(self.rv)
        self.history.append((self.rv, copy.deepcopy(self.node)))
        self.lock.notify_all()

    def fault(self, kind: str) -> Any:
        with self.lock:
            queue = self.faults.get(kind) or []
            return queue.pop(0) if queue else None


def make_handler(api: FakeAPI) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # chunked watch streams, like the API server

        def log_message(self, *_args: Any) -> None:
            pass

        def _send(self, code: int, obj: Any) -> None:
            body = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _status(self, code: int, reason: str) -> None:
            self._send(
                code,
                {
                    "kind": "Status",
                    "apiVersion": "v1",
                    "status": "Failure",
                    "code": code,
                    "reason": reason,
                    "message": reason,
                },
            )

        def _drop(self) -> None:
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)

        def _injected(self, kind: str) -> bool:
            f = api.fault(kind)
            if f is None:
                return False
            if f == "drop":
                self._drop()
            elif isinstance(f, tuple):  # (content type, body): a 200 whose body is not a Node
                ctype, raw = f
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)
            elif callable(f):  # a concurrent writer acts first; the request then proceeds
                api.change(f)
                return False
            else:
                self._status(
                    int(f),
                    {
                        401: "Unauthorized",
                        403: "Forbidden",
                        409: "Conflict",
                        429: "TooManyRequests",
                        500: "InternalError",
                        410: "Gone",
                    }.get(int(f), "Error"),
                )
            return True

        def _chunk(self, obj: Any) -> None:
            data = (json.dumps(obj) + "\n").encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()

        def _body(self) -> Any:
            n = int(self.headers.get("Content-Length", "0"))
            return json.loads(self.rfile.read(n)) if n else None

        def do_GET(self) -> None:
            url = urlsplit(self.path)
            q = parse_qs(url.query)
            api.requests.append(("GET", url.path, "", dict(q)))
            if url.path == f"/api/v1/nodes/{NODE}":
                if not self._injected("GET node"):
                    with api.lock:
                        self._send(200, api.node)
                return
            if url.path.startswith(EVENTS + "/"):
                with api.lock:
                    found = api.stored.get(url.path.rsplit("/", 1)[1])
                if found is None:
                    self._status(404, "NotFound")
                else:
                    self._send(200, found)
                return
            if url.path == "/api/v1/nodes" and q.get("watch") == ["true"]:
                assert q.get("fieldSelector") == [f"metadata.name={NODE}"]
                self._watch(
                    int(q.get("resourceVersion", ["0"])[0]),
                    float(q.get("timeoutSeconds", ["5"])[0]),
                )
                return
            self._status(404, "NotFound")

        def _watch(self, since: int, timeout: float) -> None:
            if self._injected("WATCH"):
                return
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self.close_connection = True
            if since < api.compacted:
                self._chunk(
                    {
                        "type": "ERROR",
                        "object": {
                            "kind": "Status",
                            "code": 410,
                            "reason": "Expired",
                            "message": "old",
                        },
                    }
                )
                self.wfile.write(b"0\r\n\r\n")
                return
            sent = since
            with api.lock:
                api.watching += 1
            deadline = threading.Event()
            timer = threading.Timer(timeout, deadline.set)
            timer.start()
            try:
                while not deadline.is_set() and not api.closed:
                    with api.lock:
                        new = [(rv, n) for rv, n in api.history if rv > sent]
                        if not new:
                            api.lock.wait(0.05)
                            continue
                    for rv, n in new:
                        self._chunk({"type": "MODIFIED", "object": n})
                        sent = rv
                    after = api.fault("WATCH-after-event")
                    if after is not None:
                        # The connection ends in the middle of the chunked stream (a FIN, so
                        # the event already sent is still read): a dropped watch. A callable
                        # is another writer acting between the event and the drop.
                        if callable(after):
                            api.change(after)
                        self.close_connection = True
                        self.connection.shutdown(socket.SHUT_WR)
                        return
                self.wfile.write(b"0\r\n\r\n")  # the watch's timeout: a clean end
            except (BrokenPipeError, ConnectionResetError):
                pass
            finally:
                timer.cancel()
                with api.lock:
                    api.watching -= 1

        def do_PATCH(self) -> None:
            url = urlsplit(self.path)
            body = self._body()
            api.requests.append(("PATCH", url.path, self.headers.get("Content-Type", ""), body))
            if url.path.startswith(EVENTS + "/"):
                assert self.headers.get("Content-Type") == "application/merge-patch+json"
                with api.lock:
                    found = api.stored.get(url.path.rsplit("/", 1)[1])
                    if found is not None:
                        found.update(body)
                if found is None:
                    self._status(404, "NotFound")
                else:
                    self._send(200, found)
                return
            if url.path != f"/api/v1/nodes/{NODE}":
                self._status(404, "NotFound")
                return
            if self._injected("PATCH node"):
                return
            assert self.headers.get("Content-Type") == "application/merge-patch+json"
            meta = body.get("metadata", {})
            with api.lock:
                want = meta.get("resourceVersion")
                if want is not None and want != api.node["metadata"]["resourceVersion"]:
                    self._status(409, "Conflict")
                    return
                for part in ("annotations", "labels"):  # merge-patch: null removes a key
                    have = api.node["metadata"].setdefault(part, {})
                    for k, v in (meta.get(part) or {}).items():
                        if v is None:
                            have.pop(k, None)
                        else:
                            have[k] = v
                api._bump()
                self._send(200, api.node)

        def do_POST(self) -> None:
            url = urlsplit(self.path)
            body = self._body()
            api.requests.append(("POST", url.path, self.headers.get("Content-Type", ""), body))
            if url.path != EVENTS:
                self._status(404, "NotFound")
                return
            if self._injected("POST event"):
                return
            name = body["metadata"].get("name") or f"ev{len(api.events) + 1}"
            with api.lock:
                if name in api.stored:
                    self._status(409, "AlreadyExists")
                    return
                api.events.append(body)
                api.stored[name] = {**body, "metadata": {**body["metadata"], "name": name}}
            self._send(201, api.stored[name])

    return Handler


@pytest.fixture
def api() -> Iterator[FakeAPI]:
    state = FakeAPI()
    server = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(state))
    server.daemon_threads = True
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    state.port = server.server_address[1]  # type: ignore[attr-defined]
    yield state
    state.closed = True
    with state.lock:
        state.lock.notify_all()
    server.shutdown()
    server.server_close()


def kubeconfig(tmp_path: Path, port: int) -> str:
    path = tmp_path / "kubeconfig"
    path.write_text(
        f"""apiVersion: v1
kind: Config
clusters:
- name: test
  cluster: {{server: "http://127.0.0.1:{port}"}}
users:
- name: kvcd
  user: {{token: "t0ken"}}
contexts:
- name: test
  context: {{cluster: test, user: kvcd}}
current-context: test
"""
    )
    return str(path)


@pytest.fixture
def backend(api: FakeAPI, tmp_path: Path) -> Iterator[tuple[KubeBackend, list[float]]]:
    sleeps: list[float] = []
    be = KubeBackend(
        NODE,
        kubeconfig=kubeconfig(tmp_path, api.port),  # type: ignore[attr-defined]
        first_delay=0.01,
        max_delay=0.05,
        watch_timeout=300,
        sleep=sleeps.append,
    )
    yield be, sleeps
    be.stop()


def patches(api: FakeAPI) -> list[Any]:
    return [r[3] for r in api.requests if r[0] == "PATCH"]


def test_read_and_merge_patch_only_our_keys(api: FakeAPI, backend: Any) -> None:
    be, _ = backend
    view = be.read()
    assert view.labels["kubernetes.io/hostname"] == NODE and view.version == "100"
    view = be.update(lambda v: {"kvcd.io/nic.state": "Done", "kvcd.io/nic.reason": None})
    assert view.annotations == {"other.io/keep": "yes", "kvcd.io/nic.state": "Done"}
    # One PATCH, merge-patch, carrying only our changed key and the resourceVersion it read.
    assert [r[2] for r in api.requests if r[0] == "PATCH"] == ["application/merge-patch+json"]
    assert patches(api) == [
        {"metadata": {"resourceVersion": "100", "annotations": {"kvcd.io/nic.state": "Done"}}}
    ]
    # Nothing changes: no PATCH at all.
    be.update(lambda v: {"kvcd.io/nic.state": "Done"})
    assert len(patches(api)) == 1


def test_concurrent_writer_409_recomputes_from_a_fresh_read(api: FakeAPI, backend: Any) -> None:
    be, _ = backend
    # Between our GET and our PATCH another kvcd@ process claims a drain.
    api.faults["PATCH node"] = [lambda m: m["annotations"].update({"kvcd.io/b.drain": "x"})]
    seen: list[dict[str, str]] = []

    def change(v: NodeView) -> dict[str, str | None]:
        seen.append(dict(v.annotations))
        others = [k for k in v.annotations if k.endswith(".drain")]
        return {"kvcd.io/a.drain": "y", "kvcd.io/drain": f"claims={len(others) + 1}"}

    view = be.update(change)
    assert len(patches(api)) == 2  # 409 on the first (stale resourceVersion), then success
    assert "kvcd.io/b.drain" in seen[-1]  # recomputed with the other writer's key
    assert view.annotations["kvcd.io/drain"] == "claims=2"
    assert view.annotations["kvcd.io/b.drain"] == "x"


@pytest.mark.parametrize("fault", [409, 429, 500, "drop"])
def test_transient_errors_are_retried_with_backoff(api: FakeAPI, backend: Any, fault: Any) -> None:
    be, sleeps = backend
    api.faults["GET node"] = [fault, fault]
    assert be.read().name == NODE
    assert sleeps == [0.01, 0.02]  # doubling from first_delay


def test_patch_429_and_500_then_success(api: FakeAPI, backend: Any) -> None:
    be, sleeps = backend
    api.faults["PATCH node"] = [429, 500]
    view = be.update(lambda v: {"kvcd.io/x.state": "Working"})
    assert view.annotations["kvcd.io/x.state"] == "Working"
    assert len(sleeps) == 2


def test_gives_up_as_unavailable_and_never_hides_it(api: FakeAPI, backend: Any) -> None:
    be, sleeps = backend
    api.faults["GET node"] = [500] * 10
    with pytest.raises(Unavailable, match="HTTP 500"):
        be.read()
    assert len(sleeps) == be.attempts - 1


def test_a_hurried_backend_tries_once_with_the_shorter_timeout(api: FakeAPI, backend: Any) -> None:
    """As the daemon exits (Reporter.at_exit): one try per request, not the retries."""
    be, sleeps = backend
    be.hurry(10.0)
    assert (be.attempts, be.request_timeout) == (1, 10.0)
    api.faults["GET node"] = [500, 500]
    with pytest.raises(Unavailable, match="HTTP 500"):
        be.read()
    assert sleeps == []
    assert len([r for r in api.requests if r[0] == "GET"]) == 1


def test_forbidden_is_not_retried(api: FakeAPI, backend: Any) -> None:
    be, sleeps = backend
    api.faults["GET node"] = [403]
    with pytest.raises(Unavailable, match="HTTP 403"):
        be.read()
    assert sleeps == []


def test_unreachable_server_is_unavailable(tmp_path: Path) -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    be = KubeBackend(NODE, kubeconfig=kubeconfig(tmp_path, port), attempts=2, sleep=lambda _d: None)
    with pytest.raises(Unavailable):
        be.read()
    w = NodeWriter(be)
    assert not w.write({"kvcd.io/x.state": "Done"}) and w.failing


def test_missing_credentials_are_unavailable(tmp_path: Path) -> None:
    be = KubeBackend(NODE, kubeconfig=str(tmp_path / "absent"))
    with pytest.raises(Unavailable, match="no Kubernetes credentials"):
        be.read()


def node_body(change: Any) -> bytes:
    node = FakeAPI().node
    change(node)
    return json.dumps(node).encode()


STATUS = {"kind": "Status", "apiVersion": "v1", "status": "Success", "code": 200}
# A 200 whose body is not this Node (a proxy, a kubeconfig pointing elsewhere): the node store is
# unavailable, said with what was wrong; never read as "no labels" (an ordered upgrade would
# unload the driver) and never an error that escapes the daemon's loop.
MALFORMED = [
    ("an HTML page", "text/html", b"<html><body>Sign in</body></html>", "not JSON"),
    ("null", "application/json", b"null", "not a JSON object"),
    ("a list", "application/json", b"[]", "not a JSON object"),
    ("an empty object", "application/json", b"{}", "kind None, apiVersion None, not a v1 Node"),
    ("a Status", "application/json", json.dumps(STATUS).encode(), "kind 'Status'"),
    (
        "another node's object",
        "application/json",
        node_body(lambda n: n["metadata"].update(name="worker-2")),
        "is node 'worker-2', not 'worker-1'",
    ),
    (
        "no metadata",
        "application/json",
        node_body(lambda n: n.pop("metadata")),
        "is node None, not 'worker-1'",
    ),
    (
        "labels a string",
        "application/json",
        node_body(lambda n: n["metadata"].update(labels="kvcd.io/version.nic=1.0")),
        "'labels' must be an object of strings",
    ),
    (
        "an annotation value an int",
        "application/json",
        node_body(lambda n: n["metadata"]["annotations"].update({"kvcd.io/drain-request": 1})),
        "'annotations' must be an object of strings",
    ),
    (
        "a resourceVersion that is not a string",
        "application/json",
        node_body(lambda n: n["metadata"].update(resourceVersion=[1])),
        "resourceVersion",
    ),
]


@pytest.mark.parametrize(
    ("ctype", "raw", "says"), [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED]
)
def test_a_body_that_is_not_this_node_is_unavailable(
    api: FakeAPI, backend: Any, tmp_path: Path, ctype: str, raw: bytes, says: str
) -> None:
    be, sleeps = backend
    api.faults["GET node"] = [(ctype, raw)] * 50
    with pytest.raises(Unavailable, match=re.escape(says)):
        be.read()
    assert sleeps == []  # not retried at once: the daemon's retry comes later
    with pytest.raises(Unavailable, match=re.escape(says)):
        be.update(lambda _v: {"kvcd.io/nic.state": "Done"})
    assert patches(api) == []
    # The ordered upgrade holds the modules as they are, never unloads for "no label".
    settings = Settings(node_backend="kubernetes", kubeconfig=be.kubeconfig)
    up = OrderedUpgrade(NodeLink(settings, opener=lambda _c: be))
    c = ctx(tmp_path, settings)
    up.start(c)
    try:
        v = up.verdict(c, [])
        assert v is not None and (v.verb, v.state) == (HOLD, "Working")
        assert v.reason.startswith("NodeUnavailable") and says in v.reason
    finally:
        up.stop()
    # The answer to a PATCH is checked too.
    api.faults["GET node"] = []
    api.faults["PATCH node"] = [(ctype, raw)]
    with pytest.raises(Unavailable, match=re.escape(says)):
        be.update(lambda _v: {"kvcd.io/nic.state": "Done"})


def test_a_watch_event_that_is_not_this_node_is_not_delivered(api: FakeAPI, backend: Any) -> None:
    be, _ = backend
    views: list[NodeView] = []
    good = threading.Event()

    def changed(view: NodeView) -> None:
        views.append(view)
        if view.labels.get("kvcd.io/version.nic") == "2":
            good.set()

    be.watch(changed)
    assert until(lambda: api.watching == 1)
    api.change(lambda m: m.update(name="worker-2", labels={}))  # another node's object
    api.change(lambda m: m.update(name=NODE, labels={"kvcd.io/version.nic": "2"}))
    assert good.wait(timeout=30)
    assert all(v.labels for v in views), views  # the other node's "no labels" never arrived


def until(pred: Any, timeout: float = 30.0) -> bool:
    """Wait (bounded) for a condition on the server's state; not a timing assertion."""
    done = threading.Event()
    for _ in range(int(timeout / 0.02)):
        if pred():
            return True
        done.wait(0.02)
    return bool(pred())


def test_watch_follows_changes_relists_on_410_and_resumes_after_drops(
    api: FakeAPI, backend: Any
) -> None:
    be, _ = backend
    views: list[NodeView] = []
    want: dict[str, threading.Event] = {v: threading.Event() for v in ("1", "2", "3")}

    def changed(view: NodeView) -> None:
        views.append(view)
        value = view.labels.get("kvcd.io/version.nic")
        if value in want:
            want[value].set()

    be.watch(changed)
    api.change(lambda m: m["labels"].update({"kvcd.io/version.nic": "1"}))
    assert want["1"].wait(timeout=30)

    # The connection drops after an event: the watch resumes from the last resourceVersion.
    api.faults["WATCH-after-event"] = ["drop"]
    api.faults["WATCH"] = ["drop", 500]
    api.change(lambda m: m["annotations"].update({"x/y": "z"}))
    api.change(lambda m: m["labels"].update({"kvcd.io/version.nic": "2"}))
    assert want["2"].wait(timeout=30)
    assert until(lambda: not api.faults["WATCH"] and api.watching == 1)

    # The watch drops after "3"; when it comes back the history it resumes from has been
    # compacted (and the node changed to "4"): 410 Gone -> re-list (a GET) -> watch from there.
    gets_before = sum(1 for r in api.requests if r[:2] == ("GET", f"/api/v1/nodes/{NODE}"))

    def compact(meta: dict[str, Any]) -> None:
        meta["labels"]["kvcd.io/version.nic"] = "4"
        api.compacted = api.rv + 1  # the rv this change gets: everything before is gone

    # The compaction happens on the connection that delivered "3", after it did: arming it
    # on the next WATCH instead would race a reconnect still in its back-off from above,
    # which would then resume from before "3" and lose it to the compaction.
    want["4"] = threading.Event()
    api.faults["WATCH-after-event"] = [compact]
    api.change(lambda m: m["labels"].update({"kvcd.io/version.nic": "3"}))
    assert want["3"].wait(timeout=30)
    assert want["4"].wait(timeout=30)
    gets_after = sum(1 for r in api.requests if r[:2] == ("GET", f"/api/v1/nodes/{NODE}"))
    assert gets_after == gets_before + 1
    want["5"] = threading.Event()
    api.change(lambda m: m["labels"].update({"kvcd.io/version.nic": "5"}))
    assert want["5"].wait(timeout=30)
    watch_rvs = [
        int(r[3]["resourceVersion"][0])
        for r in api.requests
        if r[0] == "GET" and r[3].get("watch") == ["true"]
    ]
    assert watch_rvs == sorted(watch_rvs)  # never goes back in history
    assert watch_rvs[-1] >= api.compacted


PERMISSION = "(no permission: kvcd's RBAC does not let it"


@pytest.mark.parametrize(
    ("kind", "faults", "warned"),
    [
        ("WATCH", ["drop", 500], None),  # routine: debug only
        ("WATCH", [500, 500, 500, 500], "node watch: HTTP 500"),  # WATCH_WARN_AFTER in a row
        # Refused credentials or permissions: at once, and called so.
        ("WATCH", [403], f"node watch: HTTP 403 Forbidden {PERMISSION} watch nodes;"),
        (
            "GET node",
            [403],
            f"node watch: GET node {NODE}: HTTP 403 Forbidden {PERMISSION} get nodes;",
        ),
    ],
    ids=["drops-debug", "500s-after-3", "403-watch-at-once", "403-read-at-once"],
)
def test_a_failing_watch_is_said_once_and_its_recovery_too(
    api: FakeAPI,
    backend: Any,
    caplog: pytest.LogCaptureFixture,
    kind: str,
    faults: list[Any],
    warned: str | None,
) -> None:
    """A watch that keeps failing reaches the journal once at WARNING, not at debug only and
    not on every retry; when it works again, that is said at INFO."""
    be, _ = backend
    caplog.set_level(logging.DEBUG, logger="kvcd.node.kube")
    seen = threading.Event()
    api.faults[kind] = list(faults)
    be.watch(lambda v: seen.set() if v.labels.get("kvcd.io/version.nic") == "1" else None)
    assert until(lambda: not api.faults[kind] and api.watching == 1)
    api.change(lambda m: m["labels"].update({"kvcd.io/version.nic": "1"}))
    assert seen.wait(timeout=30)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    if warned is None:
        assert warnings == [] and "node watch: working again" not in infos
    else:
        assert len(warnings) == 1 and warnings[0].startswith(warned), warnings
        assert warnings[0].endswith("; retrying with back-off"), warnings
        assert until(lambda: "node watch: working again" in caplog.messages)


def test_events_name_the_node(api: FakeAPI, backend: Any) -> None:
    be, _ = backend
    be.read()
    api.faults["POST event"] = [500]
    be.event("LoadFailed", "nic: Degraded: LoadFailed: x", warning=True)
    assert len(api.events) == 1
    ev = api.events[0]
    assert ev["involvedObject"] == {"kind": "Node", "name": NODE, "uid": "uid-1"}
    assert (ev["reason"], ev["type"], ev["source"]["component"]) == (
        "LoadFailed",
        "Warning",
        "kvcd",
    )


def event_requests(api: FakeAPI) -> list[tuple[str, str]]:
    return [(r[0], r[1].removeprefix(EVENTS)) for r in api.requests if r[1].startswith(EVENTS)]


def test_the_same_event_again_counts_on_one_object(api: FakeAPI, backend: Any) -> None:
    be, _ = backend
    for _ in range(3):
        be.event("LoadFailed", "nic: Degraded: LoadFailed: x", warning=True)
    assert len(api.stored) == 1
    ((name, ev),) = api.stored.items()
    assert name.startswith(f"{NODE}.kvcd-") and ev["count"] == 3
    assert [m for m, _ in event_requests(api)] == ["POST", "PATCH", "PATCH"]
    assert all(p == f"/{name}" for m, p in event_requests(api) if m == "PATCH")


def test_a_restarted_daemon_counts_on_its_predecessors_event(
    api: FakeAPI, backend: Any, tmp_path: Path
) -> None:
    be, _ = backend
    be.event("Drift", "nic: Degraded: Drift: /etc/x", warning=True)
    again = KubeBackend(NODE, kubeconfig=kubeconfig(tmp_path, api.port), sleep=lambda _d: None)  # type: ignore[attr-defined]
    again.event("Drift", "nic: Degraded: Drift: /etc/x", warning=True)
    assert [ev["count"] for ev in api.stored.values()] == [2]
    assert [m for m, _ in event_requests(api)] == ["POST", "POST", "GET", "PATCH"]  # 409, read
    again.event("Drift", "nic: Degraded: Drift: /etc/x", warning=True)
    assert [ev["count"] for ev in api.stored.values()] == [3]


def test_an_expired_event_is_created_again(api: FakeAPI, backend: Any) -> None:
    be, _ = backend
    be.event("ModulesLoaded", "nic: Done")
    api.stored.clear()  # the API server's Event TTL (1 h by default) removed it
    be.event("ModulesLoaded", "nic: Done")
    assert [ev["count"] for ev in api.stored.values()] == [1]
    assert [m for m, _ in event_requests(api)] == ["POST", "PATCH", "POST"]


def test_a_flapping_instance_cannot_flood_the_api_server(
    api: FakeAPI, backend: Any, caplog: pytest.LogCaptureFixture
) -> None:
    be, _ = backend
    for i in range(60):
        state = ("Degraded: LoadFailed: x", "Done")[i % 2]
        be.event("LoadFailed" if i % 2 == 0 else "ModulesLoaded", f"nic: {state}")
    assert len(event_requests(api)) == 25  # the burst; the rest dropped until tokens refill
    assert len(api.stored) == 2  # and what was posted counted on two Events
    assert sum(ev["count"] for ev in api.stored.values()) == 25
    limited = [r for r in caplog.records if "node events limited" in r.getMessage()]
    assert len(limited) == 1  # said once, not per dropped event


def ctx(tmp_path: Path, settings: Settings) -> Context:
    cfg = InstanceConfig(
        "nic",
        tmp_path / "nic.toml",
        "1.0",
        (ModuleSpec("kvcd_nic"),),
        image="x",
        ordered_upgrade=True,
    )
    root = HostRoot(tmp_path)
    (tmp_path / "sys/module").mkdir(parents=True)
    return Context(root, "nic", "6.1.0", settings, cfg, lambda _e: None)


def reporter(api: FakeAPI, tmp_path: Path, **backend: Any) -> tuple[Reporter, NodeLink, Any]:
    """A Reporter on the fake API server's node, its NodeLink, and its context."""
    settings = Settings(node_backend="kubernetes", kubeconfig=kubeconfig(tmp_path, api.port))  # type: ignore[attr-defined]
    link = NodeLink(
        settings,
        opener=lambda c: KubeBackend(
            NODE, kubeconfig=settings.kubeconfig, sleep=lambda _d: None, **backend
        ),
    )
    return Reporter(link), link, ctx(tmp_path, settings)


def test_reporter_publishes_and_posts_an_event_per_state_change(
    api: FakeAPI, tmp_path: Path
) -> None:
    rep, _link, c = reporter(api, tmp_path)
    rep.start(c)
    try:
        rep.after(c, Record("nic", "Done", version="1.0", kernel="6.1.0", boot_id="b"))
        rep.after(c, Record("nic", "Done", version="1.0", kernel="6.1.0", boot_id="b"))
        rep.after(
            c,
            Record(
                "nic", "Degraded", "LoadFailed", "x", version="1.0", kernel="6.1.0", boot_id="b"
            ),
        )
        ann = api.node["metadata"]["annotations"]
        assert ann["kvcd.io/nic.state"] == "Degraded"
        assert ann["kvcd.io/nic.reason"] == "LoadFailed: x"
        assert ann["other.io/keep"] == "yes"
        assert [e["reason"] for e in api.events] == ["ModulesLoaded", "LoadFailed"]
        # The state twice, and once the node-wide OS-update gate (the first report: no next
        # kernel, upgradeable): the repeated Done cost nothing, nor did the gate again.
        assert len(patches(api)) == 3
        assert api.node["metadata"]["labels"]["kvcd.io/upgradeable"] == "true"
        assert "kvcd.io/upgradeable-reason" not in ann
        rep.after(c, Record("nic", "Done", version="1.0", kernel="6.1.0", boot_id="b"))
        rep.after(
            c, Record("nic", "Done", goal="unloaded", version="1.0", kernel="6.1.0", boot_id="b")
        )
        # Loaded again: the same Event as the first, counted; unloaded: its own.
        assert [e["reason"] for e in api.events] == [
            "ModulesLoaded",
            "LoadFailed",
            "ModulesUnloaded",
        ]
        loaded = [e for e in api.stored.values() if e["reason"] == "ModulesLoaded"]
        assert [e["count"] for e in loaded] == [2]
    finally:
        rep.stop()


POSTS = [
    # (case, what the Event POSTs get, the WARNING's start, what it names)
    ("posted: nothing said", [], None, ""),
    (
        "no RBAC for events: said once, as a permission",
        [403, 403],
        "node events: ModulesLoaded not posted: POST event: HTTP 403 Forbidden",
        "no permission: kvcd's RBAC does not let it create events",
    ),
    (
        "the API server fails: said once",
        [500, 500],
        "node events: ModulesLoaded not posted: POST event: HTTP 500",
        "",
    ),
]


@pytest.mark.parametrize(("case", "faults", "warned", "names"), POSTS, ids=[p[0] for p in POSTS])
def test_a_failing_event_post_is_said_once_and_its_recovery_too(
    api: FakeAPI,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    case: str,
    faults: list[int],
    warned: str | None,
    names: str,
) -> None:
    """A node whose RBAC lacks `create events` never gets kvcd's Events: the journal says so at
    WARNING on the first failed post (not at debug only, not on every post), and at INFO when
    a post works again."""
    rep, _link, c = reporter(api, tmp_path, attempts=1)
    caplog.set_level(logging.DEBUG, logger="kvcd.daemon.report")
    api.faults["POST event"] = list(faults)
    rep.start(c)
    try:
        done = Record("nic", "Done", version="1.0", kernel="6.1.0", boot_id="b")
        rep.after(c, done)  # ModulesLoaded
        rep.after(c, Record("nic", "Degraded", "LoadFailed", "x", version="1.0", boot_id="b"))
        assert not api.faults["POST event"]
        rep.after(c, done)  # ModulesLoaded again: posted
    finally:
        rep.stop()
    assert "ModulesLoaded" in [e["reason"] for e in api.stored.values()]
    assert api.node["metadata"]["annotations"]["kvcd.io/nic.state"] == "Done"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    if warned is None:
        assert warnings == [] and "node events: posted again" not in infos
        return
    assert len(warnings) == 1 and warnings[0].startswith(warned), warnings
    assert names in warnings[0]
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert any("LoadFailed not posted" in m for m in debug), debug  # the second: debug only
    assert infos.count("node events: posted again") == 1, infos


def test_a_node_registered_again_gets_kvcds_keys_again(api: FakeAPI, tmp_path: Path) -> None:
    """The Node is deleted and registered again (every annotation and label gone): the watch
    sees it, the reporter asks for a report at once, and that report writes kvcd's keys again;
    a report that finds them in place costs no PATCH."""
    rep, link, c = reporter(api, tmp_path)
    asked = threading.Event()
    c.post = lambda ev: asked.set() if ev.source == Reporter.name else None
    record = Record("nic", "Done", version="1.0", kernel="6.1.0", boot_id="b")
    rep.start(c)
    try:
        rep.after(c, record)
        ours = {k: v for k, v in api.node["metadata"]["annotations"].items() if "kvcd" in k}
        assert ours["kvcd.io/nic.state"] == "Done"
        writer = link.writer
        assert writer is not None

        def registered_again(meta: dict[str, Any]) -> None:
            meta["annotations"], meta["labels"] = {}, {"kubernetes.io/hostname": NODE}

        api.change(registered_again)
        # (The watch's views of kvcd's own writes may have asked already: they can come late.)
        assert until(lambda: writer.last is not None and not writer.last.annotations)
        assert until(asked.is_set)
        rep.after(c, record)
        ann = api.node["metadata"]["annotations"]
        assert {k: v for k, v in ann.items() if "kvcd" in k} == ours
        assert api.node["metadata"]["labels"]["kvcd.io/upgradeable"] == "true"
        before = len(patches(api))
        rep.after(c, record)
        assert len(patches(api)) == before
    finally:
        rep.stop()


def test_unreachable_api_keeps_modules(tmp_path: Path) -> None:
    """API server down from the start: the ordered-upgrade verdict holds (never unloads) and the
    reporter schedules a retry instead of failing the instance."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    settings = Settings(node_backend="kubernetes", kubeconfig=kubeconfig(tmp_path, port))
    link = NodeLink(
        settings,
        opener=lambda c: KubeBackend(
            NODE, kubeconfig=settings.kubeconfig, attempts=1, sleep=lambda _d: None
        ),
    )
    up, rep = OrderedUpgrade(link), Reporter(link)
    c = ctx(tmp_path, settings)
    up.start(c)
    rep.start(c)
    try:
        v = up.verdict(c, [])
        assert v is not None and (v.verb, v.state) == (HOLD, "Working")
        assert v.reason.startswith("NodeUnavailable") and "keeping modules" in v.reason
        assert rep.after(c, Record("nic", "Working", v.code, v.detail)) is None
        assert rep._timer is not None and rep._timer.is_alive()
    finally:
        rep.stop()
        up.stop()


def granted() -> set[tuple[str, str]]:
    """(resource, verb) pairs packaging/kubernetes/rbac.yaml grants kvcd's ServiceAccount."""
    rbac = Path(__file__).resolve().parents[2] / "packaging/kubernetes/rbac.yaml"
    out = set()
    for doc in yaml.safe_load_all(rbac.read_text()):
        if doc and doc["kind"] in ("ClusterRole", "Role"):
            for rule in doc["rules"]:
                out |= {(r, v) for r in rule["resources"] for v in rule["verbs"]}
    return out


def needed(method: str, path: str, query: dict[str, Any]) -> tuple[str, str]:
    resource = "events" if path.startswith(EVENTS) else "nodes"
    if method == "GET" and query.get("watch") == ["true"]:
        return resource, "watch"
    if method == "GET" and path in ("/api/v1/nodes", EVENTS):
        return resource, "list"
    return resource, {"GET": "get", "PATCH": "patch", "POST": "create"}[method]


def test_every_request_is_one_the_shipped_rbac_allows(
    api: FakeAPI, backend: Any, tmp_path: Path
) -> None:
    """Docs are tests: packaging/kubernetes/rbac.yaml is what an admin applies; a request the
    backend makes that it does not allow would fail only in a real cluster."""
    be, _ = backend
    seen = threading.Event()
    be.watch(lambda _v: seen.set())
    be.update(lambda v: {"kvcd.io/nic.state": "Done"})
    assert seen.wait(10)
    be.event("LoadFailed", "nic: x", warning=True)
    be.event("LoadFailed", "nic: x", warning=True)
    KubeBackend(NODE, kubeconfig=kubeconfig(tmp_path, api.port), sleep=lambda _d: None).event(  # type: ignore[attr-defined]
        "LoadFailed", "nic: x", warning=True
    )
    used = {needed(m, path, q if isinstance(q, dict) else {}) for m, path, _ct, q in api.requests}
    assert {("nodes", "watch"), ("nodes", "patch"), ("events", "get")} <= used
    assert used <= granted(), used - granted()
