"""The live link emulator, with real sockets on loopback and real traces."""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from edge.netem.linkemu import LinkEmulator
from edge.netem.traces import Trace, from_phases, read_mahimahi, steady
from tests.support import cellular_trace_dir, cellular_trace_pairs

ROOT = Path(__file__).resolve().parents[3]
HOST = "127.0.0.1"


class Sink:
    """A real server that reads everything, stamping each read with ``clock()``."""

    def __init__(self) -> None:
        self.clock: Callable[[], float] = time.monotonic
        self.records: list[tuple[float, int, int]] = []  # (time, connection, bytes)
        self._conns = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = self._conns
        self._conns += 1
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                self.records.append((self.clock(), conn, len(data)))
        writer.close()

    def mbps(self, a: float, b: float, conn: int | None = None) -> float:
        total = sum(n for t, c, n in self.records if a <= t < b and (conn is None or c == conn))
        return total * 8 / (b - a) / 1e6


async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    writer.close()


async def source(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Sends as fast as the connection takes it, until the peer goes away."""
    chunk = bytes(65536)
    with contextlib.suppress(ConnectionError):
        while not writer.is_closing():
            writer.write(chunk)
            await writer.drain()
    writer.close()


@contextlib.asynccontextmanager
async def through(
    handler: Callable, up: Trace, down: Trace | None = None, **kw: object
) -> AsyncIterator[LinkEmulator]:
    server = await asyncio.start_server(handler, HOST, 0)
    emu = LinkEmulator((HOST, 0), (HOST, server.sockets[0].getsockname()[1]), up, down, **kw)
    await emu.start()
    try:
        yield emu
    finally:
        await emu.close()
        server.close()


async def push(port: int) -> None:
    """A client that sends as fast as the link lets it, until cancelled."""
    _, writer = await asyncio.open_connection(HOST, port)
    chunk = bytes(65536)
    try:
        while True:
            writer.write(chunk)
            await writer.drain()
    finally:
        writer.transport.abort()


async def until(emu: LinkEmulator, t: float) -> None:
    await asyncio.sleep(max(t - emu.elapsed_s, 0))


def real_uplink() -> Trace:
    return _cellular("up")


def _cellular(direction: str) -> Trace:
    """The real Verizon trace where it exists, else a generated one of the same format."""
    folder = cellular_trace_dir()
    path = folder / f"Verizon-LTE-short.{direction}"
    if not path.is_file():
        path = folder / f"{cellular_trace_pairs()[0]}.{direction}"
    return read_mahimahi(path)


@pytest.mark.parametrize(
    "make",
    [lambda: steady(8, 60), lambda: from_phases([(3, 4), (3, 12)]), real_uplink],
    ids=["steady-8", "phases-4-then-12", "verizon-uplink"],
)
async def test_delivered_throughput_follows_trace_within_15_percent_per_2s_window(
    make: Callable[[], Trace],
) -> None:
    trace = make()
    sink = Sink()
    async with through(sink.handle, trace) as emu:
        sink.clock = lambda: emu.elapsed_s
        pusher = asyncio.create_task(push(emu.port))
        await until(emu, 6.0)
        pusher.cancel()
    for start in (0.0, 2.0, 4.0):
        want = trace.capacity_mbps(start, 2.0)
        got = sink.mbps(start, start + 2.0)
        assert got == pytest.approx(want, rel=0.15), (trace.name, start, got, want)


def real_downlink() -> Trace:
    return _cellular("down")


@pytest.mark.parametrize(
    "make",
    [lambda: steady(8, 60), lambda: from_phases([(3, 12), (3, 4)]), real_downlink],
    ids=["steady-8", "phases-12-then-4", "verizon-downlink"],
)
async def test_delivered_downlink_throughput_follows_trace_within_15_percent_per_2s_window(
    make: Callable[[], Trace],
) -> None:
    trace = make()
    records: list[tuple[float, int]] = []
    async with through(source, steady(50, 60), trace) as emu:
        reader, writer = await asyncio.open_connection(HOST, emu.port)
        try:
            while emu.elapsed_s < 6.0:
                with contextlib.suppress(asyncio.TimeoutError):
                    data = await asyncio.wait_for(reader.read(65536), 0.5)
                    records.append((emu.elapsed_s, len(data)))
        finally:
            writer.transport.abort()
    for start in (0.0, 2.0, 4.0):
        got = sum(n for t, n in records if start <= t < start + 2.0) * 8 / 2.0 / 1e6
        want = trace.capacity_mbps(start, 2.0)
        assert got == pytest.approx(want, rel=0.15), (trace.name, start, got, want)


async def test_added_delay_shows_in_a_small_round_trip() -> None:
    fast = steady(50, 60)
    for delay_ms in (0.0, 40.0):
        async with through(echo, fast, fast, delay_ms=delay_ms) as emu:
            reader, writer = await asyncio.open_connection(HOST, emu.port)
            rtts = []
            for _ in range(3):
                t0 = time.monotonic()
                writer.write(b"x" * 200)
                await reader.readexactly(200)
                rtts.append(time.monotonic() - t0)
            writer.close()
        if delay_ms:
            assert min(rtts) >= 2 * delay_ms / 1000
            assert max(rtts) < 2 * delay_ms / 1000 + 0.05
        else:
            assert max(rtts) < 0.03


async def test_downlink_trace_is_read_when_the_reply_reaches_the_radio_after_the_delay() -> None:
    # mahimahi's mm-delay D mm-link: a reply travels first, then crosses the downlink;
    # the replay (edge.evaluation.sim) prices it that way, so the live link must too.
    # Downlink: 24 Mbps for 0.5 s, then an outage for 0.5 s, looping; 100 ms each way.
    # A request sent at phase 0.3 has its reply reach the radio at 0.5, in the outage:
    # it waits until 1.0 (~700 ms), where shaping before the delay gave 200 ms.
    up, down, delay = steady(100, 60), from_phases([(0.5, 24), (0.5, 0)]), 0.1
    async with through(echo, up, down, delay_ms=delay * 1000) as emu:
        reader, writer = await asyncio.open_connection(HOST, emu.port)
        rtts = []
        for phase in (1.3, 2.6):
            await until(emu, phase)
            sent = emu.elapsed_s
            writer.write(b"q")
            await reader.readexactly(1)
            model = down.finish_time(up.finish_time(sent, 1) + 2 * delay, 1)
            rtts.append((emu.elapsed_s - sent, model - sent))
        writer.close()
    (slow, slow_model), (fast, fast_model) = rtts
    assert slow_model == pytest.approx(0.7, abs=0.02)
    assert slow == pytest.approx(slow_model, abs=0.06)
    assert fast == pytest.approx(fast_model, abs=0.06)  # (phase 0.6: out of the outage at 0.8)


async def test_a_long_delay_does_not_throttle_a_fast_link() -> None:
    # 60 Mbps with 800 ms one way holds 6 MB in propagation: a fixed 4 MiB allowance
    # per connection had delivered 41 Mbps of the 60.
    trace = steady(60, 60)
    sink = Sink()
    async with through(sink.handle, trace, delay_ms=800) as emu:
        sink.clock = lambda: emu.elapsed_s
        pusher = asyncio.create_task(push(emu.port))
        await until(emu, 3.2)
        pusher.cancel()
    assert sink.mbps(1.2, 3.2) == pytest.approx(60, rel=0.1)


async def test_outage_stalls_delivery_keeps_the_connection_and_traffic_resumes() -> None:
    trace = from_phases([(1.0, 8), (1.5, 0), (10.0, 8)])
    sink = Sink()
    async with through(sink.handle, trace) as emu:
        sink.clock = lambda: emu.elapsed_s
        pusher = asyncio.create_task(push(emu.port))
        await until(emu, 1.2)
        stalled_at = emu.bytes_up
        await until(emu, 2.4)
        assert emu.bytes_up == stalled_at  # nothing crosses during the outage
        await until(emu, 3.6)
        assert not pusher.done()  # the same connection carried on
        pusher.cancel()
    assert sink.mbps(0.0, 1.0) == pytest.approx(8, rel=0.15)
    assert sink.mbps(1.1, 2.45) == 0
    assert sink.mbps(2.6, 3.6) == pytest.approx(8, rel=0.15)
    assert len({c for _, c, _ in sink.records}) == 1


async def test_set_traces_switches_the_rate_live() -> None:
    sink = Sink()
    async with through(sink.handle, steady(2, 60)) as emu:
        pusher = asyncio.create_task(push(emu.port))
        await until(emu, 1.5)
        switched = time.monotonic()
        emu.set_traces(steady(16, 60))
        assert emu.elapsed_s < 0.1  # restart_clock: the new trace starts at 0
        await asyncio.sleep(2.0)
        pusher.cancel()
    begun = switched - 1.5
    assert sink.mbps(begun + 0.5, switched) == pytest.approx(2, rel=0.15)
    assert sink.mbps(switched + 0.5, switched + 2.0) == pytest.approx(16, rel=0.15)


async def test_down_trace_shapes_server_to_client_and_none_leaves_it_unshaped() -> None:
    for down, low, high in ((steady(6, 60), 5.1, 6.9), (None, 60.0, float("inf"))):
        async with through(source, steady(50, 60), down) as emu:
            reader, writer = await asyncio.open_connection(HOST, emu.port)
            got, t0 = 0, time.monotonic()
            while time.monotonic() - t0 < 1.5:
                got += len(await reader.read(65536))
            writer.transport.abort()
        mbps = got * 8 / (time.monotonic() - t0) / 1e6
        assert low < mbps < high, (down, mbps)
        assert emu.bytes_down >= got


async def test_connections_share_one_bottleneck_fairly() -> None:
    sink = Sink()
    async with through(sink.handle, steady(8, 60)) as emu:
        sink.clock = lambda: emu.elapsed_s
        pushers = [asyncio.create_task(push(emu.port)) for _ in range(2)]
        await until(emu, 3.0)
        for p in pushers:
            p.cancel()
    assert sink.mbps(1.0, 3.0) == pytest.approx(8, rel=0.15)
    for conn in (0, 1):
        assert 2.4 < sink.mbps(1.0, 3.0, conn) < 5.6


async def test_no_loop_leaves_the_link_unshaped_after_the_trace_ends() -> None:
    sink = Sink()
    async with through(sink.handle, steady(1, 0.5), loop=False) as emu:
        sink.clock = lambda: emu.elapsed_s
        pusher = asyncio.create_task(push(emu.port))
        await until(emu, 1.2)
        pusher.cancel()
    assert sink.mbps(0.0, 0.5) == pytest.approx(1, rel=0.15)
    assert sink.mbps(0.7, 1.2) > 50


async def test_half_close_reaches_the_server_and_its_reply_comes_back() -> None:
    async def reply_at_eof(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        body = await reader.read()  # until the client's half-close
        writer.write(b"got %d" % len(body))
        await writer.drain()
        writer.close()

    async with through(reply_at_eof, steady(20, 60), steady(20, 60), delay_ms=10) as emu:
        reader, writer = await asyncio.open_connection(HOST, emu.port)
        writer.write(b"y" * 300_000)
        writer.write_eof()
        assert await asyncio.wait_for(reader.read(), 5) == b"got 300000"
        writer.close()


async def test_a_server_reset_ends_the_client_connection() -> None:
    async def reset_after_data(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(10)
        writer.transport.abort()  # unread bytes left: the kernel sends a reset

    async with through(reset_after_data, steady(20, 60), delay_ms=5) as emu:
        reader, writer = await asyncio.open_connection(HOST, emu.port)
        writer.write(b"z" * 50_000)
        with contextlib.suppress(ConnectionError):
            assert await asyncio.wait_for(reader.read(100), 3) == b""
        writer.close()


async def test_unreachable_target_resets_the_client() -> None:
    with socket.socket() as s:
        s.bind((HOST, 0))
        dead_port = s.getsockname()[1]
    emu = LinkEmulator((HOST, 0), (HOST, dead_port), steady(10, 10))
    await emu.start()
    try:
        reader, writer = await asyncio.open_connection(HOST, emu.port)
        with contextlib.suppress(ConnectionError):
            assert await asyncio.wait_for(reader.read(100), 2) == b""
        writer.close()
    finally:
        await emu.close()


async def test_closing_the_emulator_cuts_open_connections() -> None:
    async with through(echo, steady(10, 60)) as emu:
        reader, writer = await asyncio.open_connection(HOST, emu.port)
        writer.write(b"ping")
        assert await asyncio.wait_for(reader.readexactly(4), 2) == b"ping"
        await emu.close()
        with contextlib.suppress(ConnectionError):
            assert await asyncio.wait_for(reader.read(100), 2) == b""
        writer.close()


async def test_command_line_proxies_until_sigterm(tmp_path: Path) -> None:
    trace_file = tmp_path / "link.txt"
    trace_file.write_text("0 20\n1 20\n")
    server = await asyncio.start_server(echo, HOST, 0)
    target = f"{HOST}:{server.sockets[0].getsockname()[1]}"
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "edge.netem.linkemu",
        "--listen",
        f"{HOST}:0",
        "--to",
        target,
        "--up",
        str(trace_file),
        "--down",
        "steady:20",
        "--delay-ms",
        "25",
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        line = (await asyncio.wait_for(proc.stdout.readline(), 20)).decode()
        port = int(re.search(r"listening on [\d.]+:(\d+) ->", line).group(1))
        reader, writer = await asyncio.open_connection(HOST, port)
        t0 = time.monotonic()
        writer.write(b"hello")
        assert await asyncio.wait_for(reader.readexactly(5), 5) == b"hello"
        assert time.monotonic() - t0 >= 0.05
        writer.close()
        proc.send_signal(signal.SIGTERM)
        out, _ = await asyncio.wait_for(proc.communicate(), 10)
        assert proc.returncode == 0
        assert b"stopped up=5 B down=5 B" in out
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        server.close()


async def test_command_line_reports_a_missing_trace_clearly() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "edge.netem.linkemu",
        "--listen",
        f"{HOST}:0",
        "--to",
        f"{HOST}:9",
        "--up",
        "/nonexistent/trace.up",
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await asyncio.wait_for(proc.communicate(), 20)
    assert proc.returncode == 2
    assert b"/nonexistent/trace.up" in err and b"no such file" in err


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"delay_ms": float("nan")}, "delay_ms"),
        ({"delay_ms": -1.0}, "delay_ms"),
        ({"start_offset_s": 1e30}, "start_offset_s"),
        ({"start_offset_s": -5.0}, "start_offset_s"),
    ],
)
def test_nonsense_timing_is_refused_not_run(kw: dict, message: str) -> None:
    from edge.netem.traces import steady
    from shared.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        LinkEmulator((HOST, 0), (HOST, 1), steady(10, 10), **kw)
