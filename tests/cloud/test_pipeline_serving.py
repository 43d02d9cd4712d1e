"""A cloud node serving an image model: JPEG in over V2 (tritonclient JSON and binary),
the same answer as decoding by hand, labels through the classification extension,
and bad images answered 400 while the node stays up."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from shared.modeltools.samples import orientation_jpegs
from tests.shared.pipeline.conftest import jpeg_declaring, png_declaring
from tests.shared.pipeline.test_session import by_hand
from tests.support import cloud_server


@pytest.fixture(scope="module")
def node(example_repository: Path):
    proc = cloud_server(example_repository, "--models", "orientation-jpeg").start()
    yield proc
    proc.terminate()


@pytest.fixture(scope="module")
def client(node) -> triton.InferenceServerClient:
    return triton.InferenceServerClient(node.http_url.removeprefix("http://"))


def image_input(blobs: list[bytes], binary: bool) -> triton.InferInput:
    inp = triton.InferInput("image", [len(blobs), 1], "BYTES")
    inp.set_data_from_numpy(np.array([[b] for b in blobs], dtype=object), binary_data=binary)
    return inp


@pytest.mark.parametrize("binary", [False, True])
def test_a_jpeg_over_v2_with_json_or_binary_outputs_gets_the_raw_runtimes_answer(
    client: triton.InferenceServerClient, example_repository: Path, binary: bool
) -> None:
    blobs, _ = orientation_jpegs(3, seed=11, quality=80)
    outputs = [
        triton.InferRequestedOutput("fetch_name_0", binary_data=binary),
        triton.InferRequestedOutput("angle", binary_data=binary),
    ]
    # an encoded image is not text: V2 JSON cannot carry it, the binary extension does
    result = client.infer("orientation-jpeg", [image_input(blobs, True)], outputs=outputs)
    raw = ort.InferenceSession(str(example_repository / "orientation" / "1" / "model.onnx"))
    probs = result.as_numpy("fetch_name_0")
    for i, blob in enumerate(blobs):
        want = raw.run(None, {"x": by_hand(blob)})[0][0]
        assert np.abs(probs[i] - want).max() < 0.05 and probs[i].argmax() == want.argmax()
    angles = [a[0].decode() if isinstance(a[0], bytes) else a[0] for a in result.as_numpy("angle")]
    assert angles == [("0", "90", "180", "270")[int(p.argmax())] for p in probs]


def test_metadata_tells_the_client_to_send_one_encoded_image_per_item(
    client: triton.InferenceServerClient,
) -> None:
    meta = client.get_model_metadata("orientation-jpeg")
    assert meta["inputs"] == [{"name": "image", "datatype": "BYTES", "shape": [-1, 1]}]
    config = client.get_model_config("orientation-jpeg")
    assert config["input"][0]["data_type"] == "TYPE_STRING" and config["input"][0]["dims"] == [1]


def test_the_classification_extension_adds_the_labels_file_label(
    client: triton.InferenceServerClient,
) -> None:
    blobs, _ = orientation_jpegs(1, seed=2)
    out = triton.InferRequestedOutput("fetch_name_0", class_count=4)
    result = client.infer("orientation-jpeg", [image_input(blobs, True)], outputs=[out])
    rows = result.as_numpy("fetch_name_0")
    parts = [cell.decode().split(":") for cell in rows[0]]
    assert [p[2] for p in parts] and {p[2] for p in parts} == {"0", "90", "180", "270"}
    assert all(("0", "90", "180", "270")[int(p[1])] == p[2] for p in parts)


@pytest.mark.parametrize(
    ("data", "words"),
    [
        (b"definitely not an image", "not a JPEG, PNG, WebP or BMP image"),
        (orientation_jpegs(1, seed=4)[0][0][:20_000], "truncated"),
        (png_declaring(20_000, 20_000), "20000x20000"),
        (jpeg_declaring(20_000, 20_000), "20000x20000"),
    ],
    ids=["not-an-image", "truncated-jpeg", "png-bomb", "jpeg-20000x20000"],
)
def test_a_bad_image_gets_a_400_naming_the_problem_and_the_node_stays_up(
    node, client: triton.InferenceServerClient, data: bytes, words: str
) -> None:
    # the binary extension carries any bytes as they are
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "image",
                    "datatype": "BYTES",
                    "shape": [1, 1],
                    "parameters": {"binary_data_size": 4 + len(data)},
                }
            ]
        }
    ).encode()
    payload = header + len(data).to_bytes(4, "little") + data
    request = urllib.request.Request(
        node.http_url + "/v2/models/orientation-jpeg/infer",
        data=payload,
        headers={"Inference-Header-Content-Length": str(len(header))},
        method="POST",
    )
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=30)
    assert err.value.code == 400
    assert words in json.loads(err.value.read())["error"]
    good, _ = orientation_jpegs(1, seed=9)
    assert client.infer("orientation-jpeg", [image_input(good, True)]).as_numpy("angle").shape == (
        1,
        1,
    )


def test_a_tensor_where_the_image_goes_is_refused_by_datatype(
    client: triton.InferenceServerClient,
) -> None:
    inp = triton.InferInput("image", [1, 1], "FP32")
    inp.set_data_from_numpy(np.zeros((1, 1), np.float32))
    with pytest.raises(InferenceServerException, match="BYTES"):
        client.infer("orientation-jpeg", [inp])
