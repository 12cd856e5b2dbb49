"""A podman API service stand-in: an HTTP server on a unix socket, for replies the real podman
cannot give here (no registry is reachable, a build that never ends)."""

from __future__ import annotations

import socketserver
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler
from pathlib import Path


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
