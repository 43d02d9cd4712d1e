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


def boot_id() -> str | None:
    """This boot's id (Linux), None elsewhere: a mark from the same boot shares its
    ``CLOCK_BOOTTIME``, so a later process can tell a step between the two."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or None
    except OSError:
        return None


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


#: (boot id, wall - boot time, when that clock's stamps began): what a holder keeps with
#: its stamps, so that the next process of the same boot sees a step taken between them
Mark = tuple[str | None, float, float]


class WallClock:
    def __init__(
        self,
        wall: Callable[[], float] = time.time,
        elapsed: Callable[[], float] = _boot_time,
        boot: str | None = None,
    ) -> None:
        self._wall, self._elapsed = wall, elapsed
        self._boot = boot_id() if boot is None else boot
        now = wall()
        self._offset = now - elapsed()
        self._since = now  # when the current clock's stamps began (this one's time)

    def mark(self) -> Mark:
        return (self._boot, self._offset, self._since)

    def resume(self, mark: Mark) -> Step | None:
        """Carry on from an earlier process's ``mark``: the step taken since, where it
        ran in this boot (an agent restarted offline, then NTP: its stamps had kept the
        old clock's time); else its clock's stamps are this one's, from its ``since``."""
        boot, offset, since = mark
        if boot is None or boot != self._boot:
            return None  # (another boot: its boot time is not this one's)
        delta = self._offset - offset
        if -STEP_S < delta < STEP_S:
            self._since = min(self._since, since)
            return None
        self._since = min(self._since, since + delta)  # (its stamps, once moved: this clock's)
        return Step(delta, since)

    def read(self) -> tuple[float, Step | None]:
        """(now, the step since the last read, if the clock was stepped)."""
        now = self._wall()
        offset = now - self._elapsed()
        delta = offset - self._offset
        self._offset = offset  # (a slew is followed, read by read)
        if -STEP_S < delta < STEP_S:
            return now, None
        step = Step(delta, self._since)
        # the stamps it moves lie from since + delta on, in this clock: a later step
        # moves them again (the second of two steps had left them behind, to expire)
        self._since += delta
        return now, step
