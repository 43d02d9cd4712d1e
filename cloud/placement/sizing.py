"""How big a copy is on a node: batch, duty cycle and share of the node's time.

The execution model is Nexus's (SOSP'19).  A node cycles through the copies
placed on it once per duty cycle ``d`` and runs one batch of each; a request
waits at most one cycle and then its own batch.  So:

* latency, per copy: ``d + l(b) <= L`` for the batch ``b`` it plans for, an
  integer of at least one (a placed copy always has a slot for a request) and
  at most ``max_batch``, sized for the ``quantile`` of its arrivals in a cycle
  (:class:`Headroom`): ``r*d + z*cv*sqrt(r*d)``, rounded up;
* capacity, per node: ``sum(a_i + beta_i*r_i*d) + z*cv*sqrt(d*sum(beta_i^2*r_i))
  <= d``: the mean work of a cycle plus the same quantile of its pooled
  variation.  With means (``z = 0``) this is DESIGN.md's
  ``sum(a_i + beta_i*r_i*d) <= d``.  Planning every copy's burst at once
  instead (summing the per-copy quantile batches) would reserve for all
  copies bursting in the same cycle: with independent arrivals the node's
  work varies like ``sqrt`` of the sum, and the simulation in
  ``bench/packing.py`` confirms the pooled plan keeps the objectives.

The node's cycle is the shortest cycle any of its copies allows: each copy's
latency bound holds at any shorter cycle, and the node's share
``(A + z*cv*sqrt(V*d))/d + R`` falls as the cycle grows, so the longest
allowed is best; the share only grows as copies are added.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from statistics import NormalDist

from cloud.placement.types import LatencyProfile

#: relative slack for float comparisons of times (never enough to matter)
EPS = 1e-9


@dataclass(frozen=True)
class Headroom:
    """Plan for the ``quantile`` of arrivals per duty cycle rather than their mean.

    Arrivals with coefficient of variation ``cv`` (1.0: Poisson; a Gamma renewal
    process with CV ``c`` has a count variance of about ``c^2 * r * d`` in a
    window ``d``) are planned at ``r*d + z*cv*sqrt(r*d)`` per copy, ``z`` the
    normal quantile: the batch its latency is sized for.  A node's capacity is
    planned for the same quantile of its copies' pooled work, which assumes
    the models' arrivals are independent; traffic that bursts across models
    together (one client driving several) needs a larger ``cv``.
    ``Headroom(quantile=0.5, cv=0)`` plans on means."""

    quantile: float = 0.99
    cv: float = 1.0

    def __post_init__(self) -> None:
        if not 0.5 <= self.quantile < 1.0 or self.cv < 0 or math.isnan(self.cv):
            raise ValueError(f"headroom needs 0.5 <= quantile < 1 and cv >= 0: {self}")

    @property
    def k(self) -> float:
        """Standard deviations of the count planned above its mean."""
        if self.quantile <= 0.5 or self.cv == 0:
            return 0.0
        return NormalDist().inv_cdf(self.quantile) * self.cv

    def planned(self, rate: float, d: float) -> float:
        mean = rate * d
        return mean + self.k * math.sqrt(mean)

    def batch(self, rate: float, d: float) -> int:
        """Requests to plan for in one cycle of ``d`` seconds (at least one)."""
        return max(1, math.ceil(self.planned(rate, d) - EPS))

    def window(self, rate: float, batch: int) -> float:
        """The longest cycle whose planned arrivals stay within ``batch``."""
        if rate <= 0:
            return math.inf
        k = self.k
        root = (-k + math.sqrt(k * k + 4 * batch)) / 2  # sqrt(r*d) at equality
        return root * root / rate


class Slot:
    """One copy (``rate`` requests/s of a model) sized with ``profile`` on a node of
    ``speed``: ``d_max`` is the longest cycle it allows (0: it fits no cycle).

    Plain attributes, computed once: the packer asks for a slot's batch at a new
    cycle millions of times on a large fleet."""

    __slots__ = ("a", "beta", "d_max", "headroom", "k", "profile", "rate", "slo_s", "speed", "top")

    def __init__(
        self,
        profile: LatencyProfile,
        rate: float,
        slo_s: float,
        speed: float,
        headroom: Headroom,
        d_max: float,
    ) -> None:
        self.profile, self.rate, self.slo_s, self.speed = profile, rate, slo_s, speed
        self.headroom, self.d_max = headroom, d_max
        self.a, self.beta = profile.a_s / speed, profile.beta_s / speed
        self.k, self.top = headroom.k, profile.max_batch

    def batch(self, d: float) -> int:
        """The batch planned per cycle of ``d`` (the latency is sized for it)."""
        mean = self.rate * d
        b = math.ceil(mean + self.k * math.sqrt(mean) - EPS) if self.k else math.ceil(mean - EPS)
        return 1 if b < 1 else (self.top if b > self.top else b)

    @property
    def work(self) -> float:
        """Seconds of batch time per second of traffic (``beta*r``)."""
        return self.beta * self.rate

    @property
    def variance(self) -> float:
        """Variance of its batch time per cycle, per second of cycle (Poisson-scaled)."""
        return self.beta * self.beta * self.rate

    def alone(self) -> float:
        """Share of a node this copy takes alone (inf when it fits no cycle)."""
        if self.d_max <= 0:
            return math.inf
        return load([self], self.d_max, self.headroom)

    def floor(self) -> float:
        """The least share it adds to any node it joins (its mean at its longest cycle)."""
        if self.d_max <= 0:
            return math.inf
        return self.a / self.d_max + self.work


def load(slots: Iterable[Slot], d: float, headroom: Headroom) -> float:
    """Share of a cycle of ``d`` the copies keep the node busy, bursts included."""
    overhead = work = variance = 0.0
    for s in slots:
        overhead += s.a
        work += s.work
        variance += s.variance
    return share(overhead, work, variance, d, headroom.k)


def share(overhead: float, work: float, variance: float, d: float, k: float) -> float:
    """``(A + k*sqrt(V*d))/d + R`` for sums ``A`` of ``a``, ``R`` of ``beta*r``,
    ``V`` of ``beta^2*r`` (scaled by ``cv^2`` through ``k``)."""
    return (overhead + k * math.sqrt(variance * d)) / d + work


def longest_cycle(
    a: float, beta: float, max_batch: int, rate: float, slo_s: float, headroom: Headroom
) -> float:
    """The longest ``d`` with ``b(d) <= max_batch`` and ``d + a + beta*b(d) <= L``.

    For a batch ``K`` the cycles that keep the planned batch within ``K`` are
    ``d <= window(K)`` (growing with ``K``) and the latency allows
    ``d <= L - a - beta*K`` (shrinking), so the best ``K`` is where they cross:
    a binary search.  Returns 0 when not even batch 1 fits."""

    def value(k: int) -> float:
        return min(headroom.window(rate, k), slo_s - a - beta * k)

    lo, hi = 1, max_batch
    if headroom.window(rate, hi) <= slo_s - a - beta * hi:
        best = value(hi)
    else:  # find the last K whose window is still below its latency room
        while lo < hi:
            mid = (lo + hi) // 2
            if headroom.window(rate, mid) <= slo_s - a - beta * mid:
                lo = mid + 1
            else:
                hi = mid
        best = max(value(lo), value(lo - 1) if lo > 1 else 0.0)
    return best if best > 0 else 0.0


def size(
    profile: LatencyProfile, rate: float, slo_s: float, speed: float, headroom: Headroom
) -> Slot:
    a, beta = profile.a_s / speed, profile.beta_s / speed
    d_max = longest_cycle(a, beta, profile.max_batch, rate, slo_s, headroom)
    return Slot(profile, rate, slo_s, speed, headroom, d_max)


def cycle(slots: Iterable[Slot]) -> tuple[float, float] | None:
    """(duty cycle, share of it busy) of copies sharing one node, or None when they
    do not fit one cycle."""
    slots = list(slots)
    if not slots:
        return 0.0, 0.0
    d = min(s.d_max for s in slots)
    if d <= 0:
        return None
    busy = load(slots, d, slots[0].headroom)
    if busy > 1 + EPS:
        return None
    return d, busy


def full_rate(profile: LatencyProfile, slo_s: float, speed: float, headroom: Headroom) -> float:
    """The highest rate one copy serves with a node to itself (0: none).

    Nexus's saturated copy runs batches of ``B = floor((L/2 - a)/beta)`` back to
    back; searching the rate against the same feasibility rule the packer uses
    gives that figure for mean planning and the right one under headroom."""
    if size(profile, 0.0, slo_s, speed, headroom).d_max <= 0:
        return 0.0
    lo, hi = 0.0, speed / profile.beta_s
    for _ in range(60):
        mid = (lo + hi) / 2
        if cycle([size(profile, mid, slo_s, speed, headroom)]) is not None:
            lo = mid
        else:
            hi = mid
    return lo
