"""Convert a model to OpenVINO IR (``model.xml`` + ``model.bin``).

The cloud's CPU servers run OpenVINO; converting once ahead of time moves the
ONNX frontend's work out of every server start.  Weights stay FP32
(``compress_to_fp16=False``): precision is chosen at compile time with the
runtime's precision hint, not baked into the file.
"""

from __future__ import annotations

import logging
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
    if not src.is_file():
        raise ModelNotFound(f"{src} does not exist")
    if src.suffix.lower() not in CONVERTIBLE_SUFFIXES:
        raise InvalidInput(
            f"{src.name}: OpenVINO converts {sorted(CONVERTIBLE_SUFFIXES)} files, not {src.suffix}"
        )
    xml = dst if dst.suffix.lower() == ".xml" else dst / "model.xml"
    xml.parent.mkdir(parents=True, exist_ok=True)
    with tqdm(total=3, desc=f"converting {src.name}", unit="step", disable=not progress) as bar:
        bar.set_postfix_str("convert")
        try:
            model = ov.convert_model(str(src))
        except Exception as exc:  # OpenVINO raises OpConversionFailure, RuntimeError, ...
            raise InvalidInput(f"OpenVINO cannot convert {src.name}: {exc}") from exc
        bar.update(1)
        bar.set_postfix_str("save")
        ov.save_model(model, str(xml), compress_to_fp16=False)
        bar.update(1)
        bar.set_postfix_str("verify")
        _verify(ov, model, xml)
        bar.update(1)
    log.info("converted %s -> %s", src, xml)
    return xml


def _verify(ov: object, converted: object, xml: Path) -> None:
    """Read the IR back: a truncated .bin or a lost tensor name fails here, not in a server."""
    reread = ov.Core().read_model(str(xml))  # type: ignore[attr-defined]
    want = [p.get_any_name() for p in converted.inputs + converted.outputs]  # type: ignore[attr-defined]
    got = [p.get_any_name() for p in reread.inputs + reread.outputs]
    if want != got:
        raise InvalidInput(f"{xml} lost tensor names on the way: {want} became {got}")
