"""pytest configuration inside the guest (rootdir tests/e2e/guest; not collected on the host).

`@pytest.mark.boot(N)`: the test runs only in boot N of the run (entry.sh exports
KVCD_E2E_BOOT). Unmarked tests run in whichever boot runs their file. A reboot scenario marks
its tests before the reboot boot(1) and those after it boot(2); the last boot(1) test calls
kvcdguest.request_reboot(), and entry.sh reboots once the session ends.
"""

from __future__ import annotations

import os

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "boot(n): run only in boot n of the e2e run (reboots)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    boot = int(os.environ.get("KVCD_E2E_BOOT", "1"))
    keep, drop = [], []
    for item in items:
        m = item.get_closest_marker("boot")
        (keep if m is None or int(m.args[0]) == boot else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
