"""How a copy alone on a node is served: the batch chain of a dynamic batcher.

A loaded model has its own dynamic batcher (:mod:`cloud.batcher`) with one
session: when the session is free it dispatches everything queued (up to
``max_batch``) at once, and when nothing is queued the next request starts
a batch of one.  Alone on a node its batches run at the node's full speed
(``theta = 1``); the chain is written for any constant share ``theta`` of
the node (a batch of ``b`` that would take ``l(b) = a + beta*b`` with the
node to itself takes ``l(b)/theta``), which also gives a copy's *need*: the
least share at which it keeps its requests in time (a sort key and a
measure of how much of a node it takes).  Copies that share a node take
turns instead (:mod:`cloud.placement.turns`).

At a constant share ``theta`` one copy is a Markov chain over the size of
the batch in flight: a batch of ``b`` runs ``t_b = l(b)/theta``; the requests
that arrive meanwhile (``N``, Poisson with mean ``r*t_b``, or over-dispersed
with variance ``cv^2 * r*t_b`` for bursty traffic) form the next batch, and
``N = 0`` leaves the copy idle until a request starts a batch of one.  A
request that arrives ``x`` into a batch of ``b`` waits ``t_b - x`` and then
runs in a batch of ``1 + N'`` (``N'`` the others that arrive in that batch;
for Poisson arrivals they are Poisson, whatever the tagged one does), so it
is late when ``x < t_b + t_{1+N'} - L``: the slower the share, the longer
both batches, the more of each window is late.  Requests arrive in a batch
in proportion to its length (long batches collect more of them), which the
weights ``r*t_b`` below carry.

From the chain, per copy and share: the share of requests later than the
objective (:func:`late_share`), and the mean batch, hence the node time the
copy uses per second, ``r*(beta + a/mean_batch)``: the lower the share, the
bigger the batches and the less overhead.  A batch past ``max_batch`` (or
past :data:`STATES`) is counted late, which plans a little more than needed.
``bench/_packing_sim.py`` simulates the same node event by event and checks
these figures.
"""

from __future__ import annotations

import math
from functools import lru_cache
from statistics import NormalDist
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from cloud.placement.sizing import Headroom

#: shares on which a copy's node time is tabulated (log-spaced, 0.1% to the whole node)
GRID = np.geomspace(1e-3, 1.0, 41)
#: batch sizes the chain tracks at most (a larger max_batch is planned as this)
STATES = 128


class Arrivals:
    """Counts of requests in a window, as the chain needs them.

    ``cv <= 1``: Poisson (a renewal process with CV below 1 is planned as
    Poisson, which only over-plans it; ``cv == 0``: evenly spaced, the two
    integers around the mean).  ``cv > 1``: bursty traffic as clumps, a
    compound Poisson process whose clumps (geometric, mean
    ``m = (cv^2 + 1)/2``) arrive at once: its counts have the same variance
    over long windows as a renewal process of CV ``cv`` (``cv^2`` times the
    mean), and, as in such a process, a request rarely comes alone: it
    brings ``cv^2 - 1`` others on average (its clump, size-biased), which
    ride in its batch, and a clump that finds the copy idle starts a batch
    of its size."""

    def __init__(self, cv: float, top: int) -> None:
        self.cv, self.top = cv, top
        n = np.arange(top + 1, dtype=float)
        if cv > 1:
            self.mean_clump = (cv * cv + 1) / 2
            p = 1 / self.mean_clump
            self.clump = np.where(n >= 1, p * (1 - p) ** np.maximum(n - 1, 0), 0.0)
            self.mates = (n + 1) * p * p * (1 - p) ** n  # others in a request's own clump
        else:
            self.mean_clump = 1.0
            self.clump = (n == 1).astype(float)
            self.mates = (n == 0).astype(float)

    def counts(self, mu: np.ndarray) -> np.ndarray:
        """P(N = n) for ``n = 0..top`` and, last, P(N > top); ``mu`` (the mean) any shape."""
        top, cv = self.top, self.cv
        mu = np.maximum(np.asarray(mu, dtype=float), 1e-12)[..., None]
        n = np.arange(top + 1, dtype=float)
        if cv == 0:
            low = np.floor(mu)
            up = mu - low
            p = np.where(n == low, 1 - up, 0.0) + np.where(n == low + 1, up, 0.0)
        elif cv <= 1:
            p = np.exp(n * np.log(mu) - mu - _log_factorial(top))
        else:  # compound Poisson, geometric clumps (Polya-Aeppli): a three-term recursion
            lam = mu[..., 0] / self.mean_clump
            q = 1 - 1 / self.mean_clump
            p = np.zeros((*lam.shape, top + 1))
            p[..., 0] = np.exp(-lam)
            if top >= 1:
                p[..., 1] = p[..., 0] * lam * (1 - q)
            for k in range(2, top + 1):
                p[..., k] = (
                    (lam * (1 - q) + 2 * (k - 1) * q) * p[..., k - 1]
                    - (k - 2) * q * q * p[..., k - 2]
                ) / k
        return _with_tail(p)

    def with_mates(self, pm: np.ndarray) -> np.ndarray:
        """Counts of the others in a request's batch: ``pm`` (others in the window)
        plus the request's own clump-mates."""
        if self.cv <= 1:
            return pm
        top = self.top
        n = np.arange(top + 1)
        shift = n[None, :] - n[:, None]  # [i, j]: j - i mates take i others to j
        spread = np.where(shift >= 0, self.mates[np.clip(shift, 0, top)], 0.0)
        return _with_tail(pm[..., : top + 1] @ spread)


@lru_cache(maxsize=16)
def _log_factorial(top: int) -> np.ndarray:
    """``log(n!)`` for ``n = 0..top``."""
    return np.array([math.lgamma(k + 1.0) for k in range(top + 1)])


def _with_tail(p: np.ndarray) -> np.ndarray:
    tail = np.clip(1.0 - p.sum(axis=-1, keepdims=True), 0.0, 1.0)
    return np.concatenate([p, tail], axis=-1)


def chain(
    theta: np.ndarray,
    rate: float,
    a: float,
    beta: float,
    max_batch: int,
    slo_s: float,
    cv: float,
    batches: int = 1,
    window_s: float = 0.0,
    quantile: float = 0.5,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(late share, mean batch, share of requests past one batch) of one copy at each
    share in ``theta`` (module docstring).

    ``a`` and ``beta`` are the node's (the profile's divided by its speed).  The
    state is the queue ``q`` when a batch starts, up to ``batches * top``: the
    batch takes ``min(q, top)`` and the rest waits for the next, with what
    arrives meanwhile.  With ``batches == 1`` a request that does not fit the
    next batch is counted late; with more, it waits for the full batches ahead
    of it (up to ``batches + 1`` of them), which is how an objective's slack
    absorbs a burst past ``max_batch``: in time while the waits add up within
    ``L`` (the batches after the first are counted full, which only over-plans).
    A queue past ``batches * top`` is held there and every request that arrives
    while it is that long is counted late, so a copy that cannot keep up is
    never planned as one that can."""
    theta = np.atleast_1d(np.asarray(theta, dtype=float))
    top = max(1, min(int(max_batch), STATES))
    most = batches * top
    arrivals = Arrivals(cv, most)
    q = np.arange(1, most + 1)
    b = np.minimum(q, top).astype(float)
    carry = q - np.minimum(q, top)
    t = (a + beta * b)[None, :] / theta[:, None]  # (G, Q): wall time of the batch
    full = (a + beta * top) / theta[:, None, None]  # (G, 1, 1): a full batch
    rate = max(rate, 1e-9)
    pm = arrivals.counts(rate * t)  # (G, Q, most + 2): n = 0..most, then n > most
    # next queue: carry + arrivals (held at most); empty: idle, then a clump starts one
    start = arrivals.clump[1:].copy()
    start[-1] += max(0.0, 1.0 - arrivals.clump.sum())
    move = np.zeros((len(theta), most, most))
    move[:, :top, :] = pm[:, :top, :1] * start[None, None, :]
    move[:, :top, : most - 1] += pm[:, :top, 1:most]
    move[:, :top, most - 1] += pm[:, :top, most:].sum(axis=2)
    for i in range(top, most):
        c = int(carry[i])
        move[:, i, c - 1 : most - 1] = pm[:, i, : most - c]
        move[:, i, most - 1] += pm[:, i, most - c :].sum(axis=1)
    # a whiff of restarting from idle keeps the chain ergodic (evenly spaced arrivals
    # can otherwise lock it into one of several cycles)
    move = (1 - 1e-9) * move + 1e-9 * start
    system = np.swapaxes(move, 1, 2) - np.eye(most)[None]
    system[:, -1, :] = 1.0
    rhs = np.zeros((len(theta), most, 1))
    rhs[:, -1, 0] = 1.0
    pi = np.clip(np.linalg.solve(system, rhs)[..., 0], 0.0, None)
    pi /= pi.sum(axis=1, keepdims=True)
    # a request x into a batch with n others in the window: it is at a place uniform
    # among them, behind the carry; batch m (from 1) of the queue is its own
    others = arrivals.with_mates(pm)[:, :, : most + 1]  # more than most: late
    n = np.arange(most + 1)
    ahead = carry[:, None]  # (Q, 1)
    span = t[:, :, None]
    own = (a + beta * np.minimum(ahead + 1 + n[None, :], top)) / theta[:, None, None]
    frac = np.zeros((len(theta), most, most + 1))
    counted = np.zeros((most, most + 1))
    for m in range(1, batches + 2):
        upto = np.clip(m * top - ahead, 0, n[None, :] + 1)  # places in batches 1..m
        wait = own if m == 1 else m * full
        frac += (upto - counted) * np.clip((span + wait - slo_s) / span, 0.0, 1.0)
        if m == 1:
            past = ((n[None, :] + 1 - upto) / (n[None, :] + 1))[None] * others
        counted = upto
    frac = (frac + (n[None, :] + 1 - counted)) / (n[None, :] + 1)
    if batches > 1:
        frac[:, -1, :] = 1.0  # held: the queue may be longer still
    lost = np.maximum(1.0 - others.sum(axis=2), 0.0)
    late_during = rate * t * ((others * frac).sum(axis=2) + lost)
    spill = rate * t * (past.sum(axis=2) + lost)
    # a clump that ends an idle spell: its first top run at once, the rest one batch on
    clump = arrivals.mean_clump
    size = np.arange(1, most + 1)
    first = np.minimum(size, top)
    alone = t[:, first - 1]  # (G, X): its first batch
    late_alone = first * (alone > slo_s) + (size - first) * (alone + full[:, :, 0] > slo_s)
    idle_late = (start[None, :] * late_alone).sum(axis=1, keepdims=True) / clump
    idle = pm[:, :, 0] * (carry == 0) * clump
    per_cycle = rate * t + idle
    late_cycle = late_during + idle * idle_late
    arrived = (pi * per_cycle).sum(axis=1)
    share = (pi * late_cycle).sum(axis=1) / arrived
    if window_s > 0 and quantile > 0.5:
        share = _window_share(
            share, move, pi, per_cycle, late_cycle, t, idle, rate, window_s, quantile
        )
    return share, pi @ b, (pi * spill).sum(axis=1) / arrived


def _window_share(
    share: np.ndarray,
    move: np.ndarray,
    pi: np.ndarray,
    per_cycle: np.ndarray,
    late_cycle: np.ndarray,
    t: np.ndarray,
    idle: np.ndarray,
    rate: float,
    window_s: float,
    quantile: float,
) -> np.ndarray:
    """The long-run late share raised to what a window of ``window_s`` must allow: its
    late count ``K`` (mean ``mu``) may pass the ``floor(eps*n) + 1/2`` late requests
    the window's ``n`` arrivals allow (``eps = 1 - quantile``; the half is the
    continuity correction, which also makes a window of a few requests allow none)
    only with probability ``1 - quantile``, taken as ``mu + z*sd(K)``.  ``sd(K)``
    over the window's batch cycles is the chain's asymptotic variance ``2*pi(h Z h)
    - pi(h^2)`` of ``h`` = late less the long-run share of arrivals (``Z`` the
    fundamental matrix: a burst leaves a queue that takes batches to drain, so late
    requests come in runs) plus the late requests' own Poisson variance.  Returned
    scaled so that it is at most ``eps`` exactly when the window is planned for."""
    size = move.shape[1]
    centred = late_cycle - share[:, None] * per_cycle
    fundamental = np.eye(size)[None] - move + pi[:, None, :]
    zh = np.linalg.solve(fundamental, centred[..., None])[..., 0]
    variance = 2 * (pi * centred * zh).sum(axis=1) - (pi * centred * centred).sum(axis=1)
    per_one = np.maximum(variance + (pi * late_cycle).sum(axis=1), 0.0)
    cycle = (pi * (t + idle / rate)).sum(axis=1)  # a batch, and any idle spell after it
    eps, z = 1.0 - quantile, NormalDist().inv_cdf(quantile)
    arrivals = rate * window_s
    allowed = math.floor(eps * arrivals) + 0.5
    worst = share * arrivals + z * np.sqrt(per_one * window_s / cycle)
    return eps * worst / allowed


#: the most batches ahead of a request the chain follows (see :func:`assess`)
BATCHES = 4


def assess(
    theta: np.ndarray,
    rate: float,
    a: float,
    beta: float,
    max_batch: int,
    slo_s: float,
    headroom: Headroom,
) -> tuple[np.ndarray, np.ndarray]:
    """(late share of a window at the planned quantile, mean batch) at each share,
    exact enough to say which shares keep at most ``headroom.late`` late from the
    top down to the first that does not.

    The one-batch chain first; where the requests that miss a batch are what puts
    a share over the allowance, the chain that lets them wait for later batches (as
    many as the objective could hold, 2 to :data:`BATCHES`): from the fastest
    share down, and only until a share is late either way, since a need is the
    least share above which every share keeps its requests in time.  (The longer
    chain costs the cube of its length; run everywhere it would dominate.)"""
    theta = np.atleast_1d(np.asarray(theta, dtype=float))
    cv, allowed, window = headroom.cv, headroom.late, (headroom.window_s, headroom.quantile)
    late, batch, spill = chain(theta, rate, a, beta, max_batch, slo_s, cv, 1, *window)
    late, batch, spill = late.copy(), batch.copy(), spill.copy()
    # A share that cannot keep up even in full batches has a queue that only grows:
    # every request is late in the end.  The chain drops what overflows a batch (it
    # counts those requests late once), so under a lax quantile (half late allowed)
    # it would plan 400 req/s of 3 ms batches of one on a single node.
    overloaded = theta <= rate * (a / max(1, int(max_batch)) + beta)
    late[overloaded], spill[overloaded] = 1.0, 0.0
    top = max(1, min(int(max_batch), STATES))
    for i in np.argsort(-theta, kind="stable"):
        if late[i] <= allowed:
            continue
        if late[i] - spill[i] > allowed:
            break  # late whatever waits for a later batch
        share = theta[i : i + 1]
        batches = int(min(max(slo_s * float(share[0]) // (a + beta * top), 2), BATCHES))
        again, mean, _ = chain(share, rate, a, beta, max_batch, slo_s, cv, batches, *window)
        late[i], batch[i] = again[0], mean[0]
        if late[i] > allowed:
            break
    return late, batch


def node_time(
    rate: float, a: float, beta: float, mean_batch: np.ndarray, theta: np.ndarray
) -> np.ndarray:
    """Share of the node a copy keeps busy: ``r*(beta + a/mean_batch)``, at most ``theta``."""
    return np.minimum(rate * (beta + a / np.maximum(mean_batch, 1.0)), theta)
