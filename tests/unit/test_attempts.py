"""The one decision (kvcd/core/attempts.py), as a table over every combination."""

from __future__ import annotations

import itertools

import pytest

from kvcd.core import attempts as a
from kvcd.core.state import Backoff

NOW = 1000.0
LATER = NOW + 30.0


def ledger(outcome: str, intent: str = "X") -> a.Attempt:
    if outcome == "":
        return a.Attempt()
    return a.Attempt(intent, outcome, "", 1, LATER if outcome == a.TRANSIENT else 0.0)


# (last outcome, same intent, kind, now) -> decision. Literal: each row is one documented case.
TABLE = {
    # Nothing attempted yet: apply, whatever the cause.
    ("", False, a.OBSERVE, NOW): a.Decision(a.APPLY),
    ("", False, a.RETRY, NOW): a.Decision(a.APPLY),
    ("", False, a.OBSERVE, LATER): a.Decision(a.APPLY),
    ("", False, a.RETRY, LATER): a.Decision(a.APPLY),
    # Went through: an event may mean something changed; the plan is idempotent (often empty).
    (a.OK, True, a.OBSERVE, NOW): a.Decision(a.APPLY),
    (a.OK, True, a.RETRY, NOW): a.Decision(a.APPLY),
    (a.OK, True, a.OBSERVE, LATER): a.Decision(a.APPLY),
    (a.OK, True, a.RETRY, LATER): a.Decision(a.APPLY),
    # Failed for good: mere events do not redo it; start, reload or a freed cause do.
    (a.PERMANENT, True, a.OBSERVE, NOW): a.Decision(a.SKIP),
    (a.PERMANENT, True, a.RETRY, NOW): a.Decision(a.APPLY),
    (a.PERMANENT, True, a.OBSERVE, LATER): a.Decision(a.SKIP),
    (a.PERMANENT, True, a.RETRY, LATER): a.Decision(a.APPLY),
    # Failed for now: wait out the back-off unless an outside act asks again.
    (a.TRANSIENT, True, a.OBSERVE, NOW): a.Decision(a.WAIT, LATER),
    (a.TRANSIENT, True, a.RETRY, NOW): a.Decision(a.APPLY),
    (a.TRANSIENT, True, a.OBSERVE, LATER): a.Decision(a.APPLY),
    (a.TRANSIENT, True, a.RETRY, LATER): a.Decision(a.APPLY),
}
# Another intent (the config, the settings, a verdict or the kernel changed): always apply.
for outcome, kind, now in itertools.product(a.OUTCOMES[1:], a.KINDS, (NOW, LATER)):
    TABLE[(outcome, False, kind, now)] = a.Decision(a.APPLY)


def test_the_table_covers_every_combination() -> None:
    combos = set(itertools.product(a.OUTCOMES, (True, False), a.KINDS, (NOW, LATER)))
    combos -= {c for c in combos if c[0] == "" and c[1]}  # an empty ledger has no intent
    assert set(TABLE) == combos


@pytest.mark.parametrize(("case", "want"), TABLE.items(), ids=[str(k) for k in TABLE])
def test_decide(case: tuple[str, bool, str, float], want: a.Decision) -> None:
    outcome, same, kind, now = case
    assert a.decide(ledger(outcome), "X" if same else "Y", kind, now) == want


BACKOFF = Backoff(first=2.0, cap=10.0)


@pytest.mark.parametrize(
    ("last", "intent", "transient", "want"),
    [
        (a.Attempt(), "X", True, a.Attempt("X", a.TRANSIENT, "C", 1, NOW + 2)),
        (
            a.Attempt("X", a.TRANSIENT, "C", 1, 0),
            "X",
            True,
            a.Attempt("X", a.TRANSIENT, "C", 2, NOW + 4),
        ),
        (
            a.Attempt("X", a.TRANSIENT, "C", 3, 0),
            "X",
            True,
            a.Attempt("X", a.TRANSIENT, "C", 4, NOW + 10),
        ),
        # Another intent, or one that went through since: counting starts again.
        (
            a.Attempt("Y", a.TRANSIENT, "C", 5, 0),
            "X",
            True,
            a.Attempt("X", a.TRANSIENT, "C", 1, NOW + 2),
        ),
        (a.Attempt("X", a.OK), "X", True, a.Attempt("X", a.TRANSIENT, "C", 1, NOW + 2)),
        (a.Attempt(), "X", False, a.Attempt("X", a.PERMANENT, "C", 1)),
        (a.Attempt("X", a.TRANSIENT, "C", 2, 0), "X", False, a.Attempt("X", a.PERMANENT, "C", 3)),
    ],
)
def test_failed(last: a.Attempt, intent: str, transient: bool, want: a.Attempt) -> None:
    got = a.failed(last, intent, "C", transient=transient, now=NOW, backoff=BACKOFF)
    assert got == want


def test_succeeded_clears_the_failure() -> None:
    assert a.succeeded("X") == a.Attempt("X", a.OK, "", 0, 0.0)
