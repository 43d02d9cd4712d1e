"""bench/packing.py part (b): a discrete-event simulation of a packed schedule.

Each node runs the copies placed on it round-robin, work-conserving (as a
node's executor does): at its turn a copy takes what is queued, up to its max
batch, and runs it for ``l(b)/speed`` (plus Gaussian noise of the profile's
``spread_s``, when it has one); a copy with an empty queue is skipped, and an
idle node waits for the next arrival.  A request is within its SLO when its
batch finishes by ``arrival + L``.

Each copy gets its own arrival stream at its planned rate: Poisson, or a
Gamma renewal process with coefficient of variation ``cv`` (shape
``1/cv^2``), each copy as bursty as the model (a conservative split of a
model's traffic).  Nodes are independent, so each is simulated for as long as
its least busy copy needs to see ``requests`` arrivals (clamped), which keeps
the run short without starving the rare models.
"""

from __future__ import annotations

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
    """``copies``: (model, rate, slo, max_batch, a, beta, spread) in round-robin order."""
    streams = [arrivals(rng, rate, cv, horizon).tolist() for _, rate, *_ in copies]
    heads = [0] * len(copies)
    within = [0] * len(copies)
    count = len(copies)
    now, turn = 0.0, 0
    while True:
        for step in range(count):
            c = (turn + step) % count
            h = heads[c]
            if h < len(streams[c]) and streams[c][h] <= now:
                break
        else:
            waiting = [s[h] for s, h in zip(streams, heads, strict=True) if h < len(s)]
            if not waiting:
                break
            now = min(waiting)
            continue
        _, _, slo, top, a, beta, spread = copies[c]
        stream = streams[c]
        end = min(bisect_right(stream, now, h), h + top)  # what is queued, up to max batch
        took = (a + beta * (end - h)) / node.speed
        if spread > 0:
            took = max(took + float(rng.normal(0.0, spread)), 0.0)
        now += took
        within[c] += end - max(h, bisect_left(stream, now - slo, h, end))
        heads[c] = end
        turn = c + 1
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
) -> Result:
    demands = {m.name: m for m in models}
    by_name = {n.name: n for n in nodes}
    rng = np.random.default_rng(seed)
    result = Result()
    want, shortest, longest = (40, 5.0, 60.0) if quick else (requests, 20.0, 3000.0)
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
