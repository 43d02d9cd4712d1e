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

It runs on the same small HTTP server as the cloud's front
(:mod:`shared.aio.http_server`): on a device, aiohttp's server alone cost
~13 MiB of resident memory.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from typing import Any

from edge.agent import Agent
from shared import v2
from shared.admission import ByteBudget
from shared.aio.body_budget import BodyBudget
from shared.aio.http_server import (
    HttpServer,
    Request,
    Response,
    RoutedApp,
    Router,
    ServerOptions,
    add_v2_routes,
    default_max_connections,
)
from shared.aio.v2http import decode_infer, encode_infer
from shared.errors import InvalidInput, PermissionDenied, Unauthenticated
from shared.repository.repository import parse_version
from shared.tensors import Limits
from shared.tokens import Tokens, bearer, granted_stats

log = logging.getLogger(__name__)

#: the request's token grant (set by _authorize): whose idempotency keys and deferrals
GRANT = "grant"

EXTENSIONS = [
    "classification",
    "binary_tensor_data",
    "model_configuration",
    "statistics",
    "deferred",
]


def _json(data: Any, status: int = 200) -> Response:
    return Response(status, json.dumps(data, default=str).encode(), content_type="application/json")


def _steering(params: dict[str, Any]) -> tuple[float | None, int | None, bool]:
    deadline_ms = params.pop("deadline_ms", None)
    timeout_us = params.pop("timeout", None)
    if timeout_us is not None:
        v2.checked_timeout_us(timeout_us)
    if deadline_ms is None and timeout_us:
        deadline_ms = timeout_us / 1000.0
    if deadline_ms is not None and (
        not isinstance(deadline_ms, (int, float))
        or isinstance(deadline_ms, bool)
        or not 0 < deadline_ms < math.inf  # NaN too
    ):
        raise InvalidInput(f"deadline_ms must be a positive number, got {deadline_ms!r}")
    priority = params.pop("priority", None)
    if priority is not None:
        v2.checked_priority(priority)
    deferrable = params.pop("deferrable", False)
    if not isinstance(deferrable, bool):
        raise InvalidInput("deferrable must be true or false")
    return deadline_ms, priority, deferrable


class LocalApi(RoutedApp):
    """The V2 routes bound to one agent (an ``HttpApp`` for the HTTP server)."""

    def __init__(
        self,
        agent: Agent,
        limits: Limits | None = None,
        tokens: Tokens | None = None,
        max_inflight_bytes: int = 64 << 20,
    ) -> None:
        self.agent = agent
        self.limits = limits or Limits()
        self.tokens = tokens
        # bodies in flight bounded as a node's are: the connection cap times 16 MiB
        # was all that had bounded them, more than a device holds
        self.bodies = BodyBudget(ByteBudget(max_inflight_bytes), self.limits.max_body_bytes)
        r = self.router = Router()
        add_v2_routes(r, self)
        r.add("GET", "/v2/agent/status", self.status)
        r.add("POST", "/v2/agent/link", self.set_link)
        r.add("GET", "/v2/deferred/{request_id}", self.deferred)

    # ---- HttpApp ------------------------------------------------------------------------
    def check(self, request: Request) -> Response | None:
        if self.tokens is not None:
            self._authorize(request, self.tokens)
        version = request.params.get("version")
        if version is not None:
            # a plain number before it goes anywhere: it is put into the request the
            # agent sends the cloud, and a CRLF in it had smuggled whole requests there
            # under the agent's own token
            parse_version(version)
        return self.bodies.admit(request)

    def receiving(self, request: Request, received: int) -> Response | None:
        return self.bodies.receiving(request, received)

    def finished(self, request: Request) -> None:
        self.bodies.finished(request)

    @staticmethod
    def _authorize(request: Request, tokens: Tokens) -> None:
        """Health stays open; changing the agent's link is an admin operation."""
        if request.path.startswith("/v2/health/"):
            return
        given = bearer(request.header("authorization", "") or "")
        grant = tokens.find(given) if given is not None else None
        if grant is None:
            raise Unauthenticated("missing or invalid bearer token")
        scope = "admin" if request.path == "/v2/agent/link" else "infer"
        model = request.params.get("model")
        if not grant.allows(scope, model):
            what = f"model {model!r}" if model and scope == "infer" else f"{scope} operations"
            raise PermissionDenied(f"this token does not cover {what}")
        request.state[GRANT] = grant

    # ---- handlers --------------------------------------------------------------
    async def server_metadata(self, request: Request) -> Response:
        return _json({"name": "ferry-edge", "version": "0.1.0", "extensions": EXTENSIONS})

    async def live(self, request: Request) -> Response:
        return _json({"live": True})

    async def ready(self, request: Request) -> Response:
        ready = self.agent.ready
        return _json({"ready": ready}, 200 if ready else 503)

    async def status(self, request: Request) -> Response:
        return _json(await self.agent.status())

    async def set_link(self, request: Request) -> Response:
        body = v2.json_object(request.body)
        signal = body.get("signal_dbm")
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

    async def repository_index(self, request: Request) -> Response:
        entries = self.agent.dataplane.repository_index()
        grant = request.state.get(GRANT)
        if grant is not None and grant.models is not None:  # (its models, as stats)
            entries = [e for e in entries if grant.allows("infer", e.get("name"))]
        return _json(entries)

    async def model_metadata(self, request: Request) -> Response:
        name, version = request.params["model"], request.params.get("version")
        return _json(await self.agent.dataplane.model_metadata(name, version))

    async def model_config(self, request: Request) -> Response:
        name, version = request.params["model"], request.params.get("version")
        return _json(await self.agent.dataplane.model_config(name, version))

    async def model_ready(self, request: Request) -> Response:
        name = request.params["model"]
        ready = await self.agent.model_ready(name, request.params.get("version"))
        return _json({"name": name, "ready": ready}, 200 if ready else 503)

    async def stats(self, request: Request) -> Response:
        name, version = request.params.get("model"), request.params.get("version")
        doc = self.agent.dataplane.model_stats(name, version)
        return _json(granted_stats(doc, request.state.get(GRANT)))

    async def deferred(self, request: Request) -> Response:
        grant = request.state.get(GRANT)
        found = await self.agent.deferred_result(
            request.params["request_id"],
            grant.principal if grant is not None else "",
            (lambda model: grant.allows("infer", model)) if grant is not None else None,
        )
        response = found.pop("response", None)
        head = json.dumps(found, default=str).encode()
        if response is None:
            return Response(200, head, content_type="application/json")
        # the answer's V2 JSON spliced in as encoded, once, off the loop when large (it
        # was encoded, parsed back and encoded again here: 200 ms for a 600 KB answer)
        if v2.encode_needs_worker(response, None):
            chunks, _ = await asyncio.to_thread(v2.encode_response, response)
        else:
            chunks, _ = v2.encode_response(response)
        return Response(
            200,
            [head[:-1], b', "response": ' if found else b'"response": ', *chunks, b"}"],
            content_type="application/json",
        )

    async def infer(self, request: Request) -> Response:
        name, version = request.params["model"], request.params.get("version")
        if version is not None:
            self.agent.dataplane.resolve(name, version)
        decoded = await decode_infer(request, self.limits, self.bodies.inflated)
        decoded.model_version = version
        deadline_ms, priority, deferrable = _steering(decoded.parameters)
        response = await self.agent.dataplane.infer(
            name,
            decoded,
            deadline_ms=deadline_ms,
            priority=priority,
            deferrable=deferrable,
            principal=grant.principal if (grant := request.state.get(GRANT)) else "",
        )
        return await encode_infer(response, decoded)


async def start_local_api(
    agent: Agent,
    host: str,
    port: int,
    *,
    tokens: Tokens | None = None,
    limits: Limits | None = None,
    max_inflight_bytes: int = 64 << 20,
) -> HttpServer:
    """Serve ``agent``'s local API; ``server.port`` says where (port 0 picks one)."""
    api = LocalApi(agent, limits, tokens, max_inflight_bytes)
    # no pool of request bodies on a device: each would stay resident between requests
    options = ServerOptions(
        max_body_bytes=api.limits.max_body_bytes,
        body_pool_bytes=0,
        max_connections=default_max_connections(),
    )
    server = HttpServer(api, options)
    await server.start(host, port)
    return server
