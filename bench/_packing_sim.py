"""bench/packing.py part (b): a discrete-event simulation of a packed node as Ferry serves it.

A Ferry node runs one dynamic batcher per loaded model (``cloud/batcher.py``),
each with one session: when its session is free a batcher dispatches all
that is queued, up to ``max_batch``, at once, and when nothing is queued the
next request starts a batch of its own (dispatch at idle: a queue delay is
only waited while a batch runs, and with one session nothing else can run
then).  Batches of different models run at the same time in their own worker
threads and share the node's cores: each of ``n`` batches in flight advances
at ``speed/n`` (processor sharing, work-conserving: the cores never idle while
a batch is in flight).  A batch's work is ``l(b) = a + beta*b`` (plus Gaussian
noise of the profile's ``spread_s``, when it has one).  A request is within
its SLO when its batch finishes by ``arrival + L``.

Each copy gets its own arrival stream at its planned rate: Poisson, or a
Gamma renewal process with coefficient of variation ``cv`` (shape
``1/cv^2``), each copy as bursty as the model (a conservative split of a
model's traffic).  Nodes are independent, so each is simulated for as long as
its least busy copy needs to see ``requests`` arrivals, and at least the window
the objective is judged over (``Headroom.window_s``), at most 3,000 s: short
for the busy nodes, without starving the rare models.

Not modelled: a lone batch on a node of two cores with one intra-op thread
per session (``cloud/loading.py`` gives each of several sessions
``cores // sessions`` threads) uses one core, not the node; profiles measured
with the threads a node gives each session make that exact.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left, bisect_right
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

    Processor sharing by virtual time: every batch in flight advances at the same
    rate, so one that starts when the shared clock reads ``V`` with work ``w``
    ends when it reads ``V + w``; the clock runs at ``speed/n`` with ``n`` in
    flight.  Events: the earliest end, or a request for an idle copy."""
    streams = [arrivals(rng, rate, cv, horizon).tolist() for _, rate, *_ in copies]
    heads = [0] * len(copies)  # first request not yet in a batch
    starts = [0] * len(copies)  # first request of the batch in flight
    within = [0] * len(copies)
    idle = [(s[0], c) for c, s in enumerate(streams) if s]
    heapq.heapify(idle)
    running: list[tuple[float, int]] = []  # (virtual end, copy)
    clock = now = 0.0
    speed = node.speed

    def dispatch(c: int) -> None:
        _, _, _, top, a, beta, spread = copies[c]
        h = heads[c]
        end = min(bisect_right(streams[c], now, h), h + top)  # what is queued, up to max batch
        work = a + beta * (end - h)
        if spread > 0:
            work = max(work + float(rng.normal(0.0, spread)), 1e-9)
        starts[c], heads[c] = h, end
        heapq.heappush(running, (clock + work, c))

    while idle or running:
        done_at = now + (running[0][0] - clock) * len(running) / speed if running else math.inf
        if idle and idle[0][0] < done_at:
            when, c = heapq.heappop(idle)
            if running:
                clock += (when - now) * speed / len(running)
            now = when
            dispatch(c)
            continue
        clock, c = heapq.heappop(running)
        now = done_at
        stream, h, e = streams[c], starts[c], heads[c]
        within[c] += e - max(h, bisect_left(stream, now - copies[c][2], h, e))
        if e < len(stream) and stream[e] <= now:
            dispatch(c)
        elif e < len(stream):
            heapq.heappush(idle, (stream[e], c))
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
