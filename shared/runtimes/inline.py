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

The budget is the configured one or, when larger, what the hop has been
measured to cost here (up to ``HOP_CAP`` times the configured budget).  Both
costs move together: on a slow or busy host, and on one whose cores go idle
between requests, a run that takes 25 us in a tight loop took 80-110 us on
an idle server here, and its hop to a worker and back another 130-140 us.
A fixed 100 us budget then sent every such run to a worker, which cost more
than running it.

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
#: hops remembered (their median is what a hop costs)
HOP_WINDOW = 16
#: the measured hop raises the budget to at most this many times the configured one
HOP_CAP = 10


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

    __slots__ = ("_budget_ns", "_configured_ns", "_far", "_hops", "_max_bytes", "_over", "_runs")

    def __init__(self, budget_us: float) -> None:
        self._configured_ns = max(0, int(budget_us * 1000))
        self._budget_ns = self._configured_ns
        self._runs: deque[tuple[int, int]] = deque(maxlen=WINDOW)
        self._hops: deque[int] = deque(maxlen=HOP_WINDOW)
        self._over = 0  # runs in the window over budget
        self._far = 0  # runs in the window far over budget
        self._max_bytes = 0

    @property
    def budget_us(self) -> float:
        """The budget in force: the configured one, or the measured hop where larger."""
        return self._budget_ns / 1000

    def record_hop(self, hop_ns: int) -> None:
        """What one hand-off to a worker and back cost (its run left out)."""
        if self._configured_ns <= 0:
            return
        self._hops.append(max(0, int(hop_ns)))
        hop = sorted(self._hops)[len(self._hops) // 2]
        budget = min(max(hop, self._configured_ns), self._configured_ns * HOP_CAP)
        if abs(budget - self._budget_ns) * 20 > self._budget_ns:  # moved by over 5%
            self._budget_ns = budget
            far = budget * FAR_OVER
            self._over = sum(run > budget for run, _ in self._runs)
            self._far = sum(run > far for run, _ in self._runs)

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
    """Bytes of a request's arrays; an object array (BYTES: strings, encoded images)
    counts its elements' lengths, not its 8-byte slots, or a thumbnail would earn the
    gate for a 40-megapixel image decoded on the loop."""
    total = 0
    for a in inputs.values():
        total += getattr(a, "nbytes", 0)
        if getattr(getattr(a, "dtype", None), "kind", "") == "O":
            try:
                total += sum(map(len, a.flat))
            except TypeError:  # elements without a length: never inline
                total += 1 << 40
    return total
