"""How big a copy is: batch, duty cycle and occupancy under a latency objective.

The execution model is Nexus's (SOSP'19): a node cycles through the copies
placed on it once per duty cycle ``d``, running one batch of each; a request
waits at most one cycle and then its batch, so each copy needs
``d + l(b) <= L`` and the node needs ``sum l_i(b_i) <= d``.  A copy's batch is
what arrives in one cycle, planned at a quantile (``Headroom``) rather than the
mean so bursts do not break the objective: for arrivals with coefficient of
variation ``cv`` the count in a cycle has variance about ``cv^2 * r * d``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

from cloud.placement.types import LatencyProfile


@dataclass(frozen=True)
class Headroom:
    """Plan each copy's batch for the ``quantile`` of arrivals per duty cycle."""

    quantile: float = 0.99
    cv: float = 1.0

    @property
    def k(self) -> float:
        if self.quantile <= 0.5 or self.cv <= 0:
            return 0.0
        return NormalDist().inv_cdf(min(self.quantile, 0.999999)) * self.cv

    def batch(self, rate: float, d: float) -> int:
        """Requests to plan for in one cycle of ``d`` seconds (at least one)."""
        n = rate * d
        return max(1, math.ceil(n + self.k * math.sqrt(n) - 1e-9))

    def max_rate(self, batch: int, d: float) -> float:
        """The highest rate whose planned batch in a cycle of ``d`` stays <= ``batch``."""
        k = self.k
        root = (-k + math.sqrt(k * k + 4 * batch)) / 2
        return root * root / d


@dataclass(frozen=True)
class Sizing:
    """One copy's plan on a node of some speed."""

    profile: LatencyProfile
    rate: float
    slo_s: float
    speed: float
    d_max: float  # the longest duty cycle this copy allows (0: infeasible)

    def latency(self, batch: int) -> float:
        return self.profile.latency(batch, self.speed)

    def batch_at(self, d: float, headroom: Headroom) -> int:
        return min(headroom.batch(self.rate, d), self.profile.max_batch)

    def busy_at(self, d: float, headroom: Headroom) -> float:
        """Seconds of each cycle of ``d`` this copy's batch takes."""
        return self.latency(self.batch_at(d, headroom))


def size_copy(
    profile: LatencyProfile, rate: float, slo_s: float, speed: float, headroom: Headroom
) -> Sizing:
    """The longest duty cycle that keeps ``d + l(b(d)) <= L`` and ``b(d) <= max_batch``
    (0 when even batch 1 cannot meet the objective)."""

    def ok(d: float) -> bool:
        b = headroom.batch(rate, d)
        return b <= profile.max_batch and d + profile.latency(b, speed) <= slo_s

    lo, hi = 0.0, slo_s
    if not ok(profile.latency(1, speed)):
        return Sizing(profile, rate, slo_s, speed, 0.0)
    lo = profile.latency(1, speed)
    for _ in range(48):
        mid = (lo + hi) / 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return Sizing(profile, rate, slo_s, speed, lo)


def node_cycle(sizings: list[Sizing], headroom: Headroom) -> tuple[float, float] | None:
    """(duty cycle, occupancy) of copies sharing one node, or None when they do not fit.

    The cycle is the shortest ``d_max`` of the copies: each copy's latency bound
    holds at any shorter cycle, and a longer cycle batches more per overhead."""
    if not sizings:
        return 0.0, 0.0
    d = min(s.d_max for s in sizings)
    if d <= 0:
        return None
    busy = sum(s.busy_at(d, headroom) for s in sizings)
    if busy > d * (1 + 1e-9):
        return None
    return d, busy / d


def saturated_rate(
    profile: LatencyProfile, slo_s: float, speed: float, headroom: Headroom
) -> tuple[float, int]:
    """(rate, batch) of a copy that has a node to itself at its best batch
    ``B = floor((L/2 - a)/beta)`` (the node runs its batches back to back)."""
    a, beta = profile.a_s / speed, profile.beta_s / speed
    best = min(profile.max_batch, math.floor((slo_s / 2 - a) / beta + 1e-9))
    if best < 1:
        return 0.0, 0
    return headroom.max_rate(best, profile.latency(best, speed)), best
