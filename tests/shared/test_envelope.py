import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared import envelope
from shared.errors import DeadlineExceeded, FerryError, InvalidInput, Overloaded
from shared.messages import InferRequest, InferResponse, RequestedOutput
from shared.tensors import Tensor
from tests.shared.strategies import same, tensors


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
