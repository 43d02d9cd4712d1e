"""How a Ferry node serves several copies: one batch at a time, in turns.

A node that follows a placement runs its models' batches one at a time
(:class:`cloud.workers.NodeActivity`'s turnstile): a batcher with requests
queued waits for its turn in first-come order, and when the turn comes it
takes everything queued (up to ``max_batch``) and runs it with the whole
node.  So the models on a node are served round robin, each visit a batch of
what arrived since its last one, and a model with nothing queued is skipped.
Each batch runs at the node's full speed, where sharing the cores would
stretch every batch in flight: a request waits for the turns ahead of its
model's and then runs once, at full speed.

The cycle.  Between two turns of a model the node runs at most one batch of
every other model.  Model ``j`` arrives at ``r_j``; in a cycle of length ``T``
it has a batch with probability ``p_j(T) = 1 - exp(-r_j*T)``, of ``r_j*T``
requests on average, so the node's work in a cycle is on average
``W(T) = sum_j (a_j*p_j(T) + beta_j*r_j*T)``.  The mean cycle ``m`` is the
least fixed point ``m = W(m)`` above one batch (``max_j l_j(1)``: a request
that finds the node busy waits for at least the batch running).  Its
spread: the cycle's work varies with the arrivals (Poisson counts:
``beta_j^2*r_j*T``, times the burstiness; whether a rare model shows up:
about ``a_j^2*p_j*(1 - p_j)``), and a long cycle makes the next one long (its
batches are bigger, and more models show up), with weight ``phi``, so the
cycle's variance is that of one cycle's work over ``1 - phi^2`` (an AR(1)
process).  Cycles are skewed (a near-critical branching process: bursts
breed bursts), so they are taken as lognormal with that mean and variance.
Both figures are bounded so that they only grow when a copy is added (see
:func:`cycle`): a subset of copies that fit a node fits it too.

A request of model ``i`` arrives at a uniform point of its model's cycle
``C``, waits out the rest of it and runs in a batch of about ``1 + r_i*C``
(with bursty traffic its clump rides along): it is late when it arrived
less than ``C*(1 + beta_i*r_i) + a_i + beta_i - L_i`` before the cycle's end,
a share ``late_i = E[(C*(1 + beta_i*r_i) + a_i + beta_i - L_i)^+ / C]`` of
its requests (over the lognormal, by Gauss-Hermite quadrature).  The node
fits when

* every copy's late share is ``SAFETY`` times below its allowance (what the
  approximations cost: ``bench/packing.py`` (b) simulates the node event by
  event and holds every model to its share in time);
* a request that comes as its model's turn begins is in time at the mean
  cycle (:func:`reach`);
* a long cycle's arrivals (``Z_BATCH`` standard deviations of the cycle and
  of the arrivals) fit ``max_batch``, or two turns where the objective holds
  two cycles and a full batch (past it the rest waits a cycle more), and
  their mean fits one turn with room to spare (else a backlog lingers):
  ``max_batch - 1``, or half a turn for a max batch of 1;
* the cycle is finite (the per-request work ``sum_j beta_j*r_j`` below 1).

A copy alone on a node is one batcher with the node to itself: the batch
chain of :mod:`cloud.placement.serving` says exactly how it fares, and the
packers use it there (a node of one copy is where the cycle approximation is
at its worst: the copy's own batch is the whole cycle).
"""

from __future__ import annotations

import itertools
import math
from functools import lru_cache

import numpy as np

#: a copy's figure, or every copy's of a node
Array = float | np.ndarray

#: how much less late than allowed the cycle approximation plans each copy
SAFETY = 10.0
#: standard deviations of a cycle, and of its arrivals, that a turn's batch must hold
Z_BATCH = 1.5
#: Newton steps on the cycle's fixed point at most
STEPS = 60
_NODES, _WEIGHTS = np.polynomial.hermite_e.hermegauss(20)
_WEIGHTS = _WEIGHTS / _WEIGHTS.sum()


class Cycle:
    """The copies of one node, as arrays, and what the cycle model makes of them.

    ``a``, ``beta`` are per node (the profile's over the node's speed); ``top``
    the max batch; ``allowed`` each copy's allowance of late requests;
    ``burst`` how much more its counts vary than Poisson's."""

    __slots__ = ("fits", "late", "mean", "occupancy", "sd", "work")

    def __init__(
        self,
        a: np.ndarray,
        beta: np.ndarray,
        rate: np.ndarray,
        slo_s: np.ndarray,
        top: np.ndarray,
        allowed: np.ndarray,
        burst: np.ndarray,
        start: float = 0.0,
    ) -> None:
        self.mean, self.sd = cycle(a, beta, rate, slo_s, burst, start)
        if not math.isfinite(self.mean):
            self.late = np.full(len(a), math.inf)
            self.occupancy, self.fits, self.work = math.inf, False, math.inf
            return
        self.late = late_shares(self.mean, self.sd, a, beta, rate, slo_s, burst)
        self.work = float(work_in(a, beta, rate, self.mean).sum())
        lateness = float((self.late * SAFETY / allowed).max())
        busy = self.mean + Z_BATCH * self.sd  # a long cycle: what piles up meanwhile
        most = rate * busy + Z_BATCH * np.sqrt(rate * busy * burst) + 1
        # what does not fit one turn rides the next, where the objective holds two
        turns = np.where(2 * busy + a + beta * top <= slo_s, 2.0, 1.0)
        # and the mean arrivals leave a turn room to spare (top - 1: the one that came
        # as the turn began); a max batch of 1 has none, so half a turn (its "+1" had
        # refused such a model a shared node at any rate above 0)
        carried = np.maximum(most / (top * turns), rate * busy / np.maximum(top - 1, top / 2))
        batch = float(carried.max())
        mean = float((self.mean / reach(a, beta, rate, slo_s)).max())
        self.occupancy = max(self.work / self.mean, lateness, batch, mean)
        self.fits = lateness <= 1.0 and batch <= 1.0 and mean <= 1.0


def cycle(
    a: np.ndarray,
    beta: np.ndarray,
    rate: np.ndarray,
    slo_s: np.ndarray,
    burst: np.ndarray,
    start: float = 0.0,
) -> tuple[float, float]:
    """(mean, standard deviation) of the cycle (module docstring); ``inf`` when the
    copies' work per request leaves no time for their overheads.  ``start`` is a
    cycle known to be at most the mean (a node's before one more copy came).

    The mean is a least fixed point of a sum over the copies, so it grows with
    them.  The spread's two figures that would not (whether a model shows up
    varies less once its cycle is long; a longer cycle brings fewer new models)
    are bounded by ones that do: the first as were its cycle one batch long,
    the second counting new arrivals as of a quarter of each objective (the
    simulation in ``bench/packing.py`` (b) checks the result)."""
    per_request = float(beta @ rate)
    if per_request >= 1.0:
        return math.inf, 0.0
    least = float((a + beta).max())
    total, ar = float(a.sum()), a * rate
    t = max(least, start)
    for _ in range(STEPS):
        e = np.exp(-rate * t)
        work = total - float(a @ e) + per_request * t
        slope = float(ar @ e) + per_request
        gap = work - t
        if gap <= 1e-9 * t:
            break  # at (or past) the fixed point: the work fits the cycle
        step = gap / (1.0 - slope) if slope < 1.0 else gap
        t += max(step, gap)  # a concave W: Newton from below lands past the root
    else:
        return math.inf, 0.0  # too near critical to pin down: planned as not fitting
    # from above the root, Newton falls back to it monotonically
    for _ in range(STEPS):
        e = np.exp(-rate * t)
        work = max(least, total - float(a @ e) + per_request * t)
        if t - work <= 1e-7 * t:
            t = work
            break
        slope = float(ar @ e) + per_request
        # Newton from above a concave W's root stays above it (tangent over the curve)
        t = max(least, t - (t - work) / max(1.0 - slope, 1e-3))
    # bounded to grow with the cycle and with more copies (see the docstring)
    shows = -np.expm1(-rate * t)
    unsure = np.minimum(shows * np.exp(-rate * (a + beta)), 0.25)
    variance = float(a * a @ unsure + (beta * beta * rate) @ burst * t)
    phi = min(float(a * rate @ np.exp(-rate * slo_s / 4)) + per_request, 0.999)
    return t, math.sqrt(variance / (1 - phi * phi))


def work_in(a: Array, beta: Array, rate: Array, cycle_s: float) -> Array:
    """A copy's mean work in a cycle: its overhead when it has requests, and theirs."""
    return a * -np.expm1(-rate * cycle_s) + beta * rate * cycle_s


def reach(a: Array, beta: Array, rate: Array, slo_s: Array) -> Array:
    """The longest mean cycle each copy allows: a request that comes as its model's
    turn begins waits one cycle, then runs with what arrived meanwhile."""
    return (slo_s - a - beta) / (1 + beta * rate)


def late_shares(
    mean: float,
    sd: float,
    a: np.ndarray,
    beta: np.ndarray,
    rate: np.ndarray,
    slo_s: np.ndarray,
    burst: np.ndarray,
) -> np.ndarray:
    """Each copy's share of requests past its objective, the cycle lognormal.  Bursty
    traffic comes in clumps, and a request's clump rides in its batch: ``cv^2``
    requests on average, and it matters most when the clump is big, so the
    share is summed over the clump's sizes (:func:`_clump`)."""
    sigma2 = math.log1p((sd / mean) ** 2)
    c = np.exp(math.log(mean) - sigma2 / 2 + math.sqrt(sigma2) * _NODES)[:, None]
    base = c * (1 + beta * rate) + a - slo_s
    if float(burst.max()) <= 1.0:
        over = np.clip((base + beta) / c, 0.0, 1.0)
        return _WEIGHTS @ over
    total = np.zeros(len(a))
    for size, weight in _clump(float(burst.max())):  # the request's clump, size-biased
        riders = np.where(burst > 1.0, size, 1.0)
        total += weight * (_WEIGHTS @ np.clip((base + beta * riders) / c, 0.0, 1.0))
    return total


@lru_cache(maxsize=8)
def _clump(burst: float) -> tuple[tuple[float, float], ...]:
    """(size, probability) of the clump a request of bursty traffic comes in:
    geometric clumps of mean ``(cv^2 + 1)/2`` (as :class:`cloud.placement.serving.
    Arrivals` plans them), size-biased (a request is likelier in a big clump),
    so ``cv^2`` on average; sizes grouped in a few bins, the tail in the last."""
    p = 2.0 / (burst + 1.0)
    sizes = np.arange(1, 200, dtype=float)
    mass = sizes * p * p * (1 - p) ** (sizes - 1)
    mass /= mass.sum()
    edges = [1, 2, 3, 4, 6, 8, 11, 15, 20, 28, 40, 60, 200]
    found = []
    for low, high in itertools.pairwise(edges):
        part = mass[low - 1 : high - 1]
        if part.sum() > 0:
            found.append(
                (float((sizes[low - 1 : high - 1] * part).sum() / part.sum()), float(part.sum()))
            )
    return tuple(found)


def floor_share(a: float, beta: float, rate: float, slo_s: float) -> float:
    """A share of the node the copy keeps busy whatever shares it: its work per
    request, and one overhead per cycle it has requests in, cycles being at
    most its objective long."""
    if rate <= 0:
        return 0.0
    return beta * rate + a * -math.expm1(-rate * slo_s) / slo_s
