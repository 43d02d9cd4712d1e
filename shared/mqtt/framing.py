"""Cuts a byte stream into MQTT packets (sans-IO, shaped like ``asyncio.BufferedProtocol``).

The stream's owner asks :meth:`PacketFramer.get_buffer` where the next bytes
should go, writes up to that many there, and reports how many with
:meth:`buffer_updated`; complete packets then wait in :attr:`packets` as
``(first byte, body)``.  Why this shape:

- a large packet (a 602 KB tensor, a 16 MiB request) gets a buffer of its
  exact size as soon as its fixed header is known, and the kernel writes the
  rest of it straight there: no growing buffer, no joins, no copy at all of
  its body (the body is handed over as that bytearray);
- small packets are cut out of one reused scratch buffer (a copy each, of a
  few hundred bytes);
- a packet longer than ``max_packet`` is never held whole: its first
  ``keep_head`` bytes are kept (a PUBLISH's topic, properties and the start
  of its payload, enough to answer it with an error) and the rest is read
  into the scratch buffer and dropped, so memory stays bounded whatever a
  peer sends.
"""

from __future__ import annotations

from collections import deque

from shared.buffered import TAIL, FeedsBuffers, let_go
from shared.mqtt.codec import MAX_VBI, MalformedPacket
from shared.mqtt.codec import PACKET_TOO_LARGE as _PACKET_TOO_LARGE
from shared.mqtt.codec import PUBLISH as _PUBLISH

#: bodies at least this long get a buffer of their own (no copy)
LARGE_BODY = 64 * 1024
_SCRATCH = 16 * 1024  # headers and small packets; a large body is read into its own buffer


class Oversized:
    """A packet whose body was longer than the framer accepts; only ``head`` was kept."""

    __slots__ = ("first", "head", "length")

    def __init__(self, first: int, head: bytes, length: int) -> None:
        self.first = first
        self.head = head
        self.length = length


class PacketFramer(FeedsBuffers):
    def __init__(self, max_packet: int, keep_head: int = 64 * 1024, tail: int = TAIL) -> None:
        if max_packet < 2:
            raise ValueError("max_packet must allow a packet")
        self.max_packet = max_packet
        self.keep_head = keep_head
        self._tail = tail  # a large body's last bytes come through scratch (shared.buffered)
        self.packets: deque[tuple[int, bytes | bytearray] | Oversized] = deque()
        self._scratch = bytearray(_SCRATCH)
        self._view = memoryview(self._scratch)
        self._partial = bytearray()  # the start of a small packet (or of a header)
        self._big: bytearray | None = None  # the body of a large packet being read
        self._big_first = 0
        self._big_filled = 0
        self._big_view: memoryview | None = None  # the slice of it handed out last
        self._skip_first = 0  # an oversized packet being dropped
        self._skip_head = bytearray()
        self._skip_left = 0
        self._skip_length = 0

    # ---- the BufferedProtocol side ---------------------------------------------------------
    def get_buffer(self, sizehint: int = -1) -> memoryview:
        big, tail = self._big, self._tail
        if big is not None and len(big) - self._big_filled > tail:
            self._big_view = memoryview(big)[self._big_filled : len(big) - tail]
            return self._big_view
        if self._skip_left:
            return self._view[: min(self._skip_left, _SCRATCH)]
        return self._view

    def buffer_updated(self, nbytes: int) -> None:
        if self._big_view is not None:
            # the reader is done writing: end the export, so the finished body can
            # become its payload in place (a bytearray cannot be trimmed while exported)
            let_go(self._big_view)
            self._big_view = None
            self._big_filled += nbytes
            if self._big_filled == len(self._big):  # type: ignore[arg-type]  # (no tail kept)
                self.packets.append((self._big_first, self._big))  # type: ignore[arg-type]
                self._big = None
            return
        if self._skip_left:
            self._skip(self._view[:nbytes])
            return
        taken = 0
        big = self._big
        if big is not None:  # its last bytes (TAIL), and maybe the next packets'
            taken = min(nbytes, len(big) - self._big_filled)
            big[self._big_filled : self._big_filled + taken] = self._view[:taken]
            self._big_filled += taken
            if self._big_filled < len(big):
                return
            self.packets.append((self._big_first, big))
            self._big = None
        self._partial += self._view[taken:nbytes]
        self._cut()

    # ---- cutting ----------------------------------------------------------------------------
    def _cut(self) -> None:
        buf = self._partial
        pos = 0
        while len(buf) - pos >= 2:
            first = buf[pos]
            if first >> 4 == 0:
                raise MalformedPacket("packet type 0 is reserved")
            length = shift = 0
            i = pos + 1
            while True:
                if i >= len(buf):
                    del buf[:pos]
                    return  # the header is not complete yet
                byte = buf[i]
                length += (byte & 0x7F) << shift
                i += 1
                if not byte & 0x80:
                    break
                shift += 7
                if shift > 21:
                    raise MalformedPacket("remaining length longer than 4 bytes")
            if length > MAX_VBI:  # pragma: no cover - 4 bytes cannot say more
                raise MalformedPacket("remaining length too large")
            available = len(buf) - i
            if length > self.max_packet and first >> 4 != _PUBLISH:
                # (no control packet is that long: said now, not after reading it all,
                # 256 MB of it, the broker's PINGRESPs swallowed meanwhile)
                raise MalformedPacket(
                    f"a {length}-byte control packet (type {first >> 4})", _PACKET_TOO_LARGE
                )
            if length > self.max_packet:
                taken = min(available, length)
                self._skip_first, self._skip_length = first, length
                self._skip_head = bytearray(buf[i : i + min(taken, self.keep_head)])
                self._skip_left = length - taken
                del buf[: i + taken]
                if not self._skip_left:
                    self._emit_skipped()
                    pos = 0
                    continue
                if buf:  # pragma: no cover - the skip consumed everything up to here
                    raise AssertionError("bytes after an unfinished oversized packet")
                return
            if length >= LARGE_BODY:
                # a buffer of its own (what is already here is copied once, the rest
                # is read straight into it): the body becomes the payload in place
                big = bytearray(length)
                taken = min(available, length)
                big[:taken] = buf[i : i + taken]
                if taken == length:
                    self.packets.append((first, big))
                    pos = i + length
                    continue
                self._big, self._big_first, self._big_filled = big, first, taken
                buf.clear()
                return
            if available >= length:
                self.packets.append((first, bytes(buf[i : i + length])))
                pos = i + length
                continue
            break
        del buf[:pos]

    def _skip(self, data: memoryview) -> None:
        room = self.keep_head - len(self._skip_head)
        if room > 0:
            self._skip_head += data[:room]
        self._skip_left -= len(data)
        if not self._skip_left:
            self._emit_skipped()

    def _emit_skipped(self) -> None:
        self.packets.append(Oversized(self._skip_first, bytes(self._skip_head), self._skip_length))
        self._skip_head = bytearray()
