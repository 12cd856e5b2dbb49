"""kvcd.host.podman's Podman, run in a helper process: what the daemon talks to podman through.

podman-py, requests, urllib3 and rich are most of what a `kvcd run` daemon would keep resident
after its first pull, build or extraction (issue #20: about 16 MiB of a 40 MiB daemon), and a
cached start needs none of them. :class:`PodmanChild` has Podman's methods; the first call
starts a child interpreter that imports podman-py and makes each call with a real Podman, and
:meth:`PodmanChild.close` ends it. The daemon opens one per change (kvcd.daemon.executor), so
nothing of podman-py outlives the change that needed it.

One request at a time over a unix stream socketpair (the child's stdin and stdout), JSON lines:
- to the child: ``{"op": NAME, "args": {...}}``; an image archive to load goes along as an open
  file descriptor (SCM_RIGHTS), never as a path to open again;
- from the child, until the answer: ``{"line": TEXT}`` (a build's output line, for on_line),
  ``{"log": [LOGGER, LEVEL, TEXT]}`` (its log records, logged here: one journal, one set of
  fields), ``{"failpoint": POINT}`` (a test's fail point reached there: kvcd.host.failpoint,
  fired here, since the daemon is what must die), ``{"alive": true}`` every HEARTBEAT seconds,
  then ``{"ok": RESULT}`` or ``{"err": [TYPE, ARGS]}``.

What stays the same as in-process: the errors (PodmanUnavailable, PodmanError, PodmanTimedOut,
ImageInUse, OSError with its errno and path), the time limits (the child's Podman keeps them),
and a stop: the wait for the answer to a pull, build or image load is an
kvcd.host.interrupt.allowed() wait here, as the wait for podman's reply was, so the keepalive
pushes the start timeout out meanwhile and SIGTERM cuts into it; the child is then killed, which
drops its API connection as the in-process client's did. A child that dies mid-call is a
PodmanUnavailable (transient), with its exit status; its stderr is the daemon's (the journal).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
import time
import weakref
from collections.abc import Callable, Collection, Iterator, Sequence
from pathlib import Path
from typing import IO, Any

from kvcd.host import failpoint, interrupt, run
from kvcd.host.podtypes import (
    DEFAULT_URL,
    MODULE_PATTERNS,
    BuildSpec,
    ImageInfo,
    ImageInUse,
    PodmanError,
    PodmanTimedOut,
    PodmanUnavailable,
)

log = logging.getLogger(__name__)

# Seconds a child has to exit once its socket is closed, before SIGKILL (it is between calls).
END_GRACE = 5.0
# While it works on a call, the helper says so every HEARTBEAT seconds (its podman waits have
# their own limits: timeout, image_timeout); SILENCE seconds without a word from it mean it is
# wedged or starved for good: it is killed, and the call is PodmanUnavailable. Never a hang.
HEARTBEAT = 10.0
SILENCE = 300.0

# The errors a call may raise, by name: re-raised here as they were raised there.
ERRORS: dict[str, type[Exception]] = {
    c.__name__: c for c in (PodmanUnavailable, PodmanError, PodmanTimedOut, ImageInUse)
}

# The child: kvcd from the same sys.path as its parent (a dev tree, a venv, site-packages).
_BOOT = (
    "import json, sys\n"
    "sys.path[:] = json.loads(sys.argv[1])\n"
    "from kvcd.host.podchild import serve\n"
    "sys.exit(serve(json.loads(sys.argv[2])))\n"
)


def _image(data: dict[str, Any] | None) -> ImageInfo | None:
    return None if data is None else _must(data)


def _must(data: dict[str, Any]) -> ImageInfo:
    return ImageInfo(data["id"], tuple(data["tags"]), dict(data["labels"]), data["created"])


def _image_json(info: ImageInfo | None) -> dict[str, Any] | None:
    if info is None:
        return None
    return {
        "id": info.id,
        "tags": list(info.tags),
        "labels": dict(info.labels),
        "created": info.created,
    }


class PodmanChild:
    """Podman's methods (kvcd.host.podtypes.PodmanApi), made by a helper process this object
    starts at its first call and ends at :meth:`close` (or when it is collected)."""

    def __init__(
        self, url: str = DEFAULT_URL, timeout: float = 30.0, image_timeout: float | None = None
    ) -> None:
        self.url = url
        self.timeout = timeout
        self.image_timeout = image_timeout
        self._child: run.Child | None = None
        self._ended: weakref.finalize[[float], PodmanChild] | None = None

    # --- the helper's life -------------------------------------------------------------------

    @property
    def helper_pid(self) -> int | None:
        """The pid of the helper process (None: none runs)."""
        return None if self._child is None else self._child.pid

    def _start(self) -> run.Child:
        if self._child is None:
            config = {
                "url": self.url,
                "timeout": self.timeout,
                "image_timeout": self.image_timeout,
                "level": logging.getLogger("kvcd").getEffectiveLevel(),
                "heartbeat": HEARTBEAT,
            }
            argv = [sys.executable, "-c", _BOOT, json.dumps(sys.path), json.dumps(config)]
            try:
                child = run.spawn(argv)
            except run.CommandError as exc:
                raise PodmanUnavailable(f"cannot start the podman helper: {exc}") from exc
            child.sock.settimeout(SILENCE)
            self._child = child
            # Never left running by a client nobody closed (a bug, or an exception on the way).
            self._ended = weakref.finalize(self, child.end, END_GRACE)
            log.debug("podman helper started (pid %d)", child.pid)
        return self._child

    def close(self) -> int | None:
        """End the helper, if one runs (between calls: it reads EOF and exits); its exit
        status (None: none ran)."""
        return self._end(END_GRACE)

    def _end(self, grace: float) -> int | None:
        child, ended = self._child, self._ended
        self._child = self._ended = None
        if child is None or ended is None:
            return None
        ended.detach()
        return child.end(grace)

    def __enter__(self) -> PodmanChild:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- one call -----------------------------------------------------------------------------

    def _call(
        self,
        op: str,
        args: dict[str, Any],
        *,
        long: bool = False,
        on_line: Callable[[str], None] | None = None,
        fd: int | None = None,
    ) -> Any:
        """Ask the helper for `op` and wait for its answer. `long`: a pull, build or image load
        (a stop may cut into the wait, as into podman's reply in-process)."""
        child = self._start()
        request = (json.dumps({"op": op, "args": args}) + "\n").encode()
        try:
            try:
                sent = 0 if fd is None else socket.send_fds(child.sock, [request], [fd])
                child.sock.sendall(request[sent:])
            except OSError as exc:
                raise _Lost(f"is gone ({exc})") from exc
            for msg in self._messages(child.replies, long):
                if "ok" in msg:
                    return msg["ok"]
                if "err" in msg:
                    error = _error(msg["err"])
                    break  # the call is over: the helper stays for the next
                if "line" in msg and on_line is not None:
                    on_line(str(msg["line"]))
                elif "log" in msg:
                    name, level, text = msg["log"]
                    logging.getLogger(str(name)).log(int(level), "%s", text)
                elif "failpoint" in msg:  # a test's: reached in the helper, fired here
                    failpoint.hit(str(msg["failpoint"]))
        except _Lost as lost:
            rc = self._end(lost.grace)
            raise PodmanUnavailable(
                f"the podman helper (pid {child.pid}) {lost} during {op}: status {rc}"
            ) from lost.__cause__
        except BaseException:
            # A stop (Interrupted), or on_line raised: the helper is killed mid-call, which
            # drops its API connection (podman abandons a build whose client went away).
            self._end(0)
            raise
        raise error

    def _messages(self, replies: IO[bytes], long: bool) -> Iterator[dict[str, Any]]:
        """The helper's messages until its answer; _Lost when it cannot give one."""
        while True:
            try:
                if long:
                    with interrupt.allowed():
                        raw = replies.readline()
                else:
                    raw = replies.readline()
            except socket.timeout as exc:
                raise _Lost(f"said nothing for {SILENCE:g} s: killed") from exc
            except OSError as exc:
                raise _Lost(f"is gone ({exc})") from exc
            if not raw:
                raise _Lost("exited (its output is in the journal)", END_GRACE)
            msg = json.loads(raw)
            if isinstance(msg, dict):
                yield msg

    # --- Podman's methods --------------------------------------------------------------------

    def ping(self) -> None:
        self._call("ping", {})

    def get_image(self, ref: str) -> ImageInfo | None:
        return _image(self._call("get_image", {"ref": ref}))

    def list_instance_images(self, instance: str) -> list[ImageInfo]:
        return [_must(d) for d in self._call("list_instance_images", {"instance": instance})]

    def pull(
        self, ref: str, tag: str, *, auth: str | None = None, tls_verify: bool = True
    ) -> ImageInfo:
        args = {"ref": ref, "tag": tag, "auth": auth, "tls_verify": tls_verify}
        return _must(self._call("pull", args, long=True))

    def tag(self, image_id: str, ref: str, *, untag: bool = False) -> None:
        self._call("tag", {"image_id": image_id, "ref": ref, "untag": untag})

    def load(self, archive: IO[bytes], name: str) -> ImageInfo:
        return _must(self._call("load", {"name": name}, long=True, fd=archive.fileno()))

    def build(self, spec: BuildSpec, on_line: Callable[[str], None]) -> ImageInfo:
        args = {
            "context": spec.context,
            "containerfile": spec.containerfile,
            "tag": spec.tag,
            "build_args": dict(spec.build_args),
            "labels": dict(spec.labels),
        }
        return _must(self._call("build", args, long=True, on_line=on_line))

    def extract(
        self,
        image_ref: str,
        path_in_image: str,
        dest_dir: str | os.PathLike[str],
        patterns: Sequence[str] = MODULE_PATTERNS,
        kind: str = "kernel module",
    ) -> list[Path]:
        args = {
            "image_ref": image_ref,
            "path_in_image": path_in_image,
            "dest_dir": os.fspath(dest_dir),
            "patterns": list(patterns),
            "kind": kind,
        }
        return [Path(p) for p in self._call("extract", args)]

    def remove_image(self, image_id: str) -> None:
        self._call("remove_image", {"image_id": image_id})

    def gc(self, instance: str, keep: int, protect: Collection[str] = ()) -> list[ImageInfo]:
        args = {"instance": instance, "keep": keep, "protect": list(protect)}
        return [_must(d) for d in self._call("gc", args)]


class _Lost(Exception):
    """The helper cannot answer (it exited, its socket failed, or it went silent); `grace`: the
    seconds it has to exit before SIGKILL."""

    def __init__(self, what: str, grace: float = 0.0) -> None:
        super().__init__(what)
        self.grace = grace


def _error(err: list[Any]) -> Exception:
    """The helper's error as it was raised there."""
    kind, args = str(err[0]), err[1]
    if kind == "OSError":
        return OSError(*args)  # (errno, strerror, filename): FileNotFoundError and the rest
    cls = ERRORS.get(kind)
    if cls is not None:
        return cls(*args)
    return PodmanError(f"the podman helper failed: {kind}: {' '.join(map(str, args))}")


# --- the child ------------------------------------------------------------------------------


class _Forward(logging.Handler):
    """The child's log records, sent to the parent to be logged there."""

    def __init__(self, send: Callable[[dict[str, Any]], None]) -> None:
        super().__init__()
        self._send = send

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if record.exc_info:
            text += "\n" + logging.Formatter().formatException(record.exc_info)
        self._send({"log": [record.name, record.levelno, text]})


def _requests(sock: socket.socket) -> Iterator[tuple[dict[str, Any], list[int]]]:
    """The parent's requests, each with the descriptors that came with it, until EOF."""
    buf, fds = b"", []
    while True:
        while b"\n" not in buf:
            data, got, _flags, _addr = socket.recv_fds(sock, 1 << 16, 4)
            fds += got
            if not data:
                return
            buf += data
        line, buf = buf.split(b"\n", 1)
        yield json.loads(line), fds
        fds = []


def _answer(pod: Any, op: str, args: dict[str, Any], fds: list[int], send: Any) -> Any:
    if op == "load":
        with os.fdopen(fds.pop(0), "rb") as archive:
            return _image_json(pod.load(archive, args["name"]))
    if op == "build":
        spec = BuildSpec(**args)
        return _image_json(pod.build(spec, lambda line: send({"line": line})))
    if op == "extract":
        return [os.fspath(p) for p in pod.extract(**args)]
    if op in ("get_image", "pull"):
        return _image_json(getattr(pod, op)(**args))
    if op in ("list_instance_images", "gc"):
        return [_image_json(i) for i in getattr(pod, op)(**args)]
    if op in ("ping", "tag", "remove_image"):
        return getattr(pod, op)(**args)
    raise ValueError(f"unknown request {op!r}")


def serve(config: dict[str, Any]) -> int:
    """The child's main: answer the parent's requests on stdin/stdout until it closes them."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's ^C is the parent's to act on
    sock = socket.socket(fileno=os.dup(0))
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(2, 1)  # anything printed goes to stderr, never into the replies
    os.close(null)

    lock = threading.Lock()  # the heartbeat's and the calls' messages, whole lines each
    busy = threading.Event()

    def send(msg: dict[str, Any]) -> None:
        with lock:
            sock.sendall((json.dumps(msg) + "\n").encode())

    def heartbeat() -> None:
        while True:
            time.sleep(float(config["heartbeat"]))
            if busy.is_set():
                try:
                    send({"alive": True})
                except OSError:  # the parent is gone
                    return

    busy.set()  # importing podman-py: the first answer waits for it
    threading.Thread(target=heartbeat, name="kvcd-podman-heartbeat", daemon=True).start()

    failpoint.relay_to(lambda point: send({"failpoint": point}))
    logging.getLogger().addHandler(_Forward(send))
    logging.getLogger().setLevel(max(logging.INFO, int(config["level"])))
    logging.getLogger("kvcd").setLevel(int(config["level"]))

    from kvcd.host.podman import Podman

    try:
        pod: Any = Podman(config["url"], config["timeout"], config["image_timeout"])
    except PodmanError as exc:
        pod = exc  # each call says so
    for req, fds in _requests(sock):
        busy.set()
        try:
            if isinstance(pod, PodmanError):
                raise pod
            send({"ok": _answer(pod, str(req["op"]), req["args"], fds, send)})
        except (PodmanUnavailable, PodmanError) as exc:
            send({"err": [type(exc).__name__, [str(exc)]]})
        except OSError as exc:
            send({"err": ["OSError", [exc.errno, exc.strerror or str(exc), exc.filename]]})
        except Exception as exc:
            log.exception("podman helper: %s failed", req.get("op"))
            send({"err": [type(exc).__name__, [str(exc)]]})
        finally:
            busy.clear()
            for fd in fds:
                os.close(fd)
    return 0
