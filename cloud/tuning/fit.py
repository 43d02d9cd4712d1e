"""Pure tuning maths: the linear latency fit, the choice under an objective, and the
queue delay that choice leaves room for.  No runtimes, no clocks: unit-testable."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Point:
    """One measured batch size of one configuration (seconds per batch)."""

    batch: int
    p50_s: float
    p99_s: float
    mean_s: float
    runs: int

    @property
    def throughput(self) -> float:
        """Items per second with one batch in flight at a time."""
        return self.batch / self.mean_s if self.mean_s > 0 else 0.0


@dataclass(frozen=True)
class Fit:
    a_s: float
    beta_s: float
    spread_s: float  # residual standard deviation


def fit_linear(points: Sequence[Point]) -> Fit:
    """Least squares ``l(b) = a + beta*b`` over the mean latencies (the packer adds up
    batch times in a duty cycle, so it needs means; the tail is in ``spread_s`` and in
    the measured p99 the choice uses).

    One batch size (a model without a batch dimension) gives ``a = 0`` and
    ``beta = l(1)``.  A negative slope or intercept is noise on a flat curve, not a
    model that gets faster with more work, so it is clamped: placement divides by
    ``beta`` and needs ``a >= 0``."""
    if not points:
        raise ValueError("no measured points")
    xs = [float(p.batch) for p in points]
    ys = [p.mean_s for p in points]
    n = len(points)
    if n == 1 or len(set(xs)) == 1:
        return Fit(0.0, max(sum(ys) / n / xs[0], 1e-9), 0.0)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    beta = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    a = my - beta * mx
    if beta <= 0:
        beta = max(min(ys) / max(xs), 1e-9)
        a = max(0.0, min(ys) - beta)
    elif a < 0:  # refit through the origin: keeps the line close to the points
        a = 0.0
        beta = sum(x * y for x, y in zip(xs, ys, strict=True)) / sum(x * x for x in xs)
    residuals = [y - (a + beta * x) for x, y in zip(xs, ys, strict=True)]
    spread = math.sqrt(sum(r * r for r in residuals) / max(n - 2, 1))
    return Fit(a, beta, spread)


def fit_within(points: Sequence[Point], latency_s: float) -> tuple[Fit, list[int]]:
    """The fit over the batch sizes whose p99 is within the objective (at least the two
    smallest), and those sizes.  Placement never plans a batch slower than the
    objective, and on CPUs the curve bends upwards at large batches (caches): a line
    through those points would hide the fixed cost ``a`` that matters at small ones."""
    ordered = sorted(points, key=lambda p: p.batch)
    used = [p for p in ordered if p.p99_s <= latency_s]
    if len(used) < 2:
        used = ordered[:2]
    return fit_linear(used), [p.batch for p in used]


@dataclass(frozen=True)
class Candidate:
    backend: str
    threads: int
    point: Point


def choose(
    candidates: Sequence[Candidate], latency_s: float, tolerance: float = 0.02
) -> Candidate | None:
    """The most throughput whose measured batch p99 stays within half the objective
    (Nexus: the other half is for waiting in the queue); None when nothing qualifies.

    Throughputs within ``tolerance`` of the best are a tie (two runs of one point
    differ by that much), and a tie goes to fewer threads, then the smaller batch:
    threads left over serve other models, and a smaller batch waits less to fill."""
    fitting = [c for c in candidates if c.point.p99_s <= latency_s / 2]
    if not fitting:
        return None
    best = max(c.point.throughput for c in fitting)
    near = [c for c in fitting if c.point.throughput >= best * (1 - tolerance)]
    return min(near, key=lambda c: (c.threads, c.point.batch, -c.point.throughput))


def queue_delay_us(latency_s: float, batch_p99_s: float, current_us: int | None) -> int:
    """``max_queue_delay_us`` for a chosen batch: a request may wait for its batch to
    fill and then behind one running batch, inside the objective's queueing half, so
    the delay never exceeds ``L/2 - p99(b)``.  A delay the user set is kept when it
    fits; with none set, about one batch time (longer waits buy throughput only at
    loads where a backlog fills batches anyway)."""
    budget = max(0.0, latency_s / 2 - batch_p99_s)
    wanted = batch_p99_s if current_us is None else current_us / 1e6
    return int(min(wanted, budget) * 1e6)
