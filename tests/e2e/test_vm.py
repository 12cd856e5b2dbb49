"""VM end-to-end tests: one host test per guest check, asserted from the guest's junit file.

The guest is booted once per session by the `guest_run` fixture (tests/e2e/conftest.py); the
checks themselves run inside it (tests/e2e/guest/guest_smoke.py, guest_scenarios.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.e2e.conftest import GuestRun

pytestmark = pytest.mark.e2e

SMOKE = [
    "test_smoke_kernel_and_systemd",
    "test_smoke_modprobe_dummy",
    "test_smoke_podman_base_image",
    "test_smoke_podman_api_socket",
    "test_smoke_driver_build_and_load",
]

SCENARIOS = [
    "test_kvcd_installed",
    "test_a_start_loads_modules_in_order",
    "test_b_stop_unloads_restart_uses_cache",
    "test_c_reload_loads_new_version_and_params",
    "test_d_journal_has_structured_fields",
    "test_e_unloadable_module_degrades_keeps_previous",
    "test_f_kvc_format_instance",
]


@pytest.mark.parametrize("name", SMOKE, ids=[n.removeprefix("test_") for n in SMOKE])
def test_harness(guest_run: GuestRun, name: str) -> None:
    guest_run.check(name)


@pytest.mark.parametrize("name", SCENARIOS, ids=[n.removeprefix("test_") for n in SCENARIOS])
def test_kvcd(guest_run: GuestRun, name: str) -> None:
    if guest_run.mode == "smoke":
        pytest.skip("smoke run: kvcd scenarios not run")
    guest_run.check(name)
