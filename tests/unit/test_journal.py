"""The journal handler against a real datagram socket, read back with a parser of the native
protocol written here from the spec (not from the code under test)."""

from __future__ import annotations

import fcntl
import io
import logging
import os
import re
import socket
import struct
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcd.host import journal
from kvcd.host.journal import (
    MESSAGE_IDS,
    MSG_BUILD_FAILED,
    MSG_LOADED,
    InstanceAdapter,
    InstanceFilter,
    JournalHandler,
    setup_logging,
    stamp,
    stderr_is_journal,
    syslog_priority,
    valid_field_name,
)

# --- a reader of the native journal protocol ---


def parse_native(data: bytes) -> list[tuple[str, bytes]]:
    """Fields of one native-protocol datagram, in order, duplicates kept."""
    fields: list[tuple[str, bytes]] = []
    i = 0
    while i < len(data):
        nl = data.index(b"\n", i)
        eq = data.find(b"=", i, nl)
        if eq != -1:  # KEY=value\n
            fields.append((data[i:eq].decode("ascii"), data[eq + 1 : nl]))
            i = nl + 1
        else:  # KEY\n <u64 le length> value \n
            name = data[i:nl].decode("ascii")
            (size,) = struct.unpack_from("<Q", data, nl + 1)
            start = nl + 1 + 8
            value = data[start : start + size]
            assert len(value) == size, "value shorter than its length prefix"
            assert data[start + size : start + size + 1] == b"\n", "binary field not terminated"
            fields.append((name, value))
            i = start + size + 1
    return fields


def as_dict(fields: list[tuple[str, bytes]]) -> dict[str, str]:
    names = [n for n, _ in fields]
    dupes = {n for n in names if names.count(n) > 1}
    assert not dupes, f"fields sent twice: {dupes}"
    return {n: v.decode("utf-8") for n, v in fields}


def test_parser_reads_both_forms() -> None:
    raw = b"A=1\nB\n" + struct.pack("<Q", 5) + b"x\ny=z\nC=\n"
    assert parse_native(raw) == [("A", b"1"), ("B", b"x\ny=z"), ("C", b"")]


# --- fixtures ---


class Journal:
    """A stand-in journald: a datagram socket bound in tmp_path."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(5)

    def raw(self) -> bytes:
        data, fds, _flags, _addr = socket.recv_fds(self.sock, 1 << 20, 4)
        if fds:  # the memfd form: an empty datagram carrying the entry's descriptor
            assert data == b""
            (fd,) = fds
            try:
                return os.pread(fd, os.fstat(fd).st_size, 0)
            finally:
                os.close(fd)
        return data

    def entry(self) -> dict[str, str]:
        return as_dict(parse_native(self.raw()))

    def nothing_queued(self) -> bool:
        self.sock.setblocking(False)
        try:
            self.sock.recv(1)
        except BlockingIOError:
            return True
        finally:
            self.sock.settimeout(5)
        return False


@pytest.fixture
def jsock(tmp_path: Path) -> Iterator[Journal]:
    j = Journal(tmp_path / "journal.sock")
    yield j
    j.sock.close()


@pytest.fixture
def logger(jsock: Journal) -> Iterator[logging.Logger]:
    """kvcd.test.journal, propagating nowhere, with a JournalHandler on jsock."""
    lg = logging.getLogger("kvcd.test.journal")
    handler = JournalHandler(socket_path=str(jsock.path))
    lg.addHandler(handler)
    lg.setLevel(logging.DEBUG)
    lg.propagate = False
    yield lg
    lg.removeHandler(handler)
    handler.close()
    lg.propagate = True
    lg.setLevel(logging.NOTSET)


# --- the handler ---


def test_standard_fields(jsock: Journal, logger: logging.Logger) -> None:
    logger.info("loaded %s %s", "simple-kmod", "1.0")
    line = sys._getframe().f_lineno - 1
    e = jsock.entry()
    assert e == {
        "MESSAGE": "loaded simple-kmod 1.0",
        "PRIORITY": "6",
        "SYSLOG_IDENTIFIER": "kvcd",
        "CODE_FILE": __file__,
        "CODE_LINE": str(line),
        "CODE_FUNC": "test_standard_fields",
        "LOGGER": "kvcd.test.journal",
    }


def test_multiline_message_uses_the_binary_form(jsock: Journal, logger: logging.Logger) -> None:
    text = "build failed:\nmake: *** [Makefile:7] Error 2\n\ttrailing=equals"
    logger.error(text)
    raw = jsock.raw()
    encoded = text.encode()
    assert b"MESSAGE\n" + struct.pack("<Q", len(encoded)) + encoded + b"\n" in raw
    e = as_dict(parse_native(raw))
    assert e["MESSAGE"] == text
    assert e["PRIORITY"] == "3"


def test_exception_text_goes_in_the_message(jsock: Journal, logger: logging.Logger) -> None:
    try:
        raise ValueError("bad vermagic")
    except ValueError:
        logger.exception("load failed")
    e = jsock.entry()
    assert e["MESSAGE"].startswith("load failed\nTraceback (most recent call last):")
    assert e["MESSAGE"].endswith("ValueError: bad vermagic")
    assert e["PRIORITY"] == "3"


def test_extra_journal_fields(jsock: Journal, logger: logging.Logger) -> None:
    before = time.monotonic_ns() // 1000
    logger.info(
        "loaded",
        extra={
            "KVCD_INSTANCE": "simple-kmod",
            "KVCD_KERNEL": "6.1.0-18-amd64",
            "KVCD_VERSION": "1.0",
            "KVCD_STATE": "Done",
            "MESSAGE_ID": MSG_LOADED,
            "KVCD_ATTEMPT": 3,  # not a string: sent as str()
            "KVCD_NOTES": "two\nlines",  # binary form for extras too
            "KVCD_NONE": None,  # None means "no field"
        },
    )
    e = jsock.entry()
    assert e["KVCD_INSTANCE"] == "simple-kmod"
    assert e["KVCD_KERNEL"] == "6.1.0-18-amd64"
    assert e["KVCD_VERSION"] == "1.0"
    assert e["KVCD_STATE"] == "Done"
    assert e["MESSAGE_ID"] == MSG_LOADED
    assert e["KVCD_ATTEMPT"] == "3"
    assert e["KVCD_NOTES"] == "two\nlines"
    assert "KVCD_NONE" not in e
    # A catalogued event (one with a MESSAGE_ID) says when kvcd made it.
    assert before <= int(e["KVCD_MONOTONIC_USEC"]) <= time.monotonic_ns() // 1000


def test_invalid_and_reserved_field_names_are_dropped(
    jsock: Journal, logger: logging.Logger
) -> None:
    logger.warning(
        "careful",
        extra={
            "_PID": "1",  # trusted fields are journald's to set
            "_KVCD": "x",
            "1ST": "x",  # starts with a digit
            "KVCD-STATE": "x",  # dash
            "Kvcd_State": "x",  # lower case
            "kvcd_state": "x",  # ordinary logging extra for other handlers
            "K" * 65: "x",  # too long
            "MESSAGE": "spoofed",  # reserved: the handler's own field wins
            "PRIORITY": "0",
            "OK_" + "K" * 61: "kept",  # 64 characters: the longest allowed
        },
    )
    e = jsock.entry()
    assert set(e) == {
        "MESSAGE",
        "PRIORITY",
        "SYSLOG_IDENTIFIER",
        "CODE_FILE",
        "CODE_LINE",
        "CODE_FUNC",
        "LOGGER",
        "OK_" + "K" * 61,
    }
    assert e["MESSAGE"] == "careful"
    assert e["PRIORITY"] == "4"


@pytest.mark.parametrize(
    ("level", "priority"),
    [
        (logging.CRITICAL, 2),
        (logging.CRITICAL + 10, 2),
        (logging.ERROR, 3),
        (logging.WARNING, 4),
        (25, 5),  # a NOTICE between INFO and WARNING
        (logging.INFO, 6),
        (logging.DEBUG, 7),
        (5, 7),
        (logging.NOTSET, 7),
    ],
)
def test_priority_mapping(level: int, priority: int) -> None:
    assert syslog_priority(level) == priority


@pytest.mark.parametrize(
    ("level", "priority"),
    [(logging.CRITICAL, "2"), (logging.ERROR, "3"), (logging.WARNING, "4"), (logging.DEBUG, "7")],
)
def test_priority_on_the_wire(
    jsock: Journal, logger: logging.Logger, level: int, priority: str
) -> None:
    logger.log(level, "x")
    assert jsock.entry()["PRIORITY"] == priority


@pytest.mark.parametrize(
    ("name", "ok"),
    [
        ("MESSAGE_ID", True),
        ("KVCD_INSTANCE", True),
        ("A", True),
        ("A1_", True),
        ("A" * 64, True),
        ("A" * 65, False),
        ("", False),
        ("_PID", False),
        ("9LIVES", False),
        ("kvcd", False),
        ("KVCD.X", False),
        ("KVCD X", False),
        ("KVCDÄ", False),
    ],
)
def test_valid_field_name(name: str, ok: bool) -> None:
    assert valid_field_name(name) is ok


def test_static_fields_and_identifier(jsock: Journal) -> None:
    handler = JournalHandler(
        socket_path=str(jsock.path),
        identifier="kvcd-test",
        fields={"KVCD_INSTANCE": "nic", "bad name": "x", "PRIORITY": "0"},
    )
    record = logging.LogRecord("kvcd.x", logging.INFO, "/f.py", 7, "hi", None, None, func="f")
    handler.handle(record)
    e = jsock.entry()
    assert e["SYSLOG_IDENTIFIER"] == "kvcd-test"
    assert e["KVCD_INSTANCE"] == "nic"
    assert e["PRIORITY"] == "6"
    assert "bad name" not in e
    # An extra of the same name wins over the static field (sent once).
    record.KVCD_INSTANCE = "gpu"
    handler.handle(record)
    assert jsock.entry()["KVCD_INSTANCE"] == "gpu"
    handler.close()


def test_large_entry_goes_through_a_sealed_memfd(jsock: Journal, logger: logging.Logger) -> None:
    # Well above the default socket send buffer (~208 KiB), so sendto fails with EMSGSIZE.
    big = ("x" * 99 + "\n") * 2400
    logger.info(big, extra={"KVCD_INSTANCE": "gpu"})
    data, fds, _flags, _addr = socket.recv_fds(jsock.sock, 1 << 20, 4)
    assert data == b""
    assert len(fds) == 1
    fd = fds[0]
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        wanted = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
        assert seals & wanted == wanted, "journald only maps sealed memfds"
        e = as_dict(parse_native(os.pread(fd, os.fstat(fd).st_size, 0)))
    finally:
        os.close(fd)
    assert e["MESSAGE"] == big
    assert e["KVCD_INSTANCE"] == "gpu"


def test_oversized_value_is_truncated_with_a_note(jsock: Journal) -> None:
    handler = JournalHandler(socket_path=str(jsock.path), max_value_bytes=100)
    lg = logging.getLogger("kvcd.test.truncate")
    lg.addHandler(handler)
    lg.propagate = False
    try:
        lg.warning("é" * 200)  # 400 bytes of two-byte characters
    finally:
        lg.removeHandler(handler)
        lg.propagate = True
        handler.close()
    raw = dict(parse_native(jsock.raw()))["MESSAGE"]
    assert len(raw) <= 100
    text = raw.decode("utf-8")  # still valid UTF-8: cut on a character boundary
    assert re.fullmatch(r"é+\n\[kvcd: truncated \d+ of 400 bytes\]", text)


def test_journal_gone_falls_back_to_stderr(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "journal.sock"
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind(str(path))
    handler = JournalHandler(socket_path=str(path))
    lg = logging.getLogger("kvcd.test.gone")
    lg.addHandler(handler)
    lg.propagate = False
    try:
        receiver.close()  # journald restarting: nobody listens (ECONNREFUSED)
        lg.warning("while journald restarts")
        path.unlink()
        lg.error("socket missing")  # ENOENT
        err = capsys.readouterr().err
        assert "WARNING while journald restarts\n" in err
        assert "ERROR socket missing\n" in err
        assert "Traceback" not in err

        back = Journal(path)  # journald is back: entries go to it again
        lg.warning("back")
        assert back.entry()["MESSAGE"] == "back"
        back.sock.close()
    finally:
        lg.removeHandler(handler)
        lg.propagate = True
        handler.close()


# --- instance stamping ---


def test_instance_filter_stamps_every_record(jsock: Journal, logger: logging.Logger) -> None:
    (handler,) = [h for h in logger.handlers if isinstance(h, JournalHandler)]
    handler.addFilter(InstanceFilter("simple-kmod"))
    logger.info("one")
    logging.getLogger("kvcd.test.journal.child").info("from a child logger")
    logger.info("explicit wins", extra={"KVCD_INSTANCE": "other"})
    assert jsock.entry()["KVCD_INSTANCE"] == "simple-kmod"
    assert jsock.entry()["KVCD_INSTANCE"] == "simple-kmod"
    assert jsock.entry()["KVCD_INSTANCE"] == "other"


def test_instance_adapter_merges_extra(jsock: Journal, logger: logging.Logger) -> None:
    log = InstanceAdapter(logger, "nic", KVCD_KERNEL="6.1.0-18-amd64")
    log.error("build failed", extra={"MESSAGE_ID": MSG_BUILD_FAILED, "KVCD_STATE": "Degraded"})
    e = jsock.entry()
    assert e["KVCD_INSTANCE"] == "nic"
    assert e["KVCD_KERNEL"] == "6.1.0-18-amd64"
    assert e["MESSAGE_ID"] == MSG_BUILD_FAILED
    assert e["KVCD_STATE"] == "Degraded"
    assert e["CODE_FUNC"] == "test_instance_adapter_merges_extra"
    log.info("plain")
    assert jsock.entry()["KVCD_INSTANCE"] == "nic"


# --- MESSAGE_IDs ---


def test_message_ids_are_stable_unique_uuids() -> None:
    assert set(MESSAGE_IDS) == {
        "MSG_BUILD_STARTED",
        "MSG_BUILD_FINISHED",
        "MSG_BUILD_FAILED",
        "MSG_LOADED",
        "MSG_UNLOADED",
        "MSG_DEGRADED",
        "MSG_DRIFT",
        "MSG_DRIFT_RESOLVED",
        "MSG_DRIFT_FORCED",
        "MSG_DRIFT_PERIODIC",
        "MSG_MODULE_EXTERNAL",
        "MSG_NEXT_KERNEL_READY",
        "MSG_NEXT_KERNEL_FAILED",
        "MSG_NEXT_KERNEL_PREPARED",
    }
    for name, value in MESSAGE_IDS.items():
        assert getattr(journal, name) == value
        assert re.fullmatch(r"[0-9a-f]{32}", value), name
    assert len(set(MESSAGE_IDS.values())) == len(MESSAGE_IDS)
    # Published values never change.
    assert MSG_LOADED == "87b9315dc4644d2ea1e8f586eb31ab5a"


# --- setup_logging ---


@pytest.fixture
def clean_root() -> Iterator[logging.Logger]:
    root = logging.getLogger()
    saved = (list(root.handlers), root.level, logging.getLogger("kvcd").level)
    yield root
    for h in list(root.handlers):
        if h not in saved[0]:
            root.removeHandler(h)
            h.close()
    root.setLevel(saved[1])
    logging.getLogger("kvcd").setLevel(saved[2])


def ours(root: logging.Logger) -> list[logging.Handler]:
    return [h for h in root.handlers if h.get_name() == "kvcd"]


def test_setup_under_systemd_uses_the_journal(clean_root: logging.Logger, jsock: Journal) -> None:
    env = {"INVOCATION_ID": "5f2c0b0e", "PATH": "/usr/bin"}
    setup_logging(
        False, "simple-kmod", env=env, journal_socket=str(jsock.path), stream=io.StringIO()
    )
    (handler,) = ours(clean_root)
    assert isinstance(handler, JournalHandler)
    logging.getLogger("kvcd.daemon.test").info("hello", extra={"MESSAGE_ID": MSG_LOADED})
    logging.getLogger("kvcd.daemon.test").debug("not without --verbose")
    e = jsock.entry()
    assert e["MESSAGE"] == "hello"
    assert e["KVCD_INSTANCE"] == "simple-kmod"
    assert e["MESSAGE_ID"] == MSG_LOADED
    assert jsock.nothing_queued()


def test_stamped_fields_go_on_every_later_record_of_the_instance(
    clean_root: logging.Logger, jsock: Journal
) -> None:
    """README: KVCD_INSTANCE, KVCD_KERNEL and KVCD_VERSION on every record of an instance,
    whoever logs it (a watcher thread, a library), once the daemon knows them."""
    env = {"INVOCATION_ID": "5f2c0b0e"}
    setup_logging(False, "simple-kmod", env=env, journal_socket=str(jsock.path), stream=None)
    logging.getLogger("kvcd.daemon.drift").info("before the config is read")
    stamp(KVCD_KERNEL="6.1.0-56-amd64", KVCD_VERSION="1.0")
    logging.getLogger("kvcd.daemon.drift").info("drift")
    logging.getLogger("urllib3").warning("a library")
    logging.getLogger("kvcd.daemon.x").info("own wins", extra={"KVCD_VERSION": "2.0"})
    first = jsock.entry()
    assert first["KVCD_INSTANCE"] == "simple-kmod" and "KVCD_VERSION" not in first
    for _ in range(2):
        e = jsock.entry()
        assert (e["KVCD_INSTANCE"], e["KVCD_KERNEL"], e["KVCD_VERSION"]) == (
            "simple-kmod",
            "6.1.0-56-amd64",
            "1.0",
        )
    assert jsock.entry()["KVCD_VERSION"] == "2.0"


def test_setup_verbose_and_idempotent(clean_root: logging.Logger, jsock: Journal) -> None:
    env = {"INVOCATION_ID": "5f2c0b0e"}
    setup_logging(False, None, env=env, journal_socket=str(jsock.path), stream=io.StringIO())
    setup_logging(True, None, env=env, journal_socket=str(jsock.path), stream=io.StringIO())
    assert len(ours(clean_root)) == 1
    logging.getLogger("kvcd.daemon.test").debug("now visible")
    e = jsock.entry()
    assert e["MESSAGE"] == "now visible"
    assert "KVCD_INSTANCE" not in e
    # Libraries stay at INFO even with --verbose.
    assert not logging.getLogger("urllib3").isEnabledFor(logging.DEBUG)


def test_setup_without_journal_socket_uses_stderr_without_timestamps(
    clean_root: logging.Logger, tmp_path: Path
) -> None:
    stream = io.StringIO()
    env = {"INVOCATION_ID": "5f2c0b0e"}
    setup_logging(False, "nic", env=env, journal_socket=str(tmp_path / "none"), stream=stream)
    (handler,) = ours(clean_root)
    assert not isinstance(handler, JournalHandler)
    logging.getLogger("kvcd.x").warning("disk %s", "full")
    assert stream.getvalue() == "WARNING disk full\n"


def test_setup_interactive_uses_stderr_with_timestamps(
    clean_root: logging.Logger, jsock: Journal
) -> None:
    stream = io.StringIO()
    setup_logging(False, None, env={}, journal_socket=str(jsock.path), stream=stream)
    logging.getLogger("kvcd.x").info("built")
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO built\n", stream.getvalue())
    assert jsock.nothing_queued()


def test_setup_on_a_terminal_in_a_unit_stays_on_the_terminal(
    clean_root: logging.Logger, jsock: Journal
) -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = Tty()
    # e.g. a shell started from a unit that leaked INVOCATION_ID into its environment
    setup_logging(
        False, None, env={"INVOCATION_ID": "x"}, journal_socket=str(jsock.path), stream=stream
    )
    logging.getLogger("kvcd.x").info("to the terminal")
    assert stream.getvalue() == "INFO to the terminal\n"
    assert jsock.nothing_queued()


def test_stderr_is_journal(tmp_path: Path) -> None:
    with open(tmp_path / "stream", "w") as stream:
        st = os.fstat(stream.fileno())
        assert stderr_is_journal({"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}, stream)
        assert not stderr_is_journal({"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino + 1}"}, stream)
        assert not stderr_is_journal({"JOURNAL_STREAM": "garbage"}, stream)
        assert not stderr_is_journal({}, stream)
    assert not stderr_is_journal({"JOURNAL_STREAM": "1:2"}, io.StringIO())


def test_setup_on_the_journal_stream_prefixes_priority(
    clean_root: logging.Logger, tmp_path: Path
) -> None:
    # stderr is the journal's stream socket but the native socket is missing (a container):
    # '<N>' tells journald the priority of each line.
    with open(tmp_path / "stream", "w") as stream:
        st = os.fstat(stream.fileno())
        env = {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}
        setup_logging(False, None, env=env, journal_socket=str(tmp_path / "none"), stream=stream)
        logging.getLogger("kvcd.x").warning("careful")
        logging.getLogger("kvcd.x").error("broken")
    assert (tmp_path / "stream").read_text() == "<4>WARNING careful\n<3>ERROR broken\n"
