"""Bearer-token auth and body limits of a real server process (shutdown: test_server.py)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import numpy as np
import pytest

from shared import v2
from shared.messages import InferRequest
from shared.tensors import Tensor
from tests.support import cloud_server


def _call(
    url: str, body: bytes | None = None, token: str | None = None, headers: dict | None = None
):
    h = dict(headers or {})
    if token:
        h["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(
        url, data=body, headers=h, method="POST" if body is not None else "GET"
    )
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _infer_body(rows: int = 1) -> tuple[bytes, dict]:
    req = InferRequest(inputs=[Tensor.from_array("x", np.ones((rows, 4), np.float32))])
    chunks, hl = v2.encode_request(req)
    return v2.join(chunks), {v2.HEADER_LENGTH: str(hl)}


@pytest.fixture(scope="module")
def guarded(test_repository, tmp_path_factory):
    folder = tmp_path_factory.mktemp("auth")
    (folder / "tokens.txt").write_text(
        "# tokens\nsecret-one\nsecret-two  # full access\n"
        "app-token infer\ncam-token infer softmax,other\nops-token admin\n"
    )
    (folder / "cloud.toml").write_text(
        f'repository = "{test_repository}"\nmodels = ["linear"]\n'
        f'[http]\nport = 0\ntokens_file = "{folder / "tokens.txt"}"\nopen_metrics = false\n'
        "[limits]\nmax_body_bytes = 4096\nmax_elements = 512\n"
    )
    proc = cloud_server(test_repository, "--config", str(folder / "cloud.toml")).start()
    yield proc
    proc.terminate()


def test_requests_without_a_valid_token_are_refused(guarded):
    body, headers = _infer_body()
    url = guarded.http_url + "/v2/models/linear/infer"
    status, payload = _call(url, body, headers=headers)
    assert status == 401 and json.loads(payload)["code"] == "unauthenticated"
    assert _call(url, body, token="wrong", headers=headers)[0] == 401
    assert _call(url, body, token="secret-two", headers=headers)[0] == 200
    assert _call(guarded.http_url + "/metrics")[0] == 401
    assert _call(guarded.http_url + "/metrics", token="secret-one")[0] == 200


def test_health_stays_open_with_auth_on(guarded):
    assert _call(guarded.http_url + "/v2/health/live")[0] == 200
    assert _call(guarded.http_url + "/v2/health/ready")[0] == 200


def test_oversized_body_gets_413_and_the_server_stays_up(guarded):
    body, headers = _infer_body(rows=300)  # 4.8 KB of tensor data > 4096
    status, payload = _call(
        guarded.http_url + "/v2/models/linear/infer", body, token="secret-one", headers=headers
    )
    assert status == 413 and json.loads(payload)["code"] == "payload_too_large"
    doc = {
        "inputs": [
            {
                "name": "x",
                "shape": [1000, 4],
                "datatype": "FP32",
                "parameters": {"binary_data_size": 0},
            }
        ]
    }
    status, payload = _call(
        guarded.http_url + "/v2/models/linear/infer",
        json.dumps(doc).encode(),
        token="secret-one",
        headers={v2.HEADER_LENGTH: str(len(json.dumps(doc)))},
    )
    assert status == 413, payload
    assert _call(guarded.http_url + "/v2/health/live")[0] == 200


@pytest.mark.parametrize(
    "raw",
    [b"Bearer secr\xc3\xa9t", b"Bearer \xff\xfe\x80", "Bearer é".encode("latin-1")],
    ids=["utf8", "invalid-utf8", "latin1"],
)
def test_non_ascii_authorization_header_gets_401(guarded, raw):
    """Header bytes a client sends are not text we control: a wrong token, never a 500."""
    import socket

    port = int(guarded.http_url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        sock.sendall(
            b"GET /v2/models/linear HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            b"Authorization: " + raw + b"\r\n\r\n"
        )
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    status_line, _, rest = reply.partition(b"\r\n")
    assert status_line.split()[1] == b"401", reply[:300]
    assert b'"unauthenticated"' in rest
    assert _call(guarded.http_url + "/v2/health/live")[0] == 200


def test_scoped_tokens_reach_only_their_operations_and_models(guarded):
    body, headers = _infer_body()
    infer = guarded.http_url + "/v2/models/linear/infer"
    index = guarded.http_url + "/v2/repository/index"
    metrics = guarded.http_url + "/metrics"
    assert _call(infer, body, token="app-token", headers=headers)[0] == 200
    status, payload = _call(index, b"{}", token="app-token")
    assert status == 403 and json.loads(payload)["code"] == "permission_denied"
    assert _call(metrics, token="app-token")[0] == 403
    status, payload = _call(infer, body, token="cam-token", headers=headers)
    assert status == 403 and "'linear'" in json.loads(payload)["error"]
    assert _call(index, b"{}", token="ops-token")[0] == 200
    assert _call(metrics, token="ops-token")[0] == 200
    assert _call(infer, body, token="ops-token", headers=headers)[0] == 403
    unload = guarded.http_url + "/v2/repository/models/linear/unload"
    assert _call(unload, b"{}", token="app-token")[0] == 403  # still served below
    # every model's statistics, as far as the token reaches (cam-token had seen all)
    stats = guarded.http_url + "/v2/models/stats"

    def names(token):
        return [e["name"] for e in json.loads(_call(stats, token=token)[1])["model_stats"]]

    assert set(names("app-token")) == {"linear"} and names("cam-token") == []
    assert _call(infer, body, token="secret-one", headers=headers)[0] == 200


def test_without_tokens_the_control_plane_answers_only_this_machine():
    from cloud.http_front import HttpFront
    from shared.aio.http_server import Request
    from shared.http.wire import Head
    from shared.tensors import DEFAULT_LIMITS

    class Plane:  # what admit() asks of the dataplane for an infer route
        def check_servable(self, model, version):
            return None

    front = HttpFront(Plane(), limits=DEFAULT_LIMITS, metrics=lambda: (b"", "text/plain"))

    def admit(method: str, path: str, peer: str):
        head = Head()
        head.method, head.target = method, path
        return front.admit(Request(head, peer))

    remote = admit("POST", "/v2/repository/index", "10.1.2.3")
    assert remote.status == 403 and b"permission_denied" in remote.body
    assert admit("GET", "/metrics", "10.1.2.3").status == 403
    # the scope follows the route, not the path's text (extra slashes had read as an
    # inference path, and a remote caller loaded and unloaded models)
    for path in ("//v2/repository/index", "/v2/repository/index/", "//metrics", "/metrics/"):
        assert admit("POST" if "index" in path else "GET", path, "10.1.2.3").status == 403, path
    assert admit("POST", "/v2/repository/index", "127.0.0.1") is None
    assert admit("POST", "/v2/repository/index", "::1") is None
    assert admit("POST", "/v2/models/m/infer", "10.1.2.3") is None
    assert admit("GET", "/v2/health/live", "10.1.2.3") is None


def test_secrets_stay_out_of_reprs(tmp_path):
    from edge.config import CloudEndpoints
    from shared.mqtt import parse_broker_url
    from shared.tokens import parse_tokens

    tokens = parse_tokens("hunter2 admin\nother-secret infer m\n", "t.txt")
    assert "hunter2" not in repr(tokens) and "hunter2" not in repr(tokens.grants)
    broker = parse_broker_url("mqtt://edge:pa55word@broker:1883")
    assert broker.password == "pa55word" and "pa55word" not in repr(broker)
    cloud = CloudEndpoints(http_url="http://c", token="tok-secret", mqtt_password="mq-secret")
    assert "tok-secret" not in repr(cloud) and "mq-secret" not in repr(cloud)


def test_a_malformed_tokens_line_is_a_config_error_naming_the_line():
    from shared.errors import ConfigError
    from shared.tokens import parse_tokens

    with pytest.raises(ConfigError, match="line 2"):
        parse_tokens("good\nbad superuser\n", "tokens.txt")


def test_a_tokens_file_every_user_can_read_is_warned_of(tmp_path, caplog):
    from shared.tokens import load_tokens

    path = tmp_path / "tokens.txt"
    path.write_text("secret admin\n")
    path.chmod(0o600)
    with caplog.at_level("WARNING"):
        load_tokens(path)
    assert "readable by every user" not in caplog.text
    path.chmod(0o644)
    with caplog.at_level("WARNING"):
        assert load_tokens(path).find(b"secret") is not None
    assert "readable by every user" in caplog.text


def _rotate(path, text: str) -> None:
    """Replace the file the way an operator's tooling does: write aside, rename over."""
    aside = path.with_suffix(".new")
    aside.write_text(text)
    aside.chmod(0o600)
    aside.replace(path)


def _until(condition, seconds: float = 15.0) -> bool:
    import time

    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.1)
    return False


def test_a_token_removed_from_the_tokens_file_is_refused_without_a_restart(
    test_repository, tmp_path
):
    # The node read its tokens file once, at start: a leaked token, removed from the
    # file, went on working until someone restarted the node.
    tokens = tmp_path / "tokens.txt"
    _rotate(tokens, "old-token infer\nops admin\n")
    proc = cloud_server(test_repository, "--models", "linear", "--tokens-file", str(tokens)).start()
    try:
        body, headers = _infer_body()
        url = proc.http_url + "/v2/models/linear/infer"
        assert _call(url, body, token="old-token", headers=headers)[0] == 200
        _rotate(tokens, "new-token infer\nops admin\n")
        assert _until(lambda: _call(url, body, token="old-token", headers=headers)[0] == 401)
        assert _call(url, body, token="new-token", headers=headers)[0] == 200
        # a broken edit keeps the tokens in use (neither locked out nor opened up)
        _rotate(tokens, "new-token superuser\n")
        assert _until(lambda: "keeping the 2 tokens in use" in proc.output())
        assert _call(url, body, token="new-token", headers=headers)[0] == 200
        assert _call(url, body, headers=headers)[0] == 401
    finally:
        proc.terminate()


def test_the_tokens_file_is_followed_by_its_contents_not_only_its_name(tmp_path):
    from shared.tokens import TokensFile

    path = tmp_path / "tokens.txt"
    _rotate(path, "a infer\n")
    followed = TokensFile(path)
    assert followed.refresh() is None  # unchanged
    _rotate(path, "b infer\n")
    fresh = followed.refresh()
    assert fresh is not None and fresh.find(b"b") and not fresh.find(b"a")
    path.unlink()  # (mid-rotation): the tokens in use stay
    assert followed.refresh() is None and followed.tokens.find(b"b")
    _rotate(path, "c admin\n")
    assert followed.refresh().find(b"c").scopes == {"admin"}
