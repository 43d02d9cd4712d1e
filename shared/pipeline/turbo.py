"""A thin binding of libturbojpeg (Debian's libturbojpeg0, the 2.x TurboJPEG API).

Why not PyTurboJPEG: it opens and destroys a decompressor on every call and
reads the header again inside ``decode``, so one image cost nine foreign
calls, each of which gives up and retakes the GIL; on a busy 2-core server
those handovers cost more than the calls.  Here each thread keeps one
decompressor for its life, the header is read once (for the size check, then
reused by the decode), and one image costs two calls.  Served JPEG-in
throughput rose 3-5% with it (``bench/pipeline.py``), the pixels unchanged.

The decode is scaled in the IDCT by 1/2, 1/4 or 1/8 (the caller picks the
largest that still covers what its resize needs).  The library offers n/8
too, but only these have SIMD code: a 700-pixel page headed for 256 decoded
5% slower at 3/8 than at 1/2 here.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
from dataclasses import dataclass

import numpy as np

# TurboJPEG pixel formats (turbojpeg.h)
PIXEL_FORMATS = {"rgb": 0, "bgr": 1, "gray": 6}


@dataclass(frozen=True)
class Header:
    width: int
    height: int


class TurboJpegError(ValueError):
    """libturbojpeg refused the image (a fatal error or a warning: both are failures)."""


class _Decompressor:
    """One thread's TurboJPEG handle, destroyed with the thread's locals."""

    __slots__ = ("handle", "ints", "lib")

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        self.handle = lib.tjInitDecompress()
        if not self.handle:
            raise MemoryError("tjInitDecompress failed")
        self.ints = tuple(ctypes.c_int() for _ in range(4))

    def __del__(self) -> None:
        if self.handle:
            self.lib.tjDestroy(self.handle)
            self.handle = None

    def fail(self) -> TurboJpegError:
        return TurboJpegError(self.lib.tjGetErrorStr2(self.handle).decode(errors="replace"))


class TurboJpeg:
    """Header reads and scaled decodes; safe to share between threads."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        void, ulong, cint = ctypes.c_void_p, ctypes.c_ulong, ctypes.c_int
        pint = ctypes.POINTER(cint)
        lib.tjInitDecompress.restype = void
        lib.tjInitDecompress.argtypes = []
        lib.tjDestroy.argtypes = [void]
        lib.tjDecompressHeader3.argtypes = [void, ctypes.c_char_p, ulong, pint, pint, pint, pint]
        lib.tjDecompress2.argtypes = [void, ctypes.c_char_p, ulong, void, *[cint] * 5]
        lib.tjGetErrorStr2.restype = ctypes.c_char_p
        lib.tjGetErrorStr2.argtypes = [void]
        self._lib = lib
        self._local = threading.local()

    def _own(self) -> _Decompressor:
        own = getattr(self._local, "d", None)
        if own is None:
            own = self._local.d = _Decompressor(self._lib)
        return own

    def _failed(self, own: _Decompressor) -> TurboJpegError:
        """The error, and the thread's handle dropped: a call that failed mid-stream
        leaves libjpeg's state behind, and the next image this thread decoded (another
        client's) failed on it ("its header declares no size", "Bogus DQT index")."""
        error = own.fail()
        self._local.d = None
        return error

    def header(self, data: bytes) -> Header:
        own = self._own()
        width, height, subsampling, colorspace = own.ints
        # a stream of tables only writes nothing: no stale size from this thread's last image
        width.value = height.value = 0
        if self._lib.tjDecompressHeader3(
            own.handle, data, len(data), width, height, subsampling, colorspace
        ):
            raise self._failed(own)
        return Header(width.value, height.value)

    def decode(self, data: bytes, header: Header, denominator: int, color: str) -> np.ndarray:
        """(height, width, channels) uint8 pixels, decoded at 1/``denominator`` (1, 2, 4, 8)."""
        own = self._own()
        width = _scaled(header.width, denominator)
        height = _scaled(header.height, denominator)
        pixel = PIXEL_FORMATS[color]
        out = np.empty((height, width, 1 if color == "gray" else 3), np.uint8)
        if self._lib.tjDecompress2(
            own.handle, data, len(data), out.ctypes.data, width, 0, height, pixel, 0
        ):
            raise self._failed(own)
        return out


def _scaled(dimension: int, denominator: int) -> int:
    return (dimension + denominator - 1) // denominator  # TJSCALED


def load() -> TurboJpeg | None:
    """The library bound, or None where libturbojpeg is not installed."""
    name = ctypes.util.find_library("turbojpeg")
    for candidate in (name, "libturbojpeg.so.0", "libturbojpeg.so"):
        if not candidate:
            continue
        try:
            return TurboJpeg(ctypes.CDLL(candidate))
        except (OSError, AttributeError):
            continue
    return None
