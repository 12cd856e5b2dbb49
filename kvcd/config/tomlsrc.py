"""TOML source: decode a config file and find the line where a key was written.

tomllib (tomli before Python 3.11) decodes the text but keeps no positions, so error messages
would lose their line. :class:`KeyLines` is a small scanner that re-reads the already-validated
text and records, for every key path it can see (``[table]`` headers, dotted keys such as
``build.context = ...``, keys inside inline tables), the line it was first written on. It is
honest: where it cannot tell (keys inside arrays of tables, odd corners), it answers ``None``.

Reads text only; runs nothing.
"""

from __future__ import annotations

import bisect
import contextlib
import re
import sys
from pathlib import Path
from typing import Any

from kvcd.config.model import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python < 3.11 only
    import tomli as tomllib

__all__ = ["KeyLines", "decode"]

_AT_LINE = re.compile(r"\(at line (\d+), column (\d+)\)")
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")

KeyPath = tuple[str, ...]


# More dotted parts than any key kvcd reads has (params.<module>.<name> is three): tomllib, and
# KeyLines, take time quadratic in a key's parts (a 120 KB `a.a.a…` key took 100 s of CPU).
MAX_KEY_PARTS = 32
_SPECIAL = re.compile(r"[\"'#.=,\[\]{}\n]")


def _too_deep(text: str) -> int | None:
    """The line of the first key of more than MAX_KEY_PARTS dotted parts, or None: dots outside
    strings and comments, counted since the last '=', ',', bracket, brace or newline (a float
    or a date has one). Linear, and it visits only those characters and the quotes."""
    dots, line, i = 0, 1, 0
    while (m := _SPECIAL.search(text, i)) is not None:
        c, i = m.group(), m.end()
        if c == ".":
            dots += 1
            if dots >= MAX_KEY_PARTS:
                return line
        elif c == "#":
            found = text.find("\n", i)
            i = len(text) if found == -1 else found  # the newline is counted next
        elif c in "\"'":
            quote = c * 3 if text.startswith(c * 3, i - 1) else c
            end = _string_end(text, i - 1 + len(quote), quote)
            line += text.count("\n", i, end)
            i = end
        else:
            dots = 0
            line += c == "\n"
    return None


def _string_end(text: str, start: int, quote: str) -> int:
    """Where the string opened before `start` ends (after its closing quote); a basic string's
    escaped quote (an odd run of backslashes before it) does not end it."""
    while (at := text.find(quote, start)) != -1:
        before = at
        while quote[0] == '"' and before > start and text[before - 1] == "\\":
            before -= 1
        if (at - before) % 2 == 0:
            end = at + len(quote)
            while len(quote) == 3 and end < at + 5 and text.startswith(quote[0], end):
                end += 1  # a multi-line string may hold one or two quotes before its last three
            return end
        start = at + 1
    return len(text)


def decode(path: Path | str, text: str) -> dict[str, Any]:
    """Decode TOML text; a syntax error becomes a ConfigError carrying tomllib's line."""
    deep = _too_deep(text)
    if deep is not None:
        raise ConfigError(path, f"refusing: a key of more than {MAX_KEY_PARTS} dotted parts", deep)
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        message = str(exc)
        found = _AT_LINE.search(message)
        line = int(found.group(1)) if found else None
        detail = _AT_LINE.sub("", message).strip() if found else message
        where = f" (column {found.group(2)})" if found else ""
        raise ConfigError(path, f"TOML syntax error: {detail}{where}", line) from None
    except RecursionError:  # tomllib recurses per nested array or inline table
        raise ConfigError(path, "TOML nested too deeply (arrays or inline tables)") from None


class KeyLines:
    """Line numbers of keys in a TOML text that tomllib has already accepted."""

    def __init__(self, text: str) -> None:
        self._text = text
        self._newlines = [i for i, c in enumerate(text) if c == "\n"]
        self._lines: dict[KeyPath, int] = {}
        # The scanner is a helper for messages, never a second parser that can fail a config:
        # whatever it recorded before getting lost stays, the rest is unknown.
        with contextlib.suppress(IndexError, ValueError):
            self._scan()

    def line(self, *path: str) -> int | None:
        """The line where the key (or table) at ``path`` was first written, if known."""
        return self._lines.get(tuple(path))

    # --- scanning ---
    def _line_of(self, pos: int) -> int:
        return bisect.bisect_left(self._newlines, pos) + 1

    def _record(self, path: KeyPath, pos: int) -> None:
        line = self._line_of(pos)
        # A dotted key or header also defines its parents; the first mention wins.
        for i in range(1, len(path) + 1):
            self._lines.setdefault(path[:i], line)

    def _skip_blank(self, pos: int, newlines: bool = False) -> int:
        text = self._text
        while pos < len(text):
            c = text[pos]
            if c in " \t\r" or (newlines and c == "\n"):
                pos += 1
            elif newlines and c == "#":
                pos = self._end_of_line(pos)
            else:
                break
        return pos

    def _end_of_line(self, pos: int) -> int:
        end = self._text.find("\n", pos)
        return len(self._text) if end < 0 else end

    def _scan(self) -> None:
        text = self._text
        table: KeyPath = ()
        in_array_table = False
        pos = 0
        while True:
            pos = self._skip_blank(pos, newlines=True)
            if pos >= len(text):
                return
            start = pos
            if text[pos] == "[":
                array = text.startswith("[[", pos)
                keys, pos = self._key(self._skip_blank(pos + (2 if array else 1)))
                table = keys
                in_array_table = array
                if not array:
                    self._record(table, start)
                else:
                    self._lines.setdefault(table, self._line_of(start))
                pos = self._end_of_line(pos)
                continue
            keys, pos = self._key(pos)
            pos = self._skip_blank(pos)
            if not keys or pos >= len(text) or text[pos] != "=":
                pos = self._end_of_line(pos)
                continue
            pos = self._skip_blank(pos + 1)
            # Keys inside an array of tables are not addressable by a plain key path.
            path = None if in_array_table else table + keys
            if path is not None:
                self._record(path, start)
            pos = self._value(pos, path)

    def _key(self, pos: int) -> tuple[KeyPath, int]:
        text = self._text
        parts: list[str] = []
        while pos < len(text):
            pos = self._skip_blank(pos)
            c = text[pos]
            if c == '"':
                end = self._basic_end(pos + 1)
                parts.append(_unescape(text[pos + 1 : end]))
                pos = end + 1
            elif c == "'":
                end = text.index("'", pos + 1)
                parts.append(text[pos + 1 : end])
                pos = end + 1
            else:
                bare = _BARE_KEY.match(text, pos)
                if bare is None:
                    break
                parts.append(bare.group(0))
                pos = bare.end()
            pos = self._skip_blank(pos)
            if pos < len(text) and text[pos] == ".":
                pos += 1
                continue
            break
        return tuple(parts), pos

    def _basic_end(self, pos: int) -> int:
        """Index of the closing quote of a one-line basic string whose body starts at pos."""
        text = self._text
        while text[pos] != '"':
            pos += 2 if text[pos] == "\\" else 1
        return pos

    def _value(self, pos: int, path: KeyPath | None) -> int:
        text = self._text
        c = text[pos]
        if text.startswith('"""', pos) or text.startswith("'''", pos):
            quote = text[pos : pos + 3]
            pos += 3
            while not text.startswith(quote, pos):
                pos += 2 if quote == '"""' and text[pos] == "\\" else 1
            pos += 3
            while pos < len(text) and text[pos] == quote[0]:  # up to two quotes end the body
                pos += 1
            return pos
        if c == '"':
            return self._basic_end(pos + 1) + 1
        if c == "'":
            return text.index("'", pos + 1) + 1
        if c == "[":
            pos += 1
            while True:
                pos = self._skip_blank(pos, newlines=True)
                if text[pos] == "]":
                    return pos + 1
                if text[pos] == ",":
                    pos += 1
                    continue
                pos = self._value(pos, None)
        if c == "{":
            pos += 1
            while True:
                pos = self._skip_blank(pos, newlines=True)
                if text[pos] == "}":
                    return pos + 1
                if text[pos] == ",":
                    pos += 1
                    continue
                start = pos
                keys, pos = self._key(pos)
                pos = self._skip_blank(pos)
                if not keys or text[pos] != "=":
                    raise ValueError("lost in an inline table")
                pos = self._skip_blank(pos + 1)
                inner = None if path is None else path + keys
                if inner is not None:
                    self._record(inner, start)
                pos = self._value(pos, inner)
        # A bare value: number, boolean, date/time (which may hold one space).
        while pos < len(text) and text[pos] not in ",]}\n#":
            pos += 1
        return pos


def _unescape(body: str) -> str:
    """Decode a quoted key's body the way TOML does (it is valid: tomllib accepted it)."""
    if "\\" not in body:
        return body
    value = tomllib.loads(f'k = "{body}"')["k"]
    return str(value)
