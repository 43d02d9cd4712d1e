"""Moving big V2 bodies through aiohttp without big copies on the event loop.

The one exception to "no I/O in shared/": both tiers' HTTP fronts read and
write bodies of up to the body limit, and aiohttp's own ``read()`` joins a
body twice while ``Response(body=...)`` wants one joined buffer.  At 16 MiB
each such copy holds the loop (and every other connection) for ~10 ms, so
both fronts use these two coroutines instead.  They open no sockets and run
no loop of their own: they work on the aiohttp request they are handed.
"""

from __future__ import annotations

from aiohttp import web

from shared import v2
from shared.errors import InvalidInput, PayloadTooLarge

#: binary answers above this are streamed in slices instead of joined into one body
STREAM_ABOVE_BYTES = 1 << 20
STREAM_SLICE_BYTES = 256 << 10


async def read_into(request: web.Request, max_bytes: int) -> bytearray:
    """The whole body, landing in one buffer as it arrives (Content-Length sized)."""
    declared = request.content_length
    if declared is not None and declared > max_bytes:
        raise PayloadTooLarge(f"request body of {declared} bytes exceeds the limit of {max_bytes}")
    body = bytearray(declared or 0)
    filled = 0
    while chunk := await request.content.readany():
        end = filled + len(chunk)
        if declared is None:
            if end > max_bytes:
                raise PayloadTooLarge(f"request body exceeds the limit of {max_bytes} bytes")
            body += chunk
        else:
            body[filled:end] = chunk
        filled = end
    if declared is not None and filled != declared:
        raise InvalidInput(f"request body ended after {filled} of {declared} bytes")
    return body


async def binary_response(
    request: web.Request, chunks: v2.Chunks, header_length: int
) -> web.StreamResponse:
    """A binary V2 answer: small ones joined, big ones streamed slice by slice straight
    from the output arrays (no joined copy; the loop serves others between slices)."""
    headers = {v2.HEADER_LENGTH: str(header_length)}
    total = sum(len(c) for c in chunks)
    if total <= STREAM_ABOVE_BYTES:
        return web.Response(
            body=v2.join(chunks), content_type=v2.BINARY_CONTENT_TYPE, headers=headers
        )
    stream = web.StreamResponse(headers=headers)
    stream.content_type = v2.BINARY_CONTENT_TYPE
    stream.content_length = total
    await stream.prepare(request)
    for chunk in chunks:
        view = memoryview(chunk).cast("B")
        for start in range(0, len(view), STREAM_SLICE_BYTES):
            await stream.write(view[start : start + STREAM_SLICE_BYTES])
    await stream.write_eof()
    return stream
