from __future__ import annotations

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
