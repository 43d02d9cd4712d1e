"""The agent's local API: the same V2 HTTP protocol as the cloud tier.

An app or tritonclient cannot tell where a request ran, except by reading
the provenance the agent adds to the response parameters.  Request
parameters steer the agent: ``deadline_ms`` (or Triton's ``timeout`` in
microseconds), ``priority`` and ``deferrable``.  Model names are the app's
names (``[models.*]`` in agent.toml); metadata and configuration come from
the local variant, or from the cloud's V2 API for cloud-only models.

Agent extensions: ``GET /v2/agent/status``, ``GET /v2/deferred/{id}`` and
``POST /v2/agent/link`` (the OS reports that a transport now rides another
network, e.g. ``{"transport": "http", "link": "lte"}``).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from edge.agent import Agent
from shared import v2
from shared.errors import (
    FerryError,
    InvalidInput,
    PayloadTooLarge,
    PermissionDenied,
    Unauthenticated,
)
from shared.httpbody import binary_response, read_into
from shared.tensors import Limits
from shared.tokens import Tokens, bearer

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
EXTENSIONS = ["binary_tensor_data", "model_configuration", "statistics", "deferred"]


def _json(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        status=status,
        text=json.dumps(data, default=str),
        content_type="application/json",
        headers=headers,
    )


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except FerryError as exc:
        status, headers, body = exc.http_error()
        return web.Response(
            status=status, text=body, content_type="application/json", headers=headers
        )
    except web.HTTPRequestEntityTooLarge as exc:
        err = PayloadTooLarge(exc.text or "request body too large")
        return _json({"error": err.message, "code": err.code.value}, err.http_status)
    except web.HTTPException as exc:
        if exc.status >= 400:
            return _json(
                {
                    "error": exc.reason,
                    "code": "not_found" if exc.status == 404 else "invalid_argument",
                },
                exc.status,
            )
        raise
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return _json({"error": "internal error", "code": "internal"}, 500)


def _steering(params: dict[str, Any]) -> tuple[float | None, int | None, bool]:
    deadline_ms = params.pop("deadline_ms", None)
    timeout_us = params.pop("timeout", None)
    if timeout_us is not None and (type(timeout_us) is not int or timeout_us < 0):
        raise InvalidInput(f"timeout must be a non-negative integer (us), got {timeout_us!r}")
    if deadline_ms is None and timeout_us:
        deadline_ms = timeout_us / 1000.0
    if deadline_ms is not None and (
        not isinstance(deadline_ms, (int, float))
        or isinstance(deadline_ms, bool)
        or deadline_ms <= 0
    ):
        raise InvalidInput(f"deadline_ms must be a positive number, got {deadline_ms!r}")
    priority = params.pop("priority", None)
    if priority is not None and (type(priority) is not int or priority < 0):
        raise InvalidInput(f"priority must be a non-negative integer, got {priority!r}")
    deferrable = params.pop("deferrable", False)
    if not isinstance(deferrable, bool):
        raise InvalidInput("deferrable must be true or false")
    return deadline_ms, priority, deferrable


def _auth(tokens: Tokens) -> Any:
    """Health stays open; changing the agent's link is an admin operation."""

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path.startswith("/v2/health/"):
            return await handler(request)
        given = bearer(request.headers.get("Authorization", ""))
        grant = tokens.find(given) if given is not None else None
        if grant is None:
            raise Unauthenticated("missing or invalid bearer token")
        scope = "admin" if request.path == "/v2/agent/link" else "infer"
        model = request.match_info.get("model")
        if not grant.allows(scope, model):
            what = f"model {model!r}" if model and scope == "infer" else f"{scope} operations"
            raise PermissionDenied(f"this token does not cover {what}")
        return await handler(request)

    return check


class LocalApi:
    def __init__(
        self, agent: Agent, limits: Limits | None = None, tokens: Tokens | None = None
    ) -> None:
        self.agent = agent
        self.limits = limits or Limits()
        self.tokens = tokens

    def build_app(self) -> web.Application:
        middlewares: list[Any] = [_errors]
        if self.tokens is not None:
            middlewares.append(_auth(self.tokens))
        app = web.Application(client_max_size=self.limits.max_body_bytes, middlewares=middlewares)
        r = app.router
        r.add_get("/v2", self.server_metadata)
        r.add_get("/v2/health/live", self.live)
        r.add_get("/v2/health/ready", self.ready)
        r.add_get("/v2/agent/status", self.status)
        r.add_post("/v2/agent/link", self.set_link)
        r.add_get("/v2/deferred/{request_id}", self.deferred)
        r.add_post("/v2/repository/index", self.repository_index)
        r.add_get("/v2/models/stats", self.stats)
        for base in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
            r.add_get(base, self.model_metadata)
            r.add_get(base + "/ready", self.model_ready)
            r.add_get(base + "/config", self.model_config)
            r.add_get(base + "/stats", self.stats)
            r.add_post(base + "/infer", self.infer)
        return app

    # ---- handlers --------------------------------------------------------------
    async def server_metadata(self, request: web.Request) -> web.Response:
        return _json({"name": "ferry-edge", "version": "0.1.0", "extensions": EXTENSIONS})

    async def live(self, request: web.Request) -> web.Response:
        return _json({"live": True})

    async def ready(self, request: web.Request) -> web.Response:
        ready = self.agent.ready
        return _json({"ready": ready}, 200 if ready else 503)

    async def status(self, request: web.Request) -> web.Response:
        return _json(await self.agent.status())

    async def set_link(self, request: web.Request) -> web.Response:
        try:
            body = json.loads(await request.read() or b"{}")
        except ValueError as exc:
            raise InvalidInput(f"request body is not valid JSON: {exc}") from None
        signal = body.get("signal_dbm") if isinstance(body, dict) else None
        if (
            not isinstance(body, dict)
            or not isinstance(body.get("transport"), str)
            or not isinstance(body.get("link"), str)
            or not (signal is None or (isinstance(signal, int | float) and signal == signal))
            or isinstance(signal, bool)
        ):
            raise InvalidInput(
                'expected {"transport": "http" | "mqtt", "link": "<link profile>", '
                '"signal_dbm": <number, optional>}'
            )
        profile = self.agent.set_link(
            body["transport"], body["link"], None if signal is None else float(signal)
        )
        return _json({"transport": body["transport"], "link": profile.name, "signal_dbm": signal})

    async def repository_index(self, request: web.Request) -> web.Response:
        return _json(self.agent.dataplane.repository_index())

    async def model_metadata(self, request: web.Request) -> web.Response:
        name, version = request.match_info["model"], request.match_info.get("version")
        return _json(await self.agent.dataplane.model_metadata(name, version))

    async def model_config(self, request: web.Request) -> web.Response:
        name, version = request.match_info["model"], request.match_info.get("version")
        return _json(await self.agent.dataplane.model_config(name, version))

    async def model_ready(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        ready = self.agent.ready and self.agent.dataplane.model_ready(
            name, request.match_info.get("version")
        )
        return _json({"name": name, "ready": ready}, 200 if ready else 503)

    async def stats(self, request: web.Request) -> web.Response:
        name, version = request.match_info.get("model"), request.match_info.get("version")
        return _json(self.agent.dataplane.model_stats(name, version))

    async def deferred(self, request: web.Request) -> web.Response:
        found = await self.agent.deferred_result(request.match_info["request_id"])
        response = found.pop("response", None)
        if response is not None:
            chunks, _ = v2.encode_response(response)
            found["response"] = json.loads(chunks[0])
        return _json(found)

    async def infer(self, request: web.Request) -> web.StreamResponse:
        name, version = request.match_info["model"], request.match_info.get("version")
        if version is not None:
            self.agent.dataplane.resolve(name, version)
        body = await read_into(request, self.limits.max_body_bytes)
        header_length = v2.parse_header_length(request.headers.get(v2.HEADER_LENGTH), len(body))
        if v2.decode_needs_worker(body, header_length):  # big JSON or BYTES: off the loop
            decoded = await asyncio.to_thread(v2.decode_request, body, header_length, self.limits)
        else:
            decoded = v2.decode_request(body, header_length, self.limits)
        deadline_ms, priority, deferrable = _steering(decoded.parameters)
        response = await self.agent.dataplane.infer(
            name,
            decoded,
            deadline_ms=deadline_ms,
            priority=priority,
            deferrable=deferrable,
        )
        if v2.encode_needs_worker(response, decoded):
            chunks, out_header_length = await asyncio.to_thread(
                v2.encode_response, response, decoded
            )
        else:
            chunks, out_header_length = v2.encode_response(response, decoded)
        if out_header_length is None:
            return web.Response(body=chunks[0], content_type="application/json")
        return await binary_response(request, chunks, out_header_length)
