"""Feeding bytes to a parser shaped like ``asyncio.BufferedProtocol`` (sans-IO).

:class:`shared.http.wire` and :class:`shared.mqtt.framing` parsers hand out
the buffer the next bytes should land in (a body's own buffer, once its
length is known); this mixin lets tests and other shells push plain bytes
through the same path.
"""

from __future__ import annotations

#: the last bytes of a large body are read through the parser's scratch buffer, not
#: straight into the body: an event loop may hold the buffer it was handed until
#: ``buffer_updated`` returns (uvloop does), and a body completed in that call is
#: handed on there and may be trimmed in place, which an exported bytearray refuses
TAIL = 4096


def tail_for(loop: object) -> int:
    """How much of a large body to read through scratch on ``loop``: none on asyncio's own
    loops (they let go of the buffer before ``buffer_updated``: the body is read straight
    to its end, one read fewer), :data:`TAIL` on any other (uvloop holds it)."""
    return 0 if type(loop).__module__.startswith("asyncio.") else TAIL


def let_go(view: memoryview | None) -> None:
    """End our export of a handed-out buffer where the loop no longer holds it (with
    uvloop it does until ``buffer_updated`` returns, and lets go itself then)."""
    if view is not None:
        try:
            view.release()
        except BufferError:
            pass


class FeedsBuffers:
    """``feed(data)`` for a class with ``get_buffer()`` and ``buffer_updated(n)``."""

    def get_buffer(self, sizehint: int = -1) -> memoryview:  # pragma: no cover - abstract
        raise NotImplementedError

    def buffer_updated(self, nbytes: int) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def feed(self, data: bytes) -> None:
        """Take ``data`` as if it had been read into the buffers handed out."""
        view = memoryview(data)
        while view:
            target = self.get_buffer()
            n = min(len(target), len(view))
            target[:n] = view[:n]
            self.buffer_updated(n)
            view = view[n:]
