"""What a model's ``[[preprocess]]`` and ``[[postprocess]]`` tables say, checked.

Plain data: the repository parses it (``shared/repository/stages.py``), the
pipeline runs it.  ``None`` marks what the model file tells at load time
(the tensor fed, its size, layout and datatype).
"""

from __future__ import annotations

from dataclasses import dataclass

#: encoded image formats an image input may accept
IMAGE_FORMATS = ("jpeg", "png", "webp", "bmp")
RESIZE_MODES = ("stretch", "shorter_side")
INTERPOLATIONS = ("nearest", "bilinear", "bicubic", "area", "lanczos")
COLORS = ("rgb", "bgr", "gray")
LAYOUTS = ("NCHW", "NHWC")
DECODERS = ("auto", "pillow", "opencv", "turbojpeg")
#: pixels a declared image may have by default (a 40 MP photo decodes to 120 MB of RGB)
DEFAULT_MAX_PIXELS = 40_000_000


@dataclass(frozen=True)
class ImageInput:
    """One encoded-image input (a BYTES element per item) feeding a model tensor."""

    input: str = "image"
    tensor: str | None = None
    formats: tuple[str, ...] = IMAGE_FORMATS
    resize: str = "stretch"
    size: tuple[int, int] | None = None  # (height, width)
    shorter_side: int | None = None
    interpolation: str = "bilinear"
    color: str = "rgb"
    scale: float | None = None
    mean: tuple[float, ...] = ()
    std: tuple[float, ...] = ()
    layout: str | None = None
    datatype: str | None = None
    max_pixels: int = DEFAULT_MAX_PIXELS
    decoder: str = "auto"
    # a JPEG decoded at 1/2, 1/4 or 1/8 in its IDCT where the resize target allows:
    # most of the decode saved, and a smoothing a full decode + resize lacks
    scaled_decode: bool = True
    # turn the pixels as the EXIF Orientation tag says (as a phone shows the photo)
    exif_orientation: bool = False


@dataclass(frozen=True)
class OutputStage:
    """Post-processing of one model output into the output clients see (``name``)."""

    output: str
    name: str
    softmax: bool = False
    top_k: int = 0
    argmax: bool = False
    labels: str | None = None
