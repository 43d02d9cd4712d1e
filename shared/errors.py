"""One error hierarchy for both tiers.

Every failure that can reach a client is a :class:`FerryError` carrying a
transport-neutral :class:`ErrorCode`.  Fronts never invent their own error
shapes: they map the code through :data:`HTTP_STATUS` (HTTP) or copy it into
the reply envelope (MQTT), so a client sees the same code whichever way the
request travelled.
"""

from __future__ import annotations

import json
from enum import Enum


class ErrorCode(str, Enum):
    """Codes shared by HTTP and MQTT replies (values are the wire strings)."""

    INVALID_ARGUMENT = "invalid_argument"
    PAYLOAD_TOO_LARGE = "payload_too_large"
    UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type"
    NOT_FOUND = "not_found"
    UNAVAILABLE = "unavailable"
    SHUTTING_DOWN = "shutting_down"
    MODEL_NOT_READY = "model_not_ready"
    OVERLOADED = "overloaded"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    UNAUTHENTICATED = "unauthenticated"
    PERMISSION_DENIED = "permission_denied"
    CONFLICT = "conflict"
    INVALID_CONFIG = "invalid_config"
    BACKEND_MISSING = "backend_missing"
    CANCELLED = "cancelled"
    INTERNAL = "internal"


#: HTTP status for each code (used by the HTTP fronts of both tiers).
HTTP_STATUS: dict[ErrorCode, int] = {
    ErrorCode.INVALID_ARGUMENT: 400,
    ErrorCode.PAYLOAD_TOO_LARGE: 413,
    ErrorCode.UNSUPPORTED_MEDIA_TYPE: 415,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.UNAVAILABLE: 503,
    ErrorCode.SHUTTING_DOWN: 503,
    ErrorCode.MODEL_NOT_READY: 503,
    ErrorCode.OVERLOADED: 503,
    ErrorCode.DEADLINE_EXCEEDED: 504,
    ErrorCode.UNAUTHENTICATED: 401,
    ErrorCode.PERMISSION_DENIED: 403,
    ErrorCode.CONFLICT: 409,
    ErrorCode.INVALID_CONFIG: 400,
    ErrorCode.BACKEND_MISSING: 501,
    ErrorCode.CANCELLED: 499,  # as gRPC's CANCELLED maps to HTTP (nginx's "client closed")
    ErrorCode.INTERNAL: 500,
}


class FerryError(Exception):
    """Base of every error Ferry reports to a client.

    ``retry_after`` (seconds) is set where the condition is transient, so the
    HTTP front can emit ``Retry-After`` and MQTT clients can back off.
    """

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after

    @property
    def http_status(self) -> int:
        return HTTP_STATUS[self.code]

    def to_dict(self) -> dict[str, str]:
        return {"code": self.code.value, "message": self.message}

    def http_error(self) -> tuple[int, dict[str, str], str]:
        """(status, headers, JSON body) as both tiers' HTTP fronts send it."""
        headers = {}
        if self.retry_after is not None:
            headers["Retry-After"] = str(max(1, round(self.retry_after)))
        return (
            self.http_status,
            headers,
            json.dumps({"error": self.message, "code": self.code.value}),
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.code.value}: {self.message})"


class InvalidInput(FerryError):
    code = ErrorCode.INVALID_ARGUMENT


class PayloadTooLarge(FerryError):
    code = ErrorCode.PAYLOAD_TOO_LARGE


class UnsupportedMediaType(FerryError):
    """A body in an encoding Ferry cannot read (a ``Content-Encoding`` other than gzip,
    deflate or identity)."""

    code = ErrorCode.UNSUPPORTED_MEDIA_TYPE


class ModelNotFound(FerryError):
    code = ErrorCode.NOT_FOUND


class EndpointUnavailable(FerryError):
    """The endpoint cannot serve anything now (unreachable, not connected, no node).

    The agent counts it against the transport's circuit breaker; a model-level
    failure (:class:`ModelNotReady`) must not be, or one broken model in the
    cloud would close the transport for every model.
    """

    code = ErrorCode.UNAVAILABLE


class ShuttingDown(EndpointUnavailable):
    """The node is draining: it answers what it has and takes nothing new."""

    code = ErrorCode.SHUTTING_DOWN

    def __init__(self, message: str, *, retry_after: float | None = 1.0) -> None:
        super().__init__(message, retry_after=retry_after)


class ModelNotReady(FerryError):
    """This model cannot run here now (failed to load, unloaded, session closed)."""

    code = ErrorCode.MODEL_NOT_READY


class Overloaded(FerryError):
    code = ErrorCode.OVERLOADED


class DeadlineExceeded(FerryError):
    code = ErrorCode.DEADLINE_EXCEEDED


class Unauthenticated(FerryError):
    code = ErrorCode.UNAUTHENTICATED


class PermissionDenied(FerryError):
    """The caller is known but its token does not cover this operation or model."""

    code = ErrorCode.PERMISSION_DENIED


class IdempotencyConflict(FerryError):
    """An idempotency key came back with different inputs: never answer it with
    another request's outputs."""

    code = ErrorCode.CONFLICT


class ConfigError(FerryError):
    """A configuration file is wrong; the message names file, key and expectation."""

    code = ErrorCode.INVALID_CONFIG


class BackendMissing(FerryError):
    """A runtime's package (or the hardware it needs) is not available here."""

    code = ErrorCode.BACKEND_MISSING


class RunCancelled(FerryError):
    """A run stopped halfway because its answer was no longer wanted (see
    :class:`shared.runtimes.base.Cancel`); no client is ever answered with it."""

    code = ErrorCode.CANCELLED


class InternalError(FerryError):
    code = ErrorCode.INTERNAL


_BY_CODE: dict[str, type[FerryError]] = {
    cls.code.value: cls
    for cls in (
        InvalidInput,
        PayloadTooLarge,
        UnsupportedMediaType,
        ModelNotFound,
        EndpointUnavailable,
        ShuttingDown,
        ModelNotReady,
        Overloaded,
        DeadlineExceeded,
        Unauthenticated,
        PermissionDenied,
        IdempotencyConflict,
        ConfigError,
        BackendMissing,
        RunCancelled,
        InternalError,
    )
}


def error_from_code(code: str, message: str) -> FerryError:
    """Rebuild the typed error a peer reported (unknown codes become internal)."""
    cls = _BY_CODE.get(code, InternalError)
    return cls(message)
