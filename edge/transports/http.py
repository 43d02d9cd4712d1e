"""HTTP client for the cloud tier's V2 API (aiohttp, binary tensors)."""

from __future__ import annotations

import json
import ssl
import time
from typing import Any

import aiohttp

from edge.transports.base import TransferResult
from shared import v2
from shared.errors import (
    DeadlineExceeded,
    EndpointUnavailable,
    FerryError,
    InternalError,
    error_from_code,
)
from shared.messages import InferRequest, InferResponse
from shared.tensors import DEFAULT_LIMITS, Limits


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
        self._session: aiohttp.ClientSession | None = None

    @property
    def connected(self) -> bool:
        return self._session is not None and not self._session.closed

    async def start(self) -> None:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else None
        connector = aiohttp.TCPConnector(
            limit=64, force_close=False, ssl=self.tls_context if self.tls_context else True
        )
        self._session = aiohttp.ClientSession(headers=headers, connector=connector)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def probe(self, deadline: float) -> float:
        """Round trip of ``GET /v2/health/live``: a light RTT sample."""
        if self._session is None:
            raise EndpointUnavailable("HTTP transport not started")
        started = time.monotonic()
        try:
            async with self._session.get(
                f"{self.base_url}/v2/health/live",
                timeout=aiohttp.ClientTimeout(total=max(deadline - started, 0.001)),
            ) as resp:
                await resp.read()
                if resp.status != 200:
                    raise EndpointUnavailable(f"cloud endpoint answered HTTP {resp.status}")
        except TimeoutError:
            raise DeadlineExceeded("HTTP probe timed out") from None
        except aiohttp.ClientError as exc:
            raise EndpointUnavailable(f"cloud endpoint {self.base_url} unreachable: {exc}") from None
        return time.monotonic() - started

    async def get_json(self, path: str, deadline: float) -> dict:
        """GET a JSON document of the cloud's V2 API (metadata, config) for the local API."""
        if self._session is None:
            raise EndpointUnavailable("HTTP transport not started")
        try:
            async with self._session.get(
                f"{self.base_url}{path}",
                timeout=aiohttp.ClientTimeout(total=max(deadline - time.monotonic(), 0.001)),
            ) as resp:
                payload = await resp.read()
                if resp.status != 200:
                    raise _http_error(resp.status, payload)
        except TimeoutError:
            raise DeadlineExceeded(f"no reply to GET {path} within the deadline") from None
        except aiohttp.ClientError as exc:
            raise EndpointUnavailable(f"cloud endpoint {self.base_url} unreachable: {exc}") from None
        try:
            doc = json.loads(payload)
        except ValueError:
            raise InternalError(f"GET {path}: the cloud answered invalid JSON") from None
        if not isinstance(doc, dict):
            raise InternalError(f"GET {path}: the cloud answered a non-object")
        return doc

    async def infer(self, model: str, request: InferRequest, deadline: float) -> TransferResult:
        if self._session is None:
            raise EndpointUnavailable("HTTP transport not started")
        chunks, header_length = v2.encode_request(request)
        body = v2.join(chunks)
        headers = {"Content-Type": v2.BINARY_CONTENT_TYPE}
        if header_length is not None:
            headers[v2.HEADER_LENGTH] = str(header_length)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise DeadlineExceeded("deadline passed before the request was sent")
        url = f"{self.base_url}/v2/models/{model}/infer"
        started = time.monotonic()
        try:
            async with self._session.post(
                url, data=body, headers=headers, timeout=aiohttp.ClientTimeout(total=remaining)
            ) as resp:
                payload = await resp.read()
                if resp.status != 200:
                    raise _http_error(resp.status, payload)
                response = _decode_reply(payload, resp.headers, self.limits)
        except TimeoutError:
            raise DeadlineExceeded(
                f"no HTTP reply from model {model!r} within the deadline"
            ) from None
        except aiohttp.ClientError as exc:
            raise EndpointUnavailable(f"cloud endpoint {self.base_url} unreachable: {exc}") from None
        return TransferResult(response, len(body), len(payload), started, time.monotonic())


def _decode_reply(payload: bytes, headers: Any, limits: Limits) -> InferResponse:
    """A 200 reply's tensors; a malformed one is the cloud's fault, not the caller's input."""
    try:
        return v2.decode_response(
            payload, v2.parse_header_length(headers.get(v2.HEADER_LENGTH), len(payload)), limits
        )
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
