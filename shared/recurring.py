"""A problem that may last, logged so that an operator can follow it: said when it
starts (or changes), then once a minute with how often it recurred, and its end
said once.  A fault that persists (a broker away, a full disk) had logged a line
per attempt, one a second, and its recovery not at all, so the log's last line
read "still failing" long after it worked again.
"""

from __future__ import annotations

import logging
import math
import time

#: how often a problem that goes on is logged again
REPEAT_S = 60.0


class Recurring:
    """One kind of problem of one thing (``what`` names it in every line)."""

    __slots__ = ("_level", "_log", "_logged_at", "count", "since", "what")

    def __init__(self, log: logging.Logger, what: str) -> None:
        self._log = log
        self.what = what
        self.count = 0  # failures since it last worked
        self.since: float | None = None  # (monotonic) when it started failing
        self._level: int | None = None
        self._logged_at = -math.inf

    @property
    def failing(self) -> bool:
        return self.since is not None

    def failed(self, why: str, level: int = logging.WARNING) -> None:
        """One failure: said when the problem starts or gets worse (a higher level),
        else once a minute with the latest ``why`` (whose wording may vary: a count in
        it, or two causes that alternate, had made every failure a new line)."""
        now = time.monotonic()
        if self.since is None:
            self.since = now
        self.count += 1
        if self._level is None or level > self._level or now - self._logged_at >= REPEAT_S:
            again = (
                "" if self.count == 1 else f" ({self.count} times over {now - self.since:.0f} s)"
            )
            self._log.log(level, "%s: %s%s", self.what, why, again)
            self._level, self._logged_at = level, now

    def ok(self, how: str = "works again") -> None:
        """It worked: said once when it had been failing."""
        if self.since is None:
            return
        self._log.info(
            "%s: %s (%d failures over %.1f s)",
            self.what,
            how,
            self.count,
            time.monotonic() - self.since,
        )
        self.count, self.since, self._level, self._logged_at = 0, None, None, -math.inf
