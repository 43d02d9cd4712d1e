"""The pipeline around a model: by-hand equality, shapes and dtypes, config errors."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto
from PIL import Image

from shared.errors import ConfigError, InvalidInput
from shared.pipeline import open_session
from shared.repository import ModelRepository, complete_config, parse_config_dict, v2_model_metadata
from shared.runtimes import RuntimeOptions
from tests.shared.pipeline.conftest import encode, photo, write_image_model

MEAN = [0.485, 0.456, 0.406]
STD = [0.229, 0.224, 0.225]


def by_hand(data: bytes, size: int = 224, shorter: int = 256) -> np.ndarray:
    """Decode and normalise with numpy + Pillow, the way a user would before Ferry."""
    import io

    im = Image.open(io.BytesIO(data)).convert("RGB")
    w, h = im.size
    f = shorter / min(w, h)
    im = im.resize((round(w * f), round(h * f)), Image.Resampling.BILINEAR)
    a = np.asarray(im, dtype=np.float32)[:, :, ::-1]  # BGR
    top, left = (a.shape[0] - size) // 2, (a.shape[1] - size) // 2
    a = a[top : top + size, left : left + size]
    a = (a / 255.0 - np.array(MEAN, np.float32)) / np.array(STD, np.float32)
    return np.ascontiguousarray(a.transpose(2, 0, 1)[None], dtype=np.float32)


def open_model(repo: Path, name: str):
    repository = ModelRepository(repo)
    config = repository.read_config(name)
    backend, path = repository.model_file(name, 1, None)
    session = open_session(backend, path, RuntimeOptions(threads=2), config)
    return session, complete_config(config, session)


def test_a_jpeg_gives_the_raw_runtimes_answer_on_the_by_hand_tensor(
    example_repository: Path,
) -> None:
    from shared.modeltools.samples import orientation_jpegs

    session, _ = open_model(example_repository, "orientation-jpeg")
    raw = ort.InferenceSession(str(example_repository / "orientation" / "1" / "model.onnx"))
    blobs, labels = orientation_jpegs(8, seed=5)
    got = session.run({"image": np.array([[b] for b in blobs], dtype=object)})
    for i, blob in enumerate(blobs):
        want = raw.run(None, {"x": by_hand(blob)})[0][0]
        assert np.abs(got["fetch_name_0"][i] - want).max() < 0.05
        assert int(got["fetch_name_0"][i].argmax()) == int(want.argmax())
    angles = [a[0].decode() for a in got["angle"]]
    assert angles == [str((0, 90, 180, 270)[int(p.argmax())]) for p in got["fetch_name_0"]]
    assert sum(a == str((0, 90, 180, 270)[k]) for a, k in zip(angles, labels, strict=True)) >= 7


def test_a_png_at_the_model_size_is_exactly_the_by_hand_tensor(tmp_path: Path) -> None:
    write_image_model(tmp_path / "m" / "1" / "model.onnx", ["N", 3, 32, 48])
    (tmp_path / "m" / "config.toml").write_text(
        f"[[preprocess]]\ncolor = 'bgr'\nmean = {MEAN}\nstd = {STD}\n"
    )
    session, _ = open_model(tmp_path, "m")
    pixels = photo(32, 48)
    out = session.run({"image": np.array([[encode(pixels, "PNG")]], dtype=object)})["y"]
    want = (pixels[:, :, ::-1] / np.float32(255) - np.float32(MEAN)) / np.float32(STD)
    np.testing.assert_allclose(out[0], want.transpose(2, 0, 1), rtol=1e-5, atol=1e-5)


def test_an_input_of_any_rank_takes_a_batch_of_images_in_the_stated_layout(
    tmp_path: Path,
) -> None:
    write_image_model(tmp_path / "m" / "1" / "model.onnx", None)
    (tmp_path / "m" / "config.toml").write_text(
        f"[[preprocess]]\ncolor = 'bgr'\nlayout = 'NCHW'\nsize = [32, 48]\n"
        f"mean = {MEAN}\nstd = {STD}\n"
    )
    session, _ = open_model(tmp_path, "m")
    pixels = photo(32, 48)
    out = session.run({"image": np.array([[encode(pixels, "PNG")]], dtype=object)})["y"]
    want = (pixels[:, :, ::-1] / np.float32(255) - np.float32(MEAN)) / np.float32(STD)
    np.testing.assert_allclose(out, want.transpose(2, 0, 1)[None], rtol=1e-5, atol=1e-5)


def test_argmax_and_top_k_over_an_output_of_any_rank_read_its_last_axis(tmp_path: Path) -> None:
    write_image_model(tmp_path / "m" / "1" / "model.onnx", None)
    (tmp_path / "m" / "labels.txt").write_text("a\nb\nc\n")
    (tmp_path / "m" / "config.toml").write_text(
        "[[postprocess]]\noutput = 'y'\nname = 'best'\nargmax = true\nlabels = 'labels.txt'\n"
        "[[postprocess]]\noutput = 'y'\nname = 'top'\ntop_k = 2\n"
    )
    session, config = open_model(tmp_path, "m")
    x = np.array([[0.0, 2.0, 1.0], [5.0, 0.0, 1.0]], np.float32)
    out = session.run({"x": x}, ["best", "top"])
    assert out["best"].tolist() == [[b"b"], [b"a"]]
    assert out["top"].shape == (2, 2) and out["top"][1, 1].decode().endswith(":2")
    assert session.run({"x": x[0]}, ["best"])["best"].tolist() == [b"b"]
    meta = v2_model_metadata("m", config, ["1"])
    assert {"name": "best", "datatype": "BYTES", "shape": [-1]} in meta["outputs"]


def test_metadata_and_config_describe_the_bytes_input_the_client_sends(
    example_repository: Path,
) -> None:
    _, config = open_model(example_repository, "orientation-jpeg")
    meta = v2_model_metadata("orientation-jpeg", config, ["1"])
    assert meta["inputs"] == [{"name": "image", "datatype": "BYTES", "shape": [-1, 1]}]
    assert {"name": "angle", "datatype": "BYTES", "shape": [-1, 1]} in meta["outputs"]


def test_top_k_with_labels_reads_score_index_label(tmp_path: Path) -> None:
    from tests.support import write_softmax_model

    write_softmax_model(tmp_path / "s" / "1" / "model.onnx", n=4)
    (tmp_path / "s" / "labels.txt").write_text("cat\ndog\nbird\nfish\n")
    (tmp_path / "s" / "config.toml").write_text(
        "[[postprocess]]\noutput = 'probs'\nname = 'top'\ntop_k = 2\nlabels = 'labels.txt'\n"
    )
    session, _ = open_model(tmp_path, "s")
    name = session.inner.inputs[0].name
    x = np.array([[0.0, 3.0, 1.0, 0.0]], np.float32)
    out = session.run({name: x}, ["top"])["top"]
    assert out.shape == (1, 2)
    assert out[0, 0].decode().endswith(":1:dog") and out[0, 1].decode().endswith(":2:bird")


def test_a_class_past_the_labels_file_is_answered_by_its_index(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A short labels file is said when the model loads, and a class past it answers its
    index, as top-k leaves its label out (argmax's 500 failed the whole batch)."""
    from tests.support import write_softmax_model

    write_softmax_model(tmp_path / "s" / "1" / "model.onnx", n=4)
    (tmp_path / "s" / "labels.txt").write_text("cat\ndog\n")
    (tmp_path / "s" / "config.toml").write_text(
        "[[postprocess]]\noutput = 'probs'\nname = 'best'\nargmax = true\nlabels = 'labels.txt'\n"
    )
    with caplog.at_level("WARNING"):
        session, _ = open_model(tmp_path, "s")
    assert "labels.txt has 2 lines for 4 classes" in caplog.text
    x = np.array([[0.0, 3.0, 1.0, 0.0], [0.0, 0.0, 1.0, 4.0]], np.float32)
    out = session.run({session.inner.inputs[0].name: x}, ["best"])["best"]
    assert out.tolist() == [[b"dog"], [b"3"]]


def test_a_bad_image_in_a_batch_is_an_invalid_input_naming_the_input(
    example_repository: Path,
) -> None:
    session, _ = open_model(example_repository, "orientation-jpeg")
    with pytest.raises(InvalidInput, match="input 'image'"):
        session.run({"image": np.array([[b"not an image"]], dtype=object)})
    good = encode(photo(300, 200), "JPEG")
    batch = np.array([[good], [b"not an image"], [good]], dtype=object)
    with pytest.raises(InvalidInput, match=r"input 'image' item 1: not a JPEG"):
        session.run({"image": batch})


@pytest.mark.parametrize(
    ("table", "key"),
    [
        ({"preprocess": [{"colour": "rgb"}]}, "preprocess[0].colour"),
        ({"preprocess": [{"color": "cmyk"}]}, "preprocess[0].color"),
        ({"preprocess": [{"size": [0, 224]}]}, "preprocess[0].size"),
        ({"preprocess": [{"mean": [1, 2]}]}, "preprocess[0].mean"),
        ({"preprocess": [{"std": [0.0]}]}, "preprocess[0].std[0]"),
        ({"preprocess": [{"shorter_side": 256}]}, "preprocess[0].resize"),
        ({"postprocess": [{"name": "x"}]}, "postprocess[0].output"),
        ({"postprocess": [{"output": "y", "labels": "../etc/passwd"}]}, "postprocess[0].labels"),
        (
            {"postprocess": [{"output": "y", "labels": "labels.txt\u0000x"}]},
            "postprocess[0].labels",
        ),
        ({"postprocess": [{"output": "y", "top_k": 3, "argmax": True}]}, "postprocess[0].argmax"),
    ],
)
def test_config_errors_name_the_file_and_the_key(table: dict, key: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config_dict(table, "/repo/m/config.toml", "m")
    assert "/repo/m/config.toml" in str(err.value) and key in str(err.value)


@pytest.mark.parametrize(
    ("toml", "key"),
    [
        ("[[preprocess]]\ntensor = 'nope'\n", "preprocess[0].tensor"),
        ("[[preprocess]]\nsize = [10, 10]\n", "preprocess[0].size"),
        ("[[preprocess]]\ncolor = 'gray'\n", "preprocess[0].color"),
        ("[[postprocess]]\noutput = 'nope'\n", "postprocess[0].output"),
        ("[[postprocess]]\noutput = 'y'\nlabels = 'missing.txt'\n", "postprocess[0].labels"),
    ],
)
def test_load_time_errors_name_the_config_file_and_key(tmp_path: Path, toml: str, key: str) -> None:
    write_image_model(tmp_path / "m" / "1" / "model.onnx", ["N", 3, 32, 32])
    (tmp_path / "m" / "config.toml").write_text(toml)
    with pytest.raises(ConfigError) as err:
        open_model(tmp_path, "m")
    assert str(tmp_path / "m" / "config.toml") in str(err.value) and key in str(err.value)


_TYPES = {"FP32": TensorProto.FLOAT, "FP16": TensorProto.FLOAT16, "UINT8": TensorProto.UINT8}


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    layout=st.sampled_from(["NCHW", "NHWC"]),
    color=st.sampled_from(["rgb", "bgr", "gray"]),
    datatype=st.sampled_from(sorted(_TYPES)),
    height=st.integers(1, 40),
    width=st.integers(1, 40),
    batch=st.integers(1, 3),
    resize=st.sampled_from(["stretch", "shorter_side"]),
    source=st.tuples(st.integers(1, 60), st.integers(1, 60)),
    fmt=st.sampled_from(["PNG", "JPEG", "BMP", "WEBP"]),
)
def test_the_pipeline_output_always_matches_the_model_input_shape_and_dtype(
    tmp_path_factory: pytest.TempPathFactory,
    layout: str,
    color: str,
    datatype: str,
    height: int,
    width: int,
    batch: int,
    resize: str,
    source: tuple[int, int],
    fmt: str,
) -> None:
    tmp = tmp_path_factory.mktemp("prop")
    channels = 1 if color == "gray" else 3
    dims: list[int | str] = (
        ["N", channels, height, width] if layout == "NCHW" else ["N", height, width, channels]
    )
    write_image_model(tmp / "m" / "1" / "model.onnx", dims, _TYPES[datatype])
    (tmp / "m" / "config.toml").write_text(
        f"[[preprocess]]\ncolor = '{color}'\nlayout = '{layout}'\nresize = '{resize}'\n"
    )
    session, _ = open_model(tmp, "m")
    data = encode(photo(*source), fmt)
    feed = {"image": np.array([[data]] * batch, dtype=object)}
    tensor = session._tensor(session._pre[0], feed["image"])
    expected = (batch, *[d for d in dims[1:]])
    assert tensor.shape == expected
    assert tensor.dtype == np.dtype(
        {"FP32": np.float32, "FP16": np.float16, "UINT8": np.uint8}[datatype]
    )
    assert session.run(feed)["y"].shape == expected


@pytest.mark.parametrize(
    ("old", "new", "key"),
    [
        ('input = "image"', 'input = "nosuch"', "preprocess[0].input"),
        ('name = "angle"', 'name = "rotation"', "postprocess[0].name"),
    ],
)
def test_a_stage_name_the_declared_tensors_lack_is_blamed_on_the_stage(
    tmp_path: Path, example_repository: Path, old: str, new: str, key: str
) -> None:
    import shutil

    shutil.copytree(example_repository / "orientation-int8-jpeg", tmp_path / "m")
    config = tmp_path / "m" / "config.toml"
    text = config.read_text()
    assert old in text
    config.write_text(text.replace(old, new, 1))
    with pytest.raises(ConfigError, match=re.escape(f"key '{key}'")):
        open_model(tmp_path, "m")


def test_a_process_without_opencv_warns_that_its_resize_differs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from shared.pipeline import images

    write_image_model(tmp_path / "m" / "1" / "model.onnx", ["N", 3, 32, 48])
    (tmp_path / "m" / "config.toml").write_text("[[preprocess]]\ncolor = 'bgr'\n")
    open_model(tmp_path, "m")
    assert "OpenCV is not installed" not in caplog.text
    monkeypatch.setitem(images._modules, "opencv", None)
    open_model(tmp_path, "m")
    assert "OpenCV is not installed" in caplog.text and "preprocess[0].decoder" in caplog.text


def test_the_edge_install_brings_the_resize_the_cloud_uses() -> None:
    import tomllib

    root = Path(__file__).resolve().parents[3]
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    for tier in ("edge", "cloud"):
        assert "ferry[decode]" in extras[tier]
        assert any(d.startswith("onnx>=") for d in extras[tier])  # scalars vs any rank
    assert any(d.startswith("opencv-python-headless") for d in extras["decode"])


def test_an_int8_image_input_takes_pixel_minus_128_by_default(tmp_path: Path) -> None:
    # Pixels as they were clipped every one above 127 to 127: half an image, unsaid.
    write_image_model(tmp_path / "m" / "1" / "model.onnx", ["N", 32, 48, 3], TensorProto.INT8)
    (tmp_path / "m" / "config.toml").write_text("[[preprocess]]\ncolor = 'rgb'\n")
    session, _ = open_model(tmp_path, "m")
    pixels = photo(32, 48)
    out = session.run({"image": np.array([[encode(pixels, "PNG")]], dtype=object)})["y"]
    assert out.dtype == np.int8
    np.testing.assert_array_equal(out[0], (pixels.astype(np.int16) - 128).astype(np.int8))


def test_a_pixel_map_beyond_an_integer_inputs_range_warns_at_load(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    write_image_model(tmp_path / "m" / "1" / "model.onnx", ["N", 32, 48, 3], TensorProto.UINT8)
    (tmp_path / "m" / "config.toml").write_text("[[preprocess]]\nmean = [128]\n")
    open_model(tmp_path, "m")
    assert "beyond UINT8's 0..255" in caplog.text and "clipped" in caplog.text
    caplog.clear()
    (tmp_path / "m" / "config.toml").write_text("[[preprocess]]\n")  # raw pixels fit
    open_model(tmp_path, "m")
    assert "clipped" not in caplog.text


def test_loading_an_image_model_does_not_import_opencv(example_repository: Path) -> None:
    # Asking whether OpenCV is there imported it (~0.2 s of the agent's start-up).
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from shared.pipeline import open_session\n"
        "from shared.repository import ModelRepository\n"
        "from shared.runtimes import RuntimeOptions\n"
        f"repo = ModelRepository(Path({str(example_repository)!r}))\n"
        "config = repo.read_config('orientation-int8-jpeg')\n"
        "backend, path = repo.model_file('orientation-int8-jpeg', 1, None)\n"
        "open_session(backend, path, RuntimeOptions(threads=1), config)\n"
        "print('cv2' in sys.modules)\n"
    )
    root = Path(__file__).resolve().parents[3]
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False"


def test_a_precision_hint_for_a_backend_that_ignores_it_is_said(tmp_path: Path, caplog) -> None:
    # (OpenVINO's setting, taken without a word for an ONNX Runtime model)
    from tests.support import write_linear_model

    write_linear_model(tmp_path / "m" / "1" / "model.onnx")
    (tmp_path / "m" / "config.toml").write_text('[runtime]\nprecision_hint = "f16"\n')
    repo = ModelRepository(tmp_path)
    config = repo.read_config("m")
    backend, path = repo.model_file("m", 1, config.backend)
    with caplog.at_level("WARNING"):
        session = open_session(backend, path, config.runtime.to_options(), config)
    session.close()
    assert "'runtime.precision_hint' applies to the openvino backend only" in caplog.text
