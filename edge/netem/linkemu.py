"""Live link emulator: a TCP proxy that makes real connections follow a trace.

The real agent and the real cloud server talk through it, so a recorded (or
synthetic) cellular link can be replayed end to end, as mahimahi's link shell
does, without root or network namespaces.

Model, per direction:

* one bottleneck shared by every connection (a real radio link is one pipe):
  each delivery opportunity of the trace, on the emulator's trace clock,
  releases 1500 bytes of budget; bytes wait until budget exists, and
  opportunities nobody was waiting for are lost (a link does not bank idle
  capacity);
* ``delay_ms`` of one-way propagation on the far side of the bottleneck, as
  in mahimahi's ``mm-delay D mm-link UP DOWN`` (the device is inside the
  link): going up, bytes cross the bottleneck and then travel; coming down,
  they travel and then cross it, so the downlink trace is read at the time
  the bytes reach the radio (``edge.evaluation.sim`` prices an attempt the
  same way).  A per-connection task applies the delay, so it never holds
  back the shaping stage;
* an outage (no opportunities) stalls bytes but leaves connections open.

``up`` shapes client -> target; ``down`` shapes target -> client, and
``down=None`` leaves that direction unshaped (it still gets the delay).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import signal
import sys
from collections import deque

from edge.netem.traces import Trace, trace_from_spec
from shared.errors import ConfigError, FerryError

log = logging.getLogger(__name__)
_Reader, _Writer = asyncio.StreamReader, asyncio.StreamWriter

_CHUNK = 64 * 1024
#: A sender that comes back within this long of the last grant (to read its next chunk,
#: or delayed by event-loop jitter) is still owed the opportunities it missed; after a
#: longer pause the link was idle and those opportunities are gone.
_GRACE_S = 0.010
#: Bytes a connection may hold beyond what the link carries in one delay (flow control):
#: bytes in propagation are not a backlog, and a link of rate x delay above this must
#: not be throttled by it (4 MiB per delay had capped 60 Mbps at 800 ms to 41 Mbps).
_QUEUE_LIMIT = 4 * 1024 * 1024


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


#: a start offset past this (a year) would leave the clock no sub-millisecond precision
MAX_START_OFFSET_S = 365 * 86400.0


class _Link:
    """One direction's bottleneck: a token schedule that follows the trace.

    Invariant: opportunities with global index < ``_next`` are spent (used or
    lost); ``_credit`` bytes remain of the last one used.  The lock makes
    waiting senders take turns in FIFO order, so connections share fairly.
    """

    def __init__(self, clock: _Clock, trace: Trace | None, loop_trace: bool) -> None:
        self._clock = clock
        self._loop_trace = loop_trace
        self.trace = trace
        self._next = 0
        self._credit = 0
        self._last_grant = -math.inf
        self._lock = asyncio.Lock()
        self._wake: asyncio.Future[None] | None = None

    def now(self) -> float:
        return self._clock.now()

    def reset(self, trace: Trace | None) -> None:
        """Switch traces: the new schedule applies from the current trace time."""
        self.trace = trace
        self._next = trace.opportunities_before(self._clock.now()) if trace is not None else 0
        self._credit = 0
        self._last_grant = -math.inf
        if self._wake is not None:
            _resolve(self._wake)

    async def acquire(self, want: int) -> int:
        """Wait until the link can carry some bytes now; return how many (1..want)."""
        arrived = self._clock.now()
        async with self._lock:
            idle_check = True
            while True:
                trace = self.trace
                if trace is None:
                    return want
                now = self._clock.now()
                period_s = trace.period_ms / 1000.0
                if not self._loop_trace and now >= period_s:
                    return want  # the trace is over and does not repeat: unshaped
                if idle_check:
                    # Capacity nobody asked for is lost.  Capacity that passed while this
                    # sender queued or slept (a late wake-up included), or during a short
                    # gap since the last grant (reading the next chunk), is still owed --
                    # but never more than the last _GRACE_S of it: a sender that comes
                    # back often must not bank a fast phase's capacity and spend it in
                    # an outage that follows.
                    idle_check = False
                    t0 = min(arrived, now)
                    owed_s = _GRACE_S if t0 - self._last_grant <= _GRACE_S else 0.0
                    floor = trace.opportunities_before(t0 - owed_s)
                    if self._next < floor:
                        self._next, self._credit = floor, 0
                ready = trace.opportunities_before(now + 1e-6) - self._next
                budget = self._credit + max(ready, 0) * Trace.PACKET_BYTES
                if budget > 0:
                    granted = min(want, budget)
                    need = granted - self._credit
                    if need <= 0:
                        self._credit = -need
                    else:
                        used = -(-need // Trace.PACKET_BYTES)
                        self._next += used
                        self._credit = used * Trace.PACKET_BYTES - need
                    self._last_grant = now
                    return granted
                wake_at = trace.opportunity_time_s(self._next)
                if not self._loop_trace:
                    wake_at = min(wake_at, period_s)
                await self._sleep(wake_at - now)

    async def _sleep(self, delay_s: float) -> None:
        """Sleep until the next opportunity, or until ``reset`` changes the schedule."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        finite = math.isfinite(delay_s)
        handle = loop.call_later(max(delay_s, 0.0), _resolve, fut) if finite else None
        self._wake = fut
        try:
            await fut
        finally:
            self._wake = None
            if handle is not None:
                handle.cancel()


class _Clock:
    """The trace clock: seconds since (re)start plus an offset into the trace."""

    def __init__(self, offset_s: float) -> None:
        self.origin: float | None = None
        self.offset_s = offset_s

    def now(self) -> float:
        if self.origin is None:
            return self.offset_s
        return asyncio.get_running_loop().time() - self.origin + self.offset_s


class _Pipe:
    """One direction of one connection: read, shape on the shared link, delay, write.

    Up: shaped as read, then delayed.  Down: delayed as read, then shaped as it
    is written (the bottleneck is on the device's side of the delay)."""

    def __init__(self, emu: LinkEmulator, up: bool, src: _Reader, dst: _Writer) -> None:
        self._emu, self._up, self._reader, self._writer = emu, up, src, dst
        self._link = emu._up if up else emu._down
        self._line: deque[tuple[float, memoryview | None]] = deque()
        self._queued = 0
        self._ready = asyncio.Event()
        self._room = asyncio.Event()
        self._room.set()

    def _limit(self) -> int:
        """Bytes this connection may hold: what the link carries within one delay
        (around now), plus the backlog bound for a slow reader."""
        trace, delay = self._link.trace, self._emu.delay_s
        if trace is None or delay <= 0:
            return _QUEUE_LIMIT
        now = self._link.now()
        in_flight = max(
            trace.bytes_between(now - delay, now), trace.bytes_between(now, now + delay)
        )
        return _QUEUE_LIMIT + in_flight

    async def pump(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                data = await self._reader.read(_CHUNK)
                if not data:
                    return
                view = memoryview(data)
                if not self._up:  # (shaped after the delay: see deliver)
                    self._push(loop.time() + self._emu.delay_s, view)
                    view = view[len(view) :]
                while view:
                    n = await self._link.acquire(len(view))
                    self._push(loop.time() + self._emu.delay_s, view[:n])
                    view = view[n:]
                if self._queued > self._limit():
                    self._room.clear()
                    await self._room.wait()
        finally:
            self._push(loop.time() + self._emu.delay_s, None)  # EOF travels with the delay too

    def _push(self, when: float, piece: memoryview | None) -> None:
        self._line.append((when, piece))
        if piece is not None:
            self._queued += len(piece)
        self._ready.set()

    async def deliver(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._line:
                self._ready.clear()
                await self._ready.wait()
                continue
            when, piece = self._line[0]
            wait = when - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            self._line.popleft()
            if piece is None:
                if self._writer.can_write_eof() and not self._writer.is_closing():
                    self._writer.write_eof()  # half-close reaches the peer
                return
            while piece:
                n = len(piece) if self._up else await self._link.acquire(len(piece))
                self._writer.write(piece[:n])
                piece = piece[n:]
                self._queued -= n
                if self._up:
                    self._emu.bytes_up += n
                else:
                    self._emu.bytes_down += n
                if self._queued <= self._limit():
                    self._room.set()
                await self._writer.drain()


class LinkEmulator:
    """A TCP proxy from ``listen`` to ``target`` whose two directions follow traces."""

    def __init__(
        self,
        listen: tuple[str, int],
        target: tuple[str, int],
        up: Trace,
        down: Trace | None = None,
        *,
        delay_ms: float = 0.0,
        loop: bool = True,
        start_offset_s: float = 0.0,
    ) -> None:
        if not 0 <= delay_ms < math.inf:  # also NaN
            raise ConfigError(f"delay_ms must be a finite number >= 0, got {delay_ms}")
        if not 0 <= start_offset_s <= MAX_START_OFFSET_S:
            raise ConfigError(
                f"start_offset_s must be 0..{MAX_START_OFFSET_S:g} s (the trace loops), "
                f"got {start_offset_s}"
            )
        self.listen, self.target = listen, target
        self.delay_s = delay_ms / 1000.0
        self._clock = _Clock(start_offset_s)
        self._up = _Link(self._clock, up, loop)
        self._down = _Link(self._clock, down, loop)
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self.bytes_up = 0
        self.bytes_down = 0

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("LinkEmulator.port is known only after start()")
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def elapsed_s(self) -> float:
        """Position on the trace clock (start offset included)."""
        return self._clock.now()

    @property
    def traces(self) -> tuple[Trace | None, Trace | None]:
        return self._up.trace, self._down.trace

    async def start(self) -> None:
        host, port = self.listen
        try:
            self._server = await asyncio.start_server(self._handle, host, port)
        except OSError as exc:
            raise ConfigError(f"emulate-link: cannot listen on {host}:{port}: {exc}") from None
        self._clock.origin = asyncio.get_running_loop().time()
        self._up.reset(self._up.trace)
        self._down.reset(self._down.trace)

    def set_traces(
        self, up: Trace, down: Trace | None = None, *, restart_clock: bool = True
    ) -> None:
        """Switch both directions live; with ``restart_clock`` the new traces start at 0."""
        if restart_clock:
            self._clock.offset_s = 0.0
            if self._clock.origin is not None:
                self._clock.origin = asyncio.get_running_loop().time()
        self._up.reset(up)
        self._down.reset(down)

    async def close(self) -> None:
        """Stop accepting and cut every proxied connection."""
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.transport.abort()
        for task in list(self._handlers):
            task.cancel()
        if self._handlers:
            await asyncio.gather(*self._handlers, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    async def _handle(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        self._writers.add(c_writer)
        t_writer: asyncio.StreamWriter | None = None
        try:
            try:
                t_reader, t_writer = await asyncio.open_connection(*self.target)
            except OSError as exc:
                log.warning("emulate-link: cannot reach %s:%s: %s", *self.target, exc)
                c_writer.transport.abort()  # the client sees a reset, as with no route
                return
            self._writers.add(t_writer)
            up = _Pipe(self, True, c_reader, t_writer)
            down = _Pipe(self, False, t_reader, c_writer)
            await self._run_pipes(up, down, c_writer, t_writer)
        except asyncio.CancelledError:
            pass  # close(): end quietly (asyncio's stream callback chokes on a cancelled handler)
        finally:
            for w in (c_writer, t_writer):
                if w is not None:
                    self._writers.discard(w)
                    w.close()
            self._handlers.discard(task)

    async def _run_pipes(
        self, up: _Pipe, down: _Pipe, c_writer: asyncio.StreamWriter, t_writer: asyncio.StreamWriter
    ) -> None:
        tasks = [
            asyncio.ensure_future(c) for c in (up.pump(), up.deliver(), down.pump(), down.deliver())
        ]
        try:
            pending: set[asyncio.Future[None]] = set(tasks)
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
                if any(not t.cancelled() and t.exception() is not None for t in done):
                    # a reset or error on either side: cut both, like a broken path
                    c_writer.transport.abort()
                    t_writer.transport.abort()
                    break
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


# -- command line ------------------------------------------------------------------------


def _endpoint(text: str, flag: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"{flag} expects HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


_ABOUT = "A TCP proxy that makes real connections follow a link trace (rate and delay)."


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--listen", required=True, metavar="HOST:PORT", help="where to accept (port 0: any)")
    add("--to", required=True, metavar="HOST:PORT", help="the real server")
    add("--up", required=True, metavar="TRACE", help="client->server trace (see below)")
    add("--down", metavar="TRACE", help="server->client trace (default: unshaped, delay only)")
    add("--delay-ms", type=float, default=0.0, help="one-way delay per direction")
    add("--loop", action=argparse.BooleanOptionalAction, default=True, help="replay at the end")
    add("--start-offset-s", type=float, default=0.0, help="start this far into the trace")
    parser.epilog = (
        "TRACE: a mahimahi file (one ms stamp per 1500-byte opportunity), a 't_seconds mbps' "
        "file, steady:MBPS, commute:SEED, markov:SEED or markov-off:SEED. Without --down the "
        "downlink is unshaped (delay only); 'ferry-edge evaluate' without --down instead "
        "assumes the link profile's steady down_mbps. With --no-loop the link is "
        "unshaped once the trace ends."
    )


def add_emulate_link_command(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("emulate-link", help=_ABOUT, description=_ABOUT)
    _add_arguments(parser)
    return parser


async def _serve(emu: LinkEmulator) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await emu.start()
    up, down = emu.traces
    shown = [f"{t.name} ({t.mean_mbps():.2f} Mbps mean)" if t else "unshaped" for t in (up, down)]
    print(
        f"ferry-edge emulate-link listening on {emu.listen[0]}:{emu.port} -> {emu.target[0]}:"
        f"{emu.target[1]} up={shown[0]} down={shown[1]} delay={emu.delay_s * 1000:g} ms",
        flush=True,
    )
    try:
        await stop.wait()
    finally:
        await emu.close()
        done = f"up={emu.bytes_up} B down={emu.bytes_down} B"
        print(f"ferry-edge emulate-link stopped {done}", flush=True)


def run_emulate_link(args: argparse.Namespace) -> int:
    """Run until SIGINT/SIGTERM; bad arguments raise ConfigError (the CLI prints it)."""
    emu = LinkEmulator(
        _endpoint(args.listen, "--listen"),
        _endpoint(args.to, "--to"),
        trace_from_spec(args.up),
        trace_from_spec(args.down) if args.down else None,
        delay_ms=args.delay_ms,
        loop=args.loop,
        start_offset_s=args.start_offset_s,
    )
    asyncio.run(_serve(emu))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m edge.netem.linkemu", description=_ABOUT)
    _add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        return run_emulate_link(args)
    except FerryError as exc:
        print(f"emulate-link: error [{exc.code.value}]: {exc.message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
