"""Convert a model to OpenVINO IR (``model.xml`` + ``model.bin``).

The cloud's CPU servers run OpenVINO; converting once ahead of time moves the
ONNX frontend's work out of every server start.  Weights stay FP32
(``compress_to_fp16=False``): precision is chosen at compile time with the
runtime's precision hint, not baked into the file.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

from shared.errors import BackendMissing, InvalidInput, ModelNotFound

log = logging.getLogger(__name__)

#: source formats OpenVINO's frontends read
CONVERTIBLE_SUFFIXES = frozenset({".onnx", ".tflite", ".pdmodel", ".pb"})


def convert_to_openvino(src: Path, dst_dir_or_xml: Path, *, progress: bool = True) -> Path:
    """Convert ``src`` and write the IR; returns the ``.xml`` path.

    ``dst_dir_or_xml`` is either the ``.xml`` file to write or a folder that
    receives ``model.xml`` (the name a repository version folder expects).
    """
    try:
        import openvino as ov
    except ImportError as exc:
        raise BackendMissing("conversion needs openvino: pip install openvino") from exc
    from tqdm import tqdm

    src, dst = Path(src), Path(dst_dir_or_xml)
    check_source(src)
    if src.suffix.lower() not in CONVERTIBLE_SUFFIXES:
        raise InvalidInput(
            f"{src.name}: OpenVINO converts {sorted(CONVERTIBLE_SUFFIXES)} files, not {src.suffix}"
        )
    # (OpenVINO's writer takes only a lower-case .xml; the .bin goes beside it)
    xml = dst.with_suffix(".xml") if dst.suffix.lower() == ".xml" else dst / "model.xml"
    if xml.parent.exists() and not xml.parent.is_dir():
        raise InvalidInput(f"{xml.parent} is a file: give a folder or a .xml path")
    with tqdm(total=3, desc=f"converting {src.name}", unit="step", disable=not progress) as bar:
        bar.set_postfix_str("convert")
        root = logging.getLogger()
        saved = root.level, list(root.filters), list(root.handlers)
        try:
            model = ov.convert_model(str(src))
        except Exception as exc:  # OpenVINO raises OpConversionFailure, RuntimeError, ...
            raise InvalidInput(f"OpenVINO cannot convert {src.name}: {exc}") from exc
        finally:
            # Its converter sets the root logger to ERROR (and may leave it so, on a
            # failure): every warning of the process after it went unsaid.
            root.setLevel(saved[0])
            root.filters[:], root.handlers[:] = saved[1], saved[2]
        bar.update(1)
        bar.set_postfix_str("save")
        # Written beside the destination, read back, then moved over it: a failure
        # half-way never leaves a broken or mismatched IR where a good one was.
        try:
            xml.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(prefix=".ferry-ir-", dir=xml.parent) as tmp:
                staged = Path(tmp) / xml.name
                ov.save_model(model, str(staged), compress_to_fp16=False)
                bar.update(1)
                bar.set_postfix_str("verify")
                _verify(ov, model, staged)
                os.replace(staged.with_suffix(".bin"), xml.with_suffix(".bin"))
                os.replace(staged, xml)
        except OSError as exc:
            raise InvalidInput(f"cannot write {xml}: {exc.strerror or exc}") from None
        except RuntimeError as exc:  # OpenVINO's writer: a path it cannot open
            raise InvalidInput(f"cannot write {xml}: {exc}") from None
        bar.update(1)
    log.info("converted %s -> %s", src, xml)
    return xml


def check_source(src: Path) -> None:
    """The model file a tool reads: a clear error for a folder or a missing path."""
    if src.is_dir():
        raise InvalidInput(
            f"{src} is a folder: give the model file in it (ferry-cloud model inspect {src} "
            "shows which one a repository serves)"
        )
    if not src.is_file():
        raise ModelNotFound(f"{src} does not exist")


def _verify(ov: object, converted: object, xml: Path) -> None:
    """Read the IR back: a truncated .bin or a lost tensor name fails here, not in a server."""
    reread = ov.Core().read_model(str(xml))  # type: ignore[attr-defined]
    want = [p.get_any_name() for p in converted.inputs + converted.outputs]  # type: ignore[attr-defined]
    got = [p.get_any_name() for p in reread.inputs + reread.outputs]
    if want != got:
        raise InvalidInput(f"{xml} lost tensor names on the way: {want} became {got}")
