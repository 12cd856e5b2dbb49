from __future__ import annotations

from pathlib import Path

import pytest

from kvcd.core import state


@pytest.mark.parametrize(
    ("attempt", "delay"), [(0, 2.0), (1, 4.0), (2, 8.0), (7, 256.0), (8, 300.0), (50, 300.0)]
)
def test_backoff_doubles_and_caps(attempt: int, delay: float) -> None:
    assert state.Backoff().delay(attempt) == delay


def test_reason_is_code_then_detail_and_bounded() -> None:
    assert (
        state.reason_text(state.LOAD_FAILED, "kvcd_user: Unknown symbol")
        == "LoadFailed: kvcd_user: Unknown symbol"
    )
    long = state.reason_text(state.BUILD_FAILED, "x" * 2000)
    assert len(long) == state.MAX_REASON and long.endswith("…")


def test_unknown_reason_code_is_a_programming_error() -> None:
    with pytest.raises(ValueError, match="unknown reason code"):
        state.StepFailed("Oops", "detail")


def test_the_state_machine_tables_speak_the_stable_vocabulary() -> None:
    """Every reason code and state the ordered-upgrade and drain tables can produce is one of
    kvcd.core.state's (the vocabulary annotations, Events and the README list)."""
    from kvcd.core import drain, upgrade

    rows = [*upgrade.TABLE.values(), *drain.AFTER.values()]
    codes = {code for _verb, _st, code in rows if code}
    states = {st for _verb, st, _code in rows if st}
    assert codes and codes <= set(state.REASONS), codes - set(state.REASONS)
    assert states <= {state.DONE, state.WORKING, state.DEGRADED}, states


def test_the_readme_lists_every_reason_code() -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    missing = [code for code in state.REASONS if f"`{code}`" not in readme]
    assert not missing, f"README.md does not list reason codes {missing}"
