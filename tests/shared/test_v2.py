import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared import v2
from shared.datatypes import DATATYPES, numpy_dtype
from shared.errors import FerryError, InvalidInput, PayloadTooLarge
from shared.messages import InferRequest, InferResponse, RequestedOutput
from shared.tensors import Limits, Tensor
from tests.shared.strategies import (
    DEEP,
    HUGE_DIMS,
    adversarial_shapes,
    deep_depths,
    json_leaves,
    names,
    nest,
    parameters,
    raw_bytes,
    same,
    splice_deep_json,
    tensors,
    values,
)


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


@pytest.mark.parametrize("flag", ["yes", "false", 1])
def test_a_request_binary_data_output_that_is_not_a_boolean_is_refused(flag):
    body = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1.0]}],
        "parameters": {"binary_data_output": flag},
    }
    with pytest.raises(InvalidInput, match="binary_data_output must be true or false"):
        v2.decode_request(json.dumps(body).encode())


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


@pytest.mark.parametrize("value", ["abc", "0", "-3", "999999", "+6", "1_0", "\u0661", "9" * 5000])
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


# --- structure-aware fuzzing: well-formed documents with one to three faults planted ---

REQUEST_FAULTS = (
    "shape",
    "datatype",
    "name",
    "data",
    "tensor_parameters",
    "binary_data_size",
    "drop_field",
    "extra_field",
    "deep",
    "tensors",
    "outputs",
    "id",
    "parameters",
    "header_length",
    "binary_tail",
)
RESPONSE_FAULTS = (*REQUEST_FAULTS, "model_name")


@st.composite
def _entries(draw: st.DrawFn, ts: list[Tensor]) -> tuple[list[dict], list[bytes]]:
    """V2 tensor entries written as a client would: JSON (flat or nested) or binary."""
    entries, blobs = [], []
    for t in ts:
        entry: dict = {"name": t.name, "datatype": t.datatype, "shape": list(t.shape)}
        params = draw(parameters())
        if draw(st.booleans()):
            blob = raw_bytes(t)
            params["binary_data_size"] = len(blob)
            blobs.append(blob)
        else:
            flat = json_leaves(t)
            entry["data"] = nest(flat, t.shape) if draw(st.booleans()) else flat
        if params:
            entry["parameters"] = params
        entries.append(entry)
    return entries, blobs


@st.composite
def v2_documents(draw: st.DrawFn, kind: str, faulty: bool) -> dict:
    """A V2 request or response body; ``faulty`` plants faults, else it is well-formed."""
    ts = _unique(draw(st.lists(tensors(text_bytes=True), min_size=1, max_size=3)))
    entries, blobs = draw(_entries(ts))
    key = "inputs" if kind == "request" else "outputs"
    doc: dict = {key: entries}
    if kind == "response":
        doc["model_name"] = draw(names)
        if draw(st.booleans()):
            doc["model_version"] = draw(st.sampled_from(["1", "7"]))
    if draw(st.booleans()):
        doc["id"] = draw(st.text(max_size=8))
    top_params = draw(parameters())
    if top_params:
        doc["parameters"] = top_params
    outputs = None
    if kind == "request" and draw(st.booleans()):
        outputs = [{"name": n, "parameters": {"binary_data": draw(st.booleans())}} for n in "ab"]
        doc["outputs"] = outputs
    deep = None
    header_length: object = "auto"
    tail = b""
    if faulty:
        faults = REQUEST_FAULTS if kind == "request" else RESPONSE_FAULTS
        for fault in draw(st.lists(st.sampled_from(faults), min_size=1, max_size=3)):
            entry = entries[draw(st.integers(0, len(entries) - 1))]
            if fault == "shape":
                entry["shape"] = draw(adversarial_shapes("json"))
            elif fault == "datatype":
                entry["datatype"] = draw(st.one_of(st.sampled_from(sorted(DATATYPES)), values()))
            elif fault == "name":
                entry["name"] = draw(values())
            elif fault == "data":
                entry["data"] = draw(values())
            elif fault == "tensor_parameters":
                entry["parameters"] = draw(values())
            elif fault == "binary_data_size":
                if not isinstance(entry.get("parameters"), dict):
                    entry["parameters"] = {}
                entry["parameters"]["binary_data_size"] = draw(
                    st.one_of(st.integers(-5, 64), st.sampled_from([*HUGE_DIMS, 10**30]), values())
                )
            elif fault == "drop_field":
                entry.pop(draw(st.sampled_from(sorted(entry))))
            elif fault == "extra_field":
                entry[draw(st.text(max_size=6))] = draw(values())
            elif fault == "deep":
                deep = (draw(deep_depths), draw(st.booleans()))
                where = draw(st.sampled_from(["data", "shape", "parameters", "top", "extra"]))
                if where in ("data", "shape"):
                    entry[where] = [DEEP] if where == "data" else DEEP
                elif where == "parameters":
                    entry["parameters"] = {"p": DEEP}
                else:
                    doc["parameters" if where == "top" else "extra"] = DEEP
            elif fault == "tensors":
                doc[key] = draw(values())
            elif fault == "outputs" and kind == "request":
                doc["outputs"] = draw(
                    st.one_of(
                        values(),
                        st.lists(st.fixed_dictionaries({"name": values()}), max_size=2),
                        st.lists(
                            st.fixed_dictionaries(
                                {
                                    "name": names,
                                    "parameters": st.dictionaries(
                                        st.just("binary_data"), values(), max_size=1
                                    ),
                                }
                            ),
                            max_size=2,
                        ),
                    )
                )
            elif fault == "id":
                doc["id"] = draw(values())
            elif fault == "parameters":
                doc["parameters"] = draw(values())
            elif fault == "model_name":
                doc["model_name"] = draw(values())
            elif fault == "header_length":
                header_length = draw(
                    st.one_of(
                        st.integers(-3, 400),
                        st.just(10**20),
                        st.text(max_size=3),
                        st.floats(),
                        st.booleans(),
                    )
                )
            elif fault == "binary_tail":
                tail = draw(st.binary(min_size=1, max_size=9))
    head = json.dumps(doc).encode()
    if deep is not None:
        head = splice_deep_json(head, *deep)
    body = head + b"".join(blobs)
    if tail and draw(st.booleans()) and len(body) > len(head):
        body = body[: draw(st.integers(len(head), len(body) - 1))]
    else:
        body += tail
    if header_length == "auto":
        header_length = len(head) if blobs else None
    return {
        "body": body,
        "header_length": header_length,
        "tensors": ts,
        "id": doc.get("id"),
        "parameters": top_params,
        "outputs": outputs,
    }


@settings(max_examples=400, deadline=None)
@given(v2_documents("request", faulty=True))
def test_faulty_structured_requests_raise_only_ferry_errors(doc):
    try:
        v2.decode_request(doc["body"], doc["header_length"])
    except FerryError:
        pass


@settings(max_examples=300, deadline=None)
@given(v2_documents("response", faulty=True))
def test_faulty_structured_responses_raise_only_ferry_errors(doc):
    try:
        v2.decode_response(doc["body"], doc["header_length"])
    except FerryError:
        pass


@settings(max_examples=150, deadline=None)
@given(v2_documents("request", faulty=False), st.booleans())
def test_well_formed_structured_requests_decode_and_round_trip(doc, binary):
    decoded = v2.decode_request(doc["body"], doc["header_length"])
    assert decoded.id == doc["id"] and decoded.parameters == doc["parameters"]
    assert all(
        same(a, b, nan_equal=True) for a, b in zip(doc["tensors"], decoded.inputs, strict=True)
    )
    if doc["outputs"] is not None:
        assert [(o.name, o.binary) for o in decoded.outputs] == [
            (o["name"], o["parameters"]["binary_data"]) for o in doc["outputs"]
        ]
    chunks, hl = v2.encode_request(decoded, binary_inputs=binary)
    again = v2.decode_request(v2.join(chunks), hl)
    assert all(
        same(a, b, nan_equal=True) for a, b in zip(decoded.inputs, again.inputs, strict=True)
    )


@settings(max_examples=100, deadline=None)
@given(v2_documents("response", faulty=False))
def test_well_formed_structured_responses_decode(doc):
    decoded = v2.decode_response(doc["body"], doc["header_length"])
    assert decoded.id == doc["id"] and decoded.parameters == doc["parameters"]
    assert all(
        same(a, b, nan_equal=True) for a, b in zip(doc["tensors"], decoded.outputs, strict=True)
    )


# --- the audit's reproductions, pinned -------------------------------------------------


def _json_tensor(**fields) -> bytes:
    entry = {"name": "x", "datatype": "FP32", "shape": [1], "data": [1.0], **fields}
    return json.dumps({"inputs": [entry]}).encode()


@pytest.mark.parametrize(
    "shape", [[0, 10**30], [0, 2**62, 2**62], [0, 2**63 - 1, 2**63 - 1, 2**63 - 1]]
)
@pytest.mark.parametrize("datatype", ["FP32", "BYTES"])
def test_a_huge_dimension_beside_a_zero_is_refused_in_json_and_binary(shape, datatype):
    with pytest.raises(PayloadTooLarge, match="dimension"):
        v2.decode_request(_json_tensor(shape=shape, datatype=datatype, data=[]))
    body, hl = _binary_body(
        {
            "inputs": [
                {
                    "name": "x",
                    "datatype": datatype,
                    "shape": shape,
                    "parameters": {"binary_data_size": 0},
                }
            ]
        },
        b"",
    )
    with pytest.raises(PayloadTooLarge, match="dimension"):
        v2.decode_request(body + b"{}", hl)  # hl covers the header only


def test_dims_within_the_limit_that_numpy_cannot_describe_are_refused():
    with pytest.raises(InvalidInput, match="cannot be represented"):
        v2.decode_request(_json_tensor(shape=[0, 2**24, 2**24, 2**24, 2**24], data=[]))


def test_a_response_with_a_huge_declared_shape_is_refused():
    body = json.dumps(
        {
            "model_name": "m",
            "outputs": [{"name": "y", "datatype": "FP32", "shape": [0, 10**30], "data": []}],
        }
    ).encode()
    with pytest.raises(PayloadTooLarge):
        v2.decode_response(body)


@pytest.mark.parametrize("as_map", [False, True])
@pytest.mark.parametrize("where", ["data", "parameters"])
def test_deep_nesting_is_an_invalid_input_for_requests_and_responses(where, as_map):
    entry = {"name": "x", "datatype": "FP32", "shape": [1], "data": [1]}
    if where == "parameters":
        entry["parameters"] = {"p": DEEP}
    else:
        entry["data"] = DEEP
    for decode, doc in (
        (v2.decode_request, {"inputs": [entry]}),
        (v2.decode_response, {"model_name": "m", "outputs": [entry]}),
    ):
        body = splice_deep_json(json.dumps(doc).encode(), 5000, as_map)
        # (data: refused by the tensor's own rules on a Python whose JSON decoder nests
        # that deep, 3.13; parameters: by their depth bound, whatever the Python)
        match = "nested too deeply" if where == "parameters" else "nested|must be a list"
        with pytest.raises(InvalidInput, match=match):
            decode(body)
    if where == "parameters":  # (past 32 levels: refused, however deep the decoder goes)
        nested: object = 1
        for _ in range(40):
            nested = [nested] if not as_map else {"k": nested}
        tensor = {"name": "x", "datatype": "FP32", "shape": [1], "data": [1]}
        doc = {"inputs": [tensor], "parameters": {"p": nested}}
        with pytest.raises(InvalidInput, match="more than 32 levels"):
            v2.decode_request(json.dumps(doc).encode())


def test_nesting_beyond_an_arrays_dims_is_refused_without_recursion():
    data = "[" * 100 + "1" + "]" * 100
    body = f'{{"inputs": [{{"name": "x", "datatype": "FP32", "shape": [1], "data": {data}}}]}}'
    with pytest.raises(InvalidInput, match="nested deeper"):
        v2.decode_request(body.encode())


@pytest.mark.parametrize("header_length", ["12", 12.0, True, [12]])
def test_a_header_length_that_is_not_an_int_is_an_invalid_input(header_length):
    with pytest.raises(InvalidInput, match="must be an integer"):
        v2.decode_request(_json_tensor(), header_length)
    with pytest.raises(InvalidInput, match="must be an integer"):
        v2.decode_response(b'{"model_name": "m"}', header_length)


def test_response_body_over_the_limit_is_refused():
    with pytest.raises(PayloadTooLarge, match="response body"):
        v2.decode_response(b" " * 101, limits=Limits(max_body_bytes=100))


def test_json_over_the_json_limit_is_refused_with_a_pointer_to_binary_data():
    limits = Limits(max_json_body_bytes=1000)
    x = np.zeros(400, np.float32)
    chunks, hl = v2.encode_request(
        InferRequest(inputs=[Tensor.from_array("x", x)]), binary_inputs=False
    )
    with pytest.raises(PayloadTooLarge, match="binary tensor data"):
        v2.decode_request(v2.join(chunks), hl, limits)
    response = InferResponse("m", [Tensor.from_array("y", x)])
    chunks, hl = v2.encode_response(response)
    with pytest.raises(PayloadTooLarge, match="binary_data_output"):
        v2.decode_response(v2.join(chunks), hl, limits)


def test_the_json_limit_applies_to_the_header_not_the_binary_tensors():
    limits = Limits(max_json_body_bytes=1000)
    x = np.arange(4000, dtype=np.float32)  # 16 KB of binary data behind a small header
    chunks, hl = v2.encode_request(InferRequest(inputs=[Tensor.from_array("x", x)]))
    decoded = v2.decode_request(v2.join(chunks), hl, limits)
    np.testing.assert_array_equal(decoded.inputs[0].data, x)
    request = InferRequest(inputs=[], parameters={"binary_data_output": True})
    chunks, hl = v2.encode_response(InferResponse("m", [Tensor.from_array("y", x)]), request)
    np.testing.assert_array_equal(
        v2.decode_response(v2.join(chunks), hl, limits).outputs[0].data, x
    )


@pytest.mark.parametrize(
    "datatype, value", [("FP16", 70000.0), ("FP32", 1e39), ("BF16", 1e39), ("FP16", -1e10)]
)
def test_finite_json_values_that_overflow_the_datatype_are_refused(datatype, value):
    with pytest.raises(InvalidInput, match=f"out of range for {datatype}"):
        v2.decode_request(_json_tensor(datatype=datatype, shape=[2], data=[1.0, value]))


def test_json_accepts_the_non_finite_tokens_for_float_datatypes():
    body = _json_tensor(shape=[2, 2], data=[["NaN", "Infinity"], ["-Infinity", 2]])
    data = v2.decode_request(body).inputs[0].data
    assert data.dtype == np.float32
    assert np.isnan(data[0, 0]) and data[0, 1] == np.inf and data[1].tolist() == [-np.inf, 2.0]


@pytest.mark.parametrize(
    "datatype, data",
    [
        ("FP32", ["nan"]),
        ("FP32", ["inf"]),
        ("FP32", ["1.5"]),
        ("INT32", ["NaN"]),
        ("BOOL", ["Infinity"]),
    ],
)
def test_other_strings_in_numeric_json_data_are_refused(datatype, data):
    with pytest.raises(InvalidInput, match="must hold"):
        v2.decode_request(_json_tensor(datatype=datatype, data=data))


@pytest.mark.parametrize("datatype", ["FP16", "FP32", "FP64", "BF16"])
def test_non_finite_outputs_go_out_as_tokens_and_come_back(datatype):
    values = np.array([np.nan, np.inf, -np.inf, -0.0, 1.5], np.float32)
    y = Tensor("y", datatype, values.astype(numpy_dtype(datatype)))
    chunks, hl = v2.encode_response(InferResponse("m", [y]))
    assert hl is None
    assert json.loads(v2.join(chunks))["outputs"][0]["data"][:3] == ["NaN", "Infinity", "-Infinity"]
    decoded = v2.decode_response(v2.join(chunks)).outputs[0]
    assert same(y, decoded, nan_equal=True)


@settings(max_examples=100, deadline=None)
@given(st.lists(tensors(text_bytes=True), min_size=1, max_size=3))
def test_json_round_trips_non_finite_floats(ts):
    request = InferRequest(inputs=_unique(ts))
    chunks, hl = v2.encode_request(request, binary_inputs=False)
    decoded = v2.decode_request(v2.join(chunks), hl)
    assert all(
        same(a, b, nan_equal=True) for a, b in zip(request.inputs, decoded.inputs, strict=True)
    )


def test_binary_bool_bytes_other_than_0_and_1_are_refused():
    body, hl = _binary_body(
        {
            "inputs": [
                {
                    "name": "x",
                    "datatype": "BOOL",
                    "shape": [3],
                    "parameters": {"binary_data_size": 3},
                }
            ]
        },
        b"\x01\x00\x07",
    )
    with pytest.raises(InvalidInput, match="BOOL bytes must be 0 or 1"):
        v2.decode_request(body, hl)


def test_a_few_large_bytes_elements_decode_on_the_loop_but_many_go_to_a_worker():
    import numpy as np

    from shared.messages import InferRequest
    from shared.tensors import Tensor

    def body(items: list[bytes]) -> tuple[bytes, int]:
        data = np.empty(len(items), dtype=object)
        data[:] = items
        chunks, hl = v2.encode_request(InferRequest(inputs=[Tensor("img", "BYTES", data)]))
        return v2.join(chunks), hl

    jpeg, hl = body([b"\xff\xd8" + bytes(200_000)])  # one 200 KB image: one slice
    assert not v2.decode_needs_worker(jpeg, hl)
    assert v2.decode_request(jpeg, hl).inputs[0].data[0] == b"\xff\xd8" + bytes(200_000)
    many, hl = body([b"ab"] * 30_000)  # 30,000 elements parsed one by one
    assert v2.decode_needs_worker(many, hl)
    huge, hl = body([bytes(5 << 20)])  # a few elements, but megabytes to copy
    assert v2.decode_needs_worker(huge, hl)


def test_an_output_asked_twice_alike_is_one_ask_and_in_two_forms_a_400():
    x = {"name": "x", "datatype": "FP32", "shape": [1], "data": [1.0]}
    same = {"name": "y", "parameters": {"binary_data": True}}
    body = {"inputs": [x], "outputs": [same, {"name": "z"}, dict(same)]}
    decoded = v2.decode_request(json.dumps(body).encode())
    assert [(o.name, o.binary) for o in decoded.outputs] == [("y", True), ("z", None)]
    body["outputs"] = [{"name": "y", "parameters": {"classification": 2}}, same]
    with pytest.raises(InvalidInput, match="'y' is requested twice with different parameters"):
        v2.decode_request(json.dumps(body).encode())


def test_a_control_body_nested_too_deeply_is_a_400_not_a_500():
    """json's RecursionError had escaped the repository index and load, and the agent's
    link: a 500 with a traceback in the log."""
    from shared.errors import InvalidInput
    from shared.v2 import json_object

    for deep in (b"[" * 100_000, b'{"a":' * 50_000):
        with pytest.raises(InvalidInput, match="nested too deeply"):
            json_object(deep)
    with pytest.raises(InvalidInput, match="must be a JSON object"):
        json_object(b"[1]")
    assert json_object(b"  ") == {} and json_object(b'{"ready": true}') == {"ready": True}
