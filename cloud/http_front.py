"""The cloud node's HTTP front: KServe V2 with Triton's extensions.

A thin adapter over :mod:`shared.aio.http_server`: decode with
:mod:`shared.v2`, call the dataplane, encode.  What can be decided from a
request's head is decided before its body is read (:meth:`HttpFront.admit`):
the route, the token, an unknown model, the node's byte budget.  Errors
leave as ``{"error": message, "code": code}`` with the status from
:data:`shared.errors.HTTP_STATUS` (and ``Retry-After`` when overloaded); the
process stays up whatever the body holds.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from cloud.dataplane import DataPlane
from shared import v2
from shared.admission import ByteBudget
from shared.aio.body_budget import BodyBudget
from shared.aio.http_server import (
    Request,
    Response,
    RoutedApp,
    Router,
    add_v2_routes,
    json_response,
)
from shared.aio.v2http import decode_infer, encode_infer
from shared.errors import FerryError, InvalidInput, PermissionDenied, Unauthenticated
from shared.repository import ModelConfig, validate_model_name
from shared.repository.pbtxt import keep_ferry_sections, parse_load_config
from shared.tensors import Limits
from shared.tokens import Tokens, bearer, granted_stats, is_loopback

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
#: who sent a request (from its token), the scope of its idempotency key
PRINCIPAL = "principal"
GRANT = "grant"


class HttpFront(RoutedApp):
    """Routes of the V2 protocol bound to one dataplane (an ``HttpApp``)."""

    def __init__(
        self,
        dataplane: DataPlane,
        *,
        limits: Limits,
        tokens: Tokens | None = None,
        open_metrics: bool = False,
        metrics: Callable[[], tuple[bytes, str]] | None = None,
        budget: ByteBudget | None = None,
    ) -> None:
        self.dataplane = dataplane
        self.limits = limits
        self.budget = budget or ByteBudget(0)
        self.bodies = BodyBudget(self.budget, limits.max_body_bytes)
        self.tokens = tokens
        self.open_metrics = open_metrics
        self.metrics = metrics
        r = self.router = Router()
        add_v2_routes(r, self)
        r.add("POST", "/v2/repository/models/{model}/load", self.load)
        r.add("POST", "/v2/repository/models/{model}/unload", self.unload)
        if metrics is not None:
            r.add("GET", "/metrics", self.render_metrics)

    # ---- HttpApp ----------------------------------------------------------------------------
    def check(self, request: Request) -> Response | None:
        """Token, unknown model and the node's byte budget, from the head alone."""
        self._authorize(request)
        if request.route == self.infer:  # an unknown model is refused before its body
            self.dataplane.check_servable(request.params["model"], request.params.get("version"))
        return self.bodies.admit(request)

    def receiving(self, request: Request, received: int) -> Response | None:
        return self.bodies.receiving(request, received)

    def _inflated(self, request: Request, size: int) -> None:
        self.bodies.inflated(request, size)

    def finished(self, request: Request) -> None:
        self.bodies.finished(request)

    # ---- access -------------------------------------------------------------------------------
    def _authorize(self, request: Request) -> None:
        """Health is always open; with no tokens file the control plane answers only
        callers on this machine, and inference is open (as in Triton)."""
        path = request.path
        if path.startswith("/v2/health/") or (path == "/metrics" and self.open_metrics):
            return
        scope = "admin" if path.startswith("/v2/repository/") or path == "/metrics" else "infer"
        if self.tokens is None:
            if scope == "admin" and not is_loopback(request.remote):
                raise PermissionDenied(
                    "the control plane is open to this machine only; "
                    "configure http.tokens_file with an admin token to reach it remotely"
                )
            return
        given = bearer(request.header("authorization", "") or "")
        grant = self.tokens.find(given) if given is not None else None
        if grant is None:
            raise Unauthenticated("missing or invalid bearer token")
        model = request.params.get("model")
        if not grant.allows(scope, model):
            what = f"model {model!r}" if model and scope == "infer" else f"{scope} operations"
            raise PermissionDenied(f"this token does not cover {what}")
        request.state[PRINCIPAL] = grant.principal
        request.state[GRANT] = grant

    # ---- routes -------------------------------------------------------------------------------
    async def server_metadata(self, request: Request) -> Response:
        return json_response(
            {"name": SERVER_NAME, "version": SERVER_VERSION, "extensions": EXTENSIONS}
        )

    async def live(self, request: Request) -> Response:
        return json_response({"live": True})

    async def ready(self, request: Request) -> Response:
        ready = self.dataplane.is_ready()
        return json_response({"ready": ready}, 200 if ready else 503)

    async def model_metadata(self, request: Request) -> Response:
        m = request.params
        return json_response(self.dataplane.metadata(m["model"], m.get("version")))

    async def model_ready(self, request: Request) -> Response:
        m = request.params
        ready = self.dataplane.model_ready(m["model"], m.get("version"))
        return json_response({"name": m["model"], "ready": ready}, 200 if ready else 503)

    async def model_config(self, request: Request) -> Response:
        m = request.params
        return json_response(self.dataplane.model_config(m["model"], m.get("version")))

    async def stats(self, request: Request) -> Response:
        m = request.params
        doc = self.dataplane.statistics(m.get("model"), m.get("version"))
        return json_response(granted_stats(doc, request.state.get(GRANT)))

    async def repository_index(self, request: Request) -> Response:
        body = _json_body(request)
        return json_response(self.dataplane.index(bool(body.get("ready", False))))

    async def load(self, request: Request) -> Response:
        """Triton's load: ``{"parameters": {"config": "<JSON configuration>"}}`` overrides
        the repository's config for this load; model files in parameters are refused."""
        name = validate_model_name(request.params["model"])
        config = None
        body = _json_body(request)
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
            config, keep = parse_load_config(params["config"], name)
            if keep:  # Ferry's own sections, which the override does not name, stay
                base = await self._repository_config(name)
                if base is not None:
                    config = keep_ferry_sections(config, base, keep)
        await self.dataplane.load(name, config)
        return json_response({})

    async def _repository_config(self, name: str) -> ModelConfig | None:
        try:
            return await asyncio.to_thread(self.dataplane.repository.read_config, name)
        except FerryError:
            return None  # (a broken or missing file: the override stands alone)

    async def unload(self, request: Request) -> Response:
        name = validate_model_name(request.params["model"])
        await self.dataplane.unload(name)
        return json_response({})

    async def infer(self, request: Request) -> Response:
        m = request.params
        decoded = await decode_infer(request, self.limits, self._inflated)
        response = await self.dataplane.infer(
            m["model"],
            decoded,
            version=m.get("version"),
            principal=request.state.get(PRINCIPAL, ""),
        )
        return await encode_infer(response, decoded)

    async def render_metrics(self, request: Request) -> Response:
        assert self.metrics is not None
        body, content_type = self.metrics()
        return Response(200, body, content_type=content_type)


def _json_body(request: Request) -> dict[str, Any]:
    return v2.json_object(request.body)
