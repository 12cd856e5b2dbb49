"""KVC compatibility: read `/etc/kvc/<name>.conf` as data, never as shell. What the lexer accepts
and refuses: docs/internals.md "KVC confs as data".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from kvcd.config.model import ConfigError
from kvcd.config.rules import (
    MAX_KVC_ENVIRONMENT,
    MAX_KVC_EXPANDED,
    MAX_KVC_VALUE,
    MAX_KVC_VARIABLE,
)

__all__ = ["Assignment", "parse_assignments"]

_NAME_START = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz_")
_NAME_CHARS = _NAME_START | frozenset("0123456789")
_SAFE = _NAME_CHARS | frozenset("./:,+=@%-")
_BLANK = frozenset(" \t")
_DQ_ESCAPES = frozenset('"\\$`')


@dataclass(frozen=True)
class Assignment:
    """One ``NAME=VALUE`` of a conf: a string, or the words of a ``NAME=(...)`` array."""

    name: str
    value: str
    line: int
    words: tuple[str, ...] | None = None  # set for an array; value is then the words joined
    # `export NAME=…`, or `export NAME` anywhere in the file: bash passes it on to the programs
    # the hook runs. Any other assignment is a shell variable only, as when KVC sourced the conf.
    exported: bool = False


def parse_assignments(
    path: Path | str,
    text: str,
    known: Mapping[str, str] | None = None,
    runtime_only: Mapping[str, str] | None = None,
) -> list[Assignment]:
    """Lex a KVC conf into its assignments, in file order.

    ``known`` are variables that may be expanded without being assigned in the file;
    ``runtime_only`` maps names that only exist when KVC runs to the reason they cannot be
    expanded here.
    """
    return _Lexer(Path(path), text, known or {}, runtime_only or {}).run()


class _Lexer:
    def __init__(
        self, path: Path, text: str, known: Mapping[str, str], runtime_only: Mapping[str, str]
    ) -> None:
        self.path = path
        self.text = text
        self.pos = 0
        self.line = 1
        self.vars: dict[str, str] = dict(known)
        self.arrays: set[str] = set()
        self.runtime_only = runtime_only
        self.assigning = ""  # the variable whose value is being read
        self.exports: set[str] = set()  # names an `export` line names
        self.expanded = 0  # characters expanded into that value so far
        self.env_sizes: dict[str, int] = {}  # bytes of each variable's NAME=VALUE and NUL
        self.env_total = 0
        self.expanded_total = 0  # ... and into every value of the file

    # --- helpers ---
    def fail(self, message: str, line: int | None = None) -> ConfigError:
        return ConfigError(self.path, message, line if line is not None else self.line)

    def peek(self, offset: int = 0) -> str:
        i = self.pos + offset
        return self.text[i] if i < len(self.text) else ""

    def advance(self) -> str:
        c = self.text[self.pos]
        self.pos += 1
        if c == "\n":
            self.line += 1
        return c

    def skip_blanks(self) -> None:
        while self.peek() in _BLANK and self.peek():
            self.pos += 1

    def rest_of_line(self, start: int | None = None) -> str:
        begin = self.pos if start is None else start
        end = self.text.find("\n", begin)
        found = self.text[begin : end if end >= 0 else len(self.text)].strip()
        return found if len(found) <= 40 else found[:37] + "..."

    def at_end_of_statement(self) -> bool:
        return self.peek() in ("", "\n", "#")

    def skip_comment_and_newline(self) -> None:
        if self.peek() == "#":
            end = self.text.find("\n", self.pos)
            self.pos = end if end >= 0 else len(self.text)
        if self.peek() == "\n":
            self.advance()

    # --- statements ---
    def run(self) -> list[Assignment]:
        out: list[Assignment] = []
        while self.pos < len(self.text):
            self.skip_blanks()
            if self.at_end_of_statement():
                self.skip_comment_and_newline()
                continue
            found = self.assignment()
            if found is not None:
                out.append(found)
            self.skip_blanks()
            if self.peek() == "\\" and self.peek(1) in ("\n", ""):
                raise self.continuation()
            if not self.at_end_of_statement():
                assert found is not None  # 'export NAME' alone ends at the end of its line
                raise self.fail(
                    f"unexpected {self.rest_of_line()!r} after the value of '{found.name}': one "
                    "assignment per line, and quote values that hold spaces or shell characters "
                    "(in shell this would run a command)"
                )
            self.skip_comment_and_newline()
        return [replace(a, exported=True) if a.name in self.exports else a for a in out]

    def continuation(self) -> ConfigError:
        return self.fail(
            "line continuation (backslash at the end of the line) is not supported: "
            "put the assignment on one line"
        )

    def assignment(self) -> Assignment | None:
        """One assignment; None for ``export NAME`` alone (it only marks NAME exported)."""
        line = self.line
        start = self.pos
        name = self.name()
        if name == "export" and self.peek() in _BLANK and self.peek():
            self.skip_blanks()
            after_export = self.pos
            if self.export_names_only():
                return None
            self.pos = after_export
            name = self.name()
            self.exports.add(name)
        if not name or self.peek() != "=":
            if name and self.peek() == "+" and self.peek(1) == "=":
                raise self.fail(f"'{name}+=' (appending) is not supported: assign the whole value")
            found = self.rest_of_line(start)
            raise self.fail(
                f"not an assignment: {found!r} (a KVC conf may only hold NAME=VALUE lines; "
                "kvcd reads it as data and never runs it)"
            )
        self.pos += 1  # '='
        if name in self.runtime_only:
            raise self.fail(f"'{name}' cannot be assigned here: {self.runtime_only[name]}")
        self.assigning, self.expanded = name, 0
        if self.peek() == "(":
            words = self.array(name)
            self.vars[name] = self.bounded(" ".join(words), line)
            self.arrays.add(name)
            return Assignment(name, " ".join(words), line, words)
        value = self.word(in_array=False) if not self.at_value_end() else ""
        self.vars[name] = self.bounded(value, line)
        self.arrays.discard(name)
        return Assignment(name, value, line)

    def bounded(self, value: str, line: int) -> str:
        if len(value) > MAX_KVC_VALUE:
            raise self.fail(
                f"the value of '{self.assigning}' is {len(value)} characters long; a KVC conf "
                f"value may have at most {MAX_KVC_VALUE}",
                line,
            )
        name = self.assigning
        size = len(f"{name}={value}".encode(errors="surrogateescape"))
        if size > MAX_KVC_VARIABLE:
            raise self.fail(
                f"'{name}=...' is {size} bytes (UTF-8); a variable handed to a KVC library may "
                f"have at most {MAX_KVC_VARIABLE} (the kernel's bound on one environment "
                "string is 128 KiB)",
                line,
            )
        self.env_total += size + 1 - self.env_sizes.get(name, 0)
        self.env_sizes[name] = size + 1
        if self.env_total > MAX_KVC_ENVIRONMENT:
            raise self.fail(
                f"with '{name}' the variables of this conf are {self.env_total} bytes (UTF-8); "
                f"a KVC library's environment from one conf may have at most "
                f"{MAX_KVC_ENVIRONMENT} (well below the kernel's ARG_MAX)",
                line,
            )
        return value

    def export_names_only(self) -> bool:
        """Consume ``NAME [NAME...]`` after ``export`` and note them exported; False if that
        is not the whole line."""
        names = []
        while True:
            name = self.name()
            if not name or not (self.at_end_of_statement() or self.peek() in _BLANK):
                return False
            names.append(name)
            self.skip_blanks()
            if self.at_end_of_statement():
                self.exports.update(names)
                return True

    def name(self) -> str:
        start = self.pos
        if self.peek() not in _NAME_START or not self.peek():
            return ""
        while self.peek() and self.peek() in _NAME_CHARS:
            self.pos += 1
        return self.text[start : self.pos]

    def at_value_end(self) -> bool:
        return self.peek() in ("", "\n") or self.peek() in _BLANK

    def array(self, name: str) -> tuple[str, ...]:
        opened = self.line
        self.pos += 1  # '('
        words: list[str] = []
        while True:
            while self.peek() and (self.peek() in _BLANK or self.peek() == "\n"):
                self.advance()
            c = self.peek()
            if c == "":
                raise self.fail(f"unterminated array '{name}=(' opened on line {opened}", opened)
            if c == ")":
                self.pos += 1
                return tuple(words)
            if c == "#":
                raise self.fail(f"comments inside the array '{name}=(...)' are not supported")
            words.append(self.word(in_array=True))

    # --- words ---
    def word(self, in_array: bool) -> str:
        """One shell word: a concatenation of unquoted, quoted and expanded parts."""
        parts: list[str] = []
        while True:
            c = self.peek()
            if c in ("", "\n") or c in _BLANK or (in_array and c == ")"):
                return "".join(parts)
            if c in _SAFE:
                parts.append(self.advance())
            elif c == "'":
                parts.append(self.single_quoted())
            elif c == '"':
                parts.append(self.double_quoted())
            elif c == "\\":
                nxt = self.peek(1)
                if nxt in ("\n", ""):
                    raise self.continuation()
                self.pos += 2
                parts.append(nxt)
            elif c == "$":
                if in_array and self.peek(1) in _NAME_START | {"{"} and self.peek(1):
                    raise self.fail(
                        "unquoted expansion inside an array is refused (shell would split and "
                        'glob it): quote it, e.g. "$NAME"'
                    )
                parts.append(self.dollar(quoted=False))
            elif c == "`":
                raise self.fail("command substitution with backticks is not allowed")
            elif c == "#":
                parts.append(self.advance())  # '#' inside a word is not a comment in shell
            else:
                raise self.fail(self.special(c))

    def special(self, c: str) -> str:
        if c == "(":
            return "unquoted '(' (a subshell or array) is not allowed here"
        if c in "*?[]":
            return f"unquoted glob character {c!r} is not allowed: quote the value"
        if c == "~":
            return "unquoted '~' (home directory expansion) is not allowed: quote it or use a path"
        if c in ";|&<>(){}":
            return f"unquoted shell operator {c!r} is not allowed: quote the value"
        if c == "\r":
            return "carriage return found: the file has DOS line endings"
        return f"unquoted character {c!r} is not allowed: quote the value"

    def single_quoted(self) -> str:
        opened = self.line
        self.pos += 1
        end = self.text.find("'", self.pos)
        if end < 0:
            raise self.fail(f"unterminated single quote opened on line {opened}", opened)
        body = self.text[self.pos : end]
        self.line += body.count("\n")
        self.pos = end + 1
        return body

    def double_quoted(self) -> str:
        opened = self.line
        self.pos += 1
        parts: list[str] = []
        while True:
            c = self.peek()
            if c == "":
                raise self.fail(f"unterminated double quote opened on line {opened}", opened)
            if c == '"':
                self.pos += 1
                return "".join(parts)
            if c == "\\":
                nxt = self.peek(1)
                if nxt == "\n":
                    raise self.continuation()
                if nxt in _DQ_ESCAPES and nxt:
                    self.pos += 2
                    parts.append(nxt)
                else:
                    parts.append(self.advance())  # bash keeps other backslashes
            elif c == "$":
                parts.append(self.dollar(quoted=True))
            elif c == "`":
                raise self.fail("command substitution with backticks is not allowed")
            else:
                parts.append(self.advance())

    def dollar(self, quoted: bool) -> str:
        nxt = self.peek(1)
        if nxt == "(":
            if self.peek(2) == "(":
                raise self.fail("arithmetic expansion '$((...))' is not allowed")
            raise self.fail("command substitution '$(...)' is not allowed")
        if nxt == "{":
            return self.braced()
        if nxt and nxt in _NAME_START:
            self.pos += 1
            return self.expand(self.name())
        if nxt and nxt in "0123456789@*#?$!-":
            raise self.fail(f"special parameter '${nxt}' is not allowed")
        if not quoted and nxt in ("'", '"'):
            raise self.fail(f"'${nxt}...' quoting is not allowed: use plain quotes")
        self.pos += 1
        return "$"  # a lone '$' is literal in shell too

    def braced(self) -> str:
        start = self.pos
        self.pos += 2  # '${'
        name = self.name()
        if name and self.peek() == "}":
            self.pos += 1
            return self.expand(name)
        end = self.text.find("}", start)
        newline = self.text.find("\n", start)
        stop = end + 1 if end >= 0 and (newline < 0 or end < newline) else self.pos
        found = self.text[start:stop]
        raise self.fail(
            f"parameter expansion {found!r} is not supported: only ${{NAME}} of a variable "
            "assigned earlier in this file"
        )

    def expand(self, name: str) -> str:
        if name in self.runtime_only:
            raise self.fail(f"cannot expand '${name}': {self.runtime_only[name]}")
        if name in self.arrays:
            raise self.fail(f"cannot expand the array '{name}' as a string")
        if name not in self.vars:
            raise self.fail(
                f"unknown variable '{name}': only variables assigned earlier in this file "
                "can be expanded (kvcd reads the file as data; it never runs it)"
            )
        value = self.vars[name]
        # Counted before the caller joins it in, so a bomb stops before it takes memory.
        self.expanded += len(value)
        self.expanded_total += len(value)
        if self.expanded > MAX_KVC_VALUE:
            raise self.fail(
                f"expanding '${name}' makes the value of '{self.assigning}' longer than "
                f"{MAX_KVC_VALUE} characters, the most a KVC conf value may have"
            )
        if self.expanded_total > MAX_KVC_EXPANDED:
            raise self.fail(
                f"expanding '${name}' makes the expanded values of this file longer than "
                f"{MAX_KVC_EXPANDED} characters in all, the most kvcd expands in one KVC conf"
            )
        return value
