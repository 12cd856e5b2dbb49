"""The journal room: structured logging to journald over its native protocol, and log setup.

What it may touch: the journald socket (``/run/systemd/journal/socket`` unless told otherwise),
an anonymous memfd for entries too large for one datagram, and the process's stderr. No
library: the protocol is a datagram of fields, see systemd's "Native Journal Protocol":

- ``KEY=value\\n`` for a value without a newline;
- ``KEY\\n`` + the value's length as 64-bit little endian + the value + ``\\n`` otherwise;
- when the datagram is larger than the socket allows (EMSGSIZE), the same bytes go into a
  sealed memfd whose descriptor is passed with SCM_RIGHTS in an empty datagram.

A single value is cut at :data:`MAX_VALUE_BYTES` (with a note saying how much was dropped):
build logs belong in the state directory, not in one journal field.

Fields of every entry: MESSAGE, PRIORITY (syslog level), SYSLOG_IDENTIFIER, CODE_FILE,
CODE_LINE, CODE_FUNC, LOGGER, plus every ``extra`` key that is a valid journal field name
(``A-Z0-9_``, not starting with ``_`` or a digit, at most 64 characters) — e.g. KVCD_INSTANCE,
KVCD_KERNEL, KVCD_VERSION, KVCD_STATE, MESSAGE_ID. Other extra keys (lower case, ``_TRUSTED``,
…) are left to other handlers and never sent.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import stat
import struct
import sys
import time
from collections.abc import Iterator, Mapping, MutableMapping
from typing import TYPE_CHECKING, Any, TextIO

from kvcd.host.systemd import under_systemd

if TYPE_CHECKING:
    import socket

JOURNAL_SOCKET = "/run/systemd/journal/socket"
SYSLOG_IDENTIFIER = "kvcd"
MAX_VALUE_BYTES = 256 * 1024

# --- stable MESSAGE_IDs (journalctl MESSAGE_ID=…); generated once with uuid4().hex. ---
# Never change a published value: operators and catalog entries match on them.
MSG_BUILD_STARTED = "ac530fd371e8490e839297fa5c306609"
MSG_BUILD_FINISHED = "5d3990205385437abc2c091747ec1551"
MSG_BUILD_FAILED = "2fd95dff342347789aaf7f7998e98a41"
MSG_LOADED = "87b9315dc4644d2ea1e8f586eb31ab5a"
MSG_UNLOADED = "9d745d475c214df8a4b71543b9908ecb"
MSG_DEGRADED = "70f0367e8cfc464085c7ae01bd109874"
# Reserved for capabilities that are not written yet.
MSG_DRIFT = "252f3e49f0504b239c3a547f9c1f06d9"
MSG_NEXT_KERNEL_READY = "68cffd1472664457a02c51003eeeff6a"
# Next kernel: preparing it failed; after the reboot into it, its modules were prepared before
# (no build at boot).
MSG_NEXT_KERNEL_FAILED = "f806468e3b53485a86923661a7366981"
MSG_NEXT_KERNEL_PREPARED = "676d10d1f6c740e29d5ca2b95868415a"
# Drift monitor: resolved (the disk matches again), force file consumed, watch limit hit
# (periodic checks only), an instance module removed/replaced outside kvcd.
MSG_DRIFT_RESOLVED = "9b2cba1aca3645f7a78f80185c69df48"
MSG_DRIFT_FORCED = "64e2f77bf2d341f8a17ce4dafe6ecbf1"
MSG_DRIFT_PERIODIC = "499876bafb6846739c95ef4bba9e48ae"
MSG_MODULE_EXTERNAL = "1aae7027ab3b4d87a66a3f766382769a"

MESSAGE_IDS: Mapping[str, str] = {
    "MSG_BUILD_STARTED": MSG_BUILD_STARTED,
    "MSG_BUILD_FINISHED": MSG_BUILD_FINISHED,
    "MSG_BUILD_FAILED": MSG_BUILD_FAILED,
    "MSG_LOADED": MSG_LOADED,
    "MSG_UNLOADED": MSG_UNLOADED,
    "MSG_DEGRADED": MSG_DEGRADED,
    "MSG_DRIFT": MSG_DRIFT,
    "MSG_NEXT_KERNEL_READY": MSG_NEXT_KERNEL_READY,
    "MSG_NEXT_KERNEL_FAILED": MSG_NEXT_KERNEL_FAILED,
    "MSG_NEXT_KERNEL_PREPARED": MSG_NEXT_KERNEL_PREPARED,
    "MSG_DRIFT_RESOLVED": MSG_DRIFT_RESOLVED,
    "MSG_DRIFT_FORCED": MSG_DRIFT_FORCED,
    "MSG_DRIFT_PERIODIC": MSG_DRIFT_PERIODIC,
    "MSG_MODULE_EXTERNAL": MSG_MODULE_EXTERNAL,
}

INSTANCE_FIELD = "KVCD_INSTANCE"

# The name setup_logging gives its handler, to replace it on a second call.
HANDLER_NAME = "kvcd"

# Fields the handler sets itself; an `extra` key of the same name does not replace them.
RESERVED_FIELDS = frozenset(
    {"MESSAGE", "PRIORITY", "SYSLOG_IDENTIFIER", "CODE_FILE", "CODE_LINE", "CODE_FUNC", "LOGGER"}
)

_FIELD_NAME = re.compile(r"[A-Z][A-Z0-9_]{0,63}")


def with_message_id(fields: Mapping[str, str], message_id: str) -> dict[str, str]:
    """A log call's `extra`: the instance's journal fields and the event's stable MESSAGE_ID."""
    return {**fields, "MESSAGE_ID": message_id}


def valid_field_name(name: str) -> bool:
    """A name a client may send: A-Z, 0-9 and _, not starting with _ or a digit, <= 64 chars."""
    return _FIELD_NAME.fullmatch(name) is not None


def syslog_priority(levelno: int) -> int:
    """Map a logging level to a syslog priority (2 crit … 7 debug).

    Levels between INFO and WARNING (a custom NOTICE, 25) map to 5, notice.
    """
    if levelno >= logging.CRITICAL:
        return 2
    if levelno >= logging.ERROR:
        return 3
    if levelno >= logging.WARNING:
        return 4
    if levelno > logging.INFO:
        return 5
    if levelno >= logging.INFO:
        return 6
    return 7


def encode_field(name: str, value: bytes) -> bytes:
    """One field in the native format (the binary form when the value holds a newline)."""
    key = name.encode("ascii")
    if b"\n" in value:
        return key + b"\n" + struct.pack("<Q", len(value)) + value + b"\n"
    return key + b"=" + value + b"\n"


def _to_bytes(value: object, limit: int) -> bytes:
    data = value if isinstance(value, bytes) else str(value).encode("utf-8", "replace")
    if len(data) <= limit:
        return data
    note = f"\n[kvcd: truncated {len(data) - limit} of {len(data)} bytes]".encode()
    # Cut on a character boundary so the kept part stays valid UTF-8.
    head = data[: max(0, limit - len(note))].decode("utf-8", "ignore").encode("utf-8")
    return head + note


class JournalHandler(logging.Handler):
    """Sends each record to journald as one structured entry.

    ``socket_path`` is where journald listens (tests bind their own datagram socket).
    ``fields`` are added to every entry (an ``extra`` of the same name wins). If the journal
    cannot be reached the record is written to stderr instead (under systemd that is the
    journal's stream socket, which may still work), so a restarting journald loses no lines.
    """

    def __init__(
        self,
        level: int = logging.NOTSET,
        *,
        socket_path: str = JOURNAL_SOCKET,
        identifier: str = SYSLOG_IDENTIFIER,
        fields: Mapping[str, str] | None = None,
        max_value_bytes: int = MAX_VALUE_BYTES,
    ) -> None:
        super().__init__(level)
        self.socket_path = socket_path
        self.identifier = identifier
        self.fields = {k: v for k, v in (fields or {}).items() if valid_field_name(k)}
        self.max_value_bytes = max_value_bytes
        self._sock: socket.socket | None = None

    def record_fields(self, record: logging.LogRecord) -> Iterator[tuple[str, bytes]]:
        """The (name, value) pairs of one entry, in the order they are sent."""
        limit = self.max_value_bytes
        yield "MESSAGE", _to_bytes(self.format(record), limit)
        yield "PRIORITY", str(syslog_priority(record.levelno)).encode()
        yield "SYSLOG_IDENTIFIER", _to_bytes(self.identifier, limit)
        yield "CODE_FILE", _to_bytes(record.pathname, limit)
        yield "CODE_LINE", str(record.lineno).encode()
        yield "CODE_FUNC", _to_bytes(record.funcName, limit)
        yield "LOGGER", _to_bytes(record.name, limit)
        extra = {
            k: v
            for k, v in vars(record).items()
            if v is not None and k not in RESERVED_FIELDS and valid_field_name(k)
        }
        for name, value in self.fields.items():
            if name not in RESERVED_FIELDS and name not in extra:
                yield name, _to_bytes(value, limit)
        for name, value in extra.items():
            yield name, _to_bytes(value, limit)
        if "MESSAGE_ID" in extra:
            # journald stamps an entry when it receives it, which under load can be after what
            # followed it; a catalogued event also says when kvcd made it (CLOCK_MONOTONIC, as
            # systemd's *TimestampMonotonic properties).
            yield "KVCD_MONOTONIC_USEC", str(time.monotonic_ns() // 1000).encode()

    def payload(self, record: logging.LogRecord) -> bytes:
        """The datagram for one record."""
        return b"".join(encode_field(n, v) for n, v in self.record_fields(record))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            data = self.payload(record)
        except Exception:
            self.handleError(record)
            return
        try:
            self._send(data)
        except OSError:
            self._close_socket()
            self._fallback(record)

    def _send(self, data: bytes) -> None:
        import socket  # here: a CLI verb that logs to stderr never needs it

        if self._sock is None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self._sock.sendto(data, self.socket_path)
        except OSError as exc:
            # Too big for one datagram: pass it in a sealed memfd, as libsystemd does.
            if exc.errno not in (errno.EMSGSIZE, errno.ENOBUFS):
                raise
            self._send_memfd(self._sock, data)

    def _send_memfd(self, sock: socket.socket, data: bytes) -> None:
        fd = os.memfd_create("kvcd-journal", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
            # Not socket.send_fds: CPython's (3.9 to 3.11 at least) drops its address argument.
            import socket

            rights = (socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", fd))
            sock.sendmsg([b""], [rights], 0, self.socket_path)
        finally:
            os.close(fd)

    def _fallback(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stderr
            stream.write(f"{record.levelname} {self.format(record)}\n")
            stream.flush()
        except Exception:
            self.handleError(record)

    def _close_socket(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def close(self) -> None:
        self.acquire()
        try:
            self._close_socket()
        finally:
            self.release()
        super().close()


class InstanceFilter(logging.Filter):
    """Stamps ``KVCD_INSTANCE``, and the fields :func:`stamp` adds (the kernel, the configured
    version), on every record that passes; a record's own value of a field wins, unless empty.

    Attach it to a handler: one ``kvcd run <instance>`` process serves one instance, so every
    record it emits — its own, its threads' and its libraries' — belongs to that instance.
    """

    def __init__(self, instance: str) -> None:
        super().__init__()
        self.fields = {INSTANCE_FIELD: instance}

    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in self.fields.items():
            if getattr(record, key, None) in (None, ""):
                setattr(record, key, value)
        return True


def stamp(**fields: str) -> None:
    """From now on, stamp `fields` on every record of this process's instance (see
    :class:`InstanceFilter`; nothing without one: a CLI verb, a test)."""
    for handler in logging.getLogger().handlers:
        if handler.get_name() == HANDLER_NAME:
            for f in handler.filters:
                if isinstance(f, InstanceFilter):
                    f.fields.update(fields)


if TYPE_CHECKING:
    _Adapter = logging.LoggerAdapter[logging.Logger]
else:
    _Adapter = logging.LoggerAdapter


class InstanceAdapter(_Adapter):
    """A logger for one instance where one process handles several (``check-config --all``).

    Unlike the stdlib adapter before Python 3.13 it merges its fields into a call's own
    ``extra`` instead of replacing them.
    """

    def __init__(self, logger: logging.Logger, instance: str, **fields: str) -> None:
        super().__init__(logger, {INSTANCE_FIELD: instance, **fields})

    def process(
        self, msg: Any, kwargs: MutableMapping[str, Any]
    ) -> tuple[Any, MutableMapping[str, Any]]:
        kwargs["extra"] = {**(self.extra or {}), **(kwargs.get("extra") or {})}
        return msg, kwargs


def stderr_is_journal(env: Mapping[str, str] | None = None, stream: TextIO | None = None) -> bool:
    """Whether ``stream`` (stderr) is the journal stream systemd announced in JOURNAL_STREAM.

    JOURNAL_STREAM is ``<device>:<inode>`` of that socket; a child whose stderr was redirected
    inherits the variable but not the socket, hence the comparison (sd_journal_stream_fd(3)).
    """
    env = os.environ if env is None else env
    stream = sys.stderr if stream is None else stream
    dev, sep, ino = env.get("JOURNAL_STREAM", "").partition(":")
    if not sep:
        return False
    try:
        st = os.fstat(stream.fileno())
        return st.st_dev == int(dev) and st.st_ino == int(ino)
    except (OSError, ValueError, AttributeError):
        return False


class _StderrFormatter(logging.Formatter):
    """'LEVEL message'; with a '<N>' syslog prefix when stderr is the journal stream, which
    journald turns into the entry's priority."""

    def __init__(self, *, timestamps: bool, syslog_prefix: bool) -> None:
        fmt = "%(asctime)s %(levelname)s %(message)s" if timestamps else "%(levelname)s %(message)s"
        super().__init__(fmt)
        self.syslog_prefix = syslog_prefix

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        if self.syslog_prefix:
            return f"<{syslog_priority(record.levelno)}>{text}"
        return text


def _is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        return False


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (OSError, ValueError, AttributeError):
        return False


def setup_logging(
    verbose: bool,
    instance: str | None,
    *,
    env: Mapping[str, str] | None = None,
    journal_socket: str = JOURNAL_SOCKET,
    stream: TextIO | None = None,
) -> None:
    """Configure the root logger for a kvcd process (idempotent: replaces what it set before).

    - Journal handler when the journal socket exists and either stderr is the journal stream
      (JOURNAL_STREAM matches) or we run in a unit (INVOCATION_ID) with stderr not a terminal.
    - Otherwise a stderr handler, 'LEVEL message'; timestamps only when not under systemd
      (the journal stamps entries itself).
    - ``instance`` stamps KVCD_INSTANCE on every record.
    - ``verbose`` turns on DEBUG for kvcd's own loggers; libraries stay at INFO.
    """
    env = os.environ if env is None else env
    stream = sys.stderr if stream is None else stream
    root = logging.getLogger()
    for old in [h for h in root.handlers if h.get_name() == HANDLER_NAME]:
        root.removeHandler(old)
        old.close()

    handler: logging.Handler
    on_journal_stream = stderr_is_journal(env, stream)
    use_journal = _is_socket(journal_socket) and (
        on_journal_stream or (bool(env.get("INVOCATION_ID")) and not _isatty(stream))
    )
    if use_journal:
        handler = JournalHandler(socket_path=journal_socket)
    else:
        handler = logging.StreamHandler(stream)
        handler.setFormatter(
            _StderrFormatter(timestamps=not under_systemd(env), syslog_prefix=on_journal_stream)
        )
    if instance is not None:
        handler.addFilter(InstanceFilter(instance))
    handler.set_name(HANDLER_NAME)
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    logging.getLogger("kvcd").setLevel(logging.DEBUG if verbose else logging.INFO)
