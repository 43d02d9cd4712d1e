"""The MQTT MessagePack envelope (DESIGN.md section 2), sans-IO.

Request: ``{id, model_version?, inputs: [{name, datatype, shape, data}],
outputs?: [name], output_parameters?: {name: {...}}, parameters?}`` (an
output's parameters, Triton's ``classification`` say, in a map of their own,
which a peer that predates them passes over; a node reads ``{name,
parameters}`` items in ``outputs`` too); reply ``{id, model_name, model_version,
outputs, parameters}`` or ``{id, error: {code, message, retry_after_ms?}}``
(``retry_after_ms`` on transient errors such as overloaded).  ``data`` is the
tensor's raw little-endian bytes (BYTES: 4-byte length-prefixed elements).
Decoding hands back views over the payload (msgspec decodes ``bin`` into a
``memoryview`` without copying), so a tensor is copied once per hop: when
the sender packs it.  A request's ``parameters`` may name ``reply_topic``: where
an MQTT 3.1.1 client (no Response Topic property) wants its answer.
"""

from __future__ import annotations

from typing import Any

import msgspec

from shared.datatypes import validate_datatype
from shared.errors import FerryError, InvalidInput, PayloadTooLarge, error_from_code
from shared.messages import InferRequest, InferResponse, RequestedOutput, unique_outputs
from shared.tensors import (
    DEFAULT_LIMITS,
    Limits,
    Tensor,
    array_from_buffer,
    array_to_buffer,
    check_bytes_count,
    check_name,
    check_shape,
)


class WireTensor(msgspec.Struct, kw_only=True):
    name: str
    datatype: str
    shape: list[int]
    data: memoryview  # bytes also encode; decoding yields a view


class WireOutput(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: str
    parameters: dict[str, Any] | None = None


class WireRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    id: str
    model_version: str | None = None
    inputs: list[WireTensor]
    outputs: list[str | WireOutput] | None = None
    output_parameters: dict[str, dict[str, Any]] | None = None
    parameters: dict[str, Any] | None = None


class WireError(msgspec.Struct, omit_defaults=True):
    code: str
    message: str
    #: when to try again, for transient errors (overloaded); absent otherwise
    retry_after_ms: int | None = None


class WireReply(msgspec.Struct, kw_only=True, omit_defaults=True):
    id: str
    model_name: str | None = None
    model_version: str | None = None
    outputs: list[WireTensor] | None = None
    parameters: dict[str, Any] | None = None
    error: WireError | None = None


_request_decoder = msgspec.msgpack.Decoder(WireRequest)
_reply_decoder = msgspec.msgpack.Decoder(WireReply)
_encoder = msgspec.msgpack.Encoder()


def _wire(tensors: list[Tensor]) -> list[WireTensor]:
    return [
        WireTensor(
            name=t.name,
            datatype=t.datatype,
            shape=list(t.shape),
            data=array_to_buffer(t.data, t.datatype),
        )
        for t in tensors
    ]


def _from_wire(items: list[WireTensor], limits: Limits, what: str) -> list[Tensor]:
    if len(items) > limits.max_tensors:
        raise InvalidInput(f"{len(items)} {what}s exceed the limit of {limits.max_tensors}")
    out: list[Tensor] = []
    seen: set[str] = set()
    for item in items:
        name = check_name(item.name, what, limits)
        if name in seen:
            raise InvalidInput(f"{what} {name!r} appears twice")
        seen.add(name)
        datatype = validate_datatype(item.datatype)
        shape = check_shape(item.shape, name, limits)
        check_bytes_count(name, datatype, shape, limits)
        out.append(Tensor(name, datatype, array_from_buffer(name, datatype, shape, item.data)))
    return out


#: a day: a longer back-off hint is a peer's mistake, not advice
_MAX_RETRY_MS = 86_400_000
#: payloads above this are decoded in a worker thread when they may hold BYTES
WORKER_BYTES = 64 << 10


class _PeekTensor(msgspec.Struct):
    datatype: str = ""


class _PeekRequest(msgspec.Struct):
    inputs: list[_PeekTensor] = []


_peek_decoder = msgspec.msgpack.Decoder(_PeekRequest)


def decode_needs_worker(payload: bytes | memoryview) -> bool:
    """Whether decoding ``payload`` could hold the event loop for milliseconds.

    Fixed-size tensors decode as views of the payload, whatever their size;
    BYTES tensors are parsed element by element.  So a payload over
    :data:`WORKER_BYTES` goes to a worker when one of its inputs is BYTES, read
    from the envelope's structure (msgspec steps over the tensor bytes without
    reading them; scanning 602 KB of floats for the word took 0.25 ms).  A
    payload whose structure does not decode is refused on the loop.
    """
    if len(payload) <= WORKER_BYTES:
        return False
    try:
        peek = _peek_decoder.decode(payload)
    except (msgspec.DecodeError, ValueError, RecursionError):
        return False
    return any(t.datatype == "BYTES" for t in peek.inputs)


def encode_needs_worker(response: InferResponse) -> bool:
    """Whether encoding a reply could hold the event loop for milliseconds: BYTES
    outputs are joined element by element, and any output is copied once whole."""
    total = 0
    for t in response.outputs:
        if t.datatype == "BYTES" and t.data.size > 16 << 10:
            return True
        total += t.data.nbytes
    return total > 1 << 20


def _check_size(payload: bytes | memoryview, limits: Limits) -> None:
    if len(payload) > limits.max_body_bytes:
        raise PayloadTooLarge(
            f"payload of {len(payload)} bytes exceeds the limit of {limits.max_body_bytes}"
        )


def encode_request(request: InferRequest) -> bytes:
    if request.id is None:
        raise InvalidInput("an MQTT request needs an id")
    outputs: list[str | WireOutput] | None = None
    extra: dict[str, dict[str, Any]] | None = None
    if request.outputs is not None:
        outputs = [o.name for o in request.outputs]
        # (dropped, a classification asked of an offload came back as the raw tensor)
        extra = {o.name: o.parameters for o in request.outputs if o.parameters} or None
    wire = WireRequest(
        id=request.id,
        model_version=request.model_version,
        inputs=_wire(request.inputs),
        outputs=outputs,
        output_parameters=extra,
        parameters=request.parameters or None,
    )
    return _encoder.encode(wire)


def decode_request(payload: bytes | memoryview, limits: Limits = DEFAULT_LIMITS) -> InferRequest:
    _check_size(payload, limits)
    try:
        raw = _request_decoder.decode(payload)
    except (msgspec.DecodeError, ValueError) as exc:
        hint = (
            " (an MQTT request is the MessagePack envelope, not V2 JSON: see docs)"
            if bytes(payload[:1]) in (b"{", b"[")
            else ""
        )
        raise InvalidInput(f"malformed MQTT request: {exc}{hint}") from None
    except RecursionError:  # msgspec's guard against deeply nested arrays and maps
        raise InvalidInput("malformed MQTT request: nested too deeply") from None
    if not raw.inputs:
        raise InvalidInput("inference request has no inputs")
    outputs = None
    if raw.outputs is not None:
        extra = raw.output_parameters or {}
        outputs = []
        for out in raw.outputs:
            if isinstance(out, str):
                name = check_name(out, "output", limits)
                outputs.append(RequestedOutput(name, None, dict(extra.get(name) or {})))
                continue
            name = check_name(out.name, "output", limits)
            outputs.append(RequestedOutput(name, None, dict(out.parameters or {})))
        outputs = unique_outputs(outputs)
    return InferRequest(
        inputs=_from_wire(raw.inputs, limits, "input"),
        id=raw.id,
        model_version=raw.model_version,
        outputs=outputs,
        parameters=raw.parameters or {},
    )


def peek_request_id(payload: bytes | memoryview) -> str | None:
    """Best-effort id of a request that failed to decode, to address the error reply."""

    class _IdOnly(msgspec.Struct):
        id: str

    try:
        return msgspec.msgpack.decode(payload, type=_IdOnly).id
    except (msgspec.DecodeError, ValueError, TypeError, RecursionError):
        return None


def peek_reply_topic(payload: bytes | memoryview) -> str | None:
    """The ``reply_topic`` a request names in its parameters: where an MQTT 3.1.1
    client, which has no Response Topic property, asks its answer to go."""

    class _ParametersOnly(msgspec.Struct):
        parameters: dict[str, Any] | None = None

    try:
        found = msgspec.msgpack.decode(payload, type=_ParametersOnly).parameters or {}
    except (msgspec.DecodeError, ValueError, TypeError, RecursionError):
        return None
    topic = found.get("reply_topic")
    return topic if isinstance(topic, str) and topic else None


def encode_reply(response: InferResponse) -> bytes:
    wire = WireReply(
        id=response.id or "",
        model_name=response.model_name,
        model_version=response.model_version,
        outputs=_wire(response.outputs),
        parameters=response.parameters or None,
    )
    return _encoder.encode(wire)


def encode_error_reply(request_id: str, error: FerryError) -> bytes:
    retry_ms = (
        None
        if error.retry_after is None
        else min(max(1, round(error.retry_after * 1000)), _MAX_RETRY_MS)
    )
    return _encoder.encode(
        WireReply(id=request_id, error=WireError(error.code.value, error.message, retry_ms))
    )


def decode_reply(
    payload: bytes | memoryview, limits: Limits = DEFAULT_LIMITS
) -> tuple[str, InferResponse | FerryError]:
    """Decode a reply into (id, response) or (id, the typed error the peer sent)."""
    _check_size(payload, limits)
    try:
        raw = _reply_decoder.decode(payload)
    except (msgspec.DecodeError, ValueError) as exc:
        raise InvalidInput(f"malformed MQTT reply: {exc}") from None
    except RecursionError:  # msgspec's guard against deeply nested arrays and maps
        raise InvalidInput("malformed MQTT reply: nested too deeply") from None
    if raw.error is not None:
        error = error_from_code(raw.error.code, raw.error.message)
        if raw.error.retry_after_ms is not None and raw.error.retry_after_ms >= 0:
            error.retry_after = min(raw.error.retry_after_ms, _MAX_RETRY_MS) / 1000
        return raw.id, error
    if raw.model_name is None:
        raise InvalidInput("MQTT reply has neither outputs nor an error")
    response = InferResponse(
        model_name=raw.model_name,
        model_version=raw.model_version,
        id=raw.id,
        outputs=_from_wire(raw.outputs or [], limits, "output"),
        parameters=raw.parameters or {},
    )
    return raw.id, response
