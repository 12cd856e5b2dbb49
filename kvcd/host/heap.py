"""Give the C heap's free pages back to the kernel once a cycle's work is done.

A cycle (a start, a reload, a drift check, a build ahead) allocates and frees far more than the
daemon keeps between cycles: parsed indexes, JSON, a build's output, a thread's arena for
hashing. glibc keeps what was freed mapped for the next allocation, so the daemon's RSS would
stay at the high-water mark of its busiest cycle for the rest of the boot. `malloc_trim(0)`
returns every free page of every arena (madvise), and costs well under a millisecond on a
daemon's heap. The daemon calls it only when it is about to sleep: never inside a cycle.

Another libc (musl) has no malloc_trim: there is nothing to give back, and trim() says so.
"""

from __future__ import annotations

import functools
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    import ctypes

    # The process's own symbols (dlopen(NULL)): no ctypes.util.find_library child process.
    return getattr(ctypes.CDLL(None), "malloc_trim", None)


def trim() -> bool:
    """Return the C heap's free pages to the kernel; False when this libc cannot."""
    malloc_trim = _malloc_trim()
    if malloc_trim is None:
        return False
    malloc_trim(0)
    return True
