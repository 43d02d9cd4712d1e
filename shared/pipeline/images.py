"""Decoding one encoded image into the uint8 pixels a model input is made from.

Three decoders, picked per image: libjpeg-turbo (Debian's libturbojpeg,
through the thin binding in ``turbo.py``) for JPEG, OpenCV for every format,
Pillow as the one always present.  Measured here (2 vCPU): a 1024x768 camera
JPEG to 224x224 took 1.6 ms with TurboJPEG's scaled decode, 2.7 ms with
OpenCV's reduced decode, 5.2 ms with Pillow's ``draft``; the demo's 63-142 KB
scanned pages (decode, resize to 256, crop 224) 1.4-1.6 ms, 1.3-1.7 ms and
3.2-3.7 ms (``bench/pipeline.py``).  So ``auto`` tries them in that order.
Pillow-SIMD was left out: PyPI has it as source only, and it replaces Pillow
itself.  A scaled JPEG decode (1/2, 1/4, 1/8 in the IDCT) never goes below
the size the resize needs; it saves most of the work, and it also smooths as
an anti-aliasing filter would (``scaled_decode = false`` decodes full size).

Every image is checked before any pixel is decoded: its magic bytes (the
format must be one the input accepts), the size its header declares (bounded
by ``max_pixels``: a decompression bomb is refused before it allocates), and
for JPEG that the entropy-coded data ends (a truncated upload is refused
instead of decoded half grey, which libjpeg would do with only a warning).
"""

from __future__ import annotations

import collections
import io
import re
import threading
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

from shared.errors import BackendMissing, InvalidInput

_MAGIC = (
    (b"\xff\xd8\xff", "jpeg"),
    (b"\x89PNG\r\n\x1a\n", "png"),
    (b"BM", "bmp"),
)


@dataclass(frozen=True)
class Target:
    """Where one image goes: pixels (height, width), channel order and resize rule."""

    height: int
    width: int
    color: str  # rgb, bgr, gray
    resize: str  # stretch, shorter_side
    shorter_side: int | None
    interpolation: str
    formats: tuple[str, ...]
    max_pixels: int
    decoder: str  # auto, pillow, opencv, turbojpeg
    where: str  # "input 'image'" for messages
    scaled_decode: bool = True  # a JPEG may be decoded at 1/2, 1/4, 1/8 (its IDCT)
    exif_orientation: bool = False  # turned as its EXIF Orientation tag says


def sniff(data: bytes) -> str | None:
    """The image format from the first bytes (None: not an image Ferry decodes)."""
    for magic, name in _MAGIC:
        if data.startswith(magic):
            return name
    if len(data) >= 12 and data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    return None


def decode(data: bytes, target: Target) -> np.ndarray:
    """``data`` as uint8 pixels of shape (height, width, channels) for ``target``."""
    fmt = sniff(data)
    if fmt is None:
        head = data[:8].hex(" ") if data else "nothing"
        raise InvalidInput(
            f"{target.where}: not a JPEG, PNG, WebP or BMP image (it starts with {head})"
        )
    if fmt not in target.formats:
        raise InvalidInput(
            f"{target.where}: {fmt.upper()} images are not accepted by this model "
            f"(it takes {', '.join(f.upper() for f in target.formats)})"
        )
    width, height = _declared_size(data, fmt, target)
    if fmt == "jpeg" and not _jpeg_complete(data):
        raise InvalidInput(f"{target.where}: the JPEG image is truncated (no end of image)")
    turn = exif_orientation(data) if target.exif_orientation and fmt != "bmp" else 1
    if turn >= 5:  # a quarter turn: the resize target is met by the turned picture
        need_w, need_h = _decoded_size_needed(height, width, target)
    else:
        need_h, need_w = _decoded_size_needed(width, height, target)
    # What the decode holds until the resize: every decoder writes the declared size
    # (a JPEG's scaled by its IDCT reduction), and converting can copy it once more.
    scale = _reduction((width, height), (need_w, need_h)) if fmt == "jpeg" else 1
    held = -(-width // scale) * -(-height // scale) * 3 * 2
    with pixel_budget().held(held):
        return _decode(data, fmt, target, (width, height), (need_w, need_h), turn)


def exif_orientation(data: bytes) -> int:
    """The EXIF Orientation tag (1-8; 1 where there is none or it is unreadable), read
    from the header alone (Pillow parses JPEG, PNG and WebP EXIF without decoding)."""
    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with Image.open(io.BytesIO(data)) as im:
                value = im.getexif().get(0x0112, 1)
    except Exception:  # (a broken EXIF block does not make the picture unreadable)
        return 1
    return value if isinstance(value, int) and 1 <= value <= 8 else 1


def _orient(pixels: np.ndarray, turn: int) -> np.ndarray:
    """(height, width, channels) pixels turned as EXIF orientation ``turn`` says, as
    Pillow's ImageOps.exif_transpose turns them."""
    if turn == 2:
        pixels = pixels[:, ::-1]
    elif turn == 3:
        pixels = pixels[::-1, ::-1]
    elif turn == 4:
        pixels = pixels[::-1]
    elif turn == 5:
        pixels = pixels.transpose(1, 0, 2)
    elif turn == 6:
        pixels = pixels.transpose(1, 0, 2)[:, ::-1]
    elif turn == 7:
        pixels = pixels[::-1, ::-1].transpose(1, 0, 2)
    elif turn == 8:
        pixels = pixels.transpose(1, 0, 2)[::-1]
    return np.ascontiguousarray(pixels) if turn != 1 else pixels


def _decode(
    data: bytes,
    fmt: str,
    target: Target,
    size: tuple[int, int],
    need: tuple[int, int],
    turn: int = 1,
) -> np.ndarray:
    width, height = size
    need_w, need_h = need
    pixels = None
    for decoder in _decoders(fmt, target.decoder):
        try:
            pixels = decoder(data, fmt, target, (width, height), (need_w, need_h))
        except InvalidInput:
            raise
        except Exception:
            pixels = None
        if pixels is not None:
            break
    if pixels is None:
        pixels = _pillow(data, fmt, target, (width, height), (need_w, need_h))
    return _fit(_orient(pixels, turn), target)


class PixelBudget:
    """Bytes of decoded pixels the whole process may hold at once.

    ``max_pixels`` bounds one image; nothing bounded them together: nine
    models' workers and the decode pool each decoding a 36-megapixel PNG
    (105 KB on the wire) took a process to 2 GB.  A decode waits here (in its
    worker thread, never on the event loop) until its pixels fit; one that
    needs more than the whole budget runs alone.  Each decode takes and gives
    back its share without waiting on another, so none can wait forever.
    """

    def __init__(self, limit_bytes: int) -> None:
        self.limit = max(int(limit_bytes), 1)
        self.used = 0
        self.peak = 0
        self._cond = threading.Condition()
        self._queue: collections.deque[object] = collections.deque()  # waiters, in order

    def held(self, nbytes: int) -> _Held:
        return _Held(self, min(max(int(nbytes), 0), self.limit))

    def _take(self, nbytes: int) -> None:
        ticket = object()
        with self._cond:
            # In arrival order: admitting whatever fits left a big image waiting for
            # good while small ones kept overlapping.
            self._queue.append(ticket)
            try:
                while self._queue[0] is not ticket or (
                    self.used and self.used + nbytes > self.limit
                ):
                    self._cond.wait()
            except BaseException:  # (an interrupt while waiting: out of the line, or it jams)
                self._queue.remove(ticket)
                self._cond.notify_all()
                raise
            self._queue.popleft()
            self.used += nbytes
            self.peak = max(self.peak, self.used)
            self._cond.notify_all()  # the next in line may fit too

    def _give(self, nbytes: int) -> None:
        with self._cond:
            self.used -= nbytes
            self._cond.notify_all()


class _Held:
    __slots__ = ("budget", "nbytes")

    def __init__(self, budget: PixelBudget, nbytes: int) -> None:
        self.budget, self.nbytes = budget, nbytes

    def __enter__(self) -> None:
        self.budget._take(self.nbytes)

    def __exit__(self, *exc: object) -> None:
        self.budget._give(self.nbytes)


#: the budget's default: a quarter of the memory the process may still take, at most
#: 1 GiB, at least 256 MiB (a camera photo's 12 megapixels are ~72 MB decoded here)
DEFAULT_BUDGET_SHARE, DEFAULT_BUDGET_MAX, DEFAULT_BUDGET_MIN = 0.25, 1 << 30, 256 << 20
_budget: PixelBudget | None = None


def pixel_budget() -> PixelBudget:
    """The process's budget (sized on first use; :func:`set_pixel_budget` replaces it)."""
    global _budget
    if _budget is None:
        with _lock:
            if _budget is None:
                from shared.repository.capacity import available_memory

                share = int(available_memory() * DEFAULT_BUDGET_SHARE)
                _budget = PixelBudget(min(max(share, DEFAULT_BUDGET_MIN), DEFAULT_BUDGET_MAX))
    return _budget


def set_pixel_budget(limit_bytes: int) -> PixelBudget:
    global _budget
    with _lock:
        _budget = PixelBudget(limit_bytes)
    return _budget


# ---- checks before decoding -----------------------------------------------------------------


def _declared_size(data: bytes, fmt: str, target: Target) -> tuple[int, int]:
    from PIL import Image

    tj = _module("turbojpeg") if fmt == "jpeg" and target.decoder in ("auto", "turbojpeg") else None
    try:
        if tj is not None:  # a few us against Pillow's 23 us here: the frame header only
            header = tj.header(data)
            width, height = header.width, header.height
        else:
            width, height = _pillow_size(data)
    except Image.DecompressionBombError:
        width, height = _bomb_size(data)
    except Exception as exc:
        raise InvalidInput(
            f"{target.where}: not a readable {fmt.upper()} image: {_why(exc)}"
        ) from None
    if width < 1 or height < 1:
        raise InvalidInput(
            f"{target.where}: not a readable {fmt.upper()} image: its header declares no "
            f"size ({width}x{height}; cut short?)"
        )
    if width * height > target.max_pixels:
        raise InvalidInput(
            f"{target.where}: the image declares {width}x{height} pixels; this model accepts "
            f"at most {target.max_pixels:,} pixels per image (preprocess key 'max_pixels')"
        )
    return width, height


def _why(exc: Exception) -> str:
    """A decoder's reason, without the buffer object's repr Pillow puts in it."""
    why = re.sub(r"\s*<_io\.BytesIO object at 0x[0-9a-fA-F]+>", "", str(exc)).strip()
    return why or type(exc).__name__


def _pillow_size(data: bytes) -> tuple[int, int]:
    from PIL import Image

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Image.open(io.BytesIO(data)) as im:
            return im.size


def _bomb_size(data: bytes) -> tuple[int, int]:
    """Pillow refused to open it for its size: read the size without its check."""
    from PIL import Image

    limit = Image.MAX_IMAGE_PIXELS
    try:
        Image.MAX_IMAGE_PIXELS = None
        with Image.open(io.BytesIO(data)) as im:
            return im.size
    finally:
        Image.MAX_IMAGE_PIXELS = limit


def _jpeg_complete(data: bytes) -> bool:
    """An end-of-image marker after the last start-of-scan marker.

    Inside entropy-coded data 0xFF is always followed by 0x00 or a restart
    marker, so FFDA / FFD9 found there are real markers; an embedded EXIF
    thumbnail's own markers all lie before the main image's last scan.
    """
    if data.rstrip(b"\x00")[-2:] == b"\xff\xd9":
        return True
    sos = data.rfind(b"\xff\xda")
    return sos >= 0 and data.find(b"\xff\xd9", sos + 2) >= 0


def _decoded_size_needed(width: int, height: int, target: Target) -> tuple[int, int]:
    """The smallest (height, width) a scaled decode may produce without losing detail
    (the full size where scaled decodes are off)."""
    if not target.scaled_decode:
        return height, width
    if target.resize == "shorter_side":
        side = target.shorter_side or max(target.height, target.width)
        shorter = min(width, height)
        factor = side / shorter
        return max(target.height, round(height * factor)), max(target.width, round(width * factor))
    return target.height, target.width


# ---- decoders -------------------------------------------------------------------------------

_modules: dict[str, Any] = {}
_lock = threading.Lock()


def _module(name: str) -> Any:
    """Import a decoder once (None when it is not installed or cannot start)."""
    if name in _modules:
        return _modules[name]
    with _lock:
        if name in _modules:
            return _modules[name]
        found: Any = None
        try:
            if name == "opencv":
                import cv2

                cv2.setNumThreads(1)  # the pipeline's pool runs one image per thread
                found = cv2
            elif name == "turbojpeg":
                from shared.pipeline import turbo

                found = turbo.load()
        except Exception:  # not installed, or the shared library is missing
            found = None
        _modules[name] = found
        return found


def opencv_installed() -> bool:
    """Whether OpenCV is there, without importing it (~0.2 s) where nothing did yet:
    a model's load asks, and the agent's start-up must not pay for it."""
    if "opencv" in _modules:
        return _modules["opencv"] is not None
    import importlib.util

    return importlib.util.find_spec("cv2") is not None


def available_decoders() -> list[str]:
    """Decoders usable in this process (Pillow is a dependency, so always listed)."""
    return ["pillow"] + [n for n in ("opencv", "turbojpeg") if _module(n) is not None]


def _decoders(fmt: str, choice: str) -> list[Any]:
    if choice == "pillow":
        return [_pillow]
    if choice == "opencv":
        if _module("opencv") is None:
            raise BackendMissing("decoder 'opencv' needs opencv-python-headless")
        return [_opencv]
    if choice == "turbojpeg":
        if _module("turbojpeg") is None:
            raise BackendMissing(
                "decoder 'turbojpeg' needs libturbojpeg (apt-get install libturbojpeg0)"
            )
        return [_turbojpeg, _pillow] if fmt == "jpeg" else [_pillow]
    chain = []
    if fmt == "jpeg" and _module("turbojpeg") is not None:
        chain.append(_turbojpeg)
    if _module("opencv") is not None:
        chain.append(_opencv)
    chain.append(_pillow)
    return chain


def _turbojpeg(
    data: bytes, fmt: str, target: Target, size: tuple[int, int], need: tuple[int, int]
) -> np.ndarray:
    from shared.pipeline.turbo import Header

    tj = _module("turbojpeg")
    # libjpeg's "corrupt data" warnings fail the call too: the next decoder gets the image,
    # unless the warning says pixels were lost (the others then decode that part as grey,
    # silently, and the model answers a picture the app never sent)
    try:
        return tj.decode(data, Header(*size), _reduction(size, need), target.color)
    except ValueError as exc:
        if any(lost in str(exc).lower() for lost in _JPEG_DATA_LOST):
            raise InvalidInput(
                f"{target.where}: a corrupt JPEG image: {exc} (part of it is missing)"
            ) from None
        raise


#: libjpeg's warnings for entropy-coded data that is cut short or broken (JWRN_JPEG_EOF,
#: JWRN_HIT_MARKER, JWRN_HUFF_BAD_CODE): what follows decodes as grey or garbage
_JPEG_DATA_LOST = ("premature end", "bad huffman code")


def _opencv(
    data: bytes, fmt: str, target: Target, size: tuple[int, int], need: tuple[int, int]
) -> np.ndarray | None:
    cv2 = _module("opencv")
    # A JPEG's grey is its decoder's luma plane, as with libjpeg-turbo and Pillow; any
    # other format's is its colours weighed as Pillow weighs them (_luma): libpng's
    # grey (IMREAD_GRAYSCALE) truncates, and cvtColor rounds otherwise 1 time in 800.
    luma = target.color == "gray" and fmt != "jpeg"
    flags = cv2.IMREAD_GRAYSCALE if target.color == "gray" and not luma else cv2.IMREAD_COLOR
    if fmt == "jpeg":
        reduced = {
            8: (cv2.IMREAD_REDUCED_GRAYSCALE_8, cv2.IMREAD_REDUCED_COLOR_8),
            4: (cv2.IMREAD_REDUCED_GRAYSCALE_4, cv2.IMREAD_REDUCED_COLOR_4),
            2: (cv2.IMREAD_REDUCED_GRAYSCALE_2, cv2.IMREAD_REDUCED_COLOR_2),
        }.get(_reduction(size, need))
        if reduced is not None:
            flags = reduced[0] if target.color == "gray" else reduced[1]
    # OpenCV turns an image by its EXIF orientation unless told not to; the other
    # decoders do not: one rule for all, or the answer would follow the libraries
    # a machine has (docs/pipeline.md)
    flags |= cv2.IMREAD_IGNORE_ORIENTATION
    pixels = cv2.imdecode(np.frombuffer(data, np.uint8), flags)
    if pixels is None:
        return None
    if pixels.ndim == 2:
        return pixels[:, :, None]
    if luma:
        return _luma(pixels[:, :, 2], pixels[:, :, 1], pixels[:, :, 0])[:, :, None]
    if target.color == "rgb":
        pixels = pixels[:, :, ::-1]
    return pixels


def _luma(red: np.ndarray, green: np.ndarray, blue: np.ndarray) -> np.ndarray:
    """ITU-R 601 luma in Pillow's fixed point (its ``convert("L")``), to the same byte."""
    total = red.astype(np.uint32) * 19595
    total += green.astype(np.uint32) * 38470
    total += blue.astype(np.uint32) * 7471
    total += 0x8000
    return (total >> 16).astype(np.uint8)


def _reduction(size: tuple[int, int], need: tuple[int, int]) -> int:
    """The largest JPEG IDCT scale-down (8, 4, 2, else 1) that keeps ``need`` pixels."""
    (width, height), (need_w, need_h) = size, need
    for d in (8, 4, 2):
        if width // d >= need_w and height // d >= need_h:
            return d
    return 1


def _pillow(
    data: bytes, fmt: str, target: Target, size: tuple[int, int], need: tuple[int, int]
) -> np.ndarray:
    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with Image.open(io.BytesIO(data)) as im:
                if fmt == "jpeg":
                    im.draft("L" if target.color == "gray" else "RGB", need)
                if im.mode.startswith("I"):  # 16-bit grey ("I;16", "I"): convert() clips
                    wide = np.asarray(im).astype(np.int64)  # at 255; keep the top 8 bits
                    im = Image.fromarray((np.clip(wide, 0, 65535) >> 8).astype(np.uint8), "L")
                im = im.convert("L" if target.color == "gray" else "RGB")
                pixels = np.asarray(im)
    except Exception as exc:
        raise InvalidInput(
            f"{target.where}: cannot decode the {fmt.upper()} image: {_why(exc)}"
        ) from None
    if pixels.ndim == 2:
        return pixels[:, :, None]
    if target.color == "bgr":
        pixels = pixels[:, :, ::-1]
    return pixels


# ---- resize and crop --------------------------------------------------------------------------

_CV_INTERPOLATION = {"nearest": 0, "bilinear": 1, "bicubic": 2, "area": 3, "lanczos": 4}
#: Pillow's Image.Resampling values by name (NEAREST 0, BOX 4, BILINEAR 2, BICUBIC 3,
#: LANCZOS 1), so that Pillow is imported only where it resizes
_PIL_RESAMPLE = {"nearest": 0, "bilinear": 2, "bicubic": 3, "area": 4, "lanczos": 1}


#: a shorter-side resize bigger than this many crops resizes only the part the crop keeps
CROP_FIRST = 8


def _fit(pixels: np.ndarray, target: Target) -> np.ndarray:
    """Resize (stretch, or shorter side then centre crop) to the target's size.

    A shorter-side resize of a long strip would be huge (a 167-byte 30000x1
    PNG to 256 pixels high is 7.7 million wide: gigabytes, seconds), so past
    ``CROP_FIRST`` crops' worth only the crop's pixels are computed
    (:func:`_crop_resized`): the same samples as resizing it all, to within
    fixed-point rounding (area averaging with OpenCV: Pillow's box filter, as
    the Pillow decoder resizes, within a grey level on photos)."""
    height, width = pixels.shape[:2]
    if target.resize == "shorter_side":
        side = target.shorter_side or max(target.height, target.width)
        factor = side / min(width, height)
        new_h = max(target.height, round(height * factor))
        new_w = max(target.width, round(width * factor))
        crop = max(side * side, target.height * target.width)
        if new_h * new_w > CROP_FIRST * crop:
            return _crop_resized(pixels, new_h, new_w, target)
        pixels = _resize(pixels, new_h, new_w, target)
        top = (new_h - target.height) // 2
        left = (new_w - target.width) // 2
        pixels = pixels[top : top + target.height, left : left + target.width]
    else:
        pixels = _resize(pixels, target.height, target.width, target)
    return pixels


def _crop_resized(pixels: np.ndarray, new_h: int, new_w: int, target: Target) -> np.ndarray:
    """The centre crop of ``pixels`` resized to (new_h, new_w), computed for the crop's
    pixels alone (see ``_fit``).  OpenCV's affine warp samples where its resize
    would (pixel centres mapped by the same scale; nearest: the same floor); Pillow
    resizes the crop's box (a sub-pixel region, read with its filter's reach)
    where OpenCV is not used, and for area averaging, which OpenCV cannot warp."""
    height, width = pixels.shape[:2]
    fx, fy = width / new_w, height / new_h  # source pixels per resized pixel
    top, left = (new_h - target.height) // 2, (new_w - target.width) // 2
    cv2 = _module("opencv") if target.decoder != "pillow" else None
    if cv2 is not None and target.interpolation != "area":
        if target.interpolation == "nearest":  # its resize takes floor(x * scale); the warp rounds
            shift_x, shift_y = left * fx - 0.5 + 1e-6, top * fy - 0.5 + 1e-6
        else:
            shift_x, shift_y = (left + 0.5) * fx - 0.5, (top + 0.5) * fy - 0.5
        to_source = np.array([[fx, 0.0, shift_x], [0.0, fy, shift_y]], np.float64)
        out = cv2.warpAffine(
            np.ascontiguousarray(pixels),
            to_source,
            (target.width, target.height),
            flags=_CV_INTERPOLATION[target.interpolation] | cv2.WARP_INVERSE_MAP,
            borderMode=cv2.BORDER_REPLICATE,
        )
        return out if out.ndim == 3 else out[:, :, None]
    from PIL import Image

    gray = pixels.shape[2] == 1
    image = Image.fromarray(pixels[:, :, 0] if gray else np.ascontiguousarray(pixels))
    box = (left * fx, top * fy, (left + target.width) * fx, (top + target.height) * fy)
    out = np.asarray(
        image.resize((target.width, target.height), _PIL_RESAMPLE[target.interpolation], box)
    )
    return out[:, :, None] if gray else out


def _resize(pixels: np.ndarray, height: int, width: int, target: Target) -> np.ndarray:
    if pixels.shape[0] == height and pixels.shape[1] == width:
        return pixels
    cv2 = _module("opencv") if target.decoder != "pillow" else None
    if cv2 is not None:
        out = cv2.resize(
            np.ascontiguousarray(pixels),
            (width, height),
            interpolation=_CV_INTERPOLATION[target.interpolation],
        )
        return out if out.ndim == 3 else out[:, :, None]
    from PIL import Image

    resample = _PIL_RESAMPLE[target.interpolation]
    gray = pixels.shape[2] == 1
    image = Image.fromarray(pixels[:, :, 0] if gray else np.ascontiguousarray(pixels))
    out = np.asarray(image.resize((width, height), resample))
    return out[:, :, None] if gray else out
