"""What the node as a whole is running (the batchers' shared view), and its turns.

:class:`NodeActivity` counts the batches running on the node, over all its
models: a lone request may take a session with a thread per core only when
nothing else runs (it would otherwise oversubscribe the cores).  The threads
the batches run on are :class:`shared.aio.threads.SessionThread`.

A node that follows a placement also runs one batch at a time, in turns
(``[fleet] turns``, on by default there): that is the schedule the packer
plans (:mod:`cloud.placement.turns`).  A batcher with requests queued asks
for a turn; when the node is free and no batcher asked before it, it takes
the turn, forms its batch from everything queued by then and runs it with
the node's cores to itself, then hands the turn to the next in line.  So the
models on a node are served round robin, each batch collecting what arrived
while the others ran, and a batch is never stretched by another's sharing
the cores: a request waits for the turns ahead and then runs once, at full
speed.  A node that serves a fixed set of models runs batches side by side,
as before (each model's batcher dispatching when its own session is free).
"""

from __future__ import annotations

from collections import deque
from typing import Protocol


class TurnTaker(Protocol):
    """What the turnstile asks of a batcher."""

    def wants_turn(self) -> bool: ...

    def wake_for_turn(self) -> None: ...


class NodeActivity:
    """Batches running on this node, all models together, and, with ``turns``, whose
    turn it is (touched on the loop only)."""

    __slots__ = ("holder", "line", "running", "turns")

    def __init__(self, turns: bool = False) -> None:
        self.running = 0
        self.turns = turns
        self.holder: TurnTaker | None = None
        self.line: deque[TurnTaker] = deque()

    def take(self, who: TurnTaker) -> bool:
        """Whether ``who`` may start a batch now; if not, it is in line and woken
        (:meth:`TurnTaker.wake_for_turn`) when its turn comes."""
        if not self.turns:
            return True
        line = self.line
        if self.holder is None and (not line or line[0] is who):
            if line:
                line.popleft()
            self.holder = who
            return True
        if who not in line:  # a handful of models per node: a short scan
            line.append(who)
        return False

    def release(self, who: TurnTaker) -> None:
        """``who``'s batch is over (or it took a turn it did not use)."""
        if self.holder is who:
            self.holder = None
            self._wake_next()

    def leave(self, who: TurnTaker) -> None:
        """``who`` has nothing queued any more: out of the line."""
        if who in self.line:
            was_next = self.line[0] is who
            self.line.remove(who)
            if was_next and self.holder is None:
                self._wake_next()

    def _wake_next(self) -> None:
        while self.line:
            head = self.line[0]
            if head.wants_turn():
                head.wake_for_turn()
                return
            self.line.popleft()  # its requests expired or were cancelled meanwhile
