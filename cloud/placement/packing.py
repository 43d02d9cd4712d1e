"""Batching-aware bin packing of model copies onto nodes (pure; no I/O).

``place`` turns each model's demand into copies (whole-node copies for a hot
model at its best batch, one shared copy for the rest, at least
``min_copies``), then packs the copies onto as few nodes as it can: copies in
decreasing order of the share of a node they take, each onto the used node it
fills best (ties: fewest models, then most free memory, ModelMesh's order),
checking memory, backend, one copy per node and the shared duty cycle
(:mod:`cloud.placement.sizing`).  A pass then tries to empty the emptiest
nodes into the others, and small instances are finished by exact search.

Given the placement in force, every copy that is still feasible stays where
it is and only the rest is packed, so a rate change or a node leaving moves
few models, and the same input gives back the same placement.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from cloud.placement.bounds import lower_bounds
from cloud.placement.sizing import Headroom, Sizing, node_cycle, saturated_rate, size_copy
from cloud.placement.types import Copy, LatencyProfile, ModelDemand, NodeSpec, Placement

#: the emptiest nodes the improvement pass tries to empty, per round
EMPTY_TRIES = 8
#: instances up to this many copies are finished by exact search
EXACT_MAX_COPIES = 7

__all__ = ["Headroom", "Move", "check", "lower_bounds", "moves", "optimal_nodes", "place"]


@dataclass(frozen=True)
class Move:
    op: str  # "load" | "unload"
    model: str
    node: str


@dataclass
class _Item:
    """A copy waiting for a node: its model, the share of the model's rate it serves."""

    demand: ModelDemand
    rate: float
    index: int  # which copy of the model
    alone: float = 0.0  # occupancy on a speed-1 node by itself (sort key)
    memory: int = 0

    @property
    def key(self) -> tuple[str, int]:
        return (self.demand.name, self.index)


@dataclass
class _Bin:
    node: NodeSpec
    items: list[tuple[_Item, Sizing]] = field(default_factory=list)
    memory: int = 0
    occupancy: float = 0.0

    def models(self) -> set[str]:
        return {i.demand.name for i, _ in self.items}


class _Packer:
    def __init__(self, nodes: Sequence[NodeSpec], headroom: Headroom) -> None:
        self.nodes = sorted(nodes, key=lambda n: n.name)
        self.headroom = headroom
        self.bins: dict[str, _Bin] = {n.name: _Bin(n) for n in self.nodes}

    def profile_on(self, item: _Item, node: NodeSpec) -> LatencyProfile | None:
        """The allowed profile this node runs with the least time per request."""
        usable = [p for p in item.demand.profiles if p.backend in node.backends]
        if not usable:
            return None
        return min(usable, key=lambda p: (p.latency(max(1, p.max_batch)) / p.max_batch, p.a_s))

    def try_fit(self, item: _Item, bin_: _Bin) -> tuple[Sizing, float, float] | None:
        """(sizing, new occupancy, duty cycle) of ``item`` added to ``bin_``, or None."""
        node = bin_.node
        if item.demand.name in bin_.models():
            return None
        profile = self.profile_on(item, node)
        if profile is None or bin_.memory + profile.memory_bytes > node.memory_bytes:
            return None
        sizing = size_copy(profile, item.rate, item.demand.slo_s, node.speed, self.headroom)
        if sizing.d_max <= 0:
            return None
        cycle = node_cycle([s for _, s in bin_.items] + [sizing], self.headroom)
        if cycle is None:
            return None
        return sizing, cycle[1], cycle[0]

    def add(self, item: _Item, bin_: _Bin, sizing: Sizing, occupancy: float) -> None:
        bin_.items.append((item, sizing))
        bin_.memory += sizing.profile.memory_bytes
        bin_.occupancy = occupancy

    def remove(self, bin_: _Bin, key: tuple[str, int]) -> None:
        bin_.items = [(i, s) for i, s in bin_.items if i.key != key]
        bin_.memory = sum(s.profile.memory_bytes for _, s in bin_.items)
        cycle = node_cycle([s for _, s in bin_.items], self.headroom)
        bin_.occupancy = cycle[1] if cycle else 0.0

    def best_fit(self, item: _Item, used_only: bool) -> bool:
        best: tuple[tuple, _Bin, Sizing, float] | None = None
        for bin_ in self.bins.values():
            if used_only and not bin_.items:
                continue
            fit = self.try_fit(item, bin_)
            if fit is None:
                continue
            sizing, occupancy, _ = fit
            free = bin_.node.memory_bytes - bin_.memory
            rank = (
                0 if bin_.items else 1,  # a used node before a new one
                -occupancy if bin_.items else -bin_.node.memory_bytes * bin_.node.speed,
                len(bin_.items),
                -free,
                bin_.node.name,
            )
            if best is None or rank < best[0]:
                best = (rank, bin_, sizing, occupancy)
        if best is None:
            return False
        self.add(item, best[1], best[2], best[3])
        return True

    def used(self) -> list[_Bin]:
        return [b for b in self.bins.values() if b.items]

    def empty_small_nodes(self) -> None:
        """Try to move every copy of the emptiest node onto other used nodes."""
        improved = True
        while improved:
            improved = False
            emptiest = sorted(self.used(), key=lambda b: (b.occupancy, b.node.name))
            for victim in emptiest[:EMPTY_TRIES]:
                moved = list(victim.items)
                victim.items, victim.memory, victim.occupancy = [], 0, 0.0
                placed: list[tuple[_Item, _Bin]] = []
                for item, _ in sorted(moved, key=lambda x: (-x[0].alone, x[0].key)):
                    if self.best_fit(item, used_only=True):
                        placed.append((item, self._where(item)))
                    else:
                        break
                if len(placed) == len(moved):
                    improved = True
                    break
                for item, bin_ in placed:  # undo
                    self.remove(bin_, item.key)
                for item, _ in moved:
                    fit = self.try_fit(item, victim)
                    assert fit is not None
                    self.add(item, victim, fit[0], fit[1])

    def _where(self, item: _Item) -> _Bin:
        return next(b for b in self.bins.values() if any(i.key == item.key for i, _ in b.items))


def _split(
    demand: ModelDemand, nodes: Sequence[NodeSpec], headroom: Headroom
) -> tuple[list[_Item], str | None]:
    """The copies of one model, or why it cannot be placed."""
    runnable = [n for n in nodes if any(p.backend in n.backends for p in demand.profiles)]
    if not demand.profiles:
        return [], "no latency profile (run ferry-cloud tune)"
    if not runnable:
        wanted = ", ".join(sorted({p.backend for p in demand.profiles}))
        return [], f"no node runs backend {wanted}"
    if demand.rate <= 0 and demand.min_copies == 0:
        return [], "idle"
    smallest = min(p.memory_bytes for p in demand.profiles)
    largest = max(n.memory_bytes for n in runnable)
    if smallest > largest:
        return [], (
            f"needs {smallest / (1 << 20):.0f} MiB, the largest node offers "
            f"{largest / (1 << 20):.0f} MiB"
        )
    fastest = max(n.speed for n in runnable)
    best_rate, best_profile = 0.0, None
    for p in demand.profiles:
        rate, _ = saturated_rate(p, demand.slo_s, fastest, headroom)
        if rate > best_rate:
            best_rate, best_profile = rate, p
    if best_profile is None:
        p = min(demand.profiles, key=lambda q: q.a_s + q.beta_s)
        return [], (
            f"latency objective {demand.slo_s * 1000:.0f} ms is below twice the batch-1 "
            f"latency ({2 * p.latency(1, fastest) * 1000:.1f} ms)"
        )
    # whole-node copies at the saturated rate (a little under it: batches are integers)
    full_rate = best_rate * 0.98
    cap = min(len(runnable), demand.max_copies or len(runnable))
    full = int(demand.rate // full_rate) if full_rate > 0 else 0
    rest = demand.rate - full * full_rate
    rates = [full_rate] * full + ([rest] if rest > 1e-9 or full == 0 else [])
    want = max(demand.min_copies, len(rates))
    if want > len(rates):  # spread over min_copies copies evenly
        rates = [demand.rate / want] * want
    note = None
    if len(rates) > cap:  # capped: every copy at full load, the rest unserved
        rates = [min(full_rate, demand.rate / cap)] * cap
        served = sum(rates)
        if served + 1e-9 < demand.rate:
            note = (
                f"{served:.1f} of {demand.rate:.1f} req/s placed: at most {cap} copies "
                "(max_copies or the nodes that run it)"
            )
    memory = smallest
    items = []
    for index, rate in enumerate(rates):
        alone_profile = min(demand.profiles, key=lambda p: p.latency(1) + p.beta_s)
        sizing = size_copy(alone_profile, rate, demand.slo_s, 1.0, headroom)
        cycle = node_cycle([sizing], headroom) if sizing.d_max > 0 else None
        items.append(_Item(demand, rate, index, cycle[1] if cycle else 1.0, memory))
    return items, note


def place(
    models: Sequence[ModelDemand],
    nodes: Sequence[NodeSpec],
    previous: Placement | None = None,
    *,
    headroom: Headroom | None = None,
) -> Placement:
    """Copies of every model on nodes; see the module docstring."""
    headroom = headroom or Headroom()
    packer = _Packer(nodes, headroom)
    unplaced: dict[str, str] = {}
    items: list[_Item] = []
    for demand in sorted(models, key=lambda m: m.name):
        copies, why = _split(demand, packer.nodes, headroom)
        if why is not None:
            unplaced[demand.name] = why  # with copies: a partial placement, and why
        items.extend(copies)
    pending = _keep_previous(packer, items, previous)
    pending.sort(key=lambda i: (-i.alone, -i.memory, i.key))
    short: dict[str, int] = {}
    for item in pending:
        if not packer.best_fit(item, used_only=False):
            short[item.demand.name] = short.get(item.demand.name, 0) + 1
    wanted = {}
    for item in items:
        wanted[item.demand.name] = wanted.get(item.demand.name, 0) + 1
    for name, missing in sorted(short.items()):
        got = wanted[name] - missing
        unplaced[name] = (
            f"no room: every node that runs it is full ({len(nodes)} nodes)"
            if got == 0
            else f"{got} of {wanted[name]} copies placed: no room for the rest"
        )
    if previous is None or not previous.copies:
        packer.empty_small_nodes()
        if len(items) <= EXACT_MAX_COPIES and not short:
            _exact_into(packer, items)
    copies = []
    for bin_ in sorted(packer.used(), key=lambda b: b.node.name):
        cycle = node_cycle([s for _, s in bin_.items], headroom)
        assert cycle is not None
        d = math.floor(cycle[0] * 1e6) / 1e6  # published in us, never above the bound
        for item, sizing in sorted(bin_.items, key=lambda x: x[0].key):
            batch = sizing.batch_at(d, headroom)
            copies.append(
                Copy(
                    model=item.demand.name,
                    node=bin_.node.name,
                    backend=sizing.profile.backend,
                    rate=round(item.rate, 6),
                    batch=batch,
                    duty_cycle_s=d,
                    occupancy=round(sizing.latency(batch) / d, 6),
                    memory_bytes=sizing.profile.memory_bytes,
                    threads=sizing.profile.threads,
                )
            )
    copies.sort(key=lambda c: (c.model, c.node))
    bounds = lower_bounds(models, nodes)
    generation = previous.generation if previous is not None else 0
    result = Placement(tuple(copies), dict(sorted(unplaced.items())), generation, bounds)
    if previous is None or result.copies != previous.copies or result.unplaced != previous.unplaced:
        result = Placement(result.copies, result.unplaced, generation + 1, bounds)
    return result


def _keep_previous(packer: _Packer, items: list[_Item], previous: Placement | None) -> list[_Item]:
    """Put each model's copies back on the nodes that hold them now where they still
    fit; the rest is returned for packing."""
    if previous is None:
        return list(items)
    held: dict[str, list[str]] = {}
    for copy in previous.copies:
        held.setdefault(copy.model, []).append(copy.node)
    pending = []
    for item in sorted(items, key=lambda i: i.key):
        homes = sorted(held.get(item.demand.name, ()))
        bin_ = packer.bins.get(homes[item.index]) if item.index < len(homes) else None
        fit = packer.try_fit(item, bin_) if bin_ is not None else None
        if bin_ is not None and fit is not None:
            packer.add(item, bin_, fit[0], fit[1])
        else:
            pending.append(item)
    return pending


def _exact_into(packer: _Packer, items: list[_Item]) -> None:
    """Replace the packing by one on the fewest nodes (exhaustive; small instances)."""
    best = _search(packer, items, len(packer.used()) - 1)
    if best is None:
        return
    for bin_ in packer.bins.values():
        bin_.items, bin_.memory, bin_.occupancy = [], 0, 0.0
    for item, name in best:
        bin_ = packer.bins[name]
        fit = packer.try_fit(item, bin_)
        assert fit is not None
        packer.add(item, bin_, fit[0], fit[1])


def _search(packer: _Packer, items: list[_Item], limit: int) -> list[tuple[_Item, str]] | None:
    """An assignment onto at most ``limit`` nodes, fewest first, or None."""
    if limit < 1 or not items:
        return None
    for count in range(1, limit + 1):
        scratch = _Packer(packer.nodes, packer.headroom)
        order = sorted(items, key=lambda i: (-i.alone, i.key))
        found = _assign(scratch, order, 0, count, [])
        if found is not None:
            return found
    return None


def _assign(
    packer: _Packer, order: list[_Item], i: int, limit: int, chosen: list[tuple[_Item, str]]
) -> list[tuple[_Item, str]] | None:
    if i == len(order):
        return list(chosen)
    item = order[i]
    opened = [b for b in packer.bins.values() if b.items]
    candidates = list(opened)
    if len(opened) < limit:
        # distinct empty nodes matter only when nodes differ
        seen: set[tuple] = set()
        for b in packer.bins.values():
            if b.items:
                continue
            kind = (b.node.memory_bytes, b.node.backends, b.node.speed)
            if kind not in seen:
                seen.add(kind)
                candidates.append(b)
    for bin_ in candidates:
        fit = packer.try_fit(item, bin_)
        if fit is None:
            continue
        packer.add(item, bin_, fit[0], fit[1])
        chosen.append((item, bin_.node.name))
        found = _assign(packer, order, i + 1, limit, chosen)
        chosen.pop()
        packer.remove(bin_, item.key)
        if found is not None:
            return found
    return None


def optimal_nodes(models: Sequence[ModelDemand], nodes: Sequence[NodeSpec]) -> int | None:
    """The fewest nodes any assignment of the same copies needs (exhaustive: keep the
    instance small), or None when they fit on no set of these nodes."""
    headroom = Headroom()
    packer = _Packer(nodes, headroom)
    items: list[_Item] = []
    for demand in models:
        copies, _ = _split(demand, packer.nodes, headroom)
        items.extend(copies)
    if not items:
        return 0
    found = _search(packer, items, len(packer.nodes))
    return None if found is None else len({name for _, name in found})


def moves(old: Placement, new: Placement) -> list[Move]:
    before = {(c.model, c.node) for c in old.copies}
    after = {(c.model, c.node) for c in new.copies}
    loads = [Move("load", m, n) for m, n in sorted(after - before)]
    unloads = [Move("unload", m, n) for m, n in sorted(before - after)]
    return loads + unloads


def check(
    placement: Placement,
    models: Sequence[ModelDemand],
    nodes: Sequence[NodeSpec],
    headroom: Headroom | None = None,
) -> list[str]:
    """Every invariant the placement breaks (empty when it is valid)."""
    headroom = headroom or Headroom()
    problems: list[str] = []
    by_node = {n.name: n for n in nodes}
    demands = {m.name: m for m in models}
    per_node: dict[str, list[Copy]] = {}
    for copy in placement.copies:
        per_node.setdefault(copy.node, []).append(copy)
        if copy.node not in by_node:
            problems.append(f"{copy.model} on unknown node {copy.node}")
        elif copy.backend not in by_node[copy.node].backends:
            problems.append(f"{copy.model} on {copy.node}, which lacks {copy.backend}")
        if copy.model not in demands:
            problems.append(f"copy of unknown model {copy.model}")
    for name, copies in per_node.items():
        node = by_node.get(name)
        if node is None:
            continue
        models_here = [c.model for c in copies]
        if len(set(models_here)) != len(models_here):
            problems.append(f"{name} holds two copies of one model")
        memory = sum(c.memory_bytes for c in copies)
        if memory > node.memory_bytes:
            problems.append(f"{name}: {memory} bytes placed, {node.memory_bytes} available")
        sizings = []
        for c in copies:
            demand = demands.get(c.model)
            profile = demand.profile_for(c.backend) if demand else None
            if profile is None or demand is None:
                continue
            sizings.append(size_copy(profile, c.rate, demand.slo_s, node.speed, headroom))
            d = c.duty_cycle_s
            if d + profile.latency(c.batch, node.speed) > demand.slo_s * (1 + 1e-6):
                problems.append(f"{c.model} on {name}: cycle + batch exceeds its objective")
        if node_cycle(sizings, headroom) is None:
            problems.append(f"{name}: its copies do not fit one duty cycle")
    for demand in models:
        count = len(placement.copies_of(demand.name))
        if demand.name in placement.unplaced:
            if count and " placed" not in placement.unplaced[demand.name]:
                problems.append(f"{demand.name} both placed and unplaced")
            continue
        if count == 0:
            problems.append(f"{demand.name} missing without a reason")
        runnable = sum(1 for n in nodes if any(p.backend in n.backends for p in demand.profiles))
        if count < min(demand.min_copies, runnable, demand.max_copies or runnable):
            problems.append(f"{demand.name}: {count} copies, min_copies {demand.min_copies}")
        if demand.max_copies and count > demand.max_copies:
            problems.append(f"{demand.name}: {count} copies, max_copies {demand.max_copies}")
        placed_rate = sum(c.rate for c in placement.copies_of(demand.name))
        if placed_rate + 1e-6 < demand.rate and count < (demand.max_copies or runnable):
            problems.append(f"{demand.name}: {placed_rate:.2f} of {demand.rate:.2f} req/s placed")
    return problems
