"""How much of a node a copy needs, and when copies fit one node together.

A copy alone on a node is one dynamic batcher with the node to itself: the
batch chain of :mod:`cloud.placement.serving` gives its **need** ``theta``
(the least share of the node at which the planned share of its requests,
``Headroom.quantile``, meets its objective: at most 1 when it fits a node
alone) and its node time.  Several copies on one node take turns, one batch
at a time (:mod:`cloud.placement.turns`): they fit together when none needs
more than :data:`ALONE` of a node by itself, the cycle of their turns leaves
every copy its share of requests in time and its batches within
``max_batch``, and their least node times (:func:`floor_share`) fit the node.

Adding a copy only lengthens the cycle (more work per turn) and adds to the
node time, so a node that does not fit stays that way with more copies: the
packers rely on it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from statistics import NormalDist

import numpy as np

from cloud.placement.serving import GRID, STATES, assess, node_time
from cloud.placement.turns import Cycle, floor_share, reach
from cloud.placement.types import LatencyProfile

#: a copy that needs more than this share of a node alone keeps the node to itself:
#: its batches already run nearly back to back, and the exact chain that says it
#: fits alone says nothing of another model's batches cutting in
ALONE = 0.9
#: relative slack for float comparisons of shares (never enough to matter)
EPS = 1e-9
#: shares tried between two grid shares to pin a need down (1% apart)
REFINE = 16


@dataclass(frozen=True)
class Headroom:
    """Plan for a share ``quantile`` of each copy's requests within its objective, under
    arrivals with coefficient of variation ``cv`` (1: Poisson; 2: the bursty
    traffic of the benchmark; the controller takes it from ``--burst-cv``, which
    an operator can read off the nodes' arrival statistics).

    The share is judged over windows of ``window_s`` (the controller's alert
    window): a copy planned to be late exactly ``1 - quantile`` of the time in the
    long run would miss it in about half of its windows, and late requests come
    in runs (a burst leaves a queue that takes batches to drain), so a copy is
    planned for its long-run late share plus ``z`` standard deviations of a
    window's, both from its batch chain (:mod:`cloud.placement.serving`).
    ``Headroom(quantile=0.5, cv=0)`` plans on means: evenly spaced requests,
    half of them in time, no allowance for a window's luck."""

    quantile: float = 0.99
    cv: float = 1.0
    window_s: float = 60.0

    def __post_init__(self) -> None:
        if (
            not 0.5 <= self.quantile < 1.0
            or self.cv < 0
            or math.isnan(self.cv)
            or not self.window_s > 0
        ):
            raise ValueError(
                f"headroom needs 0.5 <= quantile < 1, cv >= 0 and window_s > 0: {self}"
            )

    @property
    def late(self) -> float:
        """The share of a copy's requests allowed past its objective."""
        return 1.0 - self.quantile

    @property
    def z(self) -> float:
        """Standard deviations of a window's late count planned for."""
        return _normal_quantile(self.quantile)

    @property
    def burst(self) -> float:
        """How much more a copy's node time varies than under Poisson arrivals."""
        return self.cv * self.cv if self.cv > 1 else 1.0


@lru_cache(maxsize=64)
def _normal_quantile(q: float) -> float:
    return NormalDist().inv_cdf(q) if q > 0.5 else 0.0


class Slot:
    """One copy (``rate`` requests/s of a model) sized with ``profile`` on a node of
    ``speed``: its need ``theta`` (inf: it misses its objective even alone) and its
    node time tabulated over :data:`GRID` (alone), and the figures its turns need.

    Plain attributes, computed once: the packers read them millions of times."""

    __slots__ = (
        "a",
        "allowed",
        "beta",
        "burst",
        "curve",
        "floor",
        "headroom",
        "limit",
        "profile",
        "rate",
        "reach",
        "slo_s",
        "speed",
        "theta",
        "top",
    )

    def __init__(
        self,
        profile: LatencyProfile,
        rate: float,
        slo_s: float,
        speed: float,
        headroom: Headroom,
    ) -> None:
        self.profile, self.rate, self.slo_s, self.speed = profile, rate, slo_s, speed
        self.headroom = headroom
        self.a, self.beta = profile.a_s / speed, profile.beta_s / speed
        self.top = min(profile.max_batch, STATES)
        self.limit = profile.max_batch  # a turn takes up to max_batch
        self.allowed = headroom.late
        self.burst = headroom.burst
        self.reach = reach(self.a, self.beta, rate, slo_s)
        late, batch = self._chain(GRID)
        self.theta = self._need(late)
        self.curve = node_time(rate, self.a, self.beta, batch, GRID)
        alone = self.time(self.theta) if self.theta <= 1 else math.inf
        # the least node time wherever it goes: alone, or taking turns with others
        self.floor = min(alone, floor_share(self.a, self.beta, rate, slo_s))

    def _chain(self, theta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return assess(theta, self.rate, self.a, self.beta, self.top, self.slo_s, self.headroom)

    def _need(self, late: np.ndarray) -> float:
        """The least share with the planned share of requests in time (inf: none)."""
        allowed = self.headroom.late
        bad = np.nonzero(late > allowed)[0]
        if len(bad) == 0:
            return float(GRID[0])
        last = int(bad[-1])
        if last == len(GRID) - 1:
            return math.inf
        finer = np.geomspace(float(GRID[last]), float(GRID[last + 1]), REFINE + 2)[1:]
        late = self._chain(finer)[0]
        bad = np.nonzero(late > allowed)[0]
        return float(finer[min(int(bad[-1]) + 1, REFINE)] if len(bad) else finer[0])

    def time(self, theta: float) -> float:
        """Share of the node the copy keeps busy when its batches run at ``theta``."""
        return float(np.interp(theta, GRID, self.curve))

    def batch(self, theta: float) -> int:
        """The mean batch at ``theta``, rounded up (what the copy is planned to run)."""
        busy = self.time(theta)
        if busy <= 0 or self.rate <= 0:
            return 1
        per_request = busy / self.rate - self.beta
        mean = self.a / per_request if per_request > 0 else self.top
        return max(1, min(self.top, math.ceil(mean - 1e-6)))


@lru_cache(maxsize=1 << 16)
def size(
    profile: LatencyProfile, rate: float, slo_s: float, speed: float, headroom: Headroom
) -> Slot:
    """The copy sized (memoised: a chain costs milliseconds, and the packer, the
    bounds and the baselines ask for the same copies again)."""
    return Slot(profile, rate, slo_s, speed, headroom)


def together(slots: Sequence[Slot], start: float = 0.0) -> Cycle:
    """The cycle of turns of ``slots`` sharing one node (two or more)."""
    return Cycle(
        np.array([s.a for s in slots]),
        np.array([s.beta for s in slots]),
        np.array([s.rate for s in slots]),
        np.array([s.slo_s for s in slots]),
        np.array([s.limit for s in slots], dtype=float),
        np.array([s.allowed for s in slots]),
        np.array([s.burst for s in slots]),
        start,
    )


def occupancy(slots: Iterable[Slot]) -> float:
    """How full one node's copies make it (inf: a copy fits no node): a lone copy's
    need, else the cycle's (:class:`cloud.placement.turns.Cycle`); they fit
    together when it is at most 1."""
    slots = list(slots)
    if not slots:
        return 0.0
    if any(s.theta > 1 for s in slots):
        return math.inf
    if len(slots) == 1:
        return slots[0].theta
    if any(s.theta > ALONE for s in slots):
        return max(1.0 + 1e-6, max(s.theta for s in slots))
    found = together(slots)
    return found.occupancy if found.fits else max(found.occupancy, 1.0 + 1e-6)


def fits(slots: Iterable[Slot]) -> bool:
    return occupancy(slots) <= 1 + EPS


def full_rate(profile: LatencyProfile, slo_s: float, speed: float, headroom: Headroom) -> float:
    """The highest rate one copy serves with a node to itself (0: none).

    Found by bisection on the rate against the copy's own chain at the whole
    node (``theta = 1``), the same rule the packer uses for a lone copy."""
    a, beta = profile.a_s / speed, profile.beta_s / speed
    top = min(profile.max_batch, STATES)
    one = np.array([1.0])

    def ok(rate: float) -> bool:
        late, _ = assess(one, rate, a, beta, top, slo_s, headroom)
        return bool(late[0] <= headroom.late)

    if not ok(0.0):
        return 0.0
    lo, hi = 0.0, speed / profile.beta_s
    while hi - lo > 1e-4 * hi:
        mid = (lo + hi) / 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo
