"""Nodes as bins: what a node holds, whether one more copy fits, and where it fits best.

A copy fits a node when the node runs one of its backends, has the memory,
holds no other copy of the model (ModelMesh's rule) and the node's copies
still meet their objectives taking turns (:mod:`cloud.placement.sizing`).
A bin keeps its copies' figures as arrays and the cycle of their turns, so
trying one more copy is one cycle computation, started from the current
cycle (one more copy only lengthens it).  Where several nodes fit, the
packer prefers the one whose occupancy grows least beyond the copy's own
least node time; ties go to the fuller node (best fit), then to the name.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from cloud.placement.demand import Item
from cloud.placement.sizing import ALONE, EPS, Slot, together
from cloud.placement.turns import work_in
from cloud.placement.types import NodeSpec

#: how a packing run chooses between nodes and between a copy's profiles
MARGINAL, FULLEST = "marginal", "fullest"
FAST, SMALL = "fast", "small"


@dataclass(frozen=True)
class Fit:
    """One way to add an item to a bin: which profile, and the bin's occupancy after."""

    profile_index: int
    slot: Slot
    occupancy: float
    score: tuple
    cycle_s: float = 0.0  # the mean cycle of turns after (0: a lone copy)
    work: float = 0.0  # the copies' mean work in such a cycle


#: what :meth:`Bin.add` changes, saved so that :meth:`Bin.pop` undoes it exactly
_UNDO = ("memory", "occupancy", "floor", "cycle_s", "work", "reach")


@dataclass(eq=False)
class Bin:
    """A node and its copies, with what makes one more copy cheap to try: the sum of
    their least node times and the mean cycle of their turns."""

    node: NodeSpec
    entries: list[tuple[Item, int, Slot]] = field(default_factory=list)
    names: set[str] = field(default_factory=set)
    memory: int = 0
    occupancy: float = 0.0  # how full: a lone copy's need, else the cycle's
    floor: float = 0.0  # sum of the copies' least node time
    cycle_s: float = 0.0  # mean cycle of turns (0: one copy or none)
    work: float = 0.0  # the copies' mean work in one such cycle
    reach: float = math.inf  # the longest mean cycle every copy here allows
    _saved: list[tuple] = field(default_factory=list, repr=False)

    def holds(self, model: str) -> bool:
        return model in self.names

    def fits(self, item: Item, choose: str = MARGINAL, prefer: str = FAST) -> Fit | None:
        """The best way to add ``item`` here, or None when it does not fit."""
        if item.name in self.names:
            return None
        best: Fit | None = None
        for index, profile in item.options(self.node):
            if self.memory + profile.memory_bytes > self.node.memory_bytes:
                continue
            fit = self.try_slot(item, index, item.slot(index, self.node.speed), choose, prefer)
            if fit is not None and (best is None or fit.score < best.score):
                best = fit
        return best

    def try_slot(self, item: Item, index: int, slot: Slot, choose: str, prefer: str) -> Fit | None:
        if slot.theta > 1 + EPS or self.floor + slot.floor > 1 + EPS:
            return None
        cycle_s = work = 0.0
        if not self.entries:
            occupancy = slot.theta
        else:
            if slot.theta > ALONE or self.entries[0][2].theta > ALONE:
                return None  # a copy that needs most of a node alone keeps it to itself
            if self.cycle_s > 0:  # a screen: the new cycle is at least one turn more
                start = max(self.cycle_s, slot.a + slot.beta)
                more = float(work_in(slot.a, slot.beta, slot.rate, start))
                if max(start, self.work + more) > min(self.reach, slot.reach) * (1 + EPS):
                    return None
            found = together([e[2] for e in self.entries] + [slot], self.cycle_s)
            if not found.fits:
                return None
            occupancy, cycle_s, work = found.occupancy, found.mean, found.work
        waste = round(occupancy - self.occupancy - item.floor, 9)
        fuller = -occupancy
        score: tuple = (waste, fuller) if choose == MARGINAL else (fuller, waste)
        memory = slot.profile.memory_bytes
        score = (memory, *score) if prefer == SMALL else (*score, memory)
        return Fit(index, slot, occupancy, (*score, index), cycle_s, work)

    def add(self, item: Item, fit: Fit) -> None:
        slot = fit.slot
        self._saved.append(tuple(getattr(self, name) for name in _UNDO))
        self.entries.append((item, fit.profile_index, slot))
        self.names.add(item.name)
        self.memory += slot.profile.memory_bytes
        self.floor += slot.floor
        self.occupancy = fit.occupancy
        self.cycle_s, self.work = fit.cycle_s, fit.work
        self.reach = min(self.reach, slot.reach)

    def pop(self) -> None:
        """Undo the last :meth:`add` exactly."""
        item, _, _ = self.entries.pop()
        self.names.discard(item.name)
        for name, value in zip(_UNDO, self._saved.pop(), strict=True):
            setattr(self, name, value)

    def remove(self, item: Item) -> None:
        kept = [e for e in self.entries if e[0] is not item]
        self.clear()
        for it, index, slot in kept:
            fit = self.try_slot(it, index, slot, MARGINAL, FAST)
            assert fit is not None, "a subset of copies that fit no longer fits"
            self.add(it, fit)

    def clear(self) -> None:
        self.entries, self.names, self.memory = [], set(), 0
        self.occupancy = self.floor = self.cycle_s = self.work = 0.0
        self.reach = math.inf
        self._saved = []


class Packer:
    """Bins for every node and the greedy moves over them; deterministic throughout."""

    def __init__(self, nodes: Sequence[NodeSpec], choose: str = MARGINAL, prefer: str = FAST):
        self.nodes = sorted(nodes, key=lambda n: n.name)
        self.bins = {n.name: Bin(n) for n in self.nodes}
        self.choose, self.prefer = choose, prefer
        # empty nodes are opened biggest first, so fewer are needed
        self.opening = sorted(self.nodes, key=lambda n: (-n.speed, -n.memory_bytes, n.name))

    def used(self) -> list[Bin]:
        return [b for b in self.bins.values() if b.entries]

    def fit_into(self, item: Item, bins: Iterable[Bin]) -> tuple[Bin, Fit] | None:
        best: tuple[Bin, Fit] | None = None
        for b in bins:
            if b.floor + item.floor > 1 + EPS:
                continue  # every copy takes at least its floor: a cheap screen
            fit = b.fits(item, self.choose, self.prefer)
            if fit is not None and (best is None or fit.score < best[1].score):
                best = (b, fit)
        return best

    def place(self, item: Item) -> Bin | None:
        """Put ``item`` on the used node it fits best, else on a new node."""
        found = self.fit_into(item, self.used())
        if found is None:
            for node in self.opening:
                b = self.bins[node.name]
                if b.entries:
                    continue
                fit = b.fits(item, self.choose, self.prefer)
                if fit is not None:
                    found = (b, fit)
                    break
        if found is None:
            return None
        found[0].add(item, found[1])
        return found[0]

    def empty_nodes(self, tries: int = 8) -> int:
        """Move all copies off the emptiest nodes (``tries`` of them, emptiest first)
        onto the others while that works; the number of nodes emptied."""
        emptied = 0
        progress = True
        while progress:
            progress = False
            used = self.used()
            victims = sorted(used, key=lambda b: (b.floor, len(b.entries), b.node.name))
            for victim in victims[:tries]:
                if self.evacuate(victim, [b for b in used if b is not victim]):
                    emptied += 1
                    progress = True
                    break
        return emptied

    def evacuate(self, victim: Bin, others: list[Bin]) -> bool:
        """Re-place every copy of ``victim`` on ``others``; undo unless all fit."""
        moved = sorted(victim.entries, key=lambda e: (-e[0].alone, e[0].key))
        done: list[tuple[Item, Bin]] = []
        for item, _, _ in moved:
            found = self.fit_into(item, others)
            if found is None:
                for it, b in reversed(done):
                    b.remove(it)
                return False
            found[0].add(item, found[1])
            done.append((item, found[0]))
        victim.clear()
        return True

    def balance(self, rounds: int) -> None:
        """Move single copies from the node under most pressure to the one under least
        while that lowers the higher of the two: spare time spread out absorbs bursts
        better."""
        for _ in range(rounds):
            used = sorted(self.used(), key=lambda b: (b.occupancy, b.node.name))
            if len(used) < 2:
                return
            low, high = used[0], used[-1]
            best: tuple[float, Item, Fit] | None = None
            for item, _, _ in sorted(high.entries, key=lambda e: e[0].key):
                fit = low.fits(item, self.choose, self.prefer)
                if fit is None:
                    continue
                rest = Bin(high.node)
                for it, index, slot in high.entries:
                    if it is not item:
                        again = rest.try_slot(it, index, slot, MARGINAL, FAST)
                        assert again is not None
                        rest.add(it, again)
                after = max(fit.occupancy, rest.occupancy)
                if after < high.occupancy - 1e-6 and (best is None or after < best[0]):
                    best = (after, item, fit)
            if best is None:
                return
            high.remove(best[1])
            low.add(best[1], best[2])
