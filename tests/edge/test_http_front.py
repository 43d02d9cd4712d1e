import pytest

from edge.http_front import _steering
from shared.errors import InvalidInput


@pytest.mark.parametrize(
    "params",
    [{"timeout": "soon"}, {"timeout": -5}, {"timeout": 1.5}, {"deadline_ms": 0}, {"priority": -1}],
)
def test_bad_steering_parameters_are_a_clear_400_not_a_crash(params):
    with pytest.raises(InvalidInput):
        _steering(dict(params))


def test_tritons_timeout_in_microseconds_becomes_the_deadline():
    params = {"timeout": 250_000, "other": 1}
    assert _steering(params) == (250.0, None, False)
    assert params == {"other": 1}  # steering keys are not forwarded to the cloud


async def test_the_local_api_takes_an_optional_token_and_keeps_health_open(tmp_path):
    import aiohttp

    from edge.http_front import start_local_api
    from shared.tokens import parse_tokens

    class _Agent:
        ready = True

        async def status(self):
            return {"ok": True}

    tokens = parse_tokens("app infer\nops admin\n", "tokens.txt")
    server = await start_local_api(_Agent(), "127.0.0.1", 0, tokens=tokens)
    base = f"http://127.0.0.1:{server.port}"
    async with aiohttp.ClientSession(base) as client:
        assert (await client.get("/v2/health/live")).status == 200
        assert (await client.get("/v2/agent/status")).status == 401
        ok = await client.get("/v2/agent/status", headers={"Authorization": "Bearer app"})
        assert ok.status == 200
        link = await client.post("/v2/agent/link", json={}, headers={"Authorization": "Bearer app"})
        assert link.status == 403 and (await link.json())["code"] == "permission_denied"
    import asyncio

    for path in (b"//v2/agent/link", b"/v2/agent/link/"):  # (had read as an infer path)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(
            b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer app\r\n"
            b"Content-Length: 2\r\nConnection: close\r\n\r\n{}"
        )
        assert (await reader.read(100)).startswith(b"HTTP/1.1 403"), path
        writer.close()
    await server.close()


async def test_a_version_that_is_not_a_plain_number_is_refused_before_anything_runs():
    """The agent put the URL's version into its request to the cloud: a CRLF in it (a
    percent-encoded one, decoded by the router) smuggled whole requests there, under
    the agent's own token."""
    import asyncio

    from edge.http_front import start_local_api

    class _Agent:
        ready = True

    server = await start_local_api(_Agent(), "127.0.0.1", 0)
    injected = b"1%20HTTP%2F1.1%0D%0AHost%3A%20x%0D%0A%0D%0APOST%20%2Fv2%2Frepository%2Findex"
    try:
        for route in (b"", b"/config", b"/ready", b"/infer"):
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            method = b"POST" if route == b"/infer" else b"GET"
            writer.write(
                method + b" /v2/models/m/versions/" + injected + route + b" HTTP/1.1\r\n"
                b"Host: x\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}"
            )
            answer = await reader.read(4096)
            assert answer.startswith(b"HTTP/1.1 400"), answer[:200]
            assert b"plain non-negative integer" in answer
            writer.close()
    finally:
        await server.close()


async def test_the_local_api_caps_its_connections_below_the_descriptor_limit(monkeypatch):
    # Uncapped, ~1000 idle connections used up the descriptors: accept() failed in a
    # loop (100% CPU, megabytes of log a second) and health went unanswered.
    import asyncio

    from edge import http_front

    class _Agent:
        ready = True

    monkeypatch.setattr(http_front, "default_max_connections", lambda: 2)
    server = await http_front.start_local_api(_Agent(), "127.0.0.1", 0)
    try:
        held = [await asyncio.open_connection("127.0.0.1", server.port) for _ in range(2)]
        for _, w in held:  # busy (half a head): an idle one would make room for a newcomer
            w.write(b"GET / HTTP/1.1\r\nHost")
        await asyncio.sleep(0.05)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /v2/health/live HTTP/1.1\r\n\r\n")
        assert (await reader.read(100)).startswith(b"HTTP/1.1 503")
        writer.close()
        for _, w in held:
            w.close()
        await asyncio.sleep(0.05)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /v2/health/live HTTP/1.1\r\n\r\n")
        assert (await reader.read(100)).startswith(b"HTTP/1.1 200")
        writer.close()
    finally:
        await server.close()


async def test_the_local_api_bounds_the_request_bytes_it_holds_at_once():
    """Only the connection cap times 16 MiB had bounded them: more than a device holds.
    Two uploads that trickle hold the budget; a third is refused from its head."""
    import asyncio

    from edge import http_front

    class _Agent:
        ready = True

    server = await http_front.start_local_api(
        _Agent(), "127.0.0.1", 0, max_inflight_bytes=256 << 10
    )
    try:
        path = b"POST /v2/models/m/infer HTTP/1.1\r\nContent-Length: %d\r\n\r\n"
        held = []
        for _ in range(2):  # each declares 10 MB and sends 100 KB: charged as it comes
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(path % (10 << 20) + b"x" * (100 << 10))
            held.append(writer)
        await asyncio.sleep(0.2)
        assert server.app.bodies.budget.used > 0
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(path % (1 << 20))
        head = await asyncio.wait_for(reader.read(400), 5)
        assert head.startswith(b"HTTP/1.1 503") and b"overloaded" in head
        writer.close()
        for w in held:
            w.close()
        await asyncio.sleep(0.2)
        assert server.app.bodies.budget.used == 0  # given back as the uploads ended
    finally:
        await server.close()


async def test_a_model_limited_token_sees_its_models_only_in_the_index_and_statistics():
    """The all-models statistics and the repository index had shown a token limited to
    one model every other model's names and traffic."""
    import aiohttp

    from edge.http_front import start_local_api
    from shared.tokens import parse_tokens

    class _Plane:
        def repository_index(self):
            return [{"name": "a", "state": "READY"}, {"name": "b", "state": "READY"}]

        def model_stats(self, name, version):
            return {"model_stats": [{"name": "a"}, {"name": "b"}]}

    class _Agent:
        ready = True
        dataplane = _Plane()

    tokens = parse_tokens("cam infer a\nall infer\n", "tokens.txt")
    server = await start_local_api(_Agent(), "127.0.0.1", 0, tokens=tokens)
    base = f"http://127.0.0.1:{server.port}"
    try:
        async with aiohttp.ClientSession(base) as client:
            for token, names in (("cam", ["a"]), ("all", ["a", "b"])):
                auth = {"Authorization": f"Bearer {token}"}
                index = await (await client.post("/v2/repository/index", headers=auth)).json()
                stats = await (await client.get("/v2/models/stats", headers=auth)).json()
                assert [e["name"] for e in index] == names
                assert [e["name"] for e in stats["model_stats"]] == names
    finally:
        await server.close()
