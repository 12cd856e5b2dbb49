"""kvcd/host/heap.py: what a cycle freed goes back to the kernel, not only what sits at the top
of the heap."""

from __future__ import annotations

import subprocess
import sys

# A fresh interpreter, so the heap is this test's alone: 40 MiB of 2 KiB blocks (malloc's heap,
# below its mmap threshold), every 16th kept, so what is freed is holes between live blocks,
# which glibc's own trimming of the heap's top cannot give back; then the anonymous RSS (KiB)
# with the holes, and after trim().
CHILD = """
from kvcd.host import heap

def anon():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("RssAnon"))

blocks = [bytes(2048) + bytes([i % 256]) for i in range(20_000)]
kept = blocks[::16]
del blocks
before = anon()
print(heap.trim(), before, anon())
"""


def test_trim_gives_back_a_freed_hole_in_the_heap() -> None:
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True)
    trimmed, before, after = out.stdout.split()
    assert trimmed == "True"  # glibc: this host's libc, and every distribution kvcd ships on
    assert int(before) - int(after) > 20 * 1024, (before, after)


def test_trim_again_with_nothing_freed_is_harmless() -> None:
    from kvcd.host import heap

    assert heap.trim() and heap.trim()
