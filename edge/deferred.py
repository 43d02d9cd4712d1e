"""Store-and-forward for ``deferrable`` requests.

A request that cannot run now is written to the sqlite store (WAL, durable
when ``put`` returns) and answered with a receipt; the flusher sends stored
requests when a link is usable and keeps each answer in the store for the
app to fetch.  Requests left mid-send by a crash go back to pending when the
store reopens, so nothing is lost across ``kill -9``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from edge.store import DeferredStore
from shared import envelope
from shared.errors import FerryError, InvalidInput, ModelNotFound
from shared.messages import InferRequest, InferResponse

log = logging.getLogger(__name__)

Sender = Callable[[str, InferRequest], Awaitable[InferResponse]]


class Deferrer:
    def __init__(self, store: DeferredStore, *, ttl_s: float = 24 * 3600.0) -> None:
        self.store = store
        self.ttl_s = ttl_s
        self.delivered = 0

    async def defer(
        self, model: str, request: InferRequest, *, deadline_ms: float | None, reason: str
    ) -> InferResponse:
        assert request.id is not None
        now = time.time()
        self.store.put(
            model,
            envelope.encode_request(request),
            request_id=request.id,
            created_wall=now,
            expires_wall=now + self.ttl_s,
            priority=int(request.parameters.get("priority", 0) or 0),
        )
        return InferResponse(
            model_name=model,
            outputs=[],
            id=request.id,
            parameters={
                "where": "deferred",
                "deferred": True,
                "request_id": request.id,
                "decision": reason,
            },
        )

    async def flush(self, send: Sender, can_send: Callable[[], bool], limit: int = 50) -> int:
        """Send what is stored while a link is usable; returns how many were answered."""
        for request_id in self.store.expire(time.time()):
            log.warning("deferred request %s expired before a link returned", request_id)
        done = 0
        for item in self.store.pending(limit=limit, now_wall=time.time()):
            if not can_send():
                break
            request = envelope.decode_request(item.payload)
            self.store.mark_sending(item.request_id)
            try:
                response = await send(item.model, request)
            except (InvalidInput, ModelNotFound) as exc:
                self.store.mark_delivered(item.request_id, None, f"{exc.code.value}: {exc.message}")
                done += 1
                continue
            except FerryError as exc:
                log.info("deferred %s not sent yet: %s", item.request_id, exc.message)
                self.store.mark_pending(item.request_id)
                break
            response.id = item.request_id
            self.store.mark_delivered(item.request_id, envelope.encode_reply(response), None)
            self.delivered += 1
            done += 1
        return done

    def result(self, request_id: str) -> dict[str, Any]:
        """Status of a deferred request and, once answered, its response or error."""
        found = self.store.result(request_id)
        if found is None:
            raise ModelNotFound(f"no deferred request {request_id!r}")
        out: dict[str, Any] = {"request_id": request_id, "status": found.status}
        if found.error:
            out["error"] = found.error
        if found.result:
            _, response = envelope.decode_reply(found.result)
            out["response"] = response
        return out
