"""The transport interface the edge dataplane offloads through.

Each transfer reports its timing and byte counts so the estimators can learn
bandwidth and RTT from real traffic rather than from probes alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Protocol

from shared.messages import InferRequest, InferResponse


@dataclass(slots=True)
class TransferResult:
    response: InferResponse
    sent_bytes: int
    received_bytes: int
    started: float  # time.monotonic() when the request left
    finished: float  # time.monotonic() when the reply was decoded
    #: sent more than once (a hedge, or again after a node was lost): its time says more
    #: of a node that stalled than of the link, and ``sent_bytes`` counts every copy
    resent: bool = False

    @property
    def elapsed_s(self) -> float:
        return self.finished - self.started


def as_sent(request: InferRequest, deadline: float, now: float) -> InferRequest:
    """``request`` with the time left to ``deadline`` as its V2 ``timeout`` (us).

    The cloud stops a request when its sender gives up: over HTTP the cloud
    had no word of the agent's deadline and ran on after the agent's 504, and
    MQTT's Message Expiry counts whole seconds (a 100 ms deadline gave the node
    a second).  The app's own request is left as it was.
    """
    if not math.isfinite(deadline):
        return request
    left_us = int((deadline - now) * 1e6)
    return replace(request, parameters={**request.parameters, "timeout": max(left_us, 1)})


class Transport(Protocol):
    name: str

    @property
    def connected(self) -> bool: ...

    async def start(self) -> None: ...

    async def infer(self, model: str, request: InferRequest, deadline: float) -> TransferResult:
        """Send one request; raise the peer's FerryError, or DeadlineExceeded at ``deadline``."""
        ...

    async def probe(self, deadline: float) -> float:
        """A light round trip to the endpoint; returns its seconds."""
        ...

    async def close(self) -> None: ...
