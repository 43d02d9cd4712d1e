"""Exhaustive search for the fewest nodes: the referee for small instances.

Same feasibility rules as the greedy packer (:mod:`cloud.placement.bins`),
every node and every profile tried, with two prunings that lose nothing:
empty nodes that look alike (memory, backends, speed) are tried once, and a
branch stops when the copies left need more than the room left.  The room is
exact: on a node that fits, every batch runs at least at the largest need
there, so each copy keeps the node busy at least its node time at its own
need (its floor, the least over the nodes it may use), and the floors of a
node's copies add up to at most the whole node.
"""

from __future__ import annotations

from collections.abc import Sequence

from cloud.placement.bins import FAST, MARGINAL, Bin, Fit, Packer
from cloud.placement.demand import Item
from cloud.placement.sizing import EPS

#: give up (keep the greedy answer) after this many search steps
STEP_LIMIT = 200_000


class _Budget(Exception):
    pass


class _Search:
    def __init__(self, packer: Packer, items: Sequence[Item], steps: int | None) -> None:
        self.nodes = packer.nodes
        self.order = sorted(items, key=lambda i: (-i.alone, i.key))
        floors = [i.floor for i in self.order]
        self.tails = [sum(floors[k:]) for k in range(len(floors) + 1)]
        self.steps, self.done = steps, 0

    def run(self, limit: int) -> list[tuple[Item, str, Fit]] | None:
        self.bins = [Bin(n) for n in self.nodes]
        self.chosen: list[tuple[Item, str, Fit]] = []
        return self._assign(0, limit)

    def _assign(self, i: int, limit: int) -> list[tuple[Item, str, Fit]] | None:
        if i == len(self.order):
            return list(self.chosen)
        self.done += 1
        if self.steps is not None and self.done > self.steps:
            raise _Budget
        opened = [b for b in self.bins if b.entries]
        room = sum(1 - b.floor for b in opened) + (limit - len(opened))
        if self.tails[i] > room + EPS:
            return None
        candidates = list(opened)
        if len(opened) < limit:
            seen: set[tuple] = set()
            for b in self.bins:
                kind = (b.node.memory_bytes, b.node.backends, b.node.speed)
                if not b.entries and kind not in seen:
                    seen.add(kind)
                    candidates.append(b)
        item = self.order[i]
        for b in candidates:
            if b.holds(item.name):
                continue
            for index, profile in item.options(b.node):
                if b.memory + profile.memory_bytes > b.node.memory_bytes:
                    continue
                slot = item.slot(index, b.node.speed)
                fit = b.try_slot(item, index, slot, MARGINAL, FAST)
                if fit is None:
                    continue
                b.add(item, fit)
                self.chosen.append((item, b.node.name, fit))
                found = self._assign(i + 1, limit)
                self.chosen.pop()
                b.pop()
                if found is not None:
                    return found
        return None


def search(
    packer: Packer, items: Sequence[Item], most: int, steps: int | None = STEP_LIMIT
) -> list[tuple[Item, str, Fit]] | None:
    """An assignment of every item onto the fewest nodes, at most ``most``; None when
    there is none (or the step budget ran out)."""
    state = _Search(packer, items, steps)
    for count in range(1, most + 1):
        if state.tails[0] > count + EPS:
            continue
        try:
            found = state.run(count)
        except _Budget:
            return None
        if found is not None:
            return found
    return None


def rebuild(packer: Packer, assignment: list[tuple[Item, str, Fit]]) -> None:
    """Replace the packer's bins by ``assignment`` (re-fitted in the same order)."""
    for b in packer.bins.values():
        b.clear()
    for item, name, fit in assignment:
        b = packer.bins[name]
        again = b.try_slot(item, fit.profile_index, fit.slot, MARGINAL, FAST)
        assert again is not None, "an exact assignment no longer fits"
        b.add(item, again)
