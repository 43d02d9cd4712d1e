"""Running one formed batch on a session, in a worker thread.

Split from :mod:`cloud.batcher` (which owns the queue and the scheduler):
these functions never touch the event loop.  A batch is concatenated, run
once and cut back into per-request views; when the batch fails as a whole,
each request runs alone, so one bad request fails alone (Triton's rule:
one result or one error per request).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import numpy as np

from cloud.stats import ModelStats
from shared.errors import FerryError, InternalError
from shared.runtimes.base import Session

log = logging.getLogger(__name__)

#: (outputs or error, compute ns, size of the batch it ran in, input ns, output ns);
#: input/output ns are the batch's concatenate and split times (0 when it ran alone)
Outcome = tuple[dict[str, np.ndarray] | FerryError, int, int, int, int]


@dataclass
class BatchResult:
    """One request's answer: its own slice of the batch outputs (views, no copy)."""

    outputs: dict[str, np.ndarray]
    queue_us: int
    compute_us: int
    batch_size: int


@dataclass(eq=False, slots=True)
class QueuedRequest:
    inputs: dict[str, np.ndarray]
    outputs: list[str] | None
    n: int  # items (rows of the batch dimension)
    key: tuple  # requests with equal keys can be concatenated
    arrival_ns: int
    deadline_ns: int | None
    future: asyncio.Future[BatchResult]
    done: bool = False  # dispatched, expired, cancelled or failed: no longer queued
    level: int = 0  # its priority level's queue (0: the highest)


def execute(
    session: Session, members: list[QueuedRequest], stats: ModelStats, name: str
) -> list[Outcome]:
    """Run one batch; on failure, isolate the bad request by running each alone."""
    if len(members) == 1:
        return [run_alone(session, members[0], stats, name)]
    items = sum(r.n for r in members)
    try:
        t0 = time.perf_counter_ns()
        batch = {key: np.concatenate([r.inputs[key] for r in members]) for key in members[0].inputs}
        t1 = time.perf_counter_ns()
        out = session.run(batch, union_outputs(members))
        t2 = time.perf_counter_ns()
        outcomes = split(out, members, items, t2 - t1, t1 - t0)
    except Exception as exc:
        log.info("%s: batch of %d failed (%s); running its requests alone", name, items, exc)
        return [run_alone(session, r, stats, name) for r in members]
    stats.record_execution(items, t2 - t1)
    return outcomes


def run_alone(session: Session, req: QueuedRequest, stats: ModelStats, name: str) -> Outcome:
    start = time.perf_counter_ns()
    try:
        out = session.run(req.inputs, req.outputs)
    except Exception as exc:
        if not isinstance(exc, FerryError):
            exc = InternalError(f"{name}: {type(exc).__name__}: {exc}")
        return exc, time.perf_counter_ns() - start, req.n, 0, 0
    compute = time.perf_counter_ns() - start
    stats.record_execution(req.n, compute)
    return out, compute, req.n, 0, 0


def union_outputs(members: list[QueuedRequest]) -> list[str] | None:
    """Outputs to ask the session for: all when any request wants all."""
    first = members[0].outputs
    if first is None or all(r.outputs == first for r in members):
        return first
    names: dict[str, None] = {}
    for r in members:
        if r.outputs is None:
            return None
        names.update(dict.fromkeys(r.outputs))
    return list(names)


def split(
    out: dict[str, np.ndarray],
    members: list[QueuedRequest],
    items: int,
    compute: int,
    input_ns: int,
) -> list[Outcome]:
    """Cut the batch outputs into per-request views along axis 0."""
    start_ns = time.perf_counter_ns()
    for key, arr in out.items():
        if arr.ndim < 1 or arr.shape[0] != items:
            raise InternalError(
                f"output {key!r} has shape {arr.shape}; expected leading batch dimension {items}"
            )
    views: list[dict[str, np.ndarray]] = []
    start = 0
    for r in members:
        end = start + r.n
        keys = out.keys() if r.outputs is None else r.outputs
        views.append({key: out[key][start:end] for key in keys})
        start = end
    output_ns = time.perf_counter_ns() - start_ns
    return [(v, compute, items, input_ns, output_ns) for v in views]
