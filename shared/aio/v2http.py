"""V2 inference bodies over :mod:`shared.aio.http_server`, as both tiers' fronts serve them.

Big JSON and BYTES bodies are decoded (and their answers encoded) in a worker
thread, so one request cannot stall the loop; fixed-size binary tensors are
views of the body the kernel wrote, and their answers leave as a head plus
the output arrays, never joined.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from shared import v2
from shared.aio.http_server import JSON, Request, Response
from shared.http.encoding import content_codings, decode_body
from shared.messages import InferRequest, InferResponse
from shared.tensors import Limits


async def decode_infer(
    request: Request, limits: Limits, inflated: Callable[[Request, int], None] | None = None
) -> InferRequest:
    """``inflated(request, size)`` hears a compressed body's inflated size (and may raise)."""
    body = request.body
    coding = request.header("content-encoding")
    if coding is not None and content_codings(coding):
        # tritonclient's request_compression_algorithm: gzip or deflate, a bounded
        # inflate in a worker (a small body may inflate to the limit: tens of ms)
        body = await asyncio.to_thread(decode_body, body, coding, limits.max_body_bytes)
        if inflated is not None:
            inflated(request, len(body))
    header_length = v2.parse_header_length(request.header(_HEADER_LENGTH), len(body))
    if v2.decode_needs_worker(body, header_length):
        return await asyncio.to_thread(v2.decode_request, body, header_length, limits)
    return v2.decode_request(body, header_length, limits)


async def encode_infer(response: InferResponse, decoded: InferRequest) -> Response:
    if v2.encode_needs_worker(response, decoded):
        chunks, header_length = await asyncio.to_thread(v2.encode_response, response, decoded)
    else:
        chunks, header_length = v2.encode_response(response, decoded)
    if header_length is None:
        return Response(200, chunks[0], content_type=JSON)
    return Response(
        200,
        chunks,
        content_type=v2.BINARY_CONTENT_TYPE,
        headers=[(v2.HEADER_LENGTH, str(header_length))],
    )


_HEADER_LENGTH = v2.HEADER_LENGTH.lower()
