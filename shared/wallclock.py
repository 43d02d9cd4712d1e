"""Wall-clock time that notices when the clock is stepped.

What must outlive the process (a deferred request's expiry, an answer kept
for the app) is stamped with the wall clock.  A device without a real-time
clock boots at the time it last saved and NTP steps it forward, often by
days, once a network is up: exactly when deferred requests have piled up.
Stamps taken before the step are in the old clock's time; the holder moves
them by the step so a day-long ttl stays a day long.

The step is the wall clock's move against a clock that only counts time
(``CLOCK_BOOTTIME`` where there is one: it runs through a suspend, which is
real time passing, not a step).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

#: a change of (wall - boot time) past this between two reads is a step, not a slew
#: (NTP slews at most 0.5 ms/s; it steps offsets beyond 128 ms)
STEP_S = 2.0


def _boot_time() -> float:
    try:
        return time.clock_gettime(time.CLOCK_BOOTTIME)
    except (AttributeError, OSError):  # (not Linux: monotonic, which may stop in a suspend)
        return time.monotonic()


@dataclass(frozen=True)
class Step:
    """The wall clock moved by ``delta_s``; stamps at or after ``since`` (in the old
    clock's time) were taken before it, and read ``delta_s`` wrong now."""

    delta_s: float
    since: float


class WallClock:
    def __init__(
        self,
        wall: Callable[[], float] = time.time,
        elapsed: Callable[[], float] = _boot_time,
    ) -> None:
        self._wall, self._elapsed = wall, elapsed
        now = wall()
        self._offset = now - elapsed()
        self._since = now  # when the current clock's stamps began (this one's time)

    def read(self) -> tuple[float, Step | None]:
        """(now, the step since the last read, if the clock was stepped)."""
        now = self._wall()
        offset = now - self._elapsed()
        delta = offset - self._offset
        self._offset = offset  # (a slew is followed, read by read)
        if -STEP_S < delta < STEP_S:
            return now, None
        step = Step(delta, self._since)
        self._since = now
        return now, step
