"""Give the C heap's free pages back to the system after a burst of allocations.

Loading a model (parsing the file, building the session, warming it up) frees
megabytes that glibc keeps for later: on a device that counts its RSS they
stay resident for the life of the agent.  ``malloc_trim(0)`` returns them.  It
holds the allocator's lock while it runs (~80 ms on a 400 MB heap), so it is
called once, after the start-up loads and before the first request.  Elsewhere
than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

_LIBC: list[Any] = []


def trim_heap() -> bool:
    """Return free heap memory to the system (glibc); False where there is no such call.
    Blocking for a few milliseconds: call it off the event loop."""
    if not _LIBC:
        try:  # (the process's own symbols: no ldconfig run to find the C library)
            _LIBC.append(ctypes.CDLL(None).malloc_trim)
        except (OSError, AttributeError):
            _LIBC.append(None)
    trim = _LIBC[0]
    if trim is None:
        return False
    trim(0)
    return True


#: glibc's mallopt parameter for the most arenas (malloc.h: M_ARENA_MAX)
_M_ARENA_MAX = -8


def limit_arenas(count: int) -> bool:
    """Let glibc's malloc keep at most ``count`` arenas (it makes one per thread that
    allocates, up to 8 per core, each holding its own freed memory: ~1 MiB of an
    agent's RSS for its few threads).  Call first thing in a process's ``main``,
    before threads start; False where there is no such call."""
    if "MALLOC_ARENA_MAX" in os.environ:  # the operator's own choice stands
        return False
    try:
        return bool(ctypes.CDLL(None).mallopt(_M_ARENA_MAX, int(count)))
    except (OSError, AttributeError):
        return False
