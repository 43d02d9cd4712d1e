"""Lower bounds on the nodes any placement needs: the yardstick for the packer.

What is bounded: every placement :func:`cloud.placement.packing.check`
accepts that serves each model's whole rate.  Each node runs its copies once
per duty cycle ``d``; copy ``j`` of a model (rate ``r_j``, ``sum_j r_j = r``)
plans an integer batch ``b_j >= max(1, ceil(r_j*d))``, at most ``max_batch``,
within ``d + a + beta*b_j <= L``; the node's mean work per cycle fits it,
``sum_j (a + beta*r_j*d) <= d`` (headroom only adds to both).  Latencies are
the model's best profile's divided by the fastest node's speed, which only
lowers every figure below.  A node is one unit of time, so the nodes needed
are at least the sum over copies of their shares ``a/d + beta*r_j``.

Per copy the share falls as ``d`` grows, and the latency rule caps ``d``: the
longest cycle it allows, ``d_max`` (:func:`cloud.placement.sizing.longest_cycle`
with mean batches), gives the least share ``a/d_max + beta*r_j``.  Over ``k``
copies of a model the split of the rate is free, so three relaxations of the
cap are summed instead, each valid for any split:

* ``d*(1 + beta*r_j) <= L - a`` (batch at least ``r_j*d``):
  ``(k*a + a*beta*r)/(L - a) + beta*r``;
* ``d <= max_batch/r_j``: ``r*(a/max_batch + beta)``;
* ``d <= L - a - beta`` (batch at least one): ``k*a/(L - a - beta) + beta*r``;

the largest of the three holds, and each grows with ``k``, so ``k`` is the
fewest copies any placement can have: the most of ``min_copies``, one for a
model with traffic, and ``ceil(r / r_max)``, where
``r_max = min((L - 2a)/(beta*L), max_batch/(a + beta*max_batch))`` is the most
one copy serves (``a + beta*r*d <= d`` with ``d*(1 + beta*r) <= L - a`` gives
the first, ``r*d <= max_batch`` with ``d >= a/(1 - beta*r)`` the second).
DESIGN.md's ``r*beta*L/(L - a)`` is the first sum less its ``k*a`` term, so
these bounds are at least as tight.

Memory: each of those ``k`` copies holds the smallest profile's memory on its
own node (one copy of a model per node), and no node holds more than the
largest node's memory.

Models no placement can hold (no node runs a backend of theirs, too big, an
objective below ``2a + beta``: a cycle of at least ``a`` plus a batch of one)
add nothing; a model held to fewer
copies than its rate needs (``max_copies``, few nodes that run it) counts the
rate those copies can serve.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from cloud.placement.sizing import EPS, Headroom, longest_cycle
from cloud.placement.types import Bounds, LatencyProfile, ModelDemand, NodeSpec

MEANS = Headroom(quantile=0.5, cv=0.0)


def max_copy_rate(a: float, beta: float, max_batch: int, slo_s: float) -> float:
    """The most requests/s one copy can serve (continuous batches; see above)."""
    if slo_s <= 2 * a:
        return 0.0
    return min((slo_s - 2 * a) / (beta * slo_s), max_batch / (a + beta * max_batch))


def copy_share(a: float, beta: float, max_batch: int, rate: float, slo_s: float) -> float:
    """The least share of a node one copy serving ``rate`` can take (inf: none fits)."""
    d_max = longest_cycle(a, beta, max_batch, rate, slo_s, MEANS)
    if d_max <= 0:
        return math.inf
    return a / d_max + beta * rate


def model_share(p: LatencyProfile, rate: float, slo_s: float, speed: float, k: int) -> float:
    """The least share of a node ``k`` copies of a model together take."""
    a, beta, top = p.a_s / speed, p.beta_s / speed, p.max_batch
    if k == 1:
        return copy_share(a, beta, top, rate, slo_s)
    if slo_s - a - beta <= 0:
        return math.inf
    return max(
        (k * a + a * beta * rate) / (slo_s - a) + beta * rate,
        rate * (a / top + beta),
        k * a / (slo_s - a - beta) + beta * rate,
    )


def least_copies(demand: ModelDemand, usable: Sequence[LatencyProfile], speed: float) -> int:
    """The fewest copies any placement that serves the model fully holds."""
    if demand.rate <= 0 and demand.min_copies <= 0:
        return 0
    top = max(
        (max_copy_rate(p.a_s / speed, p.beta_s / speed, p.max_batch, demand.slo_s) for p in usable),
        default=0.0,
    )
    forced = math.ceil(demand.rate / top - EPS) if top > 0 else 1
    return max(1, demand.min_copies, forced)


def lower_bounds(models: Sequence[ModelDemand], nodes: Sequence[NodeSpec]) -> Bounds:
    """Compute and memory bounds, in nodes, for the models that can be placed at all.

    Valid for every placement that serves each model's rate (see the module
    docstring for the proof); a packer is graded by how close it comes."""
    compute, memory = bound_sums(models, nodes)
    return Bounds(math.ceil(compute - 1e-6), math.ceil(memory - 1e-9))


def bound_sums(models: Sequence[ModelDemand], nodes: Sequence[NodeSpec]) -> tuple[float, float]:
    """The two bounds before rounding up: node-shares of compute, nodes of memory."""
    if not nodes:
        return 0.0, 0.0
    speed = max(n.speed for n in nodes)
    largest = max(n.memory_bytes for n in nodes)
    alike: dict[tuple[int, frozenset[str]], int] = {}
    for n in nodes:
        alike[(n.memory_bytes, n.backends)] = alike.get((n.memory_bytes, n.backends), 0) + 1
    compute, memory = 0.0, 0
    for demand in models:
        usable = [
            p
            for p in demand.profiles
            if any(p.backend in b and p.memory_bytes <= m for m, b in alike)
            and demand.slo_s > (2 * p.a_s + p.beta_s) / speed
        ]
        k = least_copies(demand, usable, speed)
        if not usable or k == 0:
            continue
        runnable = sum(
            count
            for (m, b), count in alike.items()
            if any(p.backend in b and p.memory_bytes <= m for p in usable)
        )
        k = min(k, runnable, demand.max_copies or runnable)
        best = math.inf
        for p in usable:
            top = max_copy_rate(p.a_s / speed, p.beta_s / speed, p.max_batch, demand.slo_s)
            rate = min(demand.rate, k * top)
            best = min(best, model_share(p, rate, demand.slo_s, speed, k))
        if math.isfinite(best):
            compute += best
            memory += k * min(p.memory_bytes for p in usable)
    return compute, memory / largest
