"""trim_heap gives freed C heap memory back; limit_arenas is taken by glibc."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support import ROOT

_FREED_AND_PINNED = """
import sys
from shared.heap import trim_heap

def rss_kib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])

blocks = [bytearray(4096) for _ in range(8000)]  # ~32 MiB of malloc'd blocks
pin = bytearray(4096)  # above them: the heap's top stays in use, nothing trims itself
del blocks
before = rss_kib()
assert trim_heap()
print(before - rss_kib())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_memory_a_load_freed_goes_back_to_the_system_once_trimmed():
    # in a fresh process: what this one's heap holds is pytest's business
    out = subprocess.run(
        [sys.executable, "-c", _FREED_AND_PINNED], cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) > 16 * 1024  # KiB given back of the ~32 MiB freed


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_the_arena_limit_is_taken_by_the_c_library():
    code = "from shared.heap import limit_arenas; print(limit_arenas(1))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.stdout.strip() == "True", out.stderr
