from __future__ import annotations

import io
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image


def encode(pixels: np.ndarray, fmt: str, **kw: object) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, fmt, **kw)
    return buffer.getvalue()


def photo(height: int = 300, width: int = 400, seed: int = 0) -> np.ndarray:
    """A smooth RGB picture with some texture (JPEG-friendly, not flat)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    img = np.stack([x / width * 255, y / height * 255, (x + y) % 256], -1)
    img = img + rng.normal(0, 8, img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)


def png_declaring(width: int, height: int) -> bytes:
    """A PNG whose header declares ``width`` x ``height`` but holds almost no data."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\x00" * 16))
        + chunk(b"IEND", b"")
    )


def jpeg_declaring(width: int, height: int) -> bytes:
    """A small real JPEG whose SOF marker is patched to declare another size."""
    data = bytearray(encode(photo(16, 16), "JPEG"))
    sof = data.find(b"\xff\xc0")
    assert sof > 0
    data[sof + 5 : sof + 9] = struct.pack(">HH", height, width)
    return bytes(data)


def write_image_model(
    path: Path, dims: list[int | str] | None, onnx_type: int = 1, name: str = "x"
) -> None:
    """y = x: the model input the pipeline must fill, exactly as given (dims None:
    no shape in the file, any rank)."""
    import onnx
    from onnx import helper

    graph = helper.make_graph(
        [helper.make_node("Identity", [name], ["y"])],
        "image_identity",
        [helper.make_tensor_value_info(name, onnx_type, dims)],
        [helper.make_tensor_value_info("y", onnx_type, dims)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))


@pytest.fixture
def photo_jpeg() -> bytes:
    return encode(photo(), "JPEG", quality=90)
