"""`make demo`'s journal section: an instance's journal with the image build output folded.

    journalctl -u kvcd@NAME -o json | python3 demo_journal.py [--limit N]

A build from source puts hundreds of lines (podman's STEPs, the compiler, depmod's warnings)
between kvcd's "build started" and "build finished" records; they are counted, not shown. A
build that failed shows its last lines, the ones that say why. The build records are found by
their MESSAGE_IDs, kvcd's documented ones, imported from the kvcd that is installed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterable, Iterator

from kvcd.host.journal import MSG_BUILD_FAILED, MSG_BUILD_FINISHED, MSG_BUILD_STARTED

FAILED_BUILD_TAIL = 10


def records(lines: Iterable[str]) -> Iterator[dict[str, object]]:
    for line in lines:
        if line.strip():
            yield json.loads(line)


def text(value: object) -> str:
    # journalctl -o json gives a non-UTF-8 field as a list of byte values.
    if isinstance(value, list):
        return bytes(value).decode("utf-8", "replace")
    return str(value)


def short(rec: dict[str, object]) -> str:
    """Like journalctl -o short, without the date and host: `HH:MM:SS ident[pid]: message`."""
    usec = int(text(rec.get("__REALTIME_TIMESTAMP", "0")))
    stamp = time.strftime("%H:%M:%S", time.gmtime(usec / 1e6))
    ident = text(rec.get("SYSLOG_IDENTIFIER", "?"))
    pid = f"[{text(rec['_PID'])}]" if "_PID" in rec else ""
    return f"{stamp} {ident}{pid}: {text(rec.get('MESSAGE', '')).rstrip()}"


def fold(recs: Iterable[dict[str, object]]) -> list[str]:
    out: list[str] = []
    build: list[str] | None = None
    for rec in recs:
        mid = text(rec.get("MESSAGE_ID", ""))
        line = short(rec)
        if build is not None:
            if mid not in (MSG_BUILD_FINISHED, MSG_BUILD_FAILED):
                build.append(line)
                continue
            if mid == MSG_BUILD_FAILED:
                out.append(f"         ... {len(build)} lines of image build output, the last ones:")
                out.extend(build[-FAILED_BUILD_TAIL:])
            else:
                out.append(f"         ... {len(build)} lines of image build output ...")
            build = None
        out.append(line)
        if mid == MSG_BUILD_STARTED:
            build = []
    if build is not None:  # the journal ends inside a build (it failed or is still running)
        out.append(f"         ... {len(build)} lines of image build output, the last ones:")
        out.extend(build[-FAILED_BUILD_TAIL:])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=30, help="show at most the last N lines")
    args = ap.parse_args(argv)
    lines = fold(records(sys.stdin))
    if len(lines) > args.limit:
        print(f"         ... {len(lines) - args.limit} earlier lines ...")
        lines = lines[-args.limit :]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
