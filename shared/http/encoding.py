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
    """``body`` with its content codings undone, at most ``max_bytes`` long.

    CPU-bound (a 16 KiB bomb takes ~80 ms to reach 16 MiB): callers on an
    event loop run it in a worker thread.
    """
    data = bytes(body)
    for coding in reversed(check_codings(header)):
        if coding == "deflate":
            data = _deflate(data, max_bytes)
        else:
            data = _members(data, max_bytes)
    return data


def _deflate(data: bytes, max_bytes: int) -> bytes:
    """HTTP's deflate is zlib-wrapped (RFC 9110); some clients send it raw."""
    zlib_header = (
        len(data) >= 2 and data[0] & 0x0F == 8 and data[0] >> 4 <= 7
        and (data[0] * 256 + data[1]) % 31 == 0
    )  # fmt: skip
    if not zlib_header:
        return _inflate(data, _RAW, "deflate", max_bytes)[0]
    try:
        return _inflate(data, _ZLIB, "deflate", max_bytes)[0]
    except InvalidInput as as_zlib:
        try:  # raw deflate whose first bytes happen to look like a zlib header
            return _inflate(data, _RAW, "deflate", max_bytes)[0]
        except InvalidInput:
            raise as_zlib from None


#: members a gzip body may hold (concatenated gzip files): at least this many, one per
#: KiB of the body, and one per GZIP_MEMBER_BYTES it has inflated to so far (block-gzip
#: writers such as bgzip emit one per 64 KiB of data); 200,000 empty ones in 4 MB had
#: cost minutes of a core
MAX_GZIP_MEMBERS = 64
GZIP_MEMBER_BYTES = 16 * 1024
#: input fed to zlib at a time: what a member's end leaves over is copied per member
_FEED = 64 * 1024


def _members(data: bytes, max_bytes: int) -> bytes:
    """Every member of a gzip stream (concatenated gzip files are one stream), read from
    one buffer by offset (each member had copied all the bytes after it)."""
    view = memoryview(data)
    out = bytearray()
    offset = 0
    members = 0
    while True:
        members += 1
        most = max(MAX_GZIP_MEMBERS, len(view) // 1024, len(out) // GZIP_MEMBER_BYTES)
        if members > most:
            raise InvalidInput(f"request body holds more than {most} gzip members")
        offset = _member(view, offset, out, max_bytes)
        if view[offset : offset + 2] == b"\x1f\x8b":
            continue
        if bytes(view[offset:]).strip(b"\x00"):  # zero padding after the last one is allowed
            raise InvalidInput("request body is not valid gzip data: bytes follow its end")
        return bytes(out)


def _member(view: memoryview, offset: int, out: bytearray, max_bytes: int) -> int:
    """Inflate the gzip member at ``offset`` onto ``out``; the offset just past it."""
    d = zlib.decompressobj(_GZIP)
    at = offset
    while not d.eof:
        if at >= len(view):
            raise InvalidInput("request body is not valid gzip data: it ends too soon")
        chunk = view[at : at + _FEED]
        at += len(chunk)
        try:
            out += d.decompress(chunk, max_bytes + 1 - len(out))
        except zlib.error as exc:
            raise InvalidInput(f"request body is not valid gzip data: {exc}") from None
        if len(out) > max_bytes or d.unconsumed_tail:
            raise PayloadTooLarge(
                f"request body decompresses to more than the {max_bytes}-byte limit"
            )
    return at - len(d.unused_data)


def _inflate(data: bytes, wbits: int, coding: str, max_bytes: int) -> tuple[bytes, bytes]:
    """(what one stream inflates to, the bytes after it)."""
    d = zlib.decompressobj(wbits)
    try:
        out = d.decompress(data, max_bytes + 1)
    except zlib.error as exc:
        raise InvalidInput(f"request body is not valid {coding} data: {exc}") from None
    if len(out) > max_bytes or d.unconsumed_tail:
        raise PayloadTooLarge(f"request body decompresses to more than the {max_bytes}-byte limit")
    if not d.eof:
        raise InvalidInput(f"request body is not valid {coding} data: it ends too soon")
    if wbits != _GZIP and d.unused_data:
        raise InvalidInput(f"request body is not valid {coding} data: bytes follow its end")
    return out, d.unused_data
