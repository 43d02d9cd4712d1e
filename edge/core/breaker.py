"""A circuit breaker per cloud endpoint.

closed -> open after ``failures`` consecutive failures; open for a cooldown
that doubles after each failed trial (up to ``max_cooldown_s``); then
half-open, where :meth:`allow` grants exactly one trial at a time: its
success closes the breaker, its failure re-opens it.
"""

from __future__ import annotations

from typing import Final


class CircuitBreaker:
    # Radio links come back within seconds: the agent (and the replay evaluator,
    # which must behave as the agent does) keep the probe-back cadence short.
    def __init__(
        self, failures: int = 3, cooldown_s: float = 1.0, max_cooldown_s: float = 8.0
    ) -> None:
        self.failures = failures
        self.base_cooldown_s = cooldown_s
        self.max_cooldown_s = max_cooldown_s
        self.state = "closed"
        self.opened_count = 0
        self._consecutive = 0
        self._cooldown = cooldown_s
        self._open_until = 0.0
        self._trial_out = False
        self._trial_at = 0.0
        self.opened_at: float | None = None  # when it last opened from closed

    def ready(self, now: float) -> bool:
        """Whether :meth:`allow` would grant a request now (without claiming the trial)."""
        if self.state == "closed":
            return True
        if self.state == "open" and now < self._open_until:
            return False
        return not (self.state == "half_open" and self._trial_out and not self._lapsed(now))

    def allow(self, now: float) -> bool:
        if self.state == "closed":
            return True
        if self.state == "open":
            if now < self._open_until:
                return False
            self.state = "half_open"
            self._trial_out = False
        if self._trial_out and not self._lapsed(now):
            return False
        self._trial_out, self._trial_at = True, now
        return True

    # A trial that never reported (its request was cancelled) stops blocking after this.
    TRIAL_LAPSE_S: Final = 30.0

    def _lapsed(self, now: float) -> bool:
        return now - self._trial_at > self.TRIAL_LAPSE_S

    def release(self, now: float) -> None:
        """The trial ended saying nothing of the endpoint (a bad request, an unknown model)."""
        self._trial_out = False

    def record_success(self, now: float) -> None:
        self.opened_at = None
        self._consecutive = 0
        self._cooldown = self.base_cooldown_s
        self._trial_out = False
        self.state = "closed"

    def record_failure(self, now: float) -> None:
        self._consecutive += 1
        if self.state == "half_open":
            self._cooldown = min(self._cooldown * 2, self.max_cooldown_s)
            self._open(now)
        elif self.state == "closed" and self._consecutive >= self.failures:
            self.opened_at = now
            self._open(now)

    def _open(self, now: float) -> None:
        self.state = "open"
        self.opened_count += 1
        self._open_until = now + self._cooldown
        self._trial_out = False
