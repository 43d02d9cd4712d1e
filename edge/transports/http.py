"""HTTP client for the cloud tier's V2 API (binary tensors, keep-alive connections).

It runs on :mod:`shared.aio.http_client` rather than aiohttp's client: an
offload is one request on a kept-alive connection, written as a head plus
the tensors, and on a device aiohttp's import alone cost ~13 MiB.
"""

from __future__ import annotations

import errno
import json
import logging
import ssl
import time
from urllib.parse import quote

from edge.transports.base import TransferResult, as_sent
from shared import v2
from shared.aio.http_client import ClientResponse, HttpClient
from shared.errors import (
    DeadlineExceeded,
    EndpointUnavailable,
    FerryError,
    InternalError,
    error_from_code,
)
from shared.messages import InferRequest, InferResponse
from shared.redact import redact_url
from shared.tensors import DEFAULT_LIMITS, Limits

#: seconds a transport whose endpoint refused a connection reads as down
REFUSED_RECHECK_S = 2.0


def _not_there(exc: OSError) -> bool:
    """Whether connecting failed outright: refused, or no route, on every address (a
    name with several, as localhost's ::1 and 127.0.0.1, fails as one plain OSError)."""
    if isinstance(exc, ConnectionRefusedError):
        return True
    if exc.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
        return True
    return type(exc) is OSError and exc.errno is None and "Multiple exceptions" in str(exc)


log = logging.getLogger(__name__)


class HttpTransport:
    name = "http"

    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        limits: Limits = DEFAULT_LIMITS,
        tls_context: ssl.SSLContext | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.limits = limits
        self.tls_context = tls_context
        self._client: HttpClient | None = None
        self._refused_at: float | None = None  # (monotonic) the endpoint refused a connection
        self._denied: str | None = None  # the cloud refused this agent's credentials: why

    @property
    def connected(self) -> bool:
        """Up, unless the endpoint just refused a connection: then down for
        ``REFUSED_RECHECK_S``, after which a request may find it back.  Without it
        a cloud that was stopped stayed "connected" (status, readiness of cloud-only
        models) until enough requests had failed to open the breaker."""
        if self._client is None or self._client.closed:
            return False
        at = self._refused_at
        return at is None or time.monotonic() - at >= REFUSED_RECHECK_S

    async def start(self) -> None:
        headers = [("Authorization", f"Bearer {self.token}")] if self.token else []
        self._client = HttpClient(
            self.base_url,
            tls_context=self.tls_context,
            headers=headers,
            max_body=self.limits.max_body_bytes + (1 << 20),
        )

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def _call(
        self, method: str, path: str, deadline: float, what: str, body: list | None = None,
        headers: list[tuple[str, str]] | None = None,
    ) -> ClientResponse:  # fmt: skip
        if self._client is None:
            raise EndpointUnavailable("HTTP transport not started")
        if deadline <= time.monotonic():
            raise DeadlineExceeded(f"deadline passed before {what} was sent")
        try:
            resp = await self._client.request(method, path, body, headers or (), deadline=deadline)
        except TimeoutError:
            raise DeadlineExceeded(f"no reply to {what} within the deadline") from None
        except OSError as exc:
            if _not_there(exc):
                self._refused_at = time.monotonic()
            raise EndpointUnavailable(
                f"cloud endpoint {redact_url(self.base_url)} unreachable: {exc}"
            ) from None
        self._refused_at = None
        if resp.status in (401, 403) and path != "/v2/health/live":
            if self._denied is None:  # (once, not at every request it fails)
                log.warning(
                    "cloud endpoint %s refused this agent's token (HTTP %d): offloads over it "
                    "fail until [cloud] token_file holds a token it accepts (a restart reads it)",
                    redact_url(self.base_url),
                    resp.status,
                )
            self._denied = f"the cloud refused this agent's token (HTTP {resp.status})"
        elif resp.status == 200 and path != "/v2/health/live":
            self._denied = None
        return resp

    @property
    def last_error(self) -> str | None:
        """Why offloads over this endpoint fail (status shows it, as the MQTT transport
        shows a broker's refusal), None when nothing is known.  A refused connection is
        said until a call gets through: ``connected`` turns optimistic again after
        ``REFUSED_RECHECK_S`` (nothing rechecks a link by itself, which on a cellular
        radio would cost a wake-up each time), and status had shown a dead endpoint
        as plainly connected."""
        at = self._refused_at
        if at is not None:
            ago = time.monotonic() - at
            return f"it refused a connection {ago:.0f} s ago, and no call has got through since"
        return self._denied

    async def probe(self, deadline: float) -> float:
        """Round trip of ``GET /v2/health/live``: a light RTT sample."""
        started = time.monotonic()
        resp = await self._call("GET", "/v2/health/live", deadline, "the HTTP probe")
        if resp.status != 200:
            raise EndpointUnavailable(f"cloud endpoint answered HTTP {resp.status}")
        return time.monotonic() - started

    async def get_json(self, path: str, deadline: float) -> dict:
        """GET a JSON document of the cloud's V2 API (metadata, config) for the local API."""
        resp = await self._call("GET", path, deadline, f"GET {path}")
        if resp.status != 200:
            raise _http_error(resp.status, bytes(resp.body))
        try:
            doc = json.loads(resp.body)
        except ValueError:
            raise InternalError(f"GET {path}: the cloud answered invalid JSON") from None
        if not isinstance(doc, dict):
            raise InternalError(f"GET {path}: the cloud answered a non-object")
        return doc

    async def infer(self, model: str, request: InferRequest, deadline: float) -> TransferResult:
        chunks, header_length = v2.encode_request(as_sent(request, deadline, time.monotonic()))
        headers = [("Content-Type", v2.BINARY_CONTENT_TYPE)]
        if header_length is not None:
            headers.append((v2.HEADER_LENGTH, str(header_length)))
        sent = sum(len(c) for c in chunks)
        started = time.monotonic()
        version = request.model_version
        # (each name one path segment, however the app spelt it: a version decoded from
        # the app's '%2F' had become a path of the cloud's own)
        at = f"/v2/models/{quote(model, safe='')}"
        path = f"{at}/versions/{quote(version, safe='')}/infer" if version else f"{at}/infer"
        resp = await self._call("POST", path, deadline, f"model {model!r}", chunks, headers)
        if resp.status != 200:
            raise _http_error(resp.status, bytes(resp.body))
        response = _decode_reply(resp, self.limits)
        return TransferResult(response, sent, len(resp.body), started, time.monotonic())


def _decode_reply(resp: ClientResponse, limits: Limits) -> InferResponse:
    """A 200 reply's tensors; a malformed one is the cloud's fault, not the caller's input."""
    try:
        header_length = v2.parse_header_length(resp.header(v2.HEADER_LENGTH), len(resp.body))
        return v2.decode_response(resp.body, header_length, limits)
    except FerryError as exc:
        raise InternalError(f"the cloud's reply is malformed: {exc.message}") from None


def _http_error(status: int, payload: bytes) -> FerryError:
    try:
        doc = json.loads(payload)
        message = str(doc.get("error", payload[:200]))
        code = doc.get("code")
    except (ValueError, AttributeError):
        message, code = payload[:200].decode(errors="replace"), None
    if code:
        return error_from_code(code, message)
    return {
        404: error_from_code("not_found", message),
        503: EndpointUnavailable(message),
        504: DeadlineExceeded(message),
    }.get(status, InternalError(f"HTTP {status}: {message}"))
