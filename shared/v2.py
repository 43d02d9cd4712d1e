"""KServe V2 / Triton HTTP inference codec, with the binary tensor extension.

Sans-IO: functions take and return bytes (or lists of buffers to write in
order) and the ``Inference-Header-Content-Length`` value; the HTTP fronts and
clients of both tiers add the sockets.  A binary body is a JSON header
followed by the raw tensors, in input order, of every tensor whose
parameters carry ``binary_data_size``.  Fixed-size binary tensors are decoded
as views over the body (no copy); encoded binary outputs are returned as
views over the output arrays, so the only copy is the socket write.
"""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec

from shared.datatypes import validate_datatype
from shared.errors import InvalidInput, PayloadTooLarge
from shared.messages import InferRequest, InferResponse, RequestedOutput, unique_outputs
from shared.tensors import (
    DEFAULT_LIMITS,
    Limits,
    Tensor,
    array_from_buffer,
    array_to_buffer,
    cast_json_data,
    check_bytes_count,
    check_name,
    check_shape,
    json_data,
)

HEADER_LENGTH = "Inference-Header-Content-Length"
JSON_CONTENT_TYPE = "application/json"
BINARY_CONTENT_TYPE = "application/octet-stream"

Chunks = list[bytes | memoryview]


class _JsonTensor(msgspec.Struct, kw_only=True):
    name: Any
    shape: Any
    datatype: Any
    parameters: dict[str, Any] = {}
    data: Any = msgspec.UNSET


class _JsonOutputRequest(msgspec.Struct, kw_only=True):
    name: str
    parameters: dict[str, Any] = {}


class _JsonRequest(msgspec.Struct, kw_only=True):
    id: str | None = None
    parameters: dict[str, Any] = {}
    inputs: list[_JsonTensor]
    outputs: list[_JsonOutputRequest] | None = None


class _JsonResponse(msgspec.Struct, kw_only=True):
    model_name: str
    model_version: str | None = None
    id: str | None = None
    parameters: dict[str, Any] = {}
    outputs: list[_JsonTensor] = []


_request_decoder = msgspec.json.Decoder(_JsonRequest)
_response_decoder = msgspec.json.Decoder(_JsonResponse)
_encoder = msgspec.json.Encoder()


def parse_header_length(value: str | None, body_length: int) -> int | None:
    """Validate the ``Inference-Header-Content-Length`` header value."""
    if value is None:
        return None
    stripped = value.strip(" \t")
    # (int() takes "+6", "1_0", "٣", and refuses 4,300 digits with a ValueError)
    if not stripped.isascii() or not stripped.isdigit() or len(stripped) > 18:
        raise InvalidInput(f"{HEADER_LENGTH} must be an integer, got {value!r}")
    length = int(stripped)
    if length <= 0 or length > body_length:
        raise InvalidInput(f"{HEADER_LENGTH} is {length} but the body holds {body_length} bytes")
    return length


#: JSON parts above this take milliseconds to decode or print: worth a worker thread
JSON_WORKER_BYTES = 1 << 20
#: binary BYTES data above this may be worth a worker thread (by its element count)
BYTES_WORKER_BYTES = 64 << 10
#: BYTES elements parsed one by one past this take milliseconds: a worker thread
BYTES_WORKER_ELEMENTS = 4096
#: bytes a few BYTES elements may copy on the loop (~1 ms)
BYTES_LOOP_BYTES = 4 << 20
#: elements of a JSON output likely past JSON_WORKER_BYTES once printed
_JSON_WORKER_ELEMENTS = JSON_WORKER_BYTES // 8
#: BYTES elements an encoder copies one by one: worth a worker thread
_BYTES_WORKER_ELEMENTS = 16 << 10


class _PeekTensor(msgspec.Struct):
    datatype: str = ""
    shape: list[int] = []


class _PeekRequest(msgspec.Struct):
    inputs: list[_PeekTensor] = []


_peek_decoder = msgspec.json.Decoder(_PeekRequest)


def decode_needs_worker(body: bytes | memoryview, header_length: int | None) -> bool:
    """Whether decoding ``body`` could hold the event loop for milliseconds.

    Fixed-size binary tensors are views over the body (cheap at any size);
    what costs is a big JSON part, or binary BYTES data parsed element by
    element.  That cost follows the element count, read from the JSON
    header: one 95 KB JPEG is one slice, not a reason for a thread hop.
    """
    if header_length is None:
        return len(body) > JSON_WORKER_BYTES
    if header_length > JSON_WORKER_BYTES:
        return True
    binary = len(body) - header_length
    if binary <= BYTES_WORKER_BYTES:
        return False
    try:
        peek = _peek_decoder.decode(memoryview(body)[:header_length])
    except (msgspec.DecodeError, ValueError, RecursionError):
        return False  # refused on the loop, cheaply
    elements = 0
    for tensor in peek.inputs:
        if tensor.datatype == "BYTES":
            count = 1
            for d in tensor.shape:
                count *= max(0, d) if isinstance(d, int) else 0
            elements += count
    if not elements:
        return False
    return elements > BYTES_WORKER_ELEMENTS or binary > BYTES_LOOP_BYTES


def encode_needs_worker(response: InferResponse, request: InferRequest | None) -> bool:
    """Whether encoding ``response`` could hold the event loop for milliseconds."""
    json_elements = 0
    for tensor in response.outputs:
        size = tensor.data.size
        if tensor.datatype == "BYTES" and size > _BYTES_WORKER_ELEMENTS:
            return True
        if request is None or not wants_binary(request, tensor.name):
            json_elements += size
    return json_elements > _JSON_WORKER_ELEMENTS


_INT_RANGE = (-(1 << 63), (1 << 64) - 1)


def _check_parameters(params: dict[str, Any], where: str) -> dict[str, Any]:
    """Parameters travel on as MessagePack (the agent's offload, the MQTT front):
    integers must fit 64 bits there, so one that does not is refused here."""
    stack: list[tuple[Any, int]] = [(params, 0)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict | list):
            if depth >= MAX_PARAMETER_DEPTH:  # (the JSON decoder's own limit is the
                # interpreter's recursion limit: ~1,000 levels on 3.11, ~10,000 on 3.13)
                raise InvalidInput(
                    f"{where} parameters: nested too deeply (more than "
                    f"{MAX_PARAMETER_DEPTH} levels)"
                )
            children = value.values() if isinstance(value, dict) else value
            stack.extend((child, depth + 1) for child in children)
        elif isinstance(value, int) and not _INT_RANGE[0] <= value <= _INT_RANGE[1]:
            raise InvalidInput(f"{where} parameters: integer {value} does not fit 64 bits")
    return params


#: levels of objects and arrays a request's parameters may nest (V2 parameters are flat)
MAX_PARAMETER_DEPTH = 32


def _split(
    body: bytes | memoryview, header_length: int | None, limits: Limits, what: str
) -> tuple[memoryview, memoryview]:
    """Check the body and JSON sizes, then cut the JSON header from the binary tensors."""
    view = memoryview(body)
    if len(view) > limits.max_body_bytes:
        raise PayloadTooLarge(
            f"{what} body of {len(view)} bytes exceeds the limit of {limits.max_body_bytes}"
        )
    if header_length is None:
        header, binary = view, view[len(view) :]
    elif isinstance(header_length, bool) or not isinstance(header_length, int):
        raise InvalidInput(
            f"{HEADER_LENGTH} must be an integer, got {type(header_length).__name__}"
        )
    elif header_length <= 0 or header_length > len(view):
        raise InvalidInput(
            f"{HEADER_LENGTH} is {header_length} but the body holds {len(view)} bytes"
        )
    else:
        header, binary = view[:header_length], view[header_length:]
    if len(header) > limits.max_json_body_bytes:
        hint = "binary_data_output" if what == "response" else "binary_data_size"
        raise PayloadTooLarge(
            f"{what} JSON of {len(header)} bytes exceeds the JSON limit of "
            f"{limits.max_json_body_bytes}; send large tensors as binary tensor data "
            f"({hint} with {HEADER_LENGTH}), which costs no more memory than its bytes"
        )
    return header, binary


def _tensors(
    items: list[_JsonTensor], binary: memoryview, limits: Limits, what: str
) -> list[Tensor]:
    if len(items) > limits.max_tensors:
        raise InvalidInput(f"{len(items)} {what}s exceed the limit of {limits.max_tensors}")
    tensors: list[Tensor] = []
    seen: set[str] = set()
    offset = 0
    for item in items:
        name = check_name(item.name, what, limits)
        if name in seen:
            raise InvalidInput(f"{what} {name!r} appears twice")
        seen.add(name)
        if not isinstance(item.datatype, str):
            raise InvalidInput(f"{what} {name!r}: datatype must be a string")
        datatype = validate_datatype(item.datatype)
        shape = check_shape(item.shape, name, limits)
        check_bytes_count(name, datatype, shape, limits)
        params = item.parameters
        size = params.get("binary_data_size")
        if size is not None:
            if item.data is not msgspec.UNSET:
                raise InvalidInput(f"{what} {name!r} has both data and binary_data_size")
            if type(size) is not int or size < 0:
                raise InvalidInput(
                    f"{what} {name!r}: binary_data_size must be a non-negative integer"
                )
            if offset + size > len(binary):
                raise InvalidInput(
                    f"{what} {name!r}: binary_data_size {size} runs past the body "
                    f"({len(binary) - offset} bytes remain)"
                )
            data = array_from_buffer(name, datatype, shape, binary[offset : offset + size])
            offset += size
            params = {k: v for k, v in params.items() if k != "binary_data_size"}
        elif item.data is msgspec.UNSET:
            raise InvalidInput(f"{what} {name!r} has no data and no binary_data_size")
        else:
            data = cast_json_data(name, datatype, shape, item.data)
        tensors.append(Tensor(name, datatype, data, _check_parameters(params, f"{what} {name!r}")))
    if offset != len(binary):
        raise InvalidInput(
            f"{len(binary) - offset} bytes of binary data are not claimed by any {what}"
        )
    return tensors


_NONFINITE = re.compile(rb"(?<![\w\"])-?(?:NaN|Infinity)(?![\w\"])")


def _decode_nonfinite(header: bytes | memoryview) -> _JsonRequest | None:
    """A request whose numbers include bare ``NaN``/``Infinity`` tokens, else None.

    They are not JSON, but Python's ``json.dumps`` (and so tritonclient's
    JSON mode) writes them, and Triton's parser reads them: an FP32 input
    holding inf must not be refused as malformed.  Only this rare path pays
    for the slower parser.
    """
    text = bytes(header)
    if not _NONFINITE.search(text):
        return None
    try:
        return msgspec.convert(json.loads(text), _JsonRequest)
    except (ValueError, TypeError, msgspec.ValidationError, RecursionError):
        return None


def json_object(body: bytes | bytearray | memoryview, what: str = "request body") -> dict[str, Any]:
    """A JSON object body of a control request (repository index and load, the agent's
    link); empty is {}.  Deep nesting is a 400 like any malformed body (json's
    RecursionError had been a 500 with a traceback in the log)."""
    raw = bytes(body)
    if not raw.strip():
        return {}
    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise InvalidInput(f"{what} is not valid JSON: {exc}") from None
    except RecursionError:
        raise InvalidInput(f"{what} is not valid JSON: nested too deeply") from None
    if not isinstance(value, dict):
        raise InvalidInput(f"{what} must be a JSON object")
    return value


def decode_request(
    body: bytes | memoryview, header_length: int | None = None, limits: Limits = DEFAULT_LIMITS
) -> InferRequest:
    """Decode a V2 infer request body (JSON, or JSON header + binary tensors)."""
    header, binary = _split(body, header_length, limits, "request")
    try:
        raw = _request_decoder.decode(header)
    except (msgspec.DecodeError, ValueError) as exc:
        raw = _decode_nonfinite(header)
        if raw is None:
            raise InvalidInput(f"malformed inference request: {exc}") from None
    except RecursionError:
        raise InvalidInput("malformed inference request: JSON nested too deeply") from None
    if not raw.inputs:
        raise InvalidInput("inference request has no inputs")
    inputs = _tensors(raw.inputs, binary, limits, "input")
    outputs = None
    if raw.outputs is not None:
        outputs = []
        for out in raw.outputs:
            check_name(out.name, "output", limits)
            flag = out.parameters.get("binary_data")
            if flag is not None and not isinstance(flag, bool):
                raise InvalidInput(f"output {out.name!r}: binary_data must be true or false")
            params = {k: v for k, v in out.parameters.items() if k != "binary_data"}
            _check_parameters(params, f"output {out.name!r}")
            outputs.append(RequestedOutput(out.name, flag, params))
        outputs = unique_outputs(outputs)
    parameters = _check_parameters(dict(raw.parameters), "request")
    flag = parameters.get("binary_data_output")
    if flag is not None and not isinstance(flag, bool):  # ("yes" read as true, "false" too)
        raise InvalidInput("request parameter binary_data_output must be true or false")
    return InferRequest(inputs=inputs, id=raw.id, outputs=outputs, parameters=parameters)


def checked_timeout_us(value: object) -> int:
    """A request's V2 ``timeout`` parameter (microseconds; 0: none), checked alike on
    both tiers."""
    if type(value) is not int or value < 0:
        raise InvalidInput(f"timeout must be a non-negative integer (us), got {value!r}")
    return value


def checked_priority(value: object) -> int:
    """A request's V2 ``priority`` parameter, checked alike on both tiers."""
    if type(value) is not int or value < 0:
        raise InvalidInput(f"priority must be a non-negative integer, got {value!r}")
    return value


def wants_binary(request: InferRequest, name: str) -> bool:
    """Whether output ``name`` goes back as binary (per-output flag wins)."""
    if request.outputs is not None:
        for out in request.outputs:
            if out.name == name and out.binary is not None:
                return out.binary
    return bool(request.parameters.get("binary_data_output", False))


def _encode_tensors(tensors: list[Tensor], binary_for: Any) -> tuple[list[dict[str, Any]], Chunks]:
    entries: list[dict[str, Any]] = []
    blobs: Chunks = []
    for tensor in tensors:
        entry: dict[str, Any] = {
            "name": tensor.name,
            "datatype": tensor.datatype,
            "shape": list(tensor.shape),
        }
        params = dict(tensor.parameters)
        if binary_for(tensor.name):
            blob = array_to_buffer(tensor.data, tensor.datatype)
            params["binary_data_size"] = len(blob)
            blobs.append(blob)
        else:
            entry["data"] = _json_data(tensor)
        if params:
            entry["parameters"] = params
        entries.append(entry)
    return entries, blobs


#: elements printed per step of a big JSON output (each step a few milliseconds)
_JSON_CHUNK = 1 << 15


def _json_data(tensor: Tensor) -> list | msgspec.Raw:
    """The data of a JSON output; a big one printed in steps, so a worker thread
    printing it lets the event loop have the GIL between steps."""
    flat = tensor.data.reshape(-1)
    if flat.size <= _JSON_CHUNK:
        return json_data(tensor.data, tensor.datatype)
    parts = [
        _encoder.encode(json_data(flat[i : i + _JSON_CHUNK], tensor.datatype))[1:-1]
        for i in range(0, flat.size, _JSON_CHUNK)
    ]
    return msgspec.Raw(b"[" + b",".join(parts) + b"]")


def _assemble(doc: dict[str, Any], blobs: Chunks) -> tuple[Chunks, int | None]:
    header = _encoder.encode(doc)
    if not blobs:
        return [header], None
    return [header, *blobs], len(header)


def encode_response(
    response: InferResponse, request: InferRequest | None = None
) -> tuple[Chunks, int | None]:
    """Encode a response; returns buffers to write in order and the header length.

    The header length is None when every output went back as JSON (then the
    body is plain JSON and no ``Inference-Header-Content-Length`` is sent).
    """

    def binary_for(name: str) -> bool:
        return request is not None and wants_binary(request, name)

    entries, blobs = _encode_tensors(response.outputs, binary_for)
    doc: dict[str, Any] = {"model_name": response.model_name}
    if response.model_version is not None:
        doc["model_version"] = response.model_version
    if response.id is not None:
        doc["id"] = response.id
    if response.parameters:
        doc["parameters"] = response.parameters
    doc["outputs"] = entries
    return _assemble(doc, blobs)


def encode_request(
    request: InferRequest, *, binary_inputs: bool = True, binary_outputs: bool = True
) -> tuple[Chunks, int | None]:
    """Client side: encode a request (binary tensors by default)."""
    entries, blobs = _encode_tensors(request.inputs, lambda _name: binary_inputs)
    doc: dict[str, Any] = {}
    if request.id is not None:
        doc["id"] = request.id
    params = dict(request.parameters)
    if request.outputs is None and binary_outputs:
        params["binary_data_output"] = True
    if params:
        doc["parameters"] = params
    doc["inputs"] = entries
    if request.outputs is not None:
        doc["outputs"] = [
            {
                "name": out.name,
                "parameters": {
                    **out.parameters,
                    "binary_data": binary_outputs if out.binary is None else out.binary,
                },
            }
            for out in request.outputs
        ]
    return _assemble(doc, blobs)


def decode_response(
    body: bytes | memoryview, header_length: int | None = None, limits: Limits = DEFAULT_LIMITS
) -> InferResponse:
    """Client side: decode a V2 infer response body (same limits as a request)."""
    header, binary = _split(body, header_length, limits, "response")
    try:
        raw = _response_decoder.decode(header)
    except (msgspec.DecodeError, ValueError) as exc:
        raise InvalidInput(f"malformed inference response: {exc}") from None
    except RecursionError:
        raise InvalidInput("malformed inference response: JSON nested too deeply") from None
    outputs = _tensors(raw.outputs, binary, limits, "output") if raw.outputs else []
    return InferResponse(
        model_name=raw.model_name,
        model_version=raw.model_version,
        id=raw.id,
        outputs=outputs,
        parameters=dict(raw.parameters),
    )


def join(chunks: Chunks) -> bytes:
    """One contiguous body (for transports that cannot write several buffers)."""
    return b"".join(chunks)
