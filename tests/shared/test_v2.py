import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared import v2
from shared.errors import FerryError, InvalidInput, PayloadTooLarge
from shared.messages import InferRequest, InferResponse, RequestedOutput
from shared.tensors import Limits, Tensor
from tests.shared.strategies import same, tensors


def _unique(ts: list[Tensor]) -> list[Tensor]:
    seen: dict[str, Tensor] = {}
    for t in ts:
        seen.setdefault(t.name, t)
    return list(seen.values())


@settings(max_examples=150, deadline=None)
@given(st.lists(tensors(), min_size=1, max_size=4))
def test_binary_request_round_trips_every_datatype(ts):
    request = InferRequest(inputs=_unique(ts), id="r1")
    chunks, header_length = v2.encode_request(request)
    decoded = v2.decode_request(v2.join(chunks), header_length)
    assert decoded.id == "r1"
    assert all(same(a, b) for a, b in zip(request.inputs, decoded.inputs, strict=True))


@settings(max_examples=150, deadline=None)
@given(st.lists(tensors(finite=True), min_size=1, max_size=4))
def test_json_request_round_trips_every_datatype(ts):
    request = InferRequest(inputs=_unique(ts))
    chunks, header_length = v2.encode_request(request, binary_inputs=False)
    assert header_length is None
    decoded = v2.decode_request(v2.join(chunks))
    assert all(same(a, b) for a, b in zip(request.inputs, decoded.inputs, strict=True))


@settings(max_examples=100, deadline=None)
@given(st.lists(tensors(finite=True), min_size=1, max_size=3), st.booleans())
def test_response_round_trips_binary_or_json(ts, binary):
    outputs = _unique(ts)
    request = InferRequest(inputs=[], outputs=[RequestedOutput(t.name, binary) for t in outputs])
    response = InferResponse("m", outputs, "1", "id-7", {"node": "a"})
    chunks, header_length = v2.encode_response(response, request)
    assert (header_length is not None) == binary
    decoded = v2.decode_response(v2.join(chunks), header_length)
    assert decoded.model_name == "m" and decoded.id == "id-7"
    assert decoded.parameters == {"node": "a"}
    assert all(same(a, b) for a, b in zip(outputs, decoded.outputs, strict=True))


def test_nested_json_data_is_accepted():
    body = json.dumps(
        {"inputs": [{"name": "x", "shape": [2, 2], "datatype": "INT32", "data": [[1, 2], [3, 4]]}]}
    ).encode()
    decoded = v2.decode_request(body)
    assert decoded.inputs[0].data.tolist() == [[1, 2], [3, 4]]


def test_binary_input_is_a_view_over_the_body():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    chunks, hl = v2.encode_request(InferRequest(inputs=[Tensor.from_array("x", x)]))
    body = v2.join(chunks)
    decoded = v2.decode_request(body, hl)
    assert decoded.inputs[0].data.base is not None
    assert not decoded.inputs[0].data.flags.owndata


def test_binary_output_default_follows_request_parameter():
    request = InferRequest(inputs=[], parameters={"binary_data_output": True})
    response = InferResponse("m", [Tensor.from_array("y", np.ones(3, np.float32))])
    _, hl = v2.encode_response(response, request)
    assert hl is not None
    _, hl = v2.encode_response(response, InferRequest(inputs=[]))
    assert hl is None


def _binary_body(header: dict, blob: bytes) -> tuple[bytes, int]:
    head = json.dumps(header).encode()
    return head + blob, len(head)


@pytest.mark.parametrize(
    "header, blob, message",
    [
        (
            {
                "inputs": [
                    {
                        "name": "x",
                        "shape": [4],
                        "datatype": "FP32",
                        "parameters": {"binary_data_size": 16},
                    }
                ]
            },
            b"\0" * 8,
            "runs past the body",
        ),
        (
            {
                "inputs": [
                    {
                        "name": "x",
                        "shape": [4],
                        "datatype": "FP32",
                        "parameters": {"binary_data_size": 8},
                    }
                ]
            },
            b"\0" * 8,
            "needs 16 bytes",
        ),
        (
            {
                "inputs": [
                    {
                        "name": "x",
                        "shape": [2],
                        "datatype": "FP32",
                        "parameters": {"binary_data_size": 8},
                    }
                ]
            },
            b"\0" * 12,
            "not claimed",
        ),
        (
            {
                "inputs": [
                    {
                        "name": "x",
                        "shape": [2],
                        "datatype": "FP99",
                        "parameters": {"binary_data_size": 8},
                    }
                ]
            },
            b"\0" * 8,
            "unknown datatype",
        ),
        (
            {
                "inputs": [
                    {
                        "name": "x",
                        "shape": [2],
                        "datatype": "BYTES",
                        "parameters": {"binary_data_size": 6},
                    }
                ]
            },
            b"\x05\0\0\0ab",
            "at least 8 bytes",
        ),
        (
            {
                "inputs": [
                    {
                        "name": "x",
                        "shape": [1],
                        "datatype": "BYTES",
                        "parameters": {"binary_data_size": 6},
                    }
                ]
            },
            b"\x05\0\0\0ab",
            "declares 5 bytes",
        ),
    ],
)
def test_malformed_binary_bodies_name_the_problem(header, blob, message):
    body, hl = _binary_body(header, blob)
    with pytest.raises(InvalidInput, match=message):
        v2.decode_request(body, hl)


@pytest.mark.parametrize(
    "doc, message",
    [
        (b"{not json", "malformed"),
        (b'{"inputs": []}', "no inputs"),
        (b'{"inputs": [{"name": "x", "shape": [2], "datatype": "FP32"}]}', "no data"),
        (
            b'{"inputs": [{"name": "x", "shape": [2], "datatype": "FP32", "data": [1]}]}',
            "needs 2 elements",
        ),
        (
            b'{"inputs": [{"name": "x", "shape": [-1], "datatype": "FP32", "data": []}]}',
            "non-negative",
        ),
        (
            b'{"inputs": [{"name": "x", "shape": [2], "datatype": "INT8", "data": [1, 300]}]}',
            "out of range",
        ),
        (
            b'{"inputs": [{"name": "x", "shape": [2], "datatype": "INT8", "data": [1.5, 3]}]}',
            "numbers",
        ),
        (
            b'{"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": ["a"]}]}',
            "numbers",
        ),
        (
            b'{"inputs": [{"name": "x", "shape": [2], "datatype": "BOOL", "data": [1, 0]}]}',
            "true/false",
        ),
        (
            b'{"inputs": [{"name": "x", "shape": [2], "datatype": "FP32", "data": [[1], [2, 3]]}]}',
            "regular",
        ),
        (b'{"inputs": [{"name": "", "shape": [1], "datatype": "FP32", "data": [1]}]}', "non-empty"),
        (
            b'{"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}, {"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}]}',
            "twice",
        ),
    ],
)
def test_malformed_json_bodies_name_the_problem(doc, message):
    with pytest.raises(InvalidInput, match=message):
        v2.decode_request(doc)


def test_huge_declared_shape_is_refused_before_allocating():
    doc = {
        "inputs": [
            {
                "name": "x",
                "shape": [1 << 20, 1 << 20],
                "datatype": "FP32",
                "parameters": {"binary_data_size": 4},
            }
        ]
    }
    body, hl = _binary_body(doc, b"\0" * 4)
    with pytest.raises(PayloadTooLarge, match="elements"):
        v2.decode_request(body, hl)


def test_body_over_the_limit_is_refused():
    with pytest.raises(PayloadTooLarge):
        v2.decode_request(b"x" * 101, limits=Limits(max_body_bytes=100))


@pytest.mark.parametrize("value", ["abc", "0", "-3", "999999"])
def test_bad_header_length_is_an_invalid_input(value):
    with pytest.raises(InvalidInput):
        v2.decode_request(b'{"inputs": []}', v2.parse_header_length(value, 14))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=256), st.integers(min_value=-5, max_value=300))
def test_arbitrary_bytes_raise_only_ferry_errors(body, header_length):
    try:
        v2.decode_request(body, header_length if header_length > 0 else None)
    except FerryError:
        pass


@settings(max_examples=200, deadline=None)
@given(tensors(), st.data())
def test_truncated_or_corrupted_binary_bodies_raise_only_ferry_errors(t, data):
    chunks, hl = v2.encode_request(InferRequest(inputs=[t]))
    body = bytearray(v2.join(chunks))
    cut = data.draw(st.integers(min_value=0, max_value=len(body)))
    flips = data.draw(
        st.lists(st.integers(min_value=0, max_value=max(0, len(body) - 1)), max_size=3)
    )
    for i in flips:
        if i < len(body):
            body[i] ^= 0xFF
    mutated = bytes(body[:cut])
    try:
        v2.decode_request(mutated, hl if hl and hl <= len(mutated) else None)
    except FerryError:
        pass
