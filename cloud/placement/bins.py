"""Nodes as bins: what a node holds, whether one more copy fits, and where it fits best.

A copy fits a node when the node runs one of its backends, has the memory,
holds no other copy of the model (ModelMesh's rule) and every copy there
still gets the share of the node it needs (:mod:`cloud.placement.sizing`).
A bin keeps, per copy, the sums in that rule (the others' node time and its
variance at the copy's need), so trying one more copy costs a few vector
operations over the bin's copies.  Where several nodes fit, the packer
prefers the one whose pressure grows least beyond the copy's own need: a
copy that needs a fast share on a node of patient copies makes them all
batch less (their node time at the higher share), and a patient copy on a
busy node does the same to it.  Ties go to the fuller node (best fit), then
to the name.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from cloud.placement.demand import Item
from cloud.placement.serving import GRID
from cloud.placement.sizing import EPS, Slot
from cloud.placement.types import NodeSpec

#: how a packing run chooses between nodes and between a copy's profiles
MARGINAL, FULLEST = "marginal", "fullest"
FAST, SMALL = "fast", "small"


def _at(table: np.ndarray, cell: np.ndarray, part: np.ndarray) -> np.ndarray:
    """Rows of ``table`` (or one row) interpolated at each (cell, part)."""
    return table[..., cell] * (1 - part) + table[..., cell + 1] * part


def _one(row: np.ndarray, cell: int, part: float) -> float:
    return float(row[cell]) * (1 - part) + float(row[cell + 1]) * part


@dataclass(frozen=True)
class Fit:
    """One way to add an item to a bin: which profile, and the bin's pressure after."""

    profile_index: int
    slot: Slot
    occupancy: float
    score: tuple


#: what :meth:`Bin.add` changes, saved so that :meth:`Bin.pop` undoes it exactly
_UNDO = (
    "memory",
    "occupancy",
    "floor",
    "thetas",
    "slos",
    "busy",
    "spread",
    "cells",
    "parts",
    "total",
    "total_spread",
    "peak",
)


@dataclass(eq=False)
class Bin:
    """A node and its copies, with the sums that make one more copy cheap to try.

    Per copy ``j``: its need, objective, and the others' node time and variance
    at its need (the sums in the fit rule); for the node: every copy's node time
    and variance added up over the grid of shares, so a newcomer's own sums are
    one interpolation; and the copy under most pressure, which a newcomer must
    not push past the whole node (a screen before the full check)."""

    node: NodeSpec
    entries: list[tuple[Item, int, Slot]] = field(default_factory=list)
    names: set[str] = field(default_factory=set)
    memory: int = 0
    occupancy: float = 0.0  # the largest pressure among its copies
    floor: float = 0.0  # sum of the copies' node time at their own need
    thetas: np.ndarray = field(default_factory=lambda: np.empty(0))
    slos: np.ndarray = field(default_factory=lambda: np.empty(0))
    busy: np.ndarray = field(default_factory=lambda: np.empty(0))  # others' node time at theta_j
    spread: np.ndarray = field(default_factory=lambda: np.empty(0))  # ... and its variance
    cells: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=int))
    parts: np.ndarray = field(default_factory=lambda: np.empty(0))
    total: np.ndarray = field(default_factory=lambda: np.zeros(len(GRID)))
    total_spread: np.ndarray = field(default_factory=lambda: np.zeros(len(GRID)))
    peak: int = -1  # the copy under most pressure
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

    def pressure_of_newcomer(self, slot: Slot) -> float:
        """The newcomer's own pressure beside the copies here."""
        cell, part = slot.cell, slot.part
        busy = _one(self.total, cell, part)
        variance = _one(self.total_spread, cell, part)
        return slot.theta + busy + slot.headroom.z * math.sqrt(max(variance, 0.0) / slot.slo_s)

    def try_slot(self, item: Item, index: int, slot: Slot, choose: str, prefer: str) -> Fit | None:
        theta = slot.theta
        if theta > 1 + EPS:
            return None
        occupancy = theta
        if self.entries:
            occupancy = self.pressure_of_newcomer(slot)
            if occupancy > 1 + EPS:
                return None
            j = self.peak
            cell, part = int(self.cells[j]), float(self.parts[j])
            if self.occupancy + _one(slot.curve, cell, part) > 1 + EPS:
                return None  # pushes the copy under most pressure past the node
            z = slot.headroom.z
            busy = self.busy + _at(slot.curve, self.cells, self.parts)
            spread = self.spread + _at(slot.spread, self.cells, self.parts)
            theirs = self.thetas + busy + z * np.sqrt(spread / self.slos)
            occupancy = max(occupancy, float(theirs.max()))
            if occupancy > 1 + EPS:
                return None
        waste = round(occupancy - self.occupancy - item.floor, 9)
        fuller = -occupancy
        score: tuple = (waste, fuller) if choose == MARGINAL else (fuller, waste)
        memory = slot.profile.memory_bytes
        score = (memory, *score) if prefer == SMALL else (*score, memory)
        return Fit(index, slot, occupancy, (*score, index))

    def add(self, item: Item, fit: Fit) -> None:
        slot = fit.slot
        self._saved.append(tuple(getattr(self, name) for name in _UNDO))
        z = slot.headroom.z
        own_busy = _one(self.total, slot.cell, slot.part)
        own_spread = _one(self.total_spread, slot.cell, slot.part)
        if self.entries:
            self.busy = self.busy + _at(slot.curve, self.cells, self.parts)
            self.spread = self.spread + _at(slot.spread, self.cells, self.parts)
        self.entries.append((item, fit.profile_index, slot))
        self.names.add(item.name)
        self.memory += slot.profile.memory_bytes
        self.floor += slot.floor
        self.thetas = np.append(self.thetas, slot.theta)
        self.slos = np.append(self.slos, slot.slo_s)
        self.busy = np.append(self.busy, own_busy)
        self.spread = np.append(self.spread, own_spread)
        self.cells = np.append(self.cells, slot.cell)
        self.parts = np.append(self.parts, slot.part)
        self.total = self.total + slot.curve
        self.total_spread = self.total_spread + slot.spread
        pressures = self.thetas + self.busy + z * np.sqrt(np.maximum(self.spread, 0) / self.slos)
        self.peak = int(pressures.argmax())
        self.occupancy = float(pressures[self.peak])

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
        self.occupancy = self.floor = 0.0
        self.thetas, self.slos = np.empty(0), np.empty(0)
        self.busy, self.spread = np.empty(0), np.empty(0)
        self.cells, self.parts = np.empty(0, dtype=int), np.empty(0)
        self.total, self.total_spread = np.zeros(len(GRID)), np.zeros(len(GRID))
        self.peak = -1
        self._saved = []

    def planned_share(self) -> float:
        """The share every batch here is planned to get: the largest need."""
        return float(self.thetas.max()) if self.entries else 0.0


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
