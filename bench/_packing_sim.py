"""bench/packing.py part (b): a discrete-event simulation of a packed node as Ferry serves it.

A Ferry node that follows a placement runs one dynamic batcher per loaded
model (``cloud/batcher.py``) and lets one batch run at a time
(``cloud/workers.py``'s turnstile): a batcher with requests queued waits for
its turn in first-come order, and at its turn takes everything queued, up
to ``max_batch``, and runs it with the node to itself.  A batch's work is
``l(b) = a + beta*b`` (plus Gaussian noise of the profile's ``spread_s``,
when it has one).  A request is within its SLO when its batch finishes by
``arrival + L``.

Each copy gets its own arrival stream at its planned rate: Poisson, or a
Gamma renewal process with coefficient of variation ``cv`` (shape
``1/cv^2``), each copy as bursty as the model (a conservative split of a
model's traffic).  Nodes are independent, so each is simulated for as long as
its least busy copy needs to see ``requests`` arrivals, and at least the window
the objective is judged over (``Headroom.window_s``), at most 3,000 s: short
for the busy nodes, without starving the rare models.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left, bisect_right
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from cloud.placement.types import ModelDemand, NodeSpec, Placement


@dataclass
class Result:
    sent: dict[str, int] = field(default_factory=dict)
    within: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.sent.values())

    @property
    def overall(self) -> float:
        return sum(self.within.values()) / max(1, self.total)

    @property
    def fewest(self) -> int:
        return min(self.sent.values(), default=0)

    def worst(self) -> tuple[str, float]:
        shares = [(self.within[m] / n, m) for m, n in self.sent.items() if n]
        share, model = min(shares, default=(1.0, "-"))
        return model, share


def arrivals(rng: np.random.Generator, rate: float, cv: float, horizon: float) -> np.ndarray:
    """Arrival times in ``[0, horizon)`` of a renewal process with mean rate ``rate``."""
    if rate <= 0:
        return np.empty(0)
    expected = rate * horizon
    count = int(expected + 6 * np.sqrt(expected) * max(cv, 1.0) + 16)
    times = np.empty(0)
    start = rng.uniform(0, 1 / rate)  # a stationary-ish start, not a burst at 0
    while True:
        if cv == 1.0:
            gaps = rng.exponential(1 / rate, count)
        else:
            shape = 1 / (cv * cv)
            gaps = rng.gamma(shape, 1 / (rate * shape), count)
        more = start + np.cumsum(gaps)
        times = np.concatenate([times, more])
        if more[-1] >= horizon:
            return times[times < horizon]
        start = more[-1]


def simulate_node(
    rng: np.random.Generator,
    node: NodeSpec,
    copies: list[tuple[str, float, float, int, float, float, float]],
    cv: float,
    horizon: float,
    result: Result,
) -> None:
    """``copies``: (model, rate, slo, max_batch, a, beta, spread).

    Turns: a copy with requests queued waits for its turn in first-come order;
    at its turn it takes what is queued (up to its max batch) and runs it with
    the node to itself.  Events: the end of the batch running, or the first
    request of a copy with nothing queued."""
    streams = [arrivals(rng, rate, cv, horizon).tolist() for _, rate, *_ in copies]
    heads = [0] * len(copies)  # first request not yet in a batch
    within = [0] * len(copies)
    quiet = [(s[0], c) for c, s in enumerate(streams) if s]  # (next request, copy)
    heapq.heapify(quiet)
    waiting: deque[int] = deque()
    speed = node.speed
    running: tuple[float, int, int] | None = None  # (end, copy, first request)

    def turn(now: float) -> tuple[float, int, int] | None:
        if not waiting:
            return None
        c = waiting.popleft()
        _, _, _, top, a, beta, spread = copies[c]
        h = heads[c]
        end = min(bisect_right(streams[c], now, h), h + top)  # what is queued, up to max batch
        work = a + beta * (end - h)
        if spread > 0:
            work = max(work + float(rng.normal(0.0, spread)), 1e-9)
        heads[c] = end
        return (now + work / speed, c, h)

    while quiet or running is not None:
        done_at = running[0] if running is not None else math.inf
        if quiet and quiet[0][0] < done_at:
            now, c = heapq.heappop(quiet)
            waiting.append(c)
            if running is None:
                running = turn(now)
            continue
        assert running is not None
        now, c, h = running
        stream, e = streams[c], heads[c]
        within[c] += e - max(h, bisect_left(stream, now - copies[c][2], h, e))
        if e < len(stream) and stream[e] <= now:
            waiting.append(c)  # more came meanwhile: the back of the line
        elif e < len(stream):
            heapq.heappush(quiet, (stream[e], c))
        running = turn(now)
    for (model, *_), stream, good in zip(copies, streams, within, strict=True):
        result.sent[model] = result.sent.get(model, 0) + len(stream)
        result.within[model] = result.within.get(model, 0) + good


def simulate(
    placement: Placement,
    models: list[ModelDemand],
    nodes: list[NodeSpec],
    *,
    cv: float,
    quick: bool,
    seed: int,
    requests: int = 230,
    window_s: float = 60.0,
) -> Result:
    demands = {m.name: m for m in models}
    by_name = {n.name: n for n in nodes}
    rng = np.random.default_rng(seed)
    result = Result()
    want, shortest, longest = (40, 5.0, 60.0) if quick else (requests, window_s, 3000.0)
    for name in sorted(placement.nodes_used()):
        copies = []
        for copy in sorted(placement.on_node(name), key=lambda c: c.model):
            demand = demands[copy.model]
            profile = demand.profile_for(copy.backend)
            assert profile is not None
            copies.append(
                (
                    copy.model,
                    copy.rate,
                    demand.slo_s,
                    profile.max_batch,
                    profile.a_s,
                    profile.beta_s,
                    profile.spread_s,
                )
            )
        least = min(c[1] for c in copies)
        horizon = min(max(want / least if least > 0 else longest, shortest), longest)
        simulate_node(rng, by_name[name], copies, cv, horizon, result)
    return result
