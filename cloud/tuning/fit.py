"""Pure tuning maths: the linear latency fit and the choice under an objective."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Point:
    """One measured batch size of one configuration."""

    batch: int
    p50_s: float
    p99_s: float
    mean_s: float
    runs: int

    @property
    def throughput(self) -> float:
        return self.batch / self.mean_s if self.mean_s > 0 else 0.0


@dataclass(frozen=True)
class Fit:
    a_s: float
    beta_s: float
    spread_s: float  # residual standard deviation


def fit_linear(points: Sequence[Point]) -> Fit:
    """Least squares ``l(b) = a + beta*b`` over the mean latencies.  One point (a model
    without a batch dimension) gives ``a = 0`` and ``beta = l(1)``; a fit that comes
    out with a negative intercept or slope is clamped (noise on a flat curve)."""
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
    a = max(a, 0.0)
    residuals = [y - (a + beta * x) for x, y in zip(xs, ys, strict=True)]
    spread = math.sqrt(sum(r * r for r in residuals) / max(n - 2, 1))
    return Fit(a, beta, spread)


@dataclass(frozen=True)
class Candidate:
    backend: str
    threads: int
    point: Point


def choose(candidates: Sequence[Candidate], latency_s: float) -> Candidate | None:
    """The most throughput whose batch p99 stays within half the objective (Nexus:
    the other half is for waiting in the queue); ties go to fewer threads, then the
    smaller batch.  None when nothing qualifies."""
    fitting = [c for c in candidates if c.point.p99_s <= latency_s / 2]
    if not fitting:
        return None
    return max(fitting, key=lambda c: (round(c.point.throughput, 6), -c.threads, -c.point.batch))
