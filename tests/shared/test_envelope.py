import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared import envelope
from shared.datatypes import DATATYPES
from shared.errors import DeadlineExceeded, FerryError, InvalidInput, Overloaded, PayloadTooLarge
from shared.messages import InferRequest, InferResponse, RequestedOutput
from shared.tensors import Tensor
from tests.shared.strategies import (
    DEEP,
    adversarial_shapes,
    deep_depths,
    names,
    parameters,
    raw_bytes,
    same,
    splice_deep_msgpack,
    tensors,
    values,
)


def _unique(ts):
    seen = {}
    for t in ts:
        seen.setdefault(t.name, t)
    return list(seen.values())


@settings(max_examples=150, deadline=None)
@given(st.lists(tensors(), min_size=1, max_size=4))
def test_request_round_trips_every_datatype(ts):
    request = InferRequest(
        inputs=_unique(ts),
        id="abc",
        model_version="2",
        outputs=[RequestedOutput("y")],
        parameters={"priority": 1},
    )
    decoded = envelope.decode_request(envelope.encode_request(request))
    assert decoded.id == "abc" and decoded.model_version == "2"
    assert decoded.output_names() == ["y"] and decoded.parameters == {"priority": 1}
    assert all(same(a, b) for a, b in zip(request.inputs, decoded.inputs, strict=True))


@settings(max_examples=100, deadline=None)
@given(st.lists(tensors(), min_size=1, max_size=3))
def test_reply_round_trips_every_datatype(ts):
    response = InferResponse(
        "m", _unique(ts), "1", "abc", {"queue_us": 5, "compute_us": 7, "node": "n1"}
    )
    rid, decoded = envelope.decode_reply(envelope.encode_reply(response))
    assert rid == "abc" and isinstance(decoded, InferResponse)
    assert decoded.parameters == response.parameters
    assert all(same(a, b) for a, b in zip(response.outputs, decoded.outputs, strict=True))


@pytest.mark.parametrize("error", [Overloaded("queue full"), DeadlineExceeded("late")])
def test_error_reply_round_trips_as_the_typed_error(error):
    rid, decoded = envelope.decode_reply(envelope.encode_error_reply("r9", error))
    assert rid == "r9"
    assert type(decoded) is type(error) and decoded.message == error.message


def test_decoded_tensor_is_a_view_over_the_payload():
    x = np.arange(1000, dtype=np.float32)
    payload = envelope.encode_request(InferRequest(inputs=[Tensor.from_array("x", x)], id="1"))
    decoded = envelope.decode_request(payload)
    assert not decoded.inputs[0].data.flags.owndata
    np.testing.assert_array_equal(decoded.inputs[0].data, x)


def test_request_without_id_cannot_be_encoded():
    with pytest.raises(InvalidInput):
        envelope.encode_request(InferRequest(inputs=[Tensor.from_array("x", np.ones(1))]))


def test_shape_bytes_mismatch_names_the_input():
    payload = msgspec.msgpack.encode(
        {"id": "1", "inputs": [{"name": "x", "datatype": "FP32", "shape": [3], "data": b"\0" * 8}]}
    )
    with pytest.raises(InvalidInput, match=r"'x'.*needs 12 bytes"):
        envelope.decode_request(payload)


def test_peek_request_id_recovers_the_id_of_a_bad_request():
    payload = msgspec.msgpack.encode({"id": "z1", "inputs": "nope"})
    with pytest.raises(InvalidInput):
        envelope.decode_request(payload)
    assert envelope.peek_request_id(payload) == "z1"
    assert envelope.peek_request_id(b"\xc1") is None


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=256))
def test_arbitrary_payloads_raise_only_ferry_errors(payload):
    for decode in (envelope.decode_request, envelope.decode_reply):
        try:
            decode(payload)
        except FerryError:
            pass


@settings(max_examples=200, deadline=None)
@given(tensors(), st.data())
def test_truncated_payloads_raise_only_ferry_errors(t, data):
    payload = envelope.encode_request(InferRequest(inputs=[t], id="1"))
    cut = data.draw(st.integers(min_value=0, max_value=len(payload)))
    try:
        envelope.decode_request(payload[:cut])
    except FerryError:
        pass


# --- structure-aware fuzzing: well-formed MessagePack with one to three faults planted ---

FAULTS = (
    "shape",
    "datatype",
    "name",
    "data",
    "drop_field",
    "extra_field",
    "deep",
    "tensors",
    "outputs",
    "id",
    "parameters",
    "model_version",
    "model_name",
    "error",
    "cut",
)


@st.composite
def envelope_documents(draw: st.DrawFn, kind: str, faulty: bool) -> dict:
    """A request or reply payload; ``faulty`` plants faults, else it is well-formed."""
    ts = _unique(draw(st.lists(tensors(), min_size=1, max_size=3)))
    entries = [
        {"name": t.name, "datatype": t.datatype, "shape": list(t.shape), "data": raw_bytes(t)}
        for t in ts
    ]
    key = "inputs" if kind == "request" else "outputs"
    doc: dict = {"id": draw(st.text(max_size=8)), key: entries}
    if kind == "reply":
        doc["model_name"] = draw(names)
    if draw(st.booleans()):
        doc["model_version"] = draw(st.sampled_from(["1", "7"]))
    params = draw(parameters("msgpack"))
    if params:
        doc["parameters"] = params
    if kind == "request" and draw(st.booleans()):
        doc["outputs"] = draw(st.lists(names, max_size=3))
    deep = None
    cut = None
    if faulty:
        for fault in draw(st.lists(st.sampled_from(FAULTS), min_size=1, max_size=3)):
            entry = entries[draw(st.integers(0, len(entries) - 1))]
            if fault == "shape":
                entry["shape"] = draw(adversarial_shapes("msgpack"))
            elif fault == "datatype":
                entry["datatype"] = draw(
                    st.one_of(st.sampled_from(sorted(DATATYPES)), values("msgpack"))
                )
            elif fault == "name":
                entry["name"] = draw(values("msgpack"))
            elif fault == "data":
                entry["data"] = draw(st.one_of(st.binary(max_size=40), values("msgpack")))
            elif fault == "drop_field":
                entry.pop(draw(st.sampled_from(sorted(entry))))
            elif fault == "extra_field":
                entry[draw(st.text(max_size=6))] = draw(values("msgpack"))
            elif fault == "deep":
                deep = (draw(deep_depths), draw(st.booleans()))
                where = draw(st.sampled_from(["data", "shape", "parameters", "top", "extra"]))
                if where in ("data", "shape"):
                    entry[where] = DEEP
                elif where == "parameters":
                    doc["parameters"] = {"p": DEEP}
                else:
                    doc["id" if where == "top" else "extra"] = DEEP
            elif fault == "tensors":
                doc[key] = draw(values("msgpack"))
            elif fault == "error":
                doc["error"] = draw(
                    st.one_of(
                        values("msgpack"),
                        st.fixed_dictionaries({"code": values("msgpack"), "message": names}),
                    )
                )
            elif fault == "cut":
                cut = draw(st.integers(0, 400))
            elif fault in ("outputs", "id", "parameters", "model_version", "model_name"):
                doc[fault] = draw(values("msgpack"))
    payload = msgspec.msgpack.encode(doc)
    if deep is not None:
        payload = splice_deep_msgpack(payload, *deep)
    if cut is not None:
        payload = payload[: min(cut, len(payload))]
    return {"payload": payload, "tensors": ts, "doc": doc}


@settings(max_examples=400, deadline=None)
@given(envelope_documents("request", faulty=True))
def test_faulty_structured_requests_raise_only_ferry_errors(doc):
    try:
        envelope.decode_request(doc["payload"])
    except FerryError:
        pass
    assert envelope.peek_request_id(doc["payload"]) is None or isinstance(
        envelope.peek_request_id(doc["payload"]), str
    )


@settings(max_examples=300, deadline=None)
@given(envelope_documents("reply", faulty=True))
def test_faulty_structured_replies_raise_only_ferry_errors(doc):
    try:
        envelope.decode_reply(doc["payload"])
    except FerryError:
        pass


@settings(max_examples=100, deadline=None)
@given(envelope_documents("request", faulty=False))
def test_well_formed_structured_requests_decode_and_round_trip(doc):
    decoded = envelope.decode_request(doc["payload"])
    assert decoded.id == doc["doc"]["id"]
    # repr: a NaN parameter must come back as NaN (NaN != NaN under ==)
    assert repr(decoded.parameters) == repr(doc["doc"].get("parameters", {}))
    # the same output asked twice is one ask (Triton keeps a set)
    asked = doc["doc"].get("outputs")
    assert decoded.output_names() == (None if asked is None else list(dict.fromkeys(asked)))
    assert all(same(a, b) for a, b in zip(doc["tensors"], decoded.inputs, strict=True))
    again = envelope.decode_request(envelope.encode_request(decoded))
    assert all(same(a, b) for a, b in zip(decoded.inputs, again.inputs, strict=True))


@settings(max_examples=100, deadline=None)
@given(envelope_documents("reply", faulty=False))
def test_well_formed_structured_replies_decode_and_round_trip(doc):
    rid, decoded = envelope.decode_reply(doc["payload"])
    assert rid == doc["doc"]["id"] and isinstance(decoded, InferResponse)
    assert all(same(a, b) for a, b in zip(doc["tensors"], decoded.outputs, strict=True))
    _, again = envelope.decode_reply(envelope.encode_reply(decoded))
    assert all(same(a, b) for a, b in zip(decoded.outputs, again.outputs, strict=True))


# --- the audit's reproductions, pinned -------------------------------------------------


def _request(**fields) -> bytes:
    tensor = {"name": "x", "datatype": "FP32", "shape": [1], "data": b"\0" * 4, **fields}
    return msgspec.msgpack.encode({"id": "r1", "inputs": [tensor]})


@pytest.mark.parametrize("shape", [[0, 2**64 - 1], [0, 2**62, 2**62], [0, 2**31, 2**31, 2**31]])
def test_a_huge_dimension_beside_a_zero_is_refused(shape):
    with pytest.raises(PayloadTooLarge, match="dimension"):
        envelope.decode_request(_request(shape=shape, data=b""))
    reply = msgspec.msgpack.encode(
        {
            "id": "r1",
            "model_name": "m",
            "outputs": [{"name": "y", "datatype": "FP32", "shape": shape, "data": b""}],
        }
    )
    with pytest.raises(PayloadTooLarge, match="dimension"):
        envelope.decode_reply(reply)


@pytest.mark.parametrize("as_map", [False, True])
@pytest.mark.parametrize("field", ["parameters", "unknown"])
def test_deep_nesting_in_a_field_is_an_invalid_input(field, as_map):
    value = {"p": DEEP} if field == "parameters" else DEEP
    docs = {
        envelope.decode_request: {"id": "r7", "inputs": [], field: value},
        envelope.decode_reply: {"id": "r7", "model_name": "m", field: value},
    }
    for decode, doc in docs.items():
        payload = splice_deep_msgpack(msgspec.msgpack.encode(doc), 20_000, as_map)
        assert len(payload) >= 20_000
        with pytest.raises(InvalidInput, match="nested too deeply"):
            decode(payload)
        assert envelope.peek_request_id(payload) in (None, "r7")


@pytest.mark.parametrize("as_map", [False, True])
def test_a_payload_that_is_only_nesting_has_no_id(as_map):
    nested = (b"\x81\xa1k" if as_map else b"\x91") * 20_000 + b"\xc0"
    for decode in (envelope.decode_request, envelope.decode_reply):
        with pytest.raises(InvalidInput):
            decode(nested)
    assert envelope.peek_request_id(nested) is None


def test_bool_bytes_other_than_0_and_1_are_refused():
    with pytest.raises(InvalidInput, match="BOOL bytes must be 0 or 1"):
        envelope.decode_request(_request(datatype="BOOL", shape=[2], data=b"\x00\x02"))


def test_output_parameters_travel_and_bare_names_still_decode():
    x = Tensor.from_array("x", np.ones(3, np.float32))
    request = InferRequest(
        inputs=[x],
        id="r",
        outputs=[RequestedOutput("y", parameters={"classification": 2}), RequestedOutput("z")],
    )
    decoded = envelope.decode_request(envelope.encode_request(request))
    assert [(o.name, o.parameters) for o in decoded.outputs] == [
        ("y", {"classification": 2}),
        ("z", {}),
    ]
    # an older peer's request: outputs as a list of names, no output_parameters
    wire = msgspec.msgpack.decode(envelope.encode_request(request))
    assert wire["outputs"] == ["y", "z"]  # (a peer that predates them reads these)
    del wire["output_parameters"]
    decoded = envelope.decode_request(msgspec.msgpack.encode(wire))
    assert [(o.name, o.parameters) for o in decoded.outputs] == [("y", {}), ("z", {})]
    # and an older node's decoder (outputs: list[str]) takes the new request
    old = msgspec.msgpack.Decoder(
        msgspec.defstruct("Old", [("id", str), ("outputs", list[str] | None, None)])
    )
    assert old.decode(envelope.encode_request(request)).outputs == ["y", "z"]


def test_an_output_asked_twice_is_answered_once():
    x = Tensor.from_array("x", np.ones(3, np.float32))
    request = InferRequest(inputs=[x], id="r", outputs=[RequestedOutput("y"), RequestedOutput("y")])
    decoded = envelope.decode_request(envelope.encode_request(request))
    assert [o.name for o in decoded.outputs] == ["y"]


def test_a_v2_json_body_sent_over_mqtt_is_told_what_the_payload_is():
    """It had read 'Expected `object`, got `int`' (the '{' read as a MessagePack int)."""
    with pytest.raises(InvalidInput, match="MessagePack envelope, not V2 JSON"):
        envelope.decode_request(b'{"inputs": []}')
