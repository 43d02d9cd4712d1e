"""``Content-Encoding`` of request bodies: gzip and deflate, as Triton accepts them.

tritonclient compresses an inference request when asked
(``request_compression_algorithm``); read as is, its body fails the binary
header's length check with a message that blames the wrong thing.  The
decompressed size is bounded by the same limit as a plain body (a 16 KiB
bomb must not become gigabytes), and anything else is refused with 415.
"""

from __future__ import annotations

import zlib

from shared.errors import InvalidInput, PayloadTooLarge, UnsupportedMediaType

#: zlib's wbits: gzip framing (16 + 15) and deflate, zlib-wrapped (15) as HTTP
#: means it, or raw (-15) as some clients send it
_GZIP, _ZLIB, _RAW = 31, 15, -15
#: a compressed body at least this big is inflated off the event loop
WORKER_BYTES = 256 * 1024


def content_codings(header: str | None) -> list[str]:
    """The codings of a ``Content-Encoding`` header, in the order they were applied."""
    if not header:
        return []
    codings = [c.strip().lower() for c in header.split(",")]
    return [c for c in codings if c and c != "identity"]


def check_codings(header: str | None) -> list[str]:
    """The codings, or UnsupportedMediaType naming the one Ferry cannot undo."""
    codings = content_codings(header)
    for c in codings:
        if c not in ("gzip", "x-gzip", "deflate"):
            raise UnsupportedMediaType(
                f"Content-Encoding {c!r} is not supported (gzip, deflate or identity)"
            )
    return codings


def decode_body(body: bytes | bytearray | memoryview, header: str | None, max_bytes: int) -> bytes:
    """``body`` with its content codings undone, at most ``max_bytes`` long."""
    data = body
    for coding in reversed(check_codings(header)):
        if coding == "deflate":
            wbits = _ZLIB if len(data) >= 2 and (data[0] * 256 + data[1]) % 31 == 0 else _RAW
        else:
            wbits = _GZIP
        data = _inflate(data, wbits, coding, max_bytes)
    return bytes(data) if not isinstance(data, bytes) else data


def _inflate(data, wbits: int, coding: str, max_bytes: int) -> bytes:
    d = zlib.decompressobj(wbits)
    try:
        out = d.decompress(data, max_bytes + 1)
    except zlib.error as exc:
        raise InvalidInput(f"request body is not valid {coding} data: {exc}") from None
    if len(out) > max_bytes or d.unconsumed_tail:
        raise PayloadTooLarge(f"request body decompresses to more than the {max_bytes}-byte limit")
    if not d.eof:
        raise InvalidInput(f"request body is not valid {coding} data: it ends too soon")
    return out
