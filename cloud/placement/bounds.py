"""Lower bounds on the nodes any placement needs: the yardstick for the packer.

Compute.  A copy of a model with ``l(b) = a + beta*b`` (on the fastest node,
divided by its speed) that serves rate ``r`` in a duty cycle ``d`` must meet
``d + a + beta*r*d <= L`` (its batch is at least ``r*d``), so
``d <= (L - a)/(1 + beta*r)``, and it keeps the node busy for the share
``(a + beta*r*d)/d = a/d + beta*r >= (a + beta*r*L)/(L - a)``.  Split into
``k`` copies the shares add up to ``(k*a + a*beta*r)/(L - a) + beta*r``, which
grows with ``k``; so every model needs at least its one-copy share (its
``min_copies``-copy share when that is more), whatever the packing, and the
nodes needed are at least the ceiling of the sum.  This is DESIGN.md's bound
``r*beta*L/(L - a)`` plus the batch overhead every copy pays, so it is the
tighter of the two, and still a bound: it ignores integer batches and the
headroom for bursts, which only add.

Memory.  Every model needs at least ``max(min_copies, copies its rate forces)``
copies (one node serves at most ``B/l(B)`` requests/s, ``B`` its best batch),
each holding its memory, on nodes of at most the largest memory.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from cloud.placement.types import Bounds, LatencyProfile, ModelDemand, NodeSpec


def _share(p: LatencyProfile, rate: float, slo_s: float, speed: float, copies: int) -> float:
    a, beta = p.a_s / speed, p.beta_s / speed
    if slo_s <= a:
        return math.inf
    return (copies * a + a * beta * rate) / (slo_s - a) + beta * rate


def _max_rate(p: LatencyProfile, slo_s: float, speed: float) -> float:
    a, beta = p.a_s / speed, p.beta_s / speed
    best = min(p.max_batch, math.floor((slo_s / 2 - a) / beta + 1e-9))
    return best / (a + beta * best) if best >= 1 else 0.0


def required_copies(demand: ModelDemand, speed: float, runnable: int) -> int:
    """Copies every placement holds: at least one per ``min_copies`` and as many as its
    rate forces, but never more than the nodes that run it or ``max_copies``."""
    if demand.rate <= 0 and demand.min_copies == 0:
        return 0
    top = max((_max_rate(p, demand.slo_s, speed) for p in demand.profiles), default=0.0)
    forced = math.ceil(demand.rate / top - 1e-9) if top > 0 else 1
    return min(max(1, demand.min_copies, forced), runnable, demand.max_copies or runnable)


def lower_bounds(models: Sequence[ModelDemand], nodes: Sequence[NodeSpec]) -> Bounds:
    """Compute and memory bounds, in nodes, over the models that can be placed."""
    if not nodes:
        return Bounds(0, 0)
    speed = max(n.speed for n in nodes)
    largest = max(n.memory_bytes for n in nodes)
    backends = set().union(*(n.backends for n in nodes))
    compute, memory = 0.0, 0
    for demand in models:
        usable = [p for p in demand.profiles if p.backend in backends]
        runnable = sum(1 for n in nodes if any(p.backend in n.backends for p in usable))
        copies = required_copies(demand, speed, runnable)
        if not usable or copies == 0:
            continue
        share = min(_share(p, demand.rate, demand.slo_s, speed, copies) for p in usable)
        if math.isinf(share) or min(p.memory_bytes for p in usable) > largest:
            continue  # cannot be placed at all: it adds nothing to either bound
        compute += share
        memory += copies * min(p.memory_bytes for p in usable)
    return Bounds(math.ceil(compute - 1e-9), math.ceil(memory / largest - 1e-9) if largest else 0)
