"""Static int8 quantization (QDQ) with ONNX Runtime.

Measured here (DESIGN.md section 6): ORT's *dynamic* int8 quantization made
CNNs 5-10x slower, because every activation is quantized at run time; static
QDQ with calibrated ranges kept the speed and cut the size ~3.5x.  So this is
the only quantizer Ferry offers.  Weights are per-channel (per-tensor lost
top-1 agreement on the orientation model), activations and weights signed
int8 (S8S8, ORT's recommended default for QDQ).
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

from shared.errors import BackendMissing, InvalidInput
from shared.modeltools.calibration import (
    InputSpec,
    ProgressReader,
    folder_reader,
    random_reader,
)
from shared.modeltools.convert import check_source

log = logging.getLogger(__name__)

#: ops that mark a model as quantized already: QDQ pairs and ONNX's integer operators
QUANTIZED_OPS = frozenset(
    {
        "QuantizeLinear",
        "DequantizeLinear",
        "DynamicQuantizeLinear",
        "QLinearConv",
        "QLinearMatMul",
        "ConvInteger",
        "MatMulInteger",
    }
)


def quantize_static_qdq(
    src: Path,
    dst: Path,
    calibration: Path | None = None,
    *,
    samples: int = 32,
    batch_size: int = 1,
    progress: bool = True,
) -> Path:
    """Write an int8 QDQ copy of the ONNX model ``src`` to ``dst``; returns ``dst``.

    ``calibration`` is a folder of ``.npy``/``.npz`` files; without it the
    ranges come from random data and a :class:`CalibrationWarning` is issued.
    At most ``samples`` samples are used: calibration time grows linearly and
    a few dozen representative inputs are enough for MinMax ranges.  A model
    that is already quantized is refused: quantizing it again would stack a
    second set of ranges on int8 values and only lose accuracy.  ``dst`` is
    replaced only once the new model is complete, so ``dst == src`` is safe.
    """
    try:
        import onnx
        from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType
        from onnxruntime.quantization import quantize_static as ort_quantize_static
    except ImportError as exc:
        raise BackendMissing(
            "quantization needs onnx and onnxruntime: pip install onnx onnxruntime"
        ) from exc
    from tqdm import tqdm

    src, dst = Path(src), Path(dst)
    check_source(src)
    if dst.is_dir():
        raise InvalidInput(f"{dst} is a folder: give the .onnx file to write")
    if any(p.exists() and not p.is_dir() for p in dst.parents):
        raise InvalidInput(f"cannot write {dst}: a file stands where its folder should be")
    if src.suffix.lower() != ".onnx":
        raise InvalidInput(f"{src.name}: only ONNX models can be quantized (got {src.suffix})")
    if samples < 1:
        raise InvalidInput(f"samples must be >= 1, got {samples}")
    if batch_size < 1:
        raise InvalidInput(f"batch size must be >= 1, got {batch_size}")
    # Steps: load (model + calibration data), pre-process, one per batch, quantize + write.
    with tqdm(total=3, desc=f"quantizing {src.name}", unit="step", disable=not progress) as bar:
        bar.set_postfix_str("load")
        try:
            model = onnx.load(str(src), load_external_data=False)
        except Exception as exc:  # protobuf DecodeError and friends
            raise InvalidInput(f"{src.name} is not a readable ONNX model: {exc}") from exc
        opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
        found = sorted({node.op_type for node in model.graph.node} & QUANTIZED_OPS)
        if found:
            raise InvalidInput(
                f"{src.name} is already quantized (it holds {', '.join(found)} nodes); "
                "quantize the FP32 original instead"
            )
        specs = input_specs(model.graph)
        del model
        if calibration is None:
            reader = random_reader(specs, samples=samples, batch_size=batch_size)
        else:
            reader = folder_reader(Path(calibration), specs, samples=samples, batch_size=batch_size)
        bar.total = 3 + len(reader)
        bar.update(1)
        try:
            dst.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise InvalidInput(f"cannot write {dst}: {exc.strerror or exc}") from None
        partial = dst.with_name(f".{dst.stem}.partial{dst.suffix}")
        with tempfile.TemporaryDirectory(prefix="ferry-quant-") as tmp:
            bar.set_postfix_str("pre-process")
            source = src
            if opset < PER_CHANNEL_OPSET:
                source = _upgrade(src, Path(tmp) / "upgraded.onnx", opset)
            prepared = _preprocess(source, Path(tmp) / "prepared.onnx")
            bar.update(1)
            bar.set_postfix_str("calibrate")
            wrapped = ProgressReader(reader, bar, after="quantize + write")
            try:
                ort_quantize_static(
                    str(prepared),
                    str(partial),
                    wrapped,
                    quant_format=QuantFormat.QDQ,
                    per_channel=True,
                    activation_type=QuantType.QInt8,
                    weight_type=QuantType.QInt8,
                    calibrate_method=CalibrationMethod.MinMax,
                )
                _loads(partial, src)
                os.replace(partial, dst)
            except OSError as exc:
                raise InvalidInput(f"cannot write {dst}: {exc.strerror or exc}") from None
            except InvalidInput:
                raise
            except Exception as exc:  # ORT's own error types subclass nothing of Python's
                raise InvalidInput(f"quantizing {src.name} failed: {exc}") from None
            finally:
                partial.unlink(missing_ok=True)
        bar.update(1)
    log.info("quantized %s -> %s (%d calibration batches)", src, dst, len(reader))
    return dst


#: per-channel QuantizeLinear/DequantizeLinear (their ``axis``) came with opset 13
PER_CHANNEL_OPSET = 13


def _upgrade(src: Path, out: Path, opset: int) -> Path:
    """The model at ``PER_CHANNEL_OPSET``: quantized at its own opset it wrote nodes
    that opset does not have, a model no runtime loads."""
    import onnx
    from onnx import version_converter

    try:
        model = version_converter.convert_version(onnx.load(str(src)), PER_CHANNEL_OPSET)
        onnx.save(model, str(out))
    except Exception as exc:
        raise InvalidInput(
            f"{src.name} uses opset {opset}; int8 QDQ needs opset {PER_CHANNEL_OPSET} or later, "
            f"and ONNX could not upgrade it ({exc}): export it at opset {PER_CHANNEL_OPSET}+"
        ) from None
    log.info("%s upgraded from opset %d to %d to quantize", src.name, opset, PER_CHANNEL_OPSET)
    return out


def _loads(path: Path, src: Path) -> None:
    """The quantized model must load where it will run, or it is not written."""
    import onnxruntime as ort

    try:
        ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    except Exception as exc:
        raise InvalidInput(
            f"quantizing {src.name} produced a model ONNX Runtime cannot load ({exc}); "
            "nothing was written"
        ) from None


def input_specs(graph: object) -> list[InputSpec]:
    """The graph's real inputs (initializers excluded) with numpy dtypes."""
    import numpy as np

    from shared.datatypes import numpy_dtype
    from shared.modeltools.inspect import onnx_io

    inputs, _ = onnx_io(graph)
    specs = []
    for spec in inputs:
        if spec["datatype"].startswith("onnx:") or spec["datatype"] == "BYTES":
            raise InvalidInput(
                f"input {spec['name']!r} has type {spec['datatype']}, which cannot be calibrated"
            )
        specs.append(
            InputSpec(
                spec["name"],
                np.dtype(numpy_dtype(spec["datatype"])),
                None if spec["dims"] is None else tuple(spec["dims"]),
            )
        )
    return specs


def _preprocess(src: Path, out: Path) -> Path:
    """ORT's recommended pre-pass (shape inference, BatchNorm folding); src if it fails.

    Symbolic shape inference is skipped: it needs sympy, and ONNX's own shape
    inference covers the CNNs served here.
    """
    from onnxruntime.quantization.shape_inference import quant_pre_process

    try:
        quant_pre_process(str(src), str(out), skip_symbolic_shape=True)
    except Exception as exc:  # an optional optimisation: any failure falls back
        log.warning("quantization pre-processing of %s failed (%s); using it as is", src, exc)
        return src
    return out
