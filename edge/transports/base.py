"""The transport interface the edge dataplane offloads through.

Each transfer reports its timing and byte counts so the estimators can learn
bandwidth and RTT from real traffic rather than from probes alone.
"""

from __future__ import annotations

from dataclasses import dataclass
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
