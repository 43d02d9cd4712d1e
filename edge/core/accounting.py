"""What a request costs and what its answer says about it.

Bytes an offload puts on the wire, the daily data used (for the cap), and
the provenance every answer carries in its parameters.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from edge.core.policy import Option
from shared.messages import InferRequest

# Framing bytes of a V2 binary request besides the tensor data (JSON header).
REQUEST_OVERHEAD_BYTES = 256


@dataclass
class Usage:
    """Megabytes moved today (for the daily data cap), by the device's local calendar day.

    Lives in ``store`` (the estimators' persisted extras) so a restart does
    not reset the cap.
    """

    store: dict[str, Any]
    # The day a clock reading falls on; the agent's default is the device's
    # calendar day (the cap resets at local midnight), a replay's its own.
    day: Callable[[float], str] | None = None
    _second: int = field(default=-1, repr=False)
    _day: str = field(default="", repr=False)

    def _today(self, now: float | None) -> str:
        if self.day is not None and now is not None:
            return self.day(now)
        second = int(time.time())
        if second != self._second:  # the calendar day, formatted at most once a second
            self._second, self._day = second, time.strftime("%Y-%m-%d", time.localtime(second))
        return self._day

    def add(self, nbytes: int, now: float | None = None) -> None:
        today = self._today(now)
        if self.store.get("day") != today:
            self.store["day"], self.store["mb"] = today, 0.0
        self.store["mb"] = float(self.store.get("mb", 0.0)) + nbytes / 1e6

    def today(self, now: float | None = None) -> float:
        if self.store.get("day") != self._today(now):
            return 0.0
        return float(self.store.get("mb", 0.0))


def request_bytes(request: InferRequest) -> int:
    """Bytes an offload of ``request`` puts on the wire (tensor data plus framing)."""
    total = REQUEST_OVERHEAD_BYTES
    for t in request.inputs:
        if t.datatype == "BYTES":
            total += sum(4 + len(x) for x in t.data.reshape(-1))
        else:
            total += t.data.nbytes
    return total


def batch_rows(request: InferRequest) -> int:
    for t in request.inputs:
        return int(t.data.shape[0]) if t.data.ndim else 1
    return 1


def provenance(
    where: str,
    option: Option | None,
    actual_s: float,
    energy_j: float,
    sent: int,
    received: int,
    reason: str,
    fallback: bool,
    **extra: Any,
) -> dict[str, Any]:
    params: dict[str, Any] = {
        "where": where,
        "latency_ms": round(actual_s * 1000, 3),
        "predicted_latency_ms": round(option.latency_s * 1000, 3) if option else None,
        "energy_j": round(energy_j, 6),
        "bytes_sent": sent,
        "bytes_received": received,
        "fallback": fallback,
        "decision": reason,
    }
    if params["predicted_latency_ms"] is None:
        del params["predicted_latency_ms"]
    params.update(extra)
    return params
