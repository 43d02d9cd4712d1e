"""Per-model request statistics of the agent, in Triton's statistics shape.

So the tools that read a Triton server's ``/v2/models/stats`` (perf
analyzers, dashboards) read the agent's too.  Beyond Triton's fields each
entry says where the requests ran (local, cloud-mqtt, cloud-http, deferred)
and how failures split by error code: what an agent's operator asks first.
``compute_infer`` is runtime time (local, or the cloud's as it reports),
``queue`` the cloud's queueing; the agent does not time input/output
copies apart, so those fields are left out rather than faked.  Only the
event loop writes, so plain counters suffice.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any


@dataclass
class _ModelCounters:
    success: int = 0
    items: int = 0  # batch items answered (Triton's inference_count)
    success_ns: int = 0
    fail: int = 0
    fail_ns: int = 0
    last_ms: int = 0
    queue_ns: int = 0  # the cloud's queue time, from its replies
    compute_ns: int = 0  # runtime time, local or in the cloud
    where: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)


class AgentStats:
    def __init__(self) -> None:
        self._models: dict[str, _ModelCounters] = {}

    def _get(self, model: str) -> _ModelCounters:
        found = self._models.get(model)
        if found is None:
            found = self._models[model] = _ModelCounters()
        return found

    def success(self, model: str, params: dict[str, Any], seconds: float, items: int = 1) -> None:
        """One answered request of ``items`` batch items; ``params`` is its provenance
        (where, queue_us, compute_us)."""
        c = self._get(model)
        c.success += 1
        c.items += items
        c.success_ns += int(seconds * 1e9)
        c.queue_ns += int(params.get("queue_us", 0) or 0) * 1000
        c.compute_ns += int(params.get("compute_us", 0) or 0) * 1000
        c.where[str(params.get("where", "?"))] += 1
        c.last_ms = int(time.time() * 1000)

    def failure(self, model: str, seconds: float, code: str) -> None:
        c = self._get(model)
        c.fail += 1
        c.fail_ns += int(seconds * 1e9)
        c.errors[code] += 1
        c.last_ms = int(time.time() * 1000)

    def names(self) -> list[str]:
        return sorted(self._models)

    def to_triton(self, model: str, version: str = "") -> dict[str, Any]:
        c = self._models.get(model) or _ModelCounters()
        return {
            "name": model,
            "version": version,
            "last_inference": c.last_ms,
            "inference_count": c.items,  # (batch items, as Triton counts them)
            "execution_count": c.success,
            "inference_stats": {
                "success": {"count": c.success, "ns": c.success_ns},
                "fail": {"count": c.fail, "ns": c.fail_ns},
                "queue": {"count": c.success, "ns": c.queue_ns},
                "compute_infer": {"count": c.success, "ns": c.compute_ns},
            },
            "batch_stats": [],
            "where": dict(c.where),
            "errors": dict(c.errors),
        }
