"""Batching-aware bin packing of model copies onto shared nodes (pure; no I/O).

``place`` turns each model's demand into copies (:mod:`cloud.placement.demand`:
whole-node copies for a hot model, one shared copy for the rest, at least
``min_copies``) and packs them onto as few nodes as it can
(:mod:`cloud.placement.bins`).  No single greedy order wins everywhere -
increasing objective keeps copies with like objectives together (the
copies on a node take turns, and the cycle of turns is as short as the
tightest objective there asks), decreasing size avoids fragments,
decreasing memory wins when memory binds - so a few orders are run and the
packing on the fewest nodes is kept (ties: the lowest peak occupancy),
after a pass that tries to empty the emptiest nodes and one
that evens the load.  Small instances are finished by exact search
(:mod:`cloud.placement.exact`).

Given the placement in force, every copy that still fits stays on its node
and only the rest is packed, so a change of rates or nodes moves few models;
the same input gives back an equal placement, and the generation only grows
when something changed.  The fresh packing is the yardstick: when keeping
copies in place costs more than a tenth more nodes (or leaves copies out
that a fresh packing holds), the emptiest nodes are emptied or the fresh
packing is taken.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from cloud.placement.bins import FAST, FULLEST, MARGINAL, SMALL, Packer
from cloud.placement.bounds import lower_bounds
from cloud.placement.checks import check
from cloud.placement.demand import Item, kinds, split
from cloud.placement.exact import rebuild, search
from cloud.placement.sizing import Headroom, together
from cloud.placement.turns import work_in
from cloud.placement.types import Copy, ModelDemand, NodeSpec, Placement

__all__ = [
    "Headroom",
    "Move",
    "check",
    "lower_bounds",
    "moves",
    "optimal_nodes",
    "place",
]

#: instances this small are finished by exact search
EXACT_MAX_COPIES = 8
EXACT_MAX_NODES = 8


@dataclass(frozen=True)
class Move:
    """One change a node makes to follow a new placement."""

    op: str  # "load" | "unload"
    model: str
    node: str


def _by_size(item: Item) -> tuple:
    return (-item.floor, -item.memory, item.key)


def _by_need(item: Item) -> tuple:
    return (-item.alone, -item.floor, item.key)


def _by_objective(item: Item) -> tuple:
    """Shortest objective first: copies with like objectives share a node's cycle,
    and a cycle is as short as the tightest objective on the node asks."""
    return (item.demand.slo_s, -item.floor, item.key)


def _objective_band(ratio: float) -> Callable[[Item], tuple]:
    """Objectives within a factor ``ratio`` of each other as one band, biggest copies
    first within it: a band's copies share cycles as well as equal objectives
    do, and big copies first leave small ones to fill the gaps."""
    step = math.log(ratio)

    def order(item: Item) -> tuple:
        return (math.floor(math.log(item.demand.slo_s) / step), -item.floor, item.key)

    return order


def _big_then_need(item: Item) -> tuple:
    return (0, *_by_size(item)) if item.floor >= 0.5 else (1, *_by_need(item))


def _by_memory(item: Item) -> tuple:
    return (-item.memory, -item.floor, item.key)


#: (order, how to choose a node, which profile to prefer)
VARIANTS: tuple[tuple[Callable[[Item], tuple], str, str], ...] = (
    (_by_objective, MARGINAL, FAST),
    (_objective_band(1.3), MARGINAL, FAST),
    (_objective_band(1.15), MARGINAL, FAST),
    (_by_memory, FULLEST, SMALL),
    (_big_then_need, MARGINAL, FAST),
)


def place(
    models: Sequence[ModelDemand],
    nodes: Sequence[NodeSpec],
    previous: Placement | None = None,
    *,
    headroom: Headroom | None = None,
) -> Placement:
    """Copies of every model on ``nodes``, fewest nodes first; see the module docstring.

    Never raises for an infeasible fleet: what cannot be placed is in
    ``unplaced`` with the reason, including models only partly served."""
    headroom = headroom if headroom is not None else Headroom()
    fleet = sorted({n.name: n for n in nodes}.values(), key=lambda n: n.name)
    demands = sorted({m.name: m for m in models}.values(), key=lambda m: m.name)
    items: list[Item] = []
    notes: dict[str, str] = {}
    alike = kinds(fleet)
    where: dict[str, list[tuple[NodeSpec, int]]] = {}  # the nodes each model may go to
    # Models asking more than every node they can run on serves: their copies go in
    # last, into the room the others leave (first, their whole-node copies took every
    # node, and the models that fit went unserved)
    over: set[str] = set()
    for demand in demands:
        if demand.avoid:  # the nodes it failed to load on are not where it can go
            usable = [n for n in fleet if n.name not in demand.avoid]
            where[demand.name] = kinds(usable)
            copies, why = split(demand, where[demand.name], headroom)
            if not copies or why is not None:
                failed = f"failed to load on {', '.join(sorted(demand.avoid))}"
                why = failed if why is None or not usable else f"{failed}; {why}"
        else:
            where[demand.name] = alike
            copies, why = split(demand, alike, headroom)
        if _past_reach(demand, copies, where[demand.name], headroom):
            over.add(demand.name)
        items.extend(copies)
        if why is not None:
            notes[demand.name] = why
    bounds = lower_bounds(demands, fleet, headroom)
    first = [item for item in items if item.name not in over]
    last = [item for item in items if item.name in over]
    packer, short = _fresh(first, fleet, bounds.nodes)
    if last:  # (ending as the incremental packing ends: a fixed point)
        short = _make_room(packer, short + last, fleet)
    if previous is not None and previous.copies:
        # (the copies of every model stay where they fit, those past the fleet's reach
        # too: where that leaves more out than the fresh packing, the fresh one is kept)
        kept, kept_short, held = _incremental(items, fleet, previous)
        if held == 0:  # nothing of the old placement survives: nothing to keep stable
            kept, kept_short = packer, short
        kept_short = _make_room(kept, kept_short, fleet)
        if len(kept_short) <= len(short):
            used, best = len(kept.used()), len(packer.used())
            if used > best + max(1, math.ceil(0.1 * best)):
                kept.empty_nodes(tries=len(fleet))
            packer, short = kept, kept_short
    wanted: dict[str, int] = {}
    planned: dict[str, float] = {}
    for item in items:
        wanted[item.name] = wanted.get(item.name, 0) + 1
        planned[item.name] = planned.get(item.name, 0.0) + item.rate
    missing: dict[str, int] = {}
    for item in short:
        missing[item.name] = missing.get(item.name, 0) + 1
    squeezed = _squeeze(packer, missing, wanted, demands, where, headroom, previous)
    for name in squeezed:
        del missing[name]
    copies = _copies(packer)
    unplaced = dict(notes)
    for name, lost in sorted(missing.items()):
        got = wanted[name] - lost
        room = (
            f"no room on the {len(fleet)} nodes"
            if got == 0
            else f"{got} of {wanted[name]} copies placed: no room for the rest"
        )
        unplaced[name] = f"{notes[name]}; {room}" if name in notes else room
    for name, rate in squeezed.items():
        room = (
            f"no room on the {len(fleet)} nodes for {planned[name]:.1f} req/s: one copy "
            f"planned for {rate:.1f} req/s"
        )
        unplaced[name] = f"{notes[name]}; {room}" if name in notes else room
    result = Placement(copies, dict(sorted(unplaced.items())), 1, bounds)
    if previous is None:
        return result
    same = result.copies == previous.copies and result.unplaced == previous.unplaced
    generation = previous.generation if same else previous.generation + 1
    return Placement(result.copies, result.unplaced, generation, bounds)


#: halvings of a model's rate tried for the one copy the fleet has room for
SQUEEZE_HALVINGS = 30


def _squeeze(
    packer: Packer,
    missing: dict[str, int],
    wanted: dict[str, int],
    demands: Sequence[ModelDemand],
    where: dict[str, list[tuple[NodeSpec, int]]],
    headroom: Headroom,
    previous: Placement | None = None,
) -> dict[str, float]:
    """Models none of whose copies found room keep one copy, planned for the highest
    rate (halving the model's) that fits beside the rest: a rate declared above what the
    fleet can serve unloaded the model's only copy, and every request got 503 where the
    node's queue bound would have answered what it could and refused the rest.
    ``missing``: copies left out per model.  Returns each such model's rate planned."""
    out: dict[str, float] = {}
    for demand in demands:
        if missing.get(demand.name, 0) < wanted.get(demand.name, 0) or demand.rate <= 0:
            continue  # some copy is placed, or none was wanted
        rate = demand.rate
        for _ in range(SQUEEZE_HALVINGS):
            rate /= 2
            one = replace(demand, rate=rate, min_copies=1, max_copies=1)
            items, _why = split(one, where[demand.name], headroom)
            if items and (_keep(packer, items[0], previous) or packer.place(items[0]) is not None):
                out[demand.name] = rate
                break
    return out


def _keep(packer: Packer, item: Item, previous: Placement | None) -> bool:
    """Put ``item`` where the previous placement had its model's copy at the same rate,
    on the same backend, if it still fits there: a squeezed copy had been placed afresh
    at each re-placement and could land on another backend (a reload for nothing)."""
    if previous is None:
        return False
    for copy in previous.copies:
        if copy.model != item.name or copy.rate != item.rate or copy.node not in packer.bins:
            continue
        b = packer.bins[copy.node]
        if b.holds(item.name):
            return False
        for index, profile in item.options(b.node):
            if profile.backend != copy.backend:
                continue
            if b.memory + profile.memory_bytes > b.node.memory_bytes:
                return False
            fit = b.try_slot(item, index, item.slot(index, b.node.speed), MARGINAL, FAST)
            if fit is None:
                return False
            b.add(item, fit)
            return True
    return False


def _past_reach(
    demand: ModelDemand,
    copies: list[Item],
    where: list[tuple[NodeSpec, int]],
    headroom: Headroom,
) -> bool:
    """Whether ``demand`` asks more than every node it may run on could serve (its
    copies then go in last); not one its own ``max_copies`` caps, which the fleet
    could serve and which packs as any other."""
    if sum(c.rate for c in copies) >= demand.rate * (1 - 1e-9):
        return False
    if not demand.max_copies:
        return True
    uncapped, _why = split(replace(demand, max_copies=0), where, headroom)
    return sum(c.rate for c in uncapped) < demand.rate * (1 - 1e-9)


def _fresh(items: list[Item], fleet: list[NodeSpec], bound: int) -> tuple[Packer, list[Item]]:
    """The best packing of ``items`` over the variants (fewest left out, fewest nodes,
    lowest peak share)."""
    best: tuple[tuple, Packer, list[Item]] | None = None
    for order, choose, prefer in VARIANTS:
        packer = Packer(fleet, choose, prefer)
        short = [item for item in sorted(items, key=order) if packer.place(item) is None]
        packer.empty_nodes()
        short = [item for item in short if packer.place(item) is None]  # on nodes freed
        used = packer.used()
        rank = (len(short), len(used), round(max((b.occupancy for b in used), default=0), 6))
        if best is None or rank < best[0]:
            best = (rank, packer, short)
        if not short and len(used) <= bound:
            break  # cannot do better than the bound
    assert best is not None
    _, packer, short = best
    small = len(items) <= EXACT_MAX_COPIES and len(fleet) <= EXACT_MAX_NODES
    if items and small and (short or len(packer.used()) > bound):
        most = len(fleet) if short else len(packer.used()) - 1
        found = search(packer, items, most)
        if found is not None:
            rebuild(packer, found)
            short = []
    # the incremental packing finishes with these same rules: re-placing this result
    # must find nothing more to do
    packer.choose, packer.prefer = MARGINAL, FAST
    packer.balance(rounds=2 * len(packer.used()))
    return packer, _make_room(packer, short, fleet)


def _make_room(packer: Packer, short: list[Item], fleet: list[NodeSpec]) -> list[Item]:
    """Empty what nodes can be emptied and retry the copies left out, until neither
    helps; the fresh and the incremental packing both end here, so re-placing a
    placement's own input finds nothing more to do (a fixed point)."""
    short = [item for item in short if packer.place(item) is None]
    while short and packer.empty_nodes(tries=len(fleet)):
        short = [item for item in short if packer.place(item) is None]
    return short


def _incremental(
    items: list[Item], fleet: list[NodeSpec], previous: Placement
) -> tuple[Packer, list[Item], int]:
    """Keep each model's previous copies where they still fit (unchanged ones first),
    then pack the rest around them; also says how many copies stayed."""
    packer = Packer(fleet, MARGINAL, FAST)
    held: dict[str, list[Copy]] = {}
    for copy in previous.copies:
        if copy.node in packer.bins:
            held.setdefault(copy.model, []).append(copy)
    per_model: dict[str, list[Item]] = {}
    for item in items:
        per_model.setdefault(item.name, []).append(item)
    pairs: list[tuple[Item, Copy]] = []
    pending: list[Item] = []
    for name in sorted(per_model):
        mine = sorted(per_model[name], key=lambda i: (-i.rate, i.index))
        before = sorted(held.get(name, ()), key=lambda c: (-c.rate, c.node))
        for item in list(mine):  # a copy planned as before keeps its node first
            same = next((c for c in before if c.rate == item.rate), None)
            if same is not None:
                pairs.append((item, same))
                mine.remove(item)
                before.remove(same)
        pairs.extend(zip(mine, before, strict=False))
        pending.extend(mine[len(before) :])
    pairs.sort(key=lambda p: (p[0].rate != p[1].rate, p[0].key))
    for item, copy in pairs:
        b = packer.bins[copy.node]
        fit = None
        for index, profile in item.options(b.node):
            if profile.backend != copy.backend or b.holds(item.name):
                continue
            if b.memory + profile.memory_bytes <= b.node.memory_bytes:
                fit = b.try_slot(item, index, item.slot(index, b.node.speed), MARGINAL, FAST)
            break
        if fit is None:
            pending.append(item)
        else:
            b.add(item, fit)
    held = len(items) - len(pending)
    pending.sort(key=_by_need)
    short = [item for item in pending if packer.place(item) is None]
    return packer, short, held


def _copies(packer: Packer) -> tuple[Copy, ...]:
    """The bins as published copies.  A lone copy runs at the node's full speed: its
    mean ``batch`` in ``duty_cycle_s`` (its own batch cycle), keeping the node
    busy ``occupancy`` of the time.  Copies that take turns share one cycle
    (``duty_cycle_s``, the mean time between two turns of a model) and each
    runs about what arrives in it."""
    copies = []
    for b in packer.used():
        entries = sorted(b.entries, key=lambda e: e[0].key)
        # the cycle again, from the copies in a fixed order: the bin's own came by a
        # path (the order copies were added) that a re-placement need not repeat
        turns = together([slot for _, _, slot in entries]) if len(entries) > 1 else None
        for item, _, slot in entries:
            if turns is not None:
                cycle = turns.mean
                batch = max(1, min(slot.limit, math.ceil(slot.rate * cycle - 1e-9)))
                busy = float(work_in(slot.a, slot.beta, slot.rate, cycle)) / cycle
            else:
                batch = slot.batch(slot.theta)
                cycle = (slot.a + slot.beta * batch) / slot.theta
                busy = slot.time(slot.theta)
            copies.append(
                Copy(
                    model=item.name,
                    node=b.node.name,
                    backend=slot.profile.backend,
                    rate=item.rate,
                    batch=batch,
                    duty_cycle_s=round(cycle, 9),
                    occupancy=round(busy, 6),
                    memory_bytes=slot.profile.memory_bytes,
                    threads=slot.profile.threads,
                )
            )
    return tuple(sorted(copies, key=lambda c: (c.model, c.node)))


def moves(old: Placement, new: Placement) -> list[Move]:
    """Loads (first: a node loads and warms before it takes traffic) then unloads; a
    copy that changes backend on the same node is unloaded and loaded again."""
    before = {(c.model, c.node, c.backend) for c in old.copies}
    after = {(c.model, c.node, c.backend) for c in new.copies}
    loads = [Move("load", m, n) for m, n, _ in sorted(after - before)]
    unloads = [Move("unload", m, n) for m, n, _ in sorted(before - after)]
    return loads + unloads


def optimal_nodes(
    models: Sequence[ModelDemand], nodes: Sequence[NodeSpec], headroom: Headroom | None = None
) -> int | None:
    """The fewest nodes that hold the same copies ``place`` makes, under the same rules
    (exhaustive: keep it to a handful of copies and nodes); None when no choice of
    nodes holds them all."""
    headroom = headroom if headroom is not None else Headroom()
    fleet = sorted({n.name: n for n in nodes}.values(), key=lambda n: n.name)
    items: list[Item] = []
    alike = kinds(fleet)
    for demand in sorted(models, key=lambda m: m.name):
        items.extend(split(demand, alike, headroom)[0])
    if not items:
        return 0
    found = search(Packer(fleet), items, len(fleet), steps=None)
    return None if found is None else len({name for _, name, _ in found})
