"""How much of a node a copy needs, and when copies fit one node together.

A node shares its cores among the batches running (:mod:`cloud.placement.serving`):
with ``n`` batches in flight each runs at ``theta = 1/n`` of the node's speed.
Per copy two figures, from the batch chain of its dynamic batcher:

* its **need** ``theta_j``: the least share at which its batches must run for
  the planned share of its requests (``Headroom.quantile``) to meet its
  objective; above it the copy is fine, below it too many requests wait for
  a slow batch in flight and then run in a slow batch of their own;
* its **node time** ``c_j(theta)``: the share of the node it keeps busy when its
  batches run at ``theta``.  ``c_j`` falls as ``theta`` falls: a copy slowed
  down collects bigger batches and pays its overhead ``a`` less often, which
  is how a node's dynamic batchers make room for one another.

Copies fit one node when every copy ``j`` gets its need:

    theta_j + sum_{i != j} c_i(theta_j) + z * sqrt(sum_{i != j} v_i(theta_j) / L_j) <= 1

A batch of ``j`` shares the node with the others' batches; by Little's law the
others keep ``c_i(theta)/theta`` batches in flight on average, so ``j`` runs at
``theta = 1/(1 + sum c_i(theta)/theta)``, which reaches ``theta_j`` exactly when
the first two terms fit.  The third is the burst allowance, pooled over the
node: the others' work over ``j``'s objective ``L_j`` varies (``v_i``: the
variance of copy ``i``'s node time per second, from its batches' size and how
often it is idle; a copy that is always busy takes its share and no more,
so it adds no variance), and the node is planned for the ``quantile`` of that
sum rather than for every copy's burst at once: with independent arrivals the
sum varies like the square root of the variances' sum.  ``z`` is the normal
quantile and ``v`` carries the arrivals' burstiness.

Adding a copy only raises every left-hand side (``c`` is non-negative and
the sums grow), so a node that does not fit stays that way with more copies:
the packers rely on it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from statistics import NormalDist

import numpy as np

from cloud.placement.serving import GRID, STATES, assess, node_time
from cloud.placement.types import LatencyProfile

#: relative slack for float comparisons of shares (never enough to matter)
EPS = 1e-9
#: shares tried between two grid shares to pin a need down (1% apart)
REFINE = 16


@dataclass(frozen=True)
class Headroom:
    """Plan for a share ``quantile`` of each copy's requests within its objective, under
    arrivals with coefficient of variation ``cv`` (1: Poisson; 2: the bursty
    traffic of the benchmark; the controller takes it from ``--burst-cv``, which
    an operator can read off the nodes' arrival statistics), and for the same
    quantile of each node's pooled burst.

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
        """Standard deviations of a node's pooled burst planned for."""
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
    node time and variance tabulated over :data:`GRID`.

    Plain attributes, computed once: the packers read them millions of times."""

    __slots__ = (
        "a",
        "beta",
        "cell",
        "curve",
        "floor",
        "headroom",
        "part",
        "profile",
        "rate",
        "slo_s",
        "speed",
        "spread",
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
        late, batch = self._chain(GRID)
        self.theta = self._need(late)
        self.curve = node_time(rate, self.a, self.beta, batch, GRID)
        busy = self.curve / GRID
        work = self.a + self.beta * np.maximum(batch, 1.0)
        self.spread = rate / np.maximum(batch, 1.0) * work * work * (1 - busy) * headroom.burst
        self.floor = self.time(self.theta) if self.theta <= 1 else math.inf
        self.cell, self.part = locate(min(self.theta, 1.0))

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

    def variance(self, theta: float) -> float:
        """Variance of that share per second (burstiness included)."""
        return float(np.interp(theta, GRID, self.spread))

    def batch(self, theta: float) -> int:
        """The mean batch at ``theta``, rounded up (what the copy is planned to run)."""
        busy = self.time(theta)
        if busy <= 0 or self.rate <= 0:
            return 1
        per_request = busy / self.rate - self.beta
        mean = self.a / per_request if per_request > 0 else self.top
        return max(1, min(self.top, math.ceil(mean - 1e-6)))


def locate(theta: float) -> tuple[int, float]:
    """The cell of :data:`GRID` that holds ``theta`` and where in it (linear interpolation
    by hand: the packers interpolate at a few shares per try, where numpy's call
    overhead would dominate)."""
    cell = min(max(int(np.searchsorted(GRID, theta, side="right")) - 1, 0), len(GRID) - 2)
    low, high = float(GRID[cell]), float(GRID[cell + 1])
    return cell, min(max((theta - low) / (high - low), 0.0), 1.0)


@lru_cache(maxsize=1 << 16)
def size(
    profile: LatencyProfile, rate: float, slo_s: float, speed: float, headroom: Headroom
) -> Slot:
    """The copy sized (memoised: a chain costs milliseconds, and the packer, the
    bounds and the baselines ask for the same copies again)."""
    return Slot(profile, rate, slo_s, speed, headroom)


def pressures(slots: Sequence[Slot], z: float) -> np.ndarray:
    """The left-hand side of the fit rule (module docstring) for each copy."""
    thetas = np.array([s.theta for s in slots])
    cells = np.array([s.cell for s in slots])
    parts = np.array([s.part for s in slots])
    curves = np.array([s.curve for s in slots])  # (n, G)
    spreads = np.array([s.spread for s in slots])
    # [j, i]: copy i's node time (variance) at copy j's need
    times = curves[:, cells].T * (1 - parts[:, None]) + curves[:, cells + 1].T * parts[:, None]
    varis = spreads[:, cells].T * (1 - parts[:, None]) + spreads[:, cells + 1].T * parts[:, None]
    busy = times.sum(axis=1) - np.diag(times)
    variance = np.maximum(varis.sum(axis=1) - np.diag(varis), 0.0)
    slos = np.array([s.slo_s for s in slots])
    return thetas + busy + z * np.sqrt(variance / slos)


def pressure(slots: Sequence[Slot], j: int, z: float) -> float:
    """The left-hand side of the fit rule for ``slots[j]``."""
    return float(pressures(slots, z)[j])


def occupancy(slots: Iterable[Slot]) -> float:
    """The largest pressure among copies sharing one node (inf: a copy fits no node);
    they fit together when it is at most 1."""
    slots = list(slots)
    if not slots:
        return 0.0
    if any(s.theta > 1 for s in slots):
        return math.inf
    return float(pressures(slots, slots[0].headroom.z).max())


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
