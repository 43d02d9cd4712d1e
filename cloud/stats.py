"""Per-model-version counters behind ``/v2/models/{m}/stats`` and ``/metrics``.

The batcher updates these on every request and every batch, so the hot path
is one lock and a handful of int additions; all formatting (Triton JSON,
Prometheus families) happens at read time from a :meth:`ModelStats.snapshot`.
Durations are cumulative nanoseconds, as in Triton's statistics extension.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from shared.errors import ErrorCode, FerryError

#: Triton's failure reasons (the ``reason`` label of nv_inference_request_failure)
REJECTED = "REJECTED"  # refused or expired before it ran: queue full, deadline, stopping
CANCELED = "CANCELED"  # the client went away while it was queued
BACKEND = "BACKEND"  # the runtime failed on it
OTHER = "OTHER"  # rejected by validation before the batcher
FAILURE_REASONS = (REJECTED, CANCELED, BACKEND, OTHER)

_REJECTED_CODES = (ErrorCode.OVERLOADED, ErrorCode.DEADLINE_EXCEEDED, ErrorCode.UNAVAILABLE)


def failure_reason(exc: FerryError) -> str:
    """The reason a request that never reached a session failed, from its error code."""
    return REJECTED if exc.code in _REJECTED_CODES else OTHER


@dataclass(frozen=True)
class StatsSnapshot:
    """A consistent copy of one model version's counters (taken under the lock)."""

    name: str
    version: int
    success_count: int
    success_ns: int
    fail_count: int
    fail_ns: int
    queue_ns: int
    compute_infer_ns: int
    inference_count: int
    execution_count: int
    pending: int
    last_inference_ms: int
    memory_bytes: int | None
    compute_input_ns: int = 0
    compute_output_ns: int = 0
    duplicate_count: int = 0
    #: failure reason -> requests (keys from FAILURE_REASONS)
    fail_reasons: dict[str, int] = field(default_factory=dict)
    #: batch size -> (batches run at that size, cumulative compute ns)
    batch: dict[int, tuple[int, int]] = field(default_factory=dict)


class ModelStats:
    """Thread-safe counters for one model version.

    ``pending`` (requests queued, not yet dispatched) is a gauge the batcher
    assigns directly; ``memory_bytes`` is set by the dataplane when it knows the
    size of the loaded model.
    """

    __slots__ = (
        "_batch",
        "_compute_infer_ns",
        "_compute_input_ns",
        "_compute_output_ns",
        "_duplicate_count",
        "_execution_count",
        "_fail_count",
        "_fail_ns",
        "_fail_reasons",
        "_inference_count",
        "_last_inference_ms",
        "_lock",
        "_queue_ns",
        "_success_count",
        "_success_ns",
        "memory_bytes",
        "name",
        "pending",
        "version",
    )

    def __init__(self, name: str, version: int) -> None:
        self.name = name
        self.version = version
        self.pending = 0
        self.memory_bytes: int | None = None
        self._lock = threading.Lock()
        self._success_count = 0
        self._success_ns = 0
        self._fail_count = 0
        self._fail_ns = 0
        self._fail_reasons = dict.fromkeys(FAILURE_REASONS, 0)
        self._queue_ns = 0
        self._compute_infer_ns = 0
        self._compute_input_ns = 0
        self._compute_output_ns = 0
        self._inference_count = 0
        self._execution_count = 0
        self._duplicate_count = 0
        self._last_inference_ms = 0
        # batch size -> [count, compute ns]; lists so the hot path mutates in place
        self._batch: dict[int, list[int]] = {}

    def record_success(
        self,
        request_ns: int,
        queue_ns: int,
        compute_ns: int,
        items: int,
        input_ns: int = 0,
        output_ns: int = 0,
    ) -> None:
        """One request answered; ``compute_ns`` is its batch's run time (Triton's convention)."""
        self.record_successes(1, request_ns, queue_ns, compute_ns, items, input_ns, output_ns)

    def record_successes(
        self,
        count: int,
        request_ns: int,
        queue_ns: int,
        compute_ns: int,
        items: int,
        input_ns: int = 0,
        output_ns: int = 0,
    ) -> None:
        """``count`` requests answered at once (sums of their figures): one lock per batch."""
        if not count:
            return
        now_ms = time.time_ns() // 1_000_000
        with self._lock:
            self._success_count += count
            self._success_ns += request_ns
            self._queue_ns += queue_ns
            self._compute_infer_ns += compute_ns
            self._compute_input_ns += input_ns
            self._compute_output_ns += output_ns
            self._inference_count += items
            self._last_inference_ms = now_ms

    def record_failure(self, request_ns: int, reason: str = OTHER) -> None:
        """One request answered with an error; ``reason`` is one of FAILURE_REASONS."""
        with self._lock:
            self._fail_count += 1
            self._fail_ns += request_ns
            self._fail_reasons[reason] = self._fail_reasons.get(reason, 0) + 1

    def record_duplicate(self) -> None:
        """A retried request answered from the idempotency cache (the model did not run)."""
        with self._lock:
            self._duplicate_count += 1

    def record_execution(self, batch_size: int, compute_ns: int) -> None:
        """One batch of ``batch_size`` items ran through the session successfully."""
        with self._lock:
            self._execution_count += 1
            entry = self._batch.get(batch_size)
            if entry is None:
                self._batch[batch_size] = [1, compute_ns]
            else:
                entry[0] += 1
                entry[1] += compute_ns

    def snapshot(self) -> StatsSnapshot:
        with self._lock:
            return StatsSnapshot(
                name=self.name,
                version=self.version,
                success_count=self._success_count,
                success_ns=self._success_ns,
                fail_count=self._fail_count,
                fail_ns=self._fail_ns,
                queue_ns=self._queue_ns,
                compute_infer_ns=self._compute_infer_ns,
                inference_count=self._inference_count,
                execution_count=self._execution_count,
                pending=self.pending,
                last_inference_ms=self._last_inference_ms,
                memory_bytes=self.memory_bytes,
                compute_input_ns=self._compute_input_ns,
                compute_output_ns=self._compute_output_ns,
                duplicate_count=self._duplicate_count,
                fail_reasons=dict(self._fail_reasons),
                batch={size: (c, ns) for size, (c, ns) in self._batch.items()},
            )

    def to_triton(self) -> dict:
        """One ``model_stats`` entry of Triton's statistics extension.

        ``compute_input`` is the time spent concatenating requests into a
        batch, ``compute_output`` the time spent cutting the batch outputs
        into per-request views (both per request, with the batch's figure, as
        Triton counts ``compute_infer``); a request that ran alone needs
        neither, so it adds zero time.  The runtime's own input/output copies
        happen inside the session call and are part of ``compute_infer``.
        ``memory_usage`` is an estimate: see :mod:`cloud.loading`.
        """
        s = self.snapshot()
        ok = s.success_count
        return {
            "name": s.name,
            "version": str(s.version),
            "last_inference": s.last_inference_ms,
            "inference_count": s.inference_count,
            "execution_count": s.execution_count,
            "inference_stats": {
                "success": {"count": ok, "ns": s.success_ns},
                "fail": {"count": s.fail_count, "ns": s.fail_ns},
                "queue": {"count": ok, "ns": s.queue_ns},
                "compute_input": {"count": ok, "ns": s.compute_input_ns},
                "compute_infer": {"count": ok, "ns": s.compute_infer_ns},
                "compute_output": {"count": ok, "ns": s.compute_output_ns},
            },
            "batch_stats": [
                {"batch_size": size, "compute_infer": {"count": c, "ns": ns}}
                for size, (c, ns) in sorted(s.batch.items())
            ],
            "memory_usage": (
                []
                if s.memory_bytes is None
                else [{"type": "CPU", "id": 0, "byte_size": s.memory_bytes}]
            ),
        }
