"""Nodes as bins: what a node holds, whether one more copy fits, and where it fits best.

A copy fits a node when the node runs one of its backends, has the memory,
holds no other copy of the model (ModelMesh's rule) and the copies together
still fit one duty cycle (:func:`cloud.placement.sizing.cycle`).  Where
several nodes fit, the packer prefers the one whose share of time grows least
beyond the copy's own share: putting a copy with a long objective on a node
with a short cycle makes it pay its batch overhead more often, and putting a
short one on a long-cycle node shortens everyone's cycle.  Ties go to the
fuller node (best fit), then to the name.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from cloud.placement.demand import Item
from cloud.placement.sizing import EPS, Slot, load, share
from cloud.placement.types import NodeSpec

#: how a packing run chooses between nodes and between a copy's profiles
MARGINAL, FULLEST = "marginal", "fullest"
FAST, SMALL = "fast", "small"


@dataclass(frozen=True)
class Fit:
    """One way to add an item to a bin: which profile, and the bin's cycle and share
    afterwards."""

    profile_index: int
    slot: Slot
    d: float
    occupancy: float
    score: tuple


@dataclass(eq=False)
class Bin:
    """A node and its copies, with the sums that make its share O(1) to update."""

    node: NodeSpec
    entries: list[tuple[Item, int, Slot]] = field(default_factory=list)
    names: set[str] = field(default_factory=set)
    memory: int = 0
    d: float = 0.0
    overhead: float = 0.0  # sum of a
    work: float = 0.0  # sum of beta*r
    variance: float = 0.0  # sum of beta^2*r
    occupancy: float = 0.0

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
        if slot.d_max <= 0:
            return None
        d = min(self.d, slot.d_max) if self.entries else slot.d_max
        occupancy = share(
            self.overhead + slot.a, self.work + slot.work, self.variance + slot.variance, d, slot.k
        )
        if occupancy > 1 + EPS:
            return None
        waste = round(occupancy - self.occupancy - item.alone, 9)
        fuller = -occupancy
        score: tuple = (waste, fuller) if choose == MARGINAL else (fuller, waste)
        memory = slot.profile.memory_bytes
        score = (memory, *score) if prefer == SMALL else (*score, memory)
        return Fit(index, slot, d, occupancy, (*score, index))

    def add(self, item: Item, fit: Fit) -> None:
        slot = fit.slot
        self.entries.append((item, fit.profile_index, slot))
        self.names.add(item.name)
        self.memory += slot.profile.memory_bytes
        self.overhead += slot.a
        self.work += slot.work
        self.variance += slot.variance
        self.d, self.occupancy = fit.d, fit.occupancy

    def remove(self, item: Item) -> None:
        kept = [e for e in self.entries if e[0] is not item]
        self.clear()
        for it, index, slot in kept:
            fit = self.try_slot(it, index, slot, MARGINAL, FAST)
            assert fit is not None, "a subset of copies that fit no longer fits"
            self.add(it, fit)

    def clear(self) -> None:
        self.entries, self.names, self.memory, self.d = [], set(), 0, 0.0
        self.overhead = self.work = self.variance = self.occupancy = 0.0


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
            if b.occupancy + item.floor > 1 + EPS:
                continue  # a copy adds at least its floor share: a cheap screen
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
            victims = sorted(used, key=lambda b: (b.occupancy, len(b.entries), b.node.name))
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
        """Move single copies from the busiest node to the idlest while that lowers the
        busier of the two: spare time spread out absorbs bursts better."""
        for _ in range(rounds):
            used = sorted(self.used(), key=lambda b: (b.occupancy, b.node.name))
            if len(used) < 2:
                return
            low, high = used[0], used[-1]
            best: tuple[float, Item, Fit] | None = None
            for item, _, slot in sorted(high.entries, key=lambda e: e[0].key):
                fit = low.fits(item, self.choose, self.prefer)
                if fit is None:
                    continue
                rest = [s for it, _, s in high.entries if it is not item]
                left = load(rest, min(s.d_max for s in rest), slot.headroom) if rest else 0.0
                after = max(fit.occupancy, left)
                if after < high.occupancy - 1e-6 and (best is None or after < best[0]):
                    best = (after, item, fit)
            if best is None:
                return
            high.remove(best[1])
            low.add(best[1], best[2])
