"""Every invariant a placement must keep, checked from the copies as published.

Per node: memory, backends, one copy of a model per node, and that every copy
gets the share of the node its objective needs beside the others
(:func:`cloud.placement.sizing.occupancy`, sized again from the profiles at
the rate each copy carries, under the plan's :class:`Headroom`; the default
is :func:`cloud.placement.packing.place`'s); each batch within
``1..max_batch``.  Per model: min/max copies, the whole rate planned, and a
reason for every model not fully served.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from cloud.placement.demand import IDLE
from cloud.placement.sizing import EPS, Headroom, occupancy, size
from cloud.placement.types import Copy, ModelDemand, NodeSpec, Placement


def check(
    placement: Placement,
    models: Sequence[ModelDemand],
    nodes: Sequence[NodeSpec],
    headroom: Headroom | None = None,
) -> list[str]:
    """The invariants ``placement`` breaks, in words (empty when it is valid)."""
    headroom = headroom if headroom is not None else Headroom()
    problems: list[str] = []
    by_node = {n.name: n for n in nodes}
    demands = {m.name: m for m in models}
    per_node: dict[str, list[Copy]] = {}
    for copy in placement.copies:
        per_node.setdefault(copy.node, []).append(copy)
    for name in sorted(per_node):
        node = by_node.get(name)
        if node is None:
            problems.append(f"copies on unknown node {name}")
            continue
        problems.extend(_check_node(node, per_node[name], demands, headroom))
    for demand in sorted(models, key=lambda m: m.name):
        problems.extend(_check_model(demand, placement, nodes))
    for model in sorted(placement.models() - set(demands)):
        problems.append(f"copies of unknown model {model}")
    return problems


def _check_node(
    node: NodeSpec,
    copies: list[Copy],
    demands: dict[str, ModelDemand],
    headroom: Headroom,
) -> list[str]:
    problems: list[str] = []
    name = node.name
    held = [c.model for c in copies]
    for model in sorted({m for m in held if held.count(m) > 1}):
        problems.append(f"{name} holds {held.count(model)} copies of {model}")
    memory = 0
    slots = []
    for c in copies:
        demand = demands.get(c.model)
        profile = demand.profile_for(c.backend) if demand else None
        if c.backend not in node.backends:
            problems.append(f"{c.model} on {name}, which does not run {c.backend}")
        if demand is None or profile is None:
            if demand is not None:
                problems.append(f"{c.model} on {name}: no profile for backend {c.backend}")
            memory += c.memory_bytes
            continue
        memory += max(c.memory_bytes, profile.memory_bytes)
        if not 1 <= c.batch <= profile.max_batch:
            problems.append(f"{c.model} on {name}: batch {c.batch} outside 1..{profile.max_batch}")
        slot = size(profile, c.rate, demand.slo_s, node.speed, headroom)
        if slot.theta > 1:
            problems.append(
                f"{c.model} on {name}: {c.rate:.1f} req/s miss the SLO "
                f"{demand.slo_s * 1000:.1f} ms for over {headroom.late:.1%} of requests "
                f"even with the node to itself"
            )
            continue
        slots.append(slot)
    if memory > node.memory_bytes:
        problems.append(f"{name}: {memory} bytes placed, {node.memory_bytes} available")
    busy = occupancy(slots)
    if busy > 1 + EPS:
        problems.append(
            f"{name}: its copies need {busy:.1%} of the node for their objectives "
            f"({headroom.quantile:.0%} of requests in time)"
        )
    return problems


def _check_model(demand: ModelDemand, placement: Placement, nodes: Sequence[NodeSpec]) -> list[str]:
    copies = placement.copies_of(demand.name)
    count = len(copies)
    why = placement.unplaced.get(demand.name)
    if demand.max_copies and count > demand.max_copies:
        return [f"{demand.name}: {count} copies, max_copies {demand.max_copies}"]
    if why == IDLE:
        if count or demand.rate > 0 or demand.min_copies > 0:
            return [f"{demand.name}: marked idle with rate {demand.rate} and {count} copies"]
        return []
    if why is not None:
        return []  # not fully served, and the placement says why
    if count == 0:
        return [f"{demand.name} missing without a reason"]
    problems = []
    hosts = sum(
        1
        for n in nodes
        if any(
            p.backend in n.backends and p.memory_bytes <= n.memory_bytes for p in demand.profiles
        )
    )
    least = min(demand.min_copies, demand.max_copies or demand.min_copies, hosts)
    if count < least:
        problems.append(f"{demand.name}: {count} copies, min_copies {demand.min_copies}")
    planned = math.fsum(c.rate for c in copies)
    if planned < demand.rate * (1 - 1e-6) - 1e-9:
        problems.append(
            f"{demand.name}: {planned:.2f} of {demand.rate:.2f} req/s planned, no reason given"
        )
    return problems
