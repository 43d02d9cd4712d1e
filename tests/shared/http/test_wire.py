"""HTTP/1.1 parsing: any chunking reads the same; every malformed message gets its status."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.http.wire import (
    FIRST_BODY_BYTES,
    BodyPool,
    Head,
    HttpError,
    RequestParser,
    ResponseParser,
)
from tests.support import feed_held


def requests_of(parser: RequestParser, data: bytes, cuts: list[int] = ()) -> list:
    """Feed ``data`` in pieces; collect (head, body) pairs, resuming after each."""
    out, pos = [], 0
    for cut in [*cuts, len(data)]:
        parser.feed(data[pos : pos + cut])
        pos += cut
        while parser.events:
            item = parser.events.popleft()
            if isinstance(item, Head):
                out.append([item, None])
            else:
                out[-1][1] = bytes(item)
                parser.resume()
    parser.feed(data[pos:])
    return out


def post(path: str, body: bytes, extra: str = "") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode()
        + body
    )


@settings(max_examples=100, deadline=None)
@given(
    bodies=st.lists(st.binary(max_size=3000), min_size=1, max_size=4),
    big=st.booleans(),
    cuts=st.lists(st.integers(1, 70_000), max_size=10),
)
def test_any_chunking_of_pipelined_requests_reads_the_same(bodies, big, cuts) -> None:
    if big:
        bodies = [*bodies, bytes(range(256)) * 300]
    stream = b"".join(post(f"/v2/models/m{i}/infer", b) for i, b in enumerate(bodies))
    got = requests_of(RequestParser(), stream, cuts)
    assert [(h.target, b) for h, b in got] == [
        (f"/v2/models/m{i}/infer", b) for i, b in enumerate(bodies)
    ]


def test_a_large_body_is_read_in_place_into_a_buffer_that_grows_with_what_comes() -> None:
    # Memory follows the bytes that arrived: a head declaring 16 MB had a zero-filled
    # buffer of the whole length resident at once, whatever the client then sent.
    parser = RequestParser()
    body = bytes(range(256)) * 2352  # 602,112 bytes
    data = post("/infer", body)
    came = 1000 - (len(data) - len(body))  # body bytes that came with the head
    parser.feed(data[:1000])
    head = parser.events.popleft()
    assert head.headers["content-length"] == "602112"
    assert len(parser.get_buffer()) == FIRST_BODY_BYTES - came
    parser.feed(data[1000 : 1000 + FIRST_BODY_BYTES - came])
    assert len(parser._body) == FIRST_BODY_BYTES  # full: grown only once more bytes came
    assert len(parser.get_buffer()) < FIRST_BODY_BYTES  # (scratch meanwhile)
    parser.feed(data[1000 + FIRST_BODY_BYTES - came : 1000 + FIRST_BODY_BYTES - came + 10])
    assert len(parser._body) == 4 * FIRST_BODY_BYTES  # x4, the bytes so far kept
    parser.feed(data[1000 + FIRST_BODY_BYTES - came + 10 :])
    (got,) = parser.events
    assert isinstance(got, bytearray) and got == body
    # the last step takes a buffer of the whole length the pool holds ready (no new
    # memory, no zero fill); a head alone never takes one (a trickling client would
    # hold a whole resident buffer for 64 KiB of budget)
    pool = BodyPool()
    kept = bytearray(len(body))
    pool.give(kept)
    parser = RequestParser(pool=pool)
    parser.feed(data[:1000])
    parser.events.popleft()
    assert len(parser._body) == FIRST_BODY_BYTES and pool.reused == 0
    parser.feed(data[1000:])
    assert parser.events.popleft() == body and pool.reused == 1


def test_a_body_is_complete_only_when_the_loop_no_longer_holds_its_buffer() -> None:
    """uvloop keeps the buffer it was handed exported until buffer_updated returns; the
    body is handed on (and may be trimmed in place) in that call, so it must not be
    that buffer."""
    parser = RequestParser()
    body = bytes(range(256)) * 1000
    data = post("/infer", body) + post("/next", b"x")
    trimmed = []

    def trim() -> None:
        for event in parser.events:
            if isinstance(event, bytearray) and not trimmed:
                del event[:1]  # raises BufferError were it still exported
                trimmed.append(event)

    feed_held(parser, data, trim)
    assert trimmed == [body[1:]]
    parser.resume()  # the owner is done with /infer: the next request is read from scratch
    assert [e.target for e in parser.events if not isinstance(e, bytearray)] == ["/infer", "/next"]


def test_a_chunked_body_with_extensions_and_trailers_is_joined() -> None:
    data = (
        b"POST /a HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nX-Trailer: y\r\n\r\n"
        b"GET /b HTTP/1.1\r\n\r\n"
    )
    got = requests_of(RequestParser(), data, [7, 13, 2, 40])
    assert [(h.target, b) for h, b in got] == [("/a", b"hello world"), ("/b", b"")]


def test_headers_are_case_insensitive_and_repeated_ones_joined() -> None:
    parser = RequestParser()
    parser.feed(b"GET / HTTP/1.1\r\nAccept: a\r\nACCEPT:  b \r\nX-Empty:\r\n\r\n")
    head = parser.events.popleft()
    assert head.headers == {"accept": "a, b", "x-empty": ""}
    assert head.keep_alive


@pytest.mark.parametrize(
    "data",
    [
        b"GET /v2/health/ready HTTP/1.1\nHost: x\n\n",  # printf | nc
        b"GET /v2/health/ready HTTP/1.1\r\nHost: x\n\r\n",  # a mix
        b"GET /v2/health/ready HTTP/1.1\nHost: x\n\r\n\r\n",  # then an empty CRLF line
    ],
)
def test_a_head_whose_lines_end_in_a_bare_lf_is_read(data: bytes) -> None:
    """It had waited out the header timeout and was closed with no answer at all."""
    got = requests_of(RequestParser(), data + post("/next", b"abc"), [5, 9])
    assert [(h.target, h.headers.get("host"), b) for h, b in got] == [
        ("/v2/health/ready", "x", b""),
        ("/next", "x", b"abc"),
    ]


def test_a_bare_lf_head_with_a_body_starting_in_crlf_and_a_bare_cr_are_told_apart() -> None:
    # the blank line straddles where a CRLF one would start: "4\n\r\n" then "\r\nab"
    got = requests_of(RequestParser(), b"POST / HTTP/1.1\nContent-Length: 4\n\r\n\r\nab")
    assert [b for _, b in got] == [b"\r\nab"]
    with pytest.raises(HttpError):  # one CR goes with its LF; a second is a bare CR
        RequestParser().feed(b"GET / HTTP/1.1\nHost: x\r\r\n\n")


def test_http_1_0_closes_unless_asked_to_keep_alive() -> None:
    parser = RequestParser()
    parser.feed(b"GET / HTTP/1.0\r\n\r\n")
    assert not parser.events.popleft().keep_alive


@pytest.mark.parametrize(
    "connection, kept",
    [("close", False), ("Keep-Alive, Close", False), ("x-not-close", True), ("", True)],
)
def test_connection_is_read_as_tokens_not_as_a_substring(connection: str, kept: bool) -> None:
    parser = RequestParser()
    parser.feed(f"GET / HTTP/1.1\r\nConnection: {connection}\r\n\r\n".encode())
    assert parser.events.popleft().keep_alive is kept


@pytest.mark.parametrize("target", [b"/v2/health/live", b"*", b"http://h/v2", b"HTTP://h/v2"])
def test_origin_absolute_and_asterisk_targets_are_read(target: bytes) -> None:
    parser = RequestParser()
    parser.feed(b"GET " + target + b" HTTP/1.1\r\n\r\n")
    assert parser.events.popleft().target == target.decode()


@pytest.mark.parametrize(
    "data, status",
    [
        (b"POST / HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n", 400),
        (b"POST / HTTP/1.1\r\nContent-Length: +3\r\n\r\n", 400),
        (b"POST / HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\n", 400),
        (b"POST / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n", 501),
        # a bare LF in a trailer field hid a second request from this parser
        (
            b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\nX: y\n\r\n"
            b"GET /v2/repository/index HTTP/1.1\r\nHost: x\r\n\r\n",
            400,
        ),
        # a bare LF inside a chunk extension (where a proxy and this parser part ways)
        (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n2;a\nb\r\n{}\r\n0\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nX: a\r\n folded\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nX: a\x01b\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nBad Name: a\r\n\r\n", 400),
        (b"GET /  HTTP/1.1\r\n\r\n", 400),
        (b"GET v2/health/live HTTP/1.1\r\n\r\n", 400),  # (no leading slash)
        (b"GET / HTTP/2.0\r\n\r\n", 505),
        (b"GET / FTP/1.1\r\n\r\n", 400),
        (b"G(T / HTTP/1.1\r\n\r\n", 400),
        (b"POST / HTTP/1.1\r\nContent-Length: 99999999\r\n\r\n", 413),
        (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400),
        (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabcd", 400),
        (b"GET / HTTP/1.1\r\n" + b"X-A: b\r\n" * 101 + b"\r\n", 431),
        (b"GET / HTTP/1.1\r\nX: " + b"a" * 70_000, 431),
    ],
)
def test_a_malformed_request_is_refused_with_its_status(data: bytes, status: int) -> None:
    with pytest.raises(HttpError) as info:
        RequestParser(max_body=1 << 20).feed(data)
    assert info.value.status == status and info.value.message


@settings(max_examples=300)
@given(st.binary(max_size=300))
def test_random_bytes_raise_nothing_but_http_error(data: bytes) -> None:
    try:
        requests_of(RequestParser(max_body=4096), b"POST / HTTP/1.1\r\n" + data)
    except HttpError:
        pass


def test_a_refused_body_is_dropped_and_the_next_request_read() -> None:
    parser = RequestParser()
    body = b"z" * 100_000
    data = post("/refused", body) + b"GET /next HTTP/1.1\r\n\r\n"
    parser.feed(data[:500])
    assert parser.events.popleft().target == "/refused"
    assert parser.skip_body()
    parser.feed(data[500:])
    head = parser.events.popleft()
    assert head.target == "/next"


def test_responses_by_length_chunked_and_to_the_end_of_the_stream() -> None:
    parser = ResponseParser()
    parser.resume()
    parser.feed(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
    assert parser.events.popleft().status == 200 and parser.events.popleft() == b"ok"
    parser.resume()
    parser.feed(b"HTTP/1.1 503 Busy\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n")
    assert parser.events.popleft().reason == "Busy" and parser.events.popleft() == b"abc"
    parser.resume()
    parser.feed(b"HTTP/1.0 200 OK\r\n\r\nuntil close")
    head = parser.events.popleft()
    assert not parser.events
    parser.end_of_stream()
    assert not head.keep_alive and parser.events.popleft() == b"until close"


@pytest.mark.parametrize("te", ["identity", "chunked, identity", "gzip"])
def test_a_response_transfer_encoding_frames_it_as_rfc_9112_says(te: str) -> None:
    parser = ResponseParser()
    parser.resume()
    parser.feed(
        f"HTTP/1.1 200 OK\r\nTransfer-Encoding: {te}\r\nContent-Length: 2\r\n\r\nok".encode()
    )
    head = parser.events.popleft()
    if te == "identity":  # no coding: the length frames it
        assert bytes(parser.events.popleft()) == b"ok"
    else:  # not chunked last: to the end of the connection
        assert not parser.events
        parser.end_of_stream()
        assert bytes(parser.events.popleft()) == b"ok"
    assert head.status == 200
