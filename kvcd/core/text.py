"""Text from files and names made safe for one line of a terminal or a log. Pure."""

from __future__ import annotations

import re

# C0 and C1 control characters and DEL: in a record, a file name or anything else read from the
# host they would reach the terminal as escape sequences or start lines of their own.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")


def shown(text: str) -> str:
    """`text` safe for a terminal line: each control character escaped ("\\x1b", "\\n")."""
    return _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode(), text)
