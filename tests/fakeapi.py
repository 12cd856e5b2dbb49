"""A podman API service stand-in: an HTTP server on a unix socket, for replies the real podman
cannot give here (no registry is reachable, a build that never ends)."""

from __future__ import annotations

import json
import socket
import socketserver
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from kvcd.host.podtypes import BuildSpec


class QuietHandler(BaseHTTPRequestHandler):
    """HTTP/1.1, no access log, no reverse lookup of a unix socket's peer."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:
        pass

    def address_string(self) -> str:
        return "fake"

    def reply(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


@contextmanager
def serving(path: Path, handler: type[BaseHTTPRequestHandler]) -> Iterator[None]:
    """`handler` answers on the unix socket `path` until the block ends."""
    server = _Server(str(path), handler)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()


class FakeAPI:
    """A unix-socket HTTP server answering (method, path suffix) with canned JSON replies."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.routes: dict[tuple[str, str], tuple[int, list[object]]] = {}
        self.requests: list[tuple[str, str, dict[str, list[str]]]] = []
        self.headers: list[dict[str, str]] = []  # of each request, in order
        self.bodies: list[bytes] = []  # of each request, in order (a chunked one joined)

    def reply(self, method: str, suffix: str, status: int, *objects: object) -> None:
        """Answer `method` on a path ending in `suffix`: each object a JSON line, or one
        bytes object as the body itself."""
        self.routes[(method, suffix)] = (status, list(objects))


def _body(handler: BaseHTTPRequestHandler) -> bytes:
    if handler.headers.get("Transfer-Encoding", "").lower() != "chunked":
        return handler.rfile.read(int(handler.headers.get("Content-Length") or 0))
    out = b""
    while size := int(handler.rfile.readline().split(b";")[0], 16):
        out += handler.rfile.read(size)
        handler.rfile.readline()
    handler.rfile.readline()
    return out


@contextmanager
def fake_api_at(path: Path) -> Iterator[FakeAPI]:
    """A FakeAPI answering on the unix socket `path` until the block ends."""
    api = FakeAPI(path)

    class Handler(QuietHandler):
        def handle_any(self) -> None:
            url = urlsplit(self.path)
            api.bodies.append(_body(self))
            api.requests.append((self.command, url.path, parse_qs(url.query)))
            api.headers.append(dict(self.headers.items()))
            status, objects = next(
                (
                    answer
                    for (method, suffix), answer in api.routes.items()
                    if method == self.command and url.path.endswith(suffix)
                ),
                (404, [{"message": "no route", "cause": "fake"}]),
            )
            if len(objects) == 1 and isinstance(objects[0], bytes):  # a raw body (an archive)
                self.reply(status, objects[0])
            else:
                self.reply(status, b"".join(json.dumps(o).encode() + b"\n" for o in objects))

        do_GET = do_POST = do_DELETE = handle_any

    with serving(api.path, Handler):
        yield api


def chunk(line: bytes) -> bytes:
    return f"{len(line):x}\r\n".encode() + line + b"\r\n"


@contextmanager
def one_build(
    tmp_path: Path, answer: Callable[[socket.socket], None]
) -> Iterator[tuple[str, BuildSpec]]:
    """A podman API socket that takes one build request (to its last context chunk) and hands
    the connection to `answer`; the URL and a build spec for it."""
    path = tmp_path / "build.sock"
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(str(path))
    srv.listen(1)

    def serve() -> None:
        conn, _ = srv.accept()
        conn.settimeout(10)
        data = b""
        while not data.endswith(b"0\r\n\r\n"):  # the request and its chunked context
            data += conn.recv(65536)
        try:
            answer(conn)
        finally:
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "Containerfile").write_text("FROM x\n")
    try:
        yield f"unix://{path}", BuildSpec(str(ctx), "Containerfile", "localhost/x:1")
    finally:
        thread.join(10)
        srv.close()
