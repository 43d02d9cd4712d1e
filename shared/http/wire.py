"""HTTP/1.1 messages on the wire, without I/O (RFC 9110 / 9112).

:class:`RequestParser` is a server's side of a connection and
:class:`ResponseParser` a client's.  Both are shaped like an
``asyncio.BufferedProtocol`` (``get_buffer`` / ``buffer_updated``) for the
same reason as :mod:`shared.mqtt.framing`: once a head says how long its
body is, the kernel writes the body straight into its own buffer (a 602 KB
tensor crosses the socket into the array it will be read from, no joins of
chunks); a long body's buffer starts at ``FIRST_BODY_BYTES`` and grows x4 as
its bytes come (each step copies what came so far: ~320 KB for a 602 KB
body), so what a connection holds follows what it sent, not what its head
declared.  Everything a peer can get wrong ends in
:class:`HttpError` with the status to answer and a message that says what was
wrong; nothing a peer sends can make a parser hold more than its limits.

Strict where laxness has burned servers: a request with both Content-Length
and Transfer-Encoding, a Content-Length that is not plain digits, an
obsolete folded header line or a control character in a header is refused
(request smuggling lives in those gaps).
"""

from __future__ import annotations

import re
import sys
from collections import deque

from shared.buffered import TAIL, FeedsBuffers, let_go
from shared.errors import InvalidInput

#: where heads (and small bodies) are read; a large body is read straight into its own
#: buffer, so what arrives with a head is copied twice at most this much
_SCRATCH = 16 * 1024
#: bodies at least this long get a buffer of their own
LARGE_BODY = 16 * 1024
#: A longer body's buffer starts this long and grows (x4) as its bytes come: memory held
#: follows what arrived, not what a head declared (a client that declares 16 MB and
#: trickles holds this much, where a zero-filled buffer of the whole length had been
#: resident at once).  The last step takes a buffer the pool holds ready, where it has one.
FIRST_BODY_BYTES = 64 * 1024
_TOKEN = frozenset(b"!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
_BAD_VALUE = bytes(c for c in range(32) if c != 9) + b"\x7f"
_BAD_TARGET = bytes(range(33)) + b"\x7f"

REASONS = {
    100: "Continue",
    200: "OK",
    204: "No Content",
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    409: "Conflict",
    411: "Length Required",
    413: "Content Too Large",
    415: "Unsupported Media Type",
    429: "Too Many Requests",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    501: "Not Implemented",
    503: "Service Unavailable",
    504: "Gateway Timeout",
    505: "HTTP Version Not Supported",
}


class BodyPool:
    """Reuses body buffers of the lengths that keep coming back.

    A fresh 602 KB ``bytearray`` is zero-filled and faulted in page by page
    (measured: ~0.1 ms of kernel and libc time a request); one taken back from
    here is neither.  A buffer is only taken back when nothing refers to it
    any more (no tensor view of it survives its request), bounded in bytes.
    """

    def __init__(self, max_bytes: int = 64 * 1024 * 1024, per_length: int = 8) -> None:
        self.max_bytes = max_bytes
        self.per_length = per_length
        self._free: dict[int, list[bytearray]] = {}
        self._bytes = 0
        self.reused = 0

    def take(self, length: int) -> bytearray:
        return self.take_free(length) or bytearray(length)

    def take_free(self, length: int) -> bytearray | None:
        """A kept buffer of ``length`` (no new memory), or None."""
        free = self._free.get(length)
        if free:
            self._bytes -= length
            self.reused += 1
            return free.pop()
        return None

    def give(self, buffer: bytearray) -> None:
        """Offer ``buffer`` back; kept only if its caller holds the last reference."""
        length = len(buffer)
        # the caller's reference, this argument and getrefcount's own: no view is left
        if length < LARGE_BODY or sys.getrefcount(buffer) > 3:
            return
        free = self._free.setdefault(length, [])
        if len(free) < self.per_length and self._bytes + length <= self.max_bytes:
            free.append(buffer)
            self._bytes += length


class HttpError(Exception):
    """A message that cannot be read; ``status`` is what a server answers it with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class Head:
    """A request's or a response's start line and headers (names lower-case)."""

    __slots__ = ("headers", "method", "reason", "status", "target", "version")

    def __init__(self) -> None:
        self.method = ""
        self.target = ""
        self.status = 0
        self.reason = ""
        self.version = "1.1"
        self.headers: dict[str, str] = {}

    @property
    def keep_alive(self) -> bool:
        # (tokens, not substrings: "Connection: x-not-close-really" closes nothing)
        tokens = {t.strip() for t in self.headers.get("connection", "").lower().split(",")}
        if self.version == "1.0":
            return "keep-alive" in tokens
        return "close" not in tokens

    def get(self, name: str, default: str | None = None) -> str | None:
        return self.headers.get(name, default)


def _parse_fields(lines: list[bytes], head: Head, max_fields: int) -> None:
    if len(lines) > max_fields:
        raise HttpError(431, f"more than {max_fields} header fields")
    headers = head.headers
    for line in lines:
        name, sep, value = line.partition(b":")
        if not sep or not name:
            raise HttpError(400, "a header line without a name and a colon")
        if name[0] in (32, 9):
            raise HttpError(400, "obsolete line folding in the header")
        if not _TOKEN.issuperset(name):
            raise HttpError(400, f"header name {name[:40]!r} is not a token")
        value = value.strip(b" \t")
        if value.translate(None, _BAD_VALUE) != value:
            raise HttpError(400, f"header {name[:40].decode()!r} holds a control character")
        key = name.decode("ascii").lower()
        text = value.decode("latin-1")
        if key in headers:
            if key in ("content-length", "host", "transfer-encoding"):
                if key != "content-length" or headers[key] != text:
                    raise HttpError(400, f"header {key!r} given twice")
                continue
            headers[key] = f"{headers[key]}, {text}"
        else:
            headers[key] = text


def _content_length(head: Head) -> int | None:
    raw = head.headers.get("content-length")
    if raw is None:
        return None
    if not raw.isascii() or not raw.isdigit() or len(raw) > 18:
        raise HttpError(400, f"Content-Length {raw[:40]!r} is not a plain number")
    return int(raw)


class _Reader(FeedsBuffers):
    """The part both parsers share: a head, then a body of known length, chunked, or to EOF."""

    def __init__(
        self,
        *,
        max_head: int,
        max_fields: int,
        max_body: int,
        pool: BodyPool | None = None,
        tail: int = TAIL,
    ) -> None:
        self.pool = pool
        self._tail = tail  # a large body's last bytes come through scratch (shared.buffered)
        self.max_head = max_head
        self.max_fields = max_fields
        self.max_body = max_body
        self.events: deque[Head | bytearray] = deque()
        self._scratch = bytearray(_SCRATCH)
        self._view = memoryview(self._scratch)
        self._buf = bytearray()  # bytes read and not yet consumed (heads, small bodies)
        self._scanned = 0  # how far an unfinished head was searched for its end
        self._body: bytearray | None = None  # a fixed-length body being filled
        self._length = 0  # its declared length (its buffer may be shorter yet: _grow)
        self._filled = 0
        self._handed: memoryview | None = None
        self._chunked: bytearray | None = None  # the body of a chunked message so far
        self._chunk_left = -1  # -1: a chunk-size line is next; -2: the trailer section
        self._to_eof: bytearray | None = None
        self._skip_left = 0  # bytes of a refused body still to be read and dropped
        self.paused = False  # the owner handles a message: the next one waits in the buffer
        self.eof = False

    # ---- BufferedProtocol ----------------------------------------------------------------------
    def get_buffer(self, sizehint: int = -1) -> memoryview:
        if self._skip_left:
            return self._view[: min(self._skip_left, _SCRATCH)]
        body, tail = self._body, self._tail
        if body is not None and not self.paused and self._length - self._filled > tail:
            if self._filled == len(body):
                # Full: grown once bytes are in hand (_advance), not on a request for a
                # buffer alone (uvloop asks again after every read that filled one).
                return self._view
            self._handed = memoryview(body)[self._filled : min(len(body), self._length - tail)]
            return self._handed
        return self._view

    def buffer_updated(self, nbytes: int) -> None:
        if self._skip_left:
            self._skip_left -= nbytes  # get_buffer never hands out more than is left
            if not self._skip_left:
                self._advance()  # the refused body is gone: on to the next message
            return
        if self._handed is not None:
            let_go(self._handed)  # the body is handed on (and may be resized) in place
            self._handed = None
            self._filled += nbytes
            if self._filled == self._length:  # (no tail kept)
                body, self._body = self._body, None
                self.events.append(body)  # type: ignore[arg-type]
                self._message_done()
            return
        self._buf += self._view[:nbytes]
        self._advance()

    def skip_body(self) -> bool:
        """Drop the body of the message being read (it was refused from its head) and go
        on to the next message; False when that cannot be done (a chunked body)."""
        if self._chunked is not None or self._to_eof is not None:
            return False
        if self._body is None:
            return True  # no body, or it was read already
        left = self._length - self._filled
        self._body = None
        take = min(left, len(self._buf))
        del self._buf[:take]
        self._skip_left = left - take
        self.paused = False
        if not self._skip_left:
            self._advance()
        return True

    def resume(self) -> None:
        """The owner is done with the last message: read the next one (already buffered?)."""
        self.paused = False
        self._advance()

    @property
    def body_received(self) -> int:
        """Bytes of the body being read that have arrived so far (0 between bodies)."""
        if self._body is not None:
            return self._filled
        if self._chunked is not None:
            return len(self._chunked)
        if self._to_eof is not None:
            return len(self._to_eof)
        return 0

    @property
    def skipping(self) -> bool:
        """A refused body is still being read and dropped."""
        return self._skip_left > 0

    @property
    def buffered(self) -> int:
        return len(self._buf)

    @property
    def idle(self) -> bool:
        """No message is partly read."""
        return (
            not self._buf and self._body is None and self._chunked is None and self._to_eof is None
        )

    # ---- parsing ------------------------------------------------------------------------------
    def _advance(self) -> None:
        while not self.paused:
            if self._to_eof is not None:
                self._to_eof += self._buf
                self._buf.clear()
                if len(self._to_eof) > self.max_body:
                    raise HttpError(413, f"body longer than {self.max_body} bytes")
                return
            if self._chunked is not None:
                if not self._advance_chunked():
                    return
                continue
            if self._body is not None:
                while self._buf and self._filled < self._length:
                    if self._filled == len(self._body):
                        self._grow()
                    take = min(len(self._buf), len(self._body) - self._filled)
                    self._body[self._filled : self._filled + take] = self._buf[:take]
                    del self._buf[:take]
                    self._filled += take
                if self._filled < self._length:
                    return
                body, self._body = self._body, None
                self.events.append(body)
                self._message_done()
                continue
            if not self._advance_head():
                return

    def _advance_head(self) -> bool:
        buf = self._buf
        while buf[:2] == b"\r\n":  # RFC 9112 2.2: ignore empty lines before a request
            del buf[:2]
            self._scanned = 0
        # (a head arriving in pieces is searched from where the last search ended, less
        # the few bytes a blank line may straddle: each piece had cost a scan of it all)
        start = max(0, self._scanned - 3)
        end = buf.find(b"\r\n\r\n", start)
        # RFC 9112 2.2: a bare LF may end a line (printf | nc): such a head had waited out
        # the header timeout unanswered.  Its blank line is "\n\n" or "\n\r\n" (one that
        # may end just past a CRLF one's start: "4\n\r\n\r\n"); a CRLF head has neither.
        limit = len(buf) if end < 0 else end + 2
        lf = buf.find(b"\n\n", start, limit)
        lfcr = buf.find(b"\n\r\n", start, limit)
        if lf < 0 and lfcr < 0:
            if end < 0:
                self._scanned = len(buf)
                if len(buf) > self.max_head:
                    raise HttpError(431, f"header section longer than {self.max_head} bytes")
                return False
            if end > self.max_head:
                raise HttpError(431, f"header section longer than {self.max_head} bytes")
            lines = bytes(buf[:end]).split(b"\r\n")
            del buf[: end + 4]
        else:
            if lf >= 0 and (lfcr < 0 or lf < lfcr):
                stop, after = lf, lf + 2
            else:
                stop, after = lfcr, lfcr + 3
            if stop > self.max_head:
                raise HttpError(431, f"header section longer than {self.max_head} bytes")
            # (one CR before each LF goes; another is a bare CR, refused as a control)
            lines = [
                line[:-1] if line.endswith(b"\r") else line
                for line in bytes(buf[:stop]).split(b"\n")
            ]
            del buf[:after]
        self._scanned = 0
        head = self._start_line(lines[0])
        _parse_fields(lines[1:], head, self.max_fields)
        self._frame(head)
        return True

    def _start_body(self, length: int) -> None:
        if length > self.max_body:
            raise HttpError(413, f"body of {length} bytes exceeds the limit of {self.max_body}")
        if length == 0:
            self.events.append(bytearray())
            self._message_done()
            return
        body = None
        if length <= FIRST_BODY_BYTES and self.pool is not None:
            body = self.pool.take_free(length)
        if body is None:  # (a longer one takes a pooled buffer only once mostly here: _grow)
            body = bytearray(min(length, FIRST_BODY_BYTES))
        self._body, self._length, self._filled = body, length, 0

    def _grow(self) -> bytearray:
        """The body's buffer, x4 longer up to its length (its bytes so far copied over)."""
        old, length = self._body, self._length
        assert old is not None
        target = min(length, 4 * len(old))
        body = None
        if target == length and self.pool is not None:
            body = self.pool.take_free(length)
        if body is None:
            body = bytearray(target)
        with memoryview(old) as filled:
            body[: self._filled] = filled[: self._filled]
        self._body = body
        return body

    def _advance_chunked(self) -> bool:
        buf, body = self._buf, self._chunked
        assert body is not None
        while True:
            if self._chunk_left == -2:  # trailer fields: skip to the empty line
                end = buf.find(b"\r\n")
                if end < 0:
                    if len(buf) > self.max_head:
                        raise HttpError(431, "trailer section too long")
                    return False
                trailer = bytes(buf[:end])
                if trailer.translate(None, b"\t") != trailer.translate(None, _CONTROLS):
                    # (a bare LF hid a second request in the trailer from this parser)
                    raise HttpError(400, "a control character in a trailer field")
                del buf[: end + 2]
                if end == 0:
                    self._chunked = None
                    self._chunk_left = -1
                    self.events.append(body)
                    self._message_done()
                    return True
                continue
            if self._chunk_left == -1:
                end = buf.find(b"\r\n")
                if end < 0:
                    if len(buf) > 1024:
                        raise HttpError(400, "chunk-size line too long")
                    return False
                line = bytes(buf[:end])
                if line.translate(None, b"\t") != line.translate(None, _CONTROLS):
                    # (a bare LF in a chunk extension is where a proxy that ends the
                    # line there and this parser part ways: request smuggling)
                    raise HttpError(400, "a control character in a chunk-size line")
                size_text = line.split(b";", 1)[0].strip(b" \t")
                try:
                    if not size_text or not all(c in b"0123456789abcdefABCDEF" for c in size_text):
                        raise ValueError
                    size = int(size_text, 16)
                except ValueError:
                    raise HttpError(400, "bad chunk size") from None
                del buf[: end + 2]
                if size == 0:
                    self._chunk_left = -2
                    continue
                if len(body) + size > self.max_body:
                    raise HttpError(413, f"body longer than {self.max_body} bytes")
                self._chunk_left = size
            need = self._chunk_left + 2
            if len(buf) < need:
                take = min(len(buf), self._chunk_left)
                body += buf[:take]
                del buf[:take]
                self._chunk_left -= take
                return False
            if buf[self._chunk_left : need] != b"\r\n":
                raise HttpError(400, "chunk data not followed by CRLF")
            body += buf[: self._chunk_left]
            del buf[:need]
            self._chunk_left = -1

    def _chunked_start(self) -> None:
        self._chunked = bytearray()
        self._chunk_left = -1

    def end_of_stream(self) -> None:
        """The peer closed its side: a body that runs to EOF is complete."""
        self.eof = True
        if self._to_eof is not None:
            body, self._to_eof = self._to_eof, None
            self.events.append(body)
            self._message_done()

    # ---- per side ----------------------------------------------------------------------------------
    def _start_line(self, line: bytes) -> Head:  # pragma: no cover - abstract
        raise NotImplementedError

    def _frame(self, head: Head) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _message_done(self) -> None:
        self.paused = True


class RequestParser(_Reader):
    """Requests as a server reads them: :attr:`events` holds a :class:`Head`, then its body
    (a bytearray, empty when there is none), and the parser pauses until :meth:`resume`."""

    def __init__(self, *, max_head: int = 64 * 1024, max_fields: int = 100,
                 max_body: int = 16 * 1024 * 1024, pool: BodyPool | None = None,
                 tail: int = TAIL) -> None:  # fmt: skip
        super().__init__(
            max_head=max_head, max_fields=max_fields, max_body=max_body, pool=pool, tail=tail
        )
        self.head: Head | None = None  # the request being read or handled

    def _start_line(self, line: bytes) -> Head:
        parts = line.split(b" ")
        if len(parts) != 3:
            raise HttpError(400, "the request line is not 'METHOD target HTTP/1.1'")
        method, target, version = parts
        if not method or not _TOKEN.issuperset(method):
            raise HttpError(400, "bad method")
        if not target or target.translate(None, _BAD_TARGET) != target:
            raise HttpError(400, "bad request target")
        if not (
            target[:1] == b"/"
            or target == b"*"
            or target[:8].lower().startswith((b"http://", b"https://"))
        ):  # (RFC 9112 3.2: origin-, absolute- or asterisk-form)
            raise HttpError(400, "a request target starts with '/'")
        if version == b"HTTP/1.1":
            v = "1.1"
        elif version == b"HTTP/1.0":
            v = "1.0"
        elif version.startswith(b"HTTP/"):
            raise HttpError(505, f"{version.decode('latin-1')} is not served; use HTTP/1.1")
        else:
            raise HttpError(400, "the request line does not end in HTTP/1.1")
        head = Head()
        head.method = method.decode("ascii")
        head.target = target.decode("latin-1")
        head.version = v
        return head

    def _frame(self, head: Head) -> None:
        self.head = head
        self.events.append(head)
        te = head.headers.get("transfer-encoding")
        length = _content_length(head)
        if te is not None:
            if length is not None:
                raise HttpError(400, "both Content-Length and Transfer-Encoding")
            if head.version == "1.0":
                raise HttpError(400, "Transfer-Encoding in an HTTP/1.0 request")
            if te.strip().lower() != "chunked":
                raise HttpError(501, f"Transfer-Encoding {te[:40]!r} is not supported")
            self._chunked_start()
            return
        self._start_body(length or 0)

    @property
    def content_length(self) -> int | None:
        """The declared body length of the request being read (None when chunked)."""
        if self.head is None:
            return None
        return _content_length(self.head) if "transfer-encoding" not in self.head.headers else None


class ResponseParser(_Reader):
    """Responses as a client reads them (one request at a time): a :class:`Head`, then its
    body.  ``expect_no_body`` is set before reading the answer to a HEAD request."""

    def __init__(self, *, max_head: int = 64 * 1024, max_fields: int = 100,
                 max_body: int = 64 * 1024 * 1024, tail: int = TAIL) -> None:  # fmt: skip
        super().__init__(max_head=max_head, max_fields=max_fields, max_body=max_body, tail=tail)
        self.expect_no_body = False
        self.paused = True  # nothing is expected before a request is sent

    def _start_line(self, line: bytes) -> Head:
        parts = line.split(b" ", 2)
        if len(parts) < 2 or parts[0] not in (b"HTTP/1.1", b"HTTP/1.0"):
            raise HttpError(502, "the peer did not answer HTTP/1.x")
        status = parts[1]
        if len(status) != 3 or not status.isdigit():
            raise HttpError(502, "bad status code")
        head = Head()
        head.version = "1.1" if parts[0] == b"HTTP/1.1" else "1.0"
        head.status = int(status)
        head.reason = parts[2].decode("latin-1") if len(parts) == 3 else ""
        return head

    def _frame(self, head: Head) -> None:
        if 100 <= head.status < 200:
            return  # an interim answer (100 Continue): the final one follows
        self.events.append(head)
        if self.expect_no_body or head.status in (204, 304):
            self.events.append(bytearray())
            self._message_done()
            return
        te = head.headers.get("transfer-encoding")
        codings = [c for c in (t.strip().lower() for t in (te or "").split(",")) if c]
        if codings and codings != ["identity"] * len(codings):
            # chunked only where it is the last coding ("xchunked" is not); any other
            # ends where the connection does (RFC 9112 6.3), whatever a length says
            if codings[-1] == "chunked":
                self._chunked_start()
            else:
                self._to_eof = bytearray()
            return
        length = _content_length(head)
        if length is None:
            self._to_eof = bytearray()
            return
        self._start_body(length)


# ---- writing ------------------------------------------------------------------------------------
def response_head(
    status: int,
    headers: list[tuple[str, str]] | tuple[tuple[str, str], ...],
    content_length: int,
    *,
    close: bool = False,
) -> bytes:
    """A response's status line and headers (Content-Length always: no chunked answers)."""
    lines = [f"HTTP/1.1 {status} {REASONS.get(status, 'Unknown')}\r\n"]
    lines.extend(f"{name}: {value}\r\n" for name, value in headers)
    lines.append(f"Content-Length: {content_length}\r\n")
    if close:
        lines.append("Connection: close\r\n")
    lines.append("\r\n")
    return "".join(lines).encode("latin-1")


def request_head(
    method: str, target: str, host: str, headers: list[tuple[str, str]], content_length: int | None
) -> bytes:
    """A request's head; a target, host or header value that would break out of its
    line (a space, CR, LF or any control character) is refused, never written: such a
    value, taken from a client of ours, had smuggled a second request to the cloud."""
    if _UNSAFE_TARGET.search(target) or _UNSAFE_VALUE.search(host):
        raise InvalidInput(f"refusing to send a request to {target[:80]!r}: unsafe characters")
    for name, value in headers:
        if _UNSAFE_VALUE.search(value) or _UNSAFE_TARGET.search(name):
            raise InvalidInput(f"refusing to send header {name[:40]!r}: unsafe characters")
    lines = [f"{method} {target} HTTP/1.1\r\nHost: {host}\r\n"]
    lines.extend(f"{name}: {value}\r\n" for name, value in headers)
    if content_length is not None:
        lines.append(f"Content-Length: {content_length}\r\n")
    lines.append("\r\n")
    return "".join(lines).encode("latin-1")


_CONTROLS = bytes(range(0x20)) + b"\x7f"

#: a request target or header name holds none of these (RFC 9112: no whitespace or
#: controls), a header value no control but tab (RFC 9110 field-value)
_UNSAFE_TARGET = re.compile(r"[\x00-\x20\x7f]")
_UNSAFE_VALUE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")

CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
