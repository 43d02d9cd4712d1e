"""Coverage-guided fuzz targets for every decoder that reads bytes from outside.

Each target is a libFuzzer-style ``TestOneInput(data: bytes)``: a
:class:`~shared.errors.FerryError` is the expected answer to bad input, and
any other exception escaping a decoder is a bug (so it propagates, and
atheris reports the input as a crash).  Inputs a decoder accepts are also
re-encoded and decoded again, the way the edge agent forwards a request it
decoded: a decoder must not accept what its own encoder cannot carry.

Run one target under atheris (the code under test is instrumented as it is
imported, so only when this module is ``__main__``)::

    python -m tests.fuzz.harnesses v2_json -max_total_time=60 CORPUS_DIR

(a file in place of the folder replays that one input).  Mutation is
structure-aware (:func:`mutate`, atheris's custom mutator): the JSON and
MessagePack decoders are C code atheris cannot see into, so byte flips alone
rarely get past them.  ``seeds(target)`` builds the seed corpus from valid documents.  The config
targets write each input to a scratch folder (``FERRY_FUZZ_SCRATCH``, or a
temporary one), because their parsers read files.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import struct
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

#: packages whose code is instrumented for coverage (and comparison) feedback
INSTRUMENTED = ["shared", "cloud", "edge", "devices", "tomllib", "urllib.parse"]


def _instrumentation() -> contextlib.AbstractContextManager:
    if __name__ != "__main__":
        return contextlib.nullcontext()
    import atheris

    return atheris.instrument_imports(include=INSTRUMENTED)


with _instrumentation():
    import numpy as np

    from cloud.config import load_config
    from edge.config import load_agent_config, load_policy_file
    from shared import envelope, v2
    from shared.datatypes import DATATYPES, numpy_dtype
    from shared.errors import FerryError, InvalidInput, Overloaded
    from shared.messages import InferRequest, InferResponse, RequestedOutput
    from shared.repository.config import parse_config, parse_config_json
    from shared.tensors import Tensor

# ---- helpers ---------------------------------------------------------------------------

#: asks for every output as binary data, so a response round trip is lossless
_ALL_BINARY = InferRequest(inputs=[], parameters={"binary_data_output": True})
_scratch_dir: Path | None = None


def _scratch(name: str) -> Path:
    global _scratch_dir
    folder = os.environ.get("FERRY_FUZZ_SCRATCH")
    if folder:
        return Path(folder) / name
    if _scratch_dir is None:
        _scratch_dir = Path(tempfile.mkdtemp(prefix="ferry-fuzz-"))
    return _scratch_dir / name


def _same_tensors(what: str, a: list[Tensor], b: list[Tensor]) -> None:
    """Bit-exact equality after a binary round trip (names, types, shapes, bytes)."""
    assert len(a) == len(b), f"{what}: {len(a)} tensors became {len(b)}"
    for x, y in zip(a, b, strict=True):
        assert (x.name, x.datatype, x.shape) == (y.name, y.datatype, y.shape), (
            f"{what}: {(x.name, x.datatype, x.shape)} became {(y.name, y.datatype, y.shape)}"
        )
        if x.datatype == "BYTES":
            same = [bytes(v) for v in x.data.reshape(-1)] == [bytes(v) for v in y.data.reshape(-1)]
        else:
            same = np.ascontiguousarray(x.data).tobytes() == np.ascontiguousarray(y.data).tobytes()
        assert same, f"{what}: the data of {x.name!r} changed"


@contextlib.contextmanager
def _must_not_fail(what: str):
    """Inside, a FerryError is a bug too: the input was already accepted."""
    try:
        yield
    except FerryError as exc:
        raise AssertionError(f"accepted, but {what} failed: {exc!r}") from exc


def _expected(fn: Callable[[], object]) -> None:
    """Run ``fn``; a FerryError is the expected outcome for bad input."""
    with contextlib.suppress(FerryError):
        fn()


# ---- V2 (KServe / Triton HTTP) ---------------------------------------------------------


def _v2_request(body: bytes, header_length: int | None) -> None:
    request = v2.decode_request(body, header_length)
    v2.decode_needs_worker(body, header_length)
    with _must_not_fail("re-encoding the request (binary V2)"):
        chunks, hl = v2.encode_request(request)
        again = v2.decode_request(v2.join(chunks), hl)
    _same_tensors("V2 request", request.inputs, again.inputs)
    # the edge forwards a request it decoded over MQTT (with an id of its own)
    with _must_not_fail("forwarding the request over MQTT"):
        request.id = request.id or "fuzz"
        relayed = envelope.decode_request(envelope.encode_request(request))
    _same_tensors("V2 request over MQTT", request.inputs, relayed.inputs)


def _v2_response(body: bytes, header_length: int | None) -> None:
    response = v2.decode_response(body, header_length)
    with _must_not_fail("re-encoding the response (binary V2)"):
        chunks, hl = v2.encode_response(response, _ALL_BINARY)
        again = v2.decode_response(v2.join(chunks), hl)
    _same_tensors("V2 response", response.outputs, again.outputs)


def v2_json(data: bytes) -> None:
    """A V2 request and response body as plain JSON (no header length)."""
    _expected(lambda: _v2_request(data, None))
    _expected(lambda: _v2_response(data, None))


def v2_binary(data: bytes) -> None:
    """A binary V2 body; the first two bytes (big-endian) are the header length.

    0 stands for "no Inference-Header-Content-Length" and any other value is
    passed on as is (past the body too: the decoder must refuse it).
    """
    if len(data) < 2:
        return
    (length,) = struct.unpack(">H", data[:2])
    body = data[2:]
    header_length = length or None
    _expected(lambda: v2.parse_header_length(str(length), len(body)))
    _expected(lambda: _v2_request(body, header_length))
    _expected(lambda: _v2_response(body, header_length))


# ---- the MQTT MessagePack envelope -----------------------------------------------------


def _envelope_request(payload: bytes) -> None:
    request = envelope.decode_request(payload)
    with _must_not_fail("re-encoding the request (MessagePack)"):
        again = envelope.decode_request(envelope.encode_request(request))
    _same_tensors("MQTT request", request.inputs, again.inputs)


def _envelope_reply(payload: bytes) -> None:
    rid, reply = envelope.decode_reply(payload)
    with _must_not_fail("re-encoding the reply (MessagePack)"):
        if isinstance(reply, InferResponse):
            rid2, again = envelope.decode_reply(envelope.encode_reply(reply))
            assert isinstance(again, InferResponse), again
            _same_tensors("MQTT reply", reply.outputs, again.outputs)
        else:
            rid2, again = envelope.decode_reply(envelope.encode_error_reply(rid, reply))
            assert isinstance(again, FerryError) and again.code == reply.code, (reply, again)
    assert rid2 == rid, (rid, rid2)


def envelope_msgpack(data: bytes) -> None:
    """An MQTT request and reply payload (MessagePack)."""
    envelope.peek_request_id(data)  # best effort: must never raise at all
    envelope.decode_needs_worker(data)
    _expected(lambda: _envelope_request(data))
    _expected(lambda: _envelope_reply(data))


# ---- configuration files ---------------------------------------------------------------


def model_config_toml(data: bytes) -> None:
    """A model's ``config.toml``, read from a file as the repository does."""
    path = _scratch("config.toml")
    path.write_bytes(data)
    _expected(lambda: parse_config(path, "m"))


def model_config_json(data: bytes) -> None:
    """The JSON ``config`` override of a load request (any str, lone surrogates too)."""
    _expected(lambda: parse_config_json(data.decode("utf-8", "surrogateescape"), "m"))


def cloud_config_toml(data: bytes) -> None:
    """A cloud node's ``cloud.toml``."""
    path = _scratch("cloud.toml")
    path.write_bytes(data)
    _expected(lambda: load_config(path, {}))


def edge_config_toml(data: bytes) -> None:
    """An edge agent's ``agent.toml`` (whole, and as a policy file)."""
    path = _scratch("agent.toml")
    path.write_bytes(data)
    _expected(lambda: load_agent_config(path))
    _expected(lambda: load_policy_file(path))


TARGETS: dict[str, Callable[[bytes], None]] = {
    "v2_json": v2_json,
    "v2_binary": v2_binary,
    "envelope": envelope_msgpack,
    "model_config_toml": model_config_toml,
    "model_config_json": model_config_json,
    "cloud_config_toml": cloud_config_toml,
    "edge_config_toml": edge_config_toml,
}


# ---- seed corpus: valid documents ------------------------------------------------------


def sample_tensors(text_bytes: bool = False) -> list[Tensor]:
    """One small tensor of every datatype, plus a scalar, an empty and a 3-d one.

    ``text_bytes`` keeps BYTES elements UTF-8 (JSON carries them as strings).
    """
    out = []
    for i, datatype in enumerate(sorted(DATATYPES)):
        name = f"t_{datatype.lower()}"
        if datatype == "BYTES":
            items = [b"cat", b"", "\u00e9t\u00e9".encode()]
            if not text_bytes:
                items.append(b"\x00\xff\xfe")
            arr = np.empty(len(items), dtype=object)
            arr[:] = items
        elif datatype == "BOOL":
            arr = np.array([[True, False], [False, True]])
        else:
            arr = (np.arange(6).reshape(2, 3) - i).astype(np.float64)
            if numpy_dtype(datatype).kind == "u":
                arr = np.abs(arr)
            if numpy_dtype(datatype).kind == "f" or datatype == "BF16":
                arr = arr * 0.5
            arr = arr.astype(numpy_dtype(datatype))
        out.append(Tensor(name, datatype, arr))
    out.append(Tensor("scalar", "FP32", np.array(1.5, np.float32)))
    out.append(Tensor("empty", "INT64", np.zeros((0, 4), np.int64)))
    out.append(Tensor("cube", "FP16", np.ones((2, 2, 2), np.float16)))
    return out


def _v2_bodies(binary: bool) -> list[tuple[bytes, int | None]]:
    ts = sample_tensors(text_bytes=not binary)
    groups = [ts, *([t] for t in ts)]
    bodies = []
    for group in groups:
        request = InferRequest(
            inputs=group,
            id="req-1",
            outputs=[RequestedOutput("y", binary), RequestedOutput("z")],
            parameters={"priority": 1, "timeout": 5000, "idempotency_key": "k"},
        )
        chunks, hl = v2.encode_request(request, binary_inputs=binary, binary_outputs=binary)
        bodies.append((v2.join(chunks), hl))
        response = InferResponse("m", group, "1", "req-1", {"node": "n1", "queue_us": 3})
        want = _ALL_BINARY if binary else None
        chunks, hl = v2.encode_response(response, want)
        bodies.append((v2.join(chunks), hl))
    return bodies


def _v2_json_seeds() -> list[bytes]:
    seeds = [body for body, _ in _v2_bodies(binary=False)]
    seeds += [
        json.dumps(doc).encode()
        for doc in (
            {
                "inputs": [
                    {"name": "x", "shape": [2, 2], "datatype": "INT32", "data": [[1, 2], [3, 4]]}
                ]
            },
            {
                "inputs": [
                    {"name": "x", "shape": [2], "datatype": "FP32", "data": ["NaN", "-Infinity"]}
                ]
            },
            {"inputs": [{"name": "b", "shape": [1], "datatype": "BYTES", "data": ["text"]}]},
            {"inputs": [{"name": "h", "shape": [1], "datatype": "BF16", "data": [1.5]}]},
            {
                "model_name": "m",
                "outputs": [{"name": "y", "shape": [1], "datatype": "FP16", "data": [0.25]}],
            },
        )
    ]
    return seeds


def _v2_binary_seeds() -> list[bytes]:
    return [struct.pack(">H", hl or 0) + body for body, hl in _v2_bodies(binary=True)]


def _envelope_seeds() -> list[bytes]:
    ts = sample_tensors()
    seeds = []
    for group in [ts, *([t] for t in ts)]:
        request = InferRequest(
            inputs=group,
            id="req-1",
            model_version="2",
            outputs=[RequestedOutput("y")],
            parameters={"priority": 1, "deadline_ms": 250},
        )
        seeds.append(envelope.encode_request(request))
        seeds.append(envelope.encode_reply(InferResponse("m", group, "1", "req-1", {"node": "n"})))
    seeds.append(envelope.encode_error_reply("req-1", InvalidInput("bad shape")))
    seeds.append(envelope.encode_error_reply("req-1", Overloaded("busy", retry_after=0.25)))
    return seeds


MODEL_CONFIGS = [
    """backend = "openvino"
max_batch_size = 32
[[input]]
name = "x"
datatype = "FP32"
dims = [3, 224, 224]
[[output]]
name = "probs"
datatype = "FP32"
dims = [4]
[[output]]
name = "label"
datatype = "BYTES"
dims = [-1]
[dynamic_batching]
max_queue_delay_us = 2000
preferred_batch_sizes = [16, 8, 8]
max_queue_size = 256
priority_levels = 3
default_priority_level = 2
default_timeout_us = 50000
[instance_group]
count = 2
kind = "gpu"
[version_policy]
specific = [3, 1]
[runtime]
threads = 2
precision_hint = "f32"
allow_spinning = true
""",
    """backend = "onnxruntime"
max_batch_size = 16
[[input]]
name = "x"
datatype = "FP16"
dims = [4]
[[output]]
name = "y"
datatype = "BF16"
dims = [3]
[dynamic_batching]
max_queue_delay_us = 20000
preferred_batch_sizes = [16]
[version_policy]
all = true
[runtime]
threads = 1
""",
    "[instance_group]\ncount = 2\n[version_policy]\nlatest = 2\n[runtime]\nprecision_hint = 'bf16'\n",
    "",
]

CLOUD_CONFIGS = [
    """repository = "repo"
node = "n1"
models = ["linear", "auto"]
shutdown_grace_s = 5.5
strict_readiness = false
idempotency_ttl_s = 30
idempotency_max_entries = 100
[http]
host = "0.0.0.0"
port = 8000
open_metrics = false
enabled = true
[mqtt]
url = "mqtts://user:pass@broker.example:8883"
username = "node"
client_id = "node-1"
tls_insecure = true
status_interval_s = 2.5
keepalive_s = 20
[limits]
max_body_bytes = 1048576
max_json_body_bytes = 65536
max_elements = 100000
max_tensors = 8
max_dims = 4
max_name_length = 64
max_queue_size = 128
max_inflight_mqtt = 64
""",
    'repository = "r"\nmodels = ["*"]\n[http]\nenabled = false\n[mqtt]\nurl = "mqtt://127.0.0.1:1883"\n',
    'repository = "r"\n[mqtt]\nurl = "tcp://[::1]:1883"\npassword_file = "missing"\n',
    'repository = "r"\n[http]\nport = 0\ntokens_file = "tokens"\n',
]

EDGE_CONFIGS = [
    """repository = "repository"
state_dir = "state"
device = "raspberry-pi-4b"
local_threads = 2
probe_interval_s = 2.5
[api]
host = "127.0.0.1"
port = 8080
enabled = true
[cloud]
mqtt = "mqtt://user:pw@127.0.0.1:1883"
http = "https://cloud.example:8443"
tls_insecure = false
[links]
mqtt = "lte"
http = "wifi"
[store]
ttl_s = 3600
keep_results_s = 7200.5
max_attempts = 3
[policy]
deadline_ms = 500
deadline_quantile = 0.9
battery_floor_percent = 20
data_cap_mb_per_day = 100
explore_after_s = 30
[policy.weights]
latency_s = 1.0
energy_j = 0.05
data_mb = 0.01
money = 2
[models.orientation]
local = "orientation-int8"
cloud = "orientation"
mode = "cascade"
deadline_ms = 300
cascade_threshold = 0.7
cascade_output = "probs"
transports = ["mqtt", "http"]
output_bytes = 64
[models.remote]
cloud = "big"
mode = "cloud"
[emulation]
local_slowdown = 2.0
local_latency_ms = 5
""",
    """# An edge agent for the example repository.
repository = "repository"
state_dir = "../.ferry-edge"
device = "x86-laptop"
[api]
enabled = false
[cloud]
http = "http://127.0.0.1:8000"
token_file = "token"
ca_file = "ca.pem"
[links]
http = "3g"
[models.m]
local = "a"
mode = "local"
""",
]


def seeds(target: str) -> list[bytes]:
    """The seed corpus of ``target``: valid documents (and a few near misses)."""
    if target == "v2_json":
        return _v2_json_seeds()
    if target == "v2_binary":
        return _v2_binary_seeds()
    if target == "envelope":
        return _envelope_seeds()
    if target == "model_config_toml":
        return [text.encode() for text in MODEL_CONFIGS]
    if target == "model_config_json":
        import tomllib

        return [json.dumps(tomllib.loads(text)).encode() for text in MODEL_CONFIGS]
    if target == "cloud_config_toml":
        return [text.encode() for text in CLOUD_CONFIGS]
    if target == "edge_config_toml":
        return [text.encode() for text in EDGE_CONFIGS]
    raise KeyError(target)


# ---- structure-aware mutation ----------------------------------------------------------
#
# msgspec and json are C code that atheris cannot see into, so byte-level mutation alone
# mostly produces documents that fail to parse.  These mutators parse the input, change
# one thing in its structure (a value swapped for an adversarial one, a key added or
# dropped, a node copied or nested deeply, binary sizes re-aligned so the tensor checks
# are reached) and serialise it again; now and then they mutate bytes instead.  The live
# fuzz tests use them too, with a plain-Python byte mutator.

#: keys of every decoded document, for inserting keys where they do not belong
KEYS = [
    "id", "name", "shape", "datatype", "data", "parameters", "inputs", "outputs",
    "binary_data_size", "binary_data", "binary_data_output", "model_name", "model_version",
    "error", "code", "message", "retry_after_ms", "priority", "timeout", "idempotency_key",
]  # fmt: skip

_HUGE = [2**24, 2**24 + 1, 2**31, 2**32, 2**53, 2**63 - 1, 2**63, 2**64 - 1]
#: values a document can carry in any format (MessagePack adds bytes, NaN and infinities)
ADVERSARIAL: list[object] = [
    None, True, False, 0, 1, -1, 3, 255, 256, 65536, *_HUGE, -(2**31), -(2**63),
    0.5, -0.0, 1e308, 5e-324, "", "x", "y", "NaN", "Infinity", "-Infinity", "\u00e9",
    "\x00", "a" * 300, *sorted(DATATYPES), "FP8", "bytes", [], {}, [0], [[]], [-1],
    [0, 2**63 - 1], [2**24, 2**24], [1, 2, 3], [[1, 2], [3]], [True], ["a", "b"],
    {"binary_data_size": 0}, {"binary_data": True}, {"code": "overloaded", "message": "m"},
]  # fmt: skip
_JSON_ONLY: list[object] = [10**30, -(10**30), 2**64, -(2**63) - 1]
_MSGPACK_ONLY: list[object] = [
    b"", b"\x00", b"\xff" * 8, b"\x01\x00\x00\x00a", b"\xff\xff\xff\x7f", float("nan"),
    float("inf"), b"\x03\x00\x00\x00abc" * 3,
]  # fmt: skip

#: TOML values and lines for the configuration targets
TOML_VALUES = [
    "0", "-1", "1", "2", "65536", "99999", "9223372036854775807", "-9223372036854775808",
    "nan", "inf", "-inf", "0.5", "1e300", "true", "false", '""', '"x"', '"\\u0000"',
    '"/"', '"."', '"a.toml"', '"mqtt://[::1"', '"mqtt://h:99999"', '"http://["',
    '"mqtts://u:p@h:8883"', '"http://h:1"', '"wifi"', '"x86-laptop"', '"cascade"', '"local"',
    '"cloud"', '"cost"', '"gpu"', '"cpu"', '"f16"', '"FP32"', '"BYTES"', '"onnxruntime"',
    "[]", "[1, -1]", "[0]", '["mqtt", "http"]', '["*"]', "[[1]]", "{}", "{ a = 1 }",
    "1979-05-27T07:32:00Z", "07:32:00", '"""\nx"""',
]  # fmt: skip


def _nodes(doc: object, path: tuple = ()) -> list[tuple]:
    """Every path into ``doc`` (dict keys and list indices), the root's included."""
    out = [path]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _nodes(v, (*path, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _nodes(v, (*path, i))
    return out


def _get(doc: object, path: tuple) -> object:
    for step in path:
        doc = doc[step]  # type: ignore[index]
    return doc


def _set(doc: object, path: tuple, value: object) -> object:
    if not path:
        return value
    _get(doc, path[:-1])[path[-1]] = value  # type: ignore[index]
    return doc


def _value(rng: random.Random, doc: object, msgpack: bool) -> object:
    pool = ADVERSARIAL + (_MSGPACK_ONLY if msgpack else _JSON_ONLY)
    roll = rng.random()
    if roll < 0.15:  # a copy of another node of the document
        return json.loads(json.dumps(_get(doc, rng.choice(_nodes(doc))), default=list))
    if roll < 0.25:
        return [rng.choice(pool) for _ in range(rng.randint(0, 6))]
    if roll < 0.3:
        return rng.randint(-(2**64), 2**64) if not msgpack else rng.randint(-(2**63), 2**64 - 1)
    return rng.choice(pool)


def _dims(rng: random.Random) -> list[int]:
    return [rng.choice([0, 1, 2, 3, 4, 7]) for _ in range(rng.randint(0, 3))]


def _element(rng: random.Random, datatype: str) -> object:
    if datatype == "BYTES":
        return rng.choice(["", "a", "\u00e9t\u00e9", "x" * 40, 1, None])
    if datatype == "BOOL":
        return rng.choice([True, False, 0, 1, 2])
    if datatype.startswith(("FP", "BF")):
        return rng.choice([0.5, -1.0, 1e38, 1e39, 65504.0, 70000.0, "NaN", "Infinity", 1])
    return rng.choice([0, 1, -1, 127, 128, 255, 256, 65535, 2**31, 2**63 - 1, 2**64 - 1, 0.5])


def _tensor_dicts(doc: object) -> list[dict]:
    if not isinstance(doc, dict):
        return []
    items = [t for key in ("inputs", "outputs") for t in (doc.get(key) or [])]
    return [t for t in items if isinstance(t, dict)]


def _count(rng: random.Random, shape: object) -> int:
    """Elements of ``shape`` when small; a few when it is not (inputs stay under 4 KiB)."""
    count = 1
    for dim in shape if isinstance(shape, list) else []:
        count *= dim if isinstance(dim, int) and 0 <= dim <= 64 else 1
    return count if count <= 256 else rng.randint(0, 8)


def _raw_tensor(rng: random.Random, datatype: object, shape: object) -> bytes:
    """Bytes for ``shape`` x ``datatype`` (BYTES: length-prefixed, sometimes wrong)."""
    count = _count(rng, shape)
    if datatype == "BYTES":
        out = b""
        for _ in range(count):
            item = rng.choice([b"", b"a", b"\xff\xfe", b"abc" * 5])
            size = len(item) if rng.random() < 0.9 else rng.choice([2**31, 2**32 - 1, 99])
            out += struct.pack("<I", size) + item
        return out
    try:
        size = numpy_dtype(datatype).itemsize if isinstance(datatype, str) else 4
    except FerryError:
        size = 4
    if datatype == "BOOL":
        return bytes(rng.choice([0, 1, 1, 2]) for _ in range(count))
    return bytes(rng.getrandbits(8) for _ in range(count * size))


def _repair(rng: random.Random, doc: object, binary: bool) -> bytes:
    """Make data agree with shape again (new random values), so deeper checks run."""
    blob = b""
    for t in _tensor_dicts(doc):
        if rng.random() < 0.5:
            t["shape"] = _dims(rng)
        shape, datatype = t.get("shape"), t.get("datatype")
        params = t.get("parameters")
        if binary and (
            (isinstance(params, dict) and "binary_data_size" in params) or "data" not in t
        ):
            raw = _raw_tensor(rng, datatype, shape)
            t.pop("data", None)
            t["parameters"] = {**(params if isinstance(params, dict) else {})}
            t["parameters"]["binary_data_size"] = len(raw)
            blob += raw
        else:
            t["data"] = [_element(rng, str(datatype)) for _ in range(_count(rng, shape))]
    return blob


def _mutate_doc(rng: random.Random, doc: object, msgpack: bool) -> object:
    paths = _nodes(doc)
    path = rng.choice(paths)
    node = _get(doc, path)
    op = rng.random()
    if op < 0.45:
        return _set(doc, path, _value(rng, doc, msgpack))
    if op < 0.6 and isinstance(node, dict):
        node[rng.choice(KEYS)] = _value(rng, doc, msgpack)
    elif op < 0.7 and path:
        parent = _get(doc, path[:-1])
        del parent[path[-1]]  # type: ignore[attr-defined]
    elif op < 0.8 and isinstance(node, list) and node:
        node.append(json.loads(json.dumps(rng.choice(node), default=list)))
    elif op < 0.85:  # deep nesting: each decoder must refuse it, not overflow the stack
        depth = rng.choice([10, 100, 1000, 1500])
        for _ in range(depth):
            node = [node] if rng.random() < 0.8 else {"k": node}
        return _set(doc, path, node)
    elif isinstance(node, str) and node:
        i = rng.randrange(len(node))
        return _set(doc, path, node[:i] + rng.choice(["", "\x00", "\u00e9", node]) + node[i + 1 :])
    else:
        return _set(doc, path, _value(rng, doc, msgpack))
    return doc


def _json_dumps(doc: object) -> bytes:
    return json.dumps(doc, default=list).encode("utf-8", "surrogatepass")


def byte_mutate(data: bytes, max_size: int, rng: random.Random) -> bytes:
    """Plain-Python byte-level mutation (flips, inserts, deletes, splices)."""
    buf = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(6)
        i = rng.randrange(len(buf) + 1)
        if op == 0 and buf:
            j = min(i, len(buf) - 1)
            buf[j] ^= 1 << rng.randrange(8)
        elif op == 1:
            buf[i:i] = bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 8)))
        elif op == 2:
            del buf[i : i + rng.randint(1, 16)]
        elif op == 3 and buf:
            j = rng.randrange(len(buf))
            buf[i:i] = buf[j : j + rng.randint(1, 32)]
        elif op == 4:
            buf[i:i] = rng.choice(
                [b"-1", b"0", b"1e999", b"NaN", b"null", b"[", b"{", b'"', b"\xff"]
            )
        else:
            buf = buf[: rng.randrange(len(buf) + 1)]
    return bytes(buf[:max_size])


def mutate(
    target: str,
    data: bytes,
    rng: random.Random,
    max_size: int = 4096,
    byte_level: Callable[[bytes, int], bytes] | None = None,
) -> bytes:
    """One mutation of ``data`` for ``target``: structural when it parses, else bytes."""

    def fallback() -> bytes:
        return (byte_level or (lambda d, n: byte_mutate(d, n, rng)))(data, max_size)

    if rng.random() < 0.25:
        return fallback()
    try:
        if target in ("v2_json", "model_config_json"):
            doc = json.loads(data)
            if rng.random() < 0.2:
                _repair(rng, doc, binary=False)
            out = _json_dumps(_mutate_doc(rng, doc, msgpack=False))
        elif target == "v2_binary":
            out = _mutate_v2_binary(data, rng)
        elif target == "envelope":
            import msgspec

            doc = msgspec.msgpack.decode(data)
            for t in _tensor_dicts(doc) if rng.random() < 0.2 else []:
                t["shape"] = _dims(rng) if rng.random() < 0.5 else t.get("shape")
                t["data"] = _raw_tensor(rng, t.get("datatype"), t["shape"])
            out = msgspec.msgpack.encode(_mutate_doc(rng, doc, msgpack=True))
        else:
            out = _mutate_toml(data.decode("utf-8"), rng).encode("utf-8", "surrogatepass")
    except (ValueError, TypeError, OverflowError, RecursionError, LookupError, struct.error):
        return fallback()
    return out if len(out) <= max_size else fallback()


def _mutate_v2_binary(data: bytes, rng: random.Random) -> bytes:
    (length,) = struct.unpack(">H", data[:2])
    body = data[2:]
    length = length if 0 < length <= len(body) else len(body)
    doc = json.loads(body[:length])
    blob = body[length:]
    if rng.random() < 0.3:
        blob = _repair(rng, doc, binary=True)
    doc = _mutate_doc(rng, doc, msgpack=False)
    if rng.random() < 0.1 and blob:  # a few bytes of the tensors
        i = rng.randrange(len(blob))
        blob = blob[:i] + bytes([rng.getrandbits(8)]) + blob[i + 1 :]
    header = _json_dumps(doc)
    new_length = len(header)
    if rng.random() < 0.15:
        new_length = rng.choice([0, 1, new_length - 1, new_length + 1, 65535, len(header + blob)])
    return struct.pack(">H", max(0, min(new_length, 65535))) + header + blob


def _mutate_toml(text: str, rng: random.Random) -> str:
    lines = text.splitlines() or [""]
    i = rng.randrange(len(lines))
    line = lines[i]
    op = rng.random()
    if op < 0.5 and "=" in line:
        key = line.split("=", 1)[0]
        lines[i] = f"{key}= {rng.choice(TOML_VALUES)}"
    elif op < 0.65:
        key = rng.choice(TOML_KEYS)
        lines.insert(i, f"{key} = {rng.choice(TOML_VALUES)}")
    elif op < 0.75:
        lines.insert(
            i, rng.choice([f"[{t}]" for t in TOML_TABLES] + [f"[[{t}]]" for t in TOML_TABLES])
        )
    elif op < 0.85:
        lines.insert(i, rng.choice(lines))
    elif op < 0.95 and len(lines) > 1:
        del lines[i]
    else:
        depth = rng.choice([10, 100, 2000])
        lines.insert(i, f"deep = {'[' * depth}{']' * depth}")
    return "\n".join(lines) + "\n"


def _schema_keys(schema: object, prefix: str = "") -> tuple[list[str], list[str]]:
    keys, tables = [], []
    if isinstance(schema, dict):
        for k, v in schema.items():
            keys.append(k)
            if isinstance(v, dict):
                tables.append(prefix + k)
                sub_keys, sub_tables = _schema_keys(v, f"{prefix}{k}.")
                keys += sub_keys
                tables += sub_tables
    return keys, tables


def _toml_vocabulary() -> tuple[list[str], list[str]]:
    import cloud.config
    import edge.config
    import shared.repository.config as model

    keys = [getattr(model, name, ()) for name in ("_TOP", "_TENSOR", "_BATCHING")]
    keys = [*(k for group in keys for k in group), "count", "kind", "latest", "all"]
    keys += ["specific", "threads", "precision_hint", "allow_spinning"]
    tables = ["input", "output", "dynamic_batching", "instance_group", "version_policy", "runtime"]
    for schema in (getattr(cloud.config, "_SCHEMA", {}), getattr(edge.config, "_SCHEMA", {})):
        k, t = _schema_keys(schema)
        keys, tables = keys + k, tables + t
    keys += list(getattr(edge.config, "_MODEL_SCHEMA", {}))
    tables += ["models.m", "models.m.x"]
    return sorted(set(keys)), sorted(set(tables))


TOML_KEYS, TOML_TABLES = _toml_vocabulary()


def main(argv: list[str]) -> None:
    """``harnesses.py TARGET [libFuzzer flags and corpus folders]``."""
    import atheris

    if len(argv) < 2 or argv[1] not in TARGETS:
        sys.exit(f"usage: {argv[0]} {{{','.join(TARGETS)}}} [libFuzzer args]")
    target = argv[1]

    def custom_mutator(data: bytes, max_size: int, seed: int) -> bytes:
        return mutate(target, data, random.Random(seed), max_size, atheris.Mutate)

    atheris.Setup([argv[0], *argv[2:]], TARGETS[target], custom_mutator=custom_mutator)
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
