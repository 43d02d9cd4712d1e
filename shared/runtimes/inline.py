"""When a run is cheaper on the caller's thread than handed to a worker.

Both tiers run inference on worker threads so the event loop never waits on
a runtime.  For a tiny model that hand-off is the dominant cost: the worker's
wake-up and the loop's wake-up after it take ~0.1 ms on a small machine, more
than the run itself (an identity or a small tabular model runs in 10-30 us).
So a run whose recent cost is under a budget of microseconds, on an input no
larger than the recent ones, may run where the caller is: the loop then
stalls for less than the hop would have cost, and one request at a time on an
idle model answers two thread wake-ups sooner.  The callers decide when
nothing else waits (an idle model with nothing queued); this gate only says
whether the model has earned it.

Sans-IO: the caller measures and records; the gate keeps a bounded window.
"""

from __future__ import annotations

from collections import deque

#: runs a model must have made (on a worker) before the gate opens
WARMUP_RUNS = 8
#: runs remembered: a very slow run keeps the gate shut for this many
WINDOW = 32
#: runs of the window that may be over budget (a run preempted by another process)
SLACK = WINDOW // 10
#: a run this many times over budget shuts the gate, whatever the rest did
FAR_OVER = 10


class InlineGate:
    """Opens for a model whose last ``WINDOW`` runs took at most ``budget_us``, but for
    ``SLACK`` of them, and none took ``FAR_OVER`` times the budget.

    A run that took a few times its budget is most often one the scheduler
    preempted (a busy device, another process): it says nothing of the model,
    and a gate that shut on each would send a tiny model to the worker on any
    busy machine.  A run far over budget shuts it at once.  ``budget_us = 0``
    never opens (every run goes to a worker).  An input larger than any in
    the window is refused: a model's cost grows with its input (dynamic
    shapes, batches), and the window has not seen that size.
    """

    __slots__ = ("_budget_ns", "_far", "_max_bytes", "_over", "_runs")

    def __init__(self, budget_us: float) -> None:
        self._budget_ns = max(0, int(budget_us * 1000))
        self._runs: deque[tuple[int, int]] = deque(maxlen=WINDOW)
        self._over = 0  # runs in the window over budget
        self._far = 0  # runs in the window far over budget
        self._max_bytes = 0

    @property
    def budget_us(self) -> float:
        return self._budget_ns / 1000

    def allows(self, nbytes: int) -> bool:
        return (
            self._budget_ns > 0
            and len(self._runs) >= WARMUP_RUNS
            and self._over <= SLACK
            and self._far == 0
            and nbytes <= self._max_bytes
        )

    def record(self, run_ns: int, nbytes: int) -> None:
        """One run's cost (wherever it ran) and the bytes of its inputs."""
        if self._budget_ns <= 0:
            return
        far = self._budget_ns * FAR_OVER
        if len(self._runs) == WINDOW:
            old_ns, old_bytes = self._runs[0]
            self._over -= old_ns > self._budget_ns
            self._far -= old_ns > far
        else:
            old_bytes = -1
        self._runs.append((run_ns, nbytes))
        self._over += run_ns > self._budget_ns
        self._far += run_ns > far
        if nbytes >= self._max_bytes:
            self._max_bytes = nbytes
        elif old_bytes == self._max_bytes:
            self._max_bytes = max(b for _, b in self._runs)


def input_bytes(inputs: dict) -> int:
    """Bytes of a request's arrays (object arrays count their element slots)."""
    return sum(getattr(a, "nbytes", 0) for a in inputs.values())
