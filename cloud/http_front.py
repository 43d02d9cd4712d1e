"""The cloud node's HTTP front: KServe V2 with Triton's extensions, on aiohttp.

A thin adapter: decode with :mod:`shared.v2`, call the dataplane, encode.
Errors leave as ``{"error": message, "code": code}`` with the status from
:data:`shared.errors.HTTP_STATUS` (and ``Retry-After`` when overloaded);
the process stays up whatever the body holds.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from cloud.admission import ByteBudget, ConnectionGuard, read_body
from cloud.dataplane import DataPlane
from shared import v2
from shared.errors import (
    FerryError,
    InvalidInput,
    PayloadTooLarge,
    PermissionDenied,
    Unauthenticated,
)
from shared.httpbody import binary_response
from shared.repository import parse_config_json, validate_model_name
from shared.tensors import Limits
from shared.tokens import Tokens, bearer, is_loopback

log = logging.getLogger(__name__)

SERVER_NAME = "ferry"
SERVER_VERSION = "0.1.0"
#: Triton's extension names, only for what this server implements
EXTENSIONS = [
    "classification",
    "binary_tensor_data",
    "model_repository",
    "model_configuration",
    "statistics",
    "schedule_policy",
]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
DATAPLANE: web.AppKey[DataPlane] = web.AppKey("dataplane", DataPlane)
#: who sent a request (from its token), the scope of its idempotency key
PRINCIPAL = "ferry.principal"


def error_response(exc: FerryError) -> web.Response:
    status, headers, body = exc.http_error()
    return web.Response(status=status, text=body, content_type="application/json", headers=headers)


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=json.dumps(data), content_type="application/json")


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except FerryError as exc:
        return error_response(exc)
    except web.HTTPRequestEntityTooLarge as exc:
        return error_response(PayloadTooLarge(exc.text or "request body too large"))
    except web.HTTPException as exc:
        if exc.status >= 400:
            code = "not_found" if exc.status == 404 else "invalid_argument"
            return web.Response(
                status=exc.status,
                text=json.dumps({"error": exc.reason, "code": code}),
                content_type="application/json",
            )
        raise
    except Exception:  # the server stays up whatever a handler hits
        log.exception("unhandled error on %s %s", request.method, request.path)
        return web.Response(
            status=500,
            text=json.dumps({"error": "internal server error", "code": "internal"}),
            content_type="application/json",
        )


def _scope(request: web.Request) -> str:
    """The control plane is the repository API and the metrics; the rest is inference."""
    path = request.path
    if path.startswith("/v2/repository/") or path == "/metrics":
        return "admin"
    return "infer"


def _auth(tokens: Tokens | None, open_metrics: bool) -> Any:
    """Health is always open; with no tokens file the control plane answers only
    callers on this machine, and inference is open (as in Triton)."""

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        path = request.path
        if path.startswith("/v2/health/") or (path == "/metrics" and open_metrics):
            return await handler(request)
        scope = _scope(request)
        if tokens is None:
            if scope == "admin" and not is_loopback(request.remote):
                return error_response(
                    PermissionDenied(
                        "the control plane is open to this machine only; "
                        "configure http.tokens_file with an admin token to reach it remotely"
                    )
                )
            return await handler(request)
        given = bearer(request.headers.get("Authorization", ""))
        grant = tokens.find(given) if given is not None else None
        if grant is None:
            return error_response(Unauthenticated("missing or invalid bearer token"))
        model = request.match_info.get("model")
        if not grant.allows(scope, model):
            what = f"model {model!r}" if model and scope == "infer" else f"{scope} operations"
            return error_response(PermissionDenied(f"this token does not cover {what}"))
        request[PRINCIPAL] = grant.principal
        return await handler(request)

    return check


class HttpFront:
    """Routes of the V2 protocol bound to one dataplane."""

    def __init__(
        self,
        dataplane: DataPlane,
        *,
        limits: Limits,
        tokens: Tokens | None = None,
        open_metrics: bool = False,
        metrics: Callable[[], tuple[bytes, str]] | None = None,
        budget: ByteBudget | None = None,
        guard: ConnectionGuard | None = None,
        body_timeout_s: float = 60.0,
    ) -> None:
        self.dataplane = dataplane
        self.limits = limits
        self.budget = budget or ByteBudget(0)
        self.guard = guard
        self.body_timeout_s = body_timeout_s
        self.tokens = tokens
        self.open_metrics = open_metrics
        self.metrics = metrics

    def build_app(self) -> web.Application:
        middlewares = [self._closing, _errors]
        if self.guard is not None:
            middlewares.insert(0, self.guard.middleware())
        middlewares.append(_auth(self.tokens, self.open_metrics))
        app = web.Application(client_max_size=self.limits.max_body_bytes, middlewares=middlewares)
        app[DATAPLANE] = self.dataplane
        r = app.router
        r.add_get("/v2", self.server_metadata)
        r.add_get("/v2/health/live", self.live)
        r.add_get("/v2/health/ready", self.ready)
        r.add_post("/v2/repository/index", self.repository_index)
        r.add_post("/v2/repository/models/{model}/load", self.load)
        r.add_post("/v2/repository/models/{model}/unload", self.unload)
        r.add_get("/v2/models/stats", self.stats)
        for base in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
            r.add_get(base, self.model_metadata)
            r.add_get(base + "/ready", self.model_ready)
            r.add_get(base + "/config", self.model_config)
            r.add_get(base + "/stats", self.stats)
            r.add_post(base + "/infer", self.infer)
        if self.metrics is not None:
            r.add_get("/metrics", self.render_metrics)
        return app

    @web.middleware
    async def _closing(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """While the node drains, every answer closes its connection after it."""
        response = await handler(request)
        if self.dataplane.closing:
            response.force_close()
        return response

    async def server_metadata(self, request: web.Request) -> web.Response:
        return _json({"name": SERVER_NAME, "version": SERVER_VERSION, "extensions": EXTENSIONS})

    async def live(self, request: web.Request) -> web.Response:
        return _json({"live": True})

    async def ready(self, request: web.Request) -> web.Response:
        ready = self.dataplane.is_ready()
        return _json({"ready": ready}, 200 if ready else 503)

    async def model_metadata(self, request: web.Request) -> web.Response:
        m = request.match_info
        return _json(self.dataplane.metadata(m["model"], m.get("version")))

    async def model_ready(self, request: web.Request) -> web.Response:
        m = request.match_info
        ready = self.dataplane.model_ready(m["model"], m.get("version"))
        return _json({"name": m["model"], "ready": ready}, 200 if ready else 503)

    async def model_config(self, request: web.Request) -> web.Response:
        m = request.match_info
        return _json(self.dataplane.model_config(m["model"], m.get("version")))

    async def stats(self, request: web.Request) -> web.Response:
        m = request.match_info
        return _json(self.dataplane.statistics(m.get("model"), m.get("version")))

    async def repository_index(self, request: web.Request) -> web.Response:
        ready_only = False
        if request.can_read_body:
            body = await self._json_body(request)
            ready_only = bool(body.get("ready", False))
        return _json(self.dataplane.index(ready_only))

    async def load(self, request: web.Request) -> web.Response:
        """Triton's load: ``{"parameters": {"config": "<JSON configuration>"}}`` overrides
        the repository's config for this load; model files in parameters are refused."""
        name = validate_model_name(request.match_info["model"])
        config = None
        if request.can_read_body:
            body = await self._json_body(request)
            unknown = sorted(set(body) - {"parameters"})
            if unknown:
                raise InvalidInput(f"load request: unknown keys {unknown}; expected 'parameters'")
            params = body.get("parameters") or {}
            if not isinstance(params, dict):
                raise InvalidInput("load request: 'parameters' must be a JSON object")
            for key in params:
                if key != "config":
                    what = "model files" if key.startswith("file:") else f"parameter {key!r}"
                    raise InvalidInput(f"load request: {what} not supported; only 'config' is")
            if "config" in params:
                config = parse_config_json(params["config"], name)
        await self.dataplane.load(name, config)
        return _json({})

    async def unload(self, request: web.Request) -> web.Response:
        name = validate_model_name(request.match_info["model"])
        await self.dataplane.unload(name)
        return _json({})

    async def _read(self, request: web.Request) -> tuple[bytearray, int]:
        """The body, within the node's byte budget and the body timeout."""
        return await read_body(
            request,
            self.budget,
            timeout_s=self.body_timeout_s,
            max_bytes=self.limits.max_body_bytes,
        )

    async def _json_body(self, request: web.Request) -> dict[str, Any]:
        raw, taken = await self._read(request)
        self.budget.give(taken)  # parsed at once; the document is small next to the body
        if not raw.strip():
            return {}
        try:
            body = json.loads(raw)
        except ValueError as exc:
            raise InvalidInput(f"request body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise InvalidInput("request body must be a JSON object")
        return body

    async def infer(self, request: web.Request) -> web.StreamResponse:
        m = request.match_info
        # An unknown model is refused before its body is read or decoded.
        self.dataplane.check_servable(m["model"], m.get("version"))
        body, taken = await self._read(request)
        try:
            return await self._infer(m, request, body)
        finally:
            self.budget.give(taken)

    async def _infer(
        self, m: Any, request: web.Request, body: bytearray
    ) -> web.StreamResponse:
        header_length = v2.parse_header_length(request.headers.get(v2.HEADER_LENGTH), len(body))
        # Big JSON and BYTES bodies are decoded (and answered) in a worker thread, so
        # one request cannot stall the loop; fixed-size binary tensors are views.
        if v2.decode_needs_worker(body, header_length):
            decoded = await asyncio.to_thread(v2.decode_request, body, header_length, self.limits)
        else:
            decoded = v2.decode_request(body, header_length, self.limits)
        response = await self.dataplane.infer(
            m["model"], decoded, version=m.get("version"), principal=request.get(PRINCIPAL, "")
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

    async def render_metrics(self, request: web.Request) -> web.Response:
        assert self.metrics is not None
        body, content_type = self.metrics()
        response = web.Response(body=body)
        response.headers["Content-Type"] = content_type
        return response
