"""Real parts for tests: a Mosquitto broker, server processes, tiny models.

Everything binds 127.0.0.1 on a free port; nothing reaches a public broker.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
BROKER_CONF = ROOT / "examples" / "mosquitto.conf"


def feed_held(parser: Any, data: bytes, after: Callable[[], None]) -> None:
    """Push ``data`` through ``parser``'s get_buffer / buffer_updated as uvloop does: the
    buffer handed out stays exported until ``buffer_updated`` and ``after`` (what the
    protocol does with what was parsed, in that same call) have returned."""
    pos = 0
    while pos < len(data):
        target = parser.get_buffer()
        n = min(len(target), len(data) - pos)
        target[:n] = data[pos : pos + n]
        pos += n
        held = memoryview(target)
        parser.buffer_updated(n)
        after()
        held.release()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout}s")


def mosquitto_binary() -> str:
    found = shutil.which("mosquitto") or (
        "/usr/sbin/mosquitto" if Path("/usr/sbin/mosquitto").exists() else None
    )
    if not found:
        raise RuntimeError("mosquitto is not installed: run scripts/setup.sh")
    return found


class Broker:
    """A Mosquitto process with the project's config on a free loopback port."""

    def __init__(self, workdir: Path, cpus: set[int] | None = None) -> None:
        self.workdir = workdir
        self.cpus = cpus
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        workdir.mkdir(parents=True, exist_ok=True)
        # Mosquitto drops root privileges; its persistence folder must stay writable.
        os.chmod(workdir, 0o777)
        self.conf = workdir / "mosquitto.conf"
        self.conf.write_text(
            BROKER_CONF.read_text()
            + f"\nlistener {self.port} 127.0.0.1\npersistence_location {workdir}/\n"
        )

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.port}"

    def start(self) -> None:
        log = open(self.workdir / "mosquitto.log", "ab")
        self.proc = subprocess.Popen(
            [mosquitto_binary(), "-c", str(self.conf)],
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=(lambda: os.sched_setaffinity(0, self.cpus)) if self.cpus else None,
        )
        wait_port(self.port)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def restart(self, down_s: float = 0.5) -> None:
        self.stop()
        time.sleep(down_s)
        self.start()


class ServerProcess:
    """A ``ferry-cloud`` (or ``ferry-edge``) process; reads its ready line."""

    def __init__(
        self,
        args: list[str],
        ready_prefix: str,
        env: dict[str, str] | None = None,
        cpus: set[int] | None = None,
    ) -> None:
        self.args = args
        self.ready_prefix = ready_prefix
        self.cpus = cpus  # CPU affinity of the process (benchmarks pin it), None: any
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc: subprocess.Popen[str] | None = None
        self.ready_line = ""
        self.lines: list[str] = []

    def start(self, timeout: float = 60.0) -> ServerProcess:
        self.proc = subprocess.Popen(
            [sys.executable, *self.args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=self.env,
            cwd=ROOT,
            start_new_session=True,
            preexec_fn=(lambda: os.sched_setaffinity(0, self.cpus)) if self.cpus else None,
        )
        ready = threading.Event()

        def pump() -> None:
            assert self.proc is not None and self.proc.stdout is not None
            for line in self.proc.stdout:
                self.lines.append(line)
                if line.startswith(self.ready_prefix) and not ready.is_set():
                    self.ready_line = line.strip()
                    ready.set()

        threading.Thread(target=pump, daemon=True).start()
        deadline = time.monotonic() + timeout
        while not ready.wait(0.1):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError("server did not start:\n" + "".join(self.lines[-40:]))
        return self

    def field(self, key: str) -> str:
        match = re.search(rf"\b{key}=(\S+)", self.ready_line)
        if not match:
            raise KeyError(key)
        return match.group(1)

    @property
    def http_url(self) -> str:
        return self.field("http")

    def terminate(self, timeout: float = 30.0) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def output(self) -> str:
        return "".join(self.lines)


def cloud_server(repository: Path, *extra: str, cpus: set[int] | None = None) -> ServerProcess:
    return ServerProcess(
        ["-m", "cloud.cli", "serve", "--repository", str(repository), "--http-port", "0", *extra],
        "ferry-cloud ready",
        cpus=cpus,
    )


# ---- tiny models built with the onnx helper API ---------------------------------------
def write_linear_model(
    path: Path,
    n_in: int = 4,
    n_out: int = 3,
    seed: int = 0,
    input_name: str = "x",
    output_name: str = "y",
) -> tuple[np.ndarray, np.ndarray]:
    """y = relu(x @ W + b) with a dynamic batch dimension; returns (W, b)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n_in, n_out)).astype(np.float32)
    b = rng.standard_normal(n_out).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", [input_name, "W"], ["xw"]),
            helper.make_node("Add", ["xw", "B"], ["pre"]),
            helper.make_node("Relu", ["pre"], [output_name]),
        ],
        "linear",
        [helper.make_tensor_value_info(input_name, TensorProto.FLOAT, ["N", n_in])],
        [helper.make_tensor_value_info(output_name, TensorProto.FLOAT, ["N", n_out])],
        initializer=[numpy_helper.from_array(w, "W"), numpy_helper.from_array(b, "B")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return w, b


def linear_reference(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.maximum(x @ w + b, 0)


def write_identity_model(
    path: Path,
    onnx_type: int,
    name_in: str = "x",
    name_out: str = "y",
    dims: list[int | str] | None = ["N", 3],  # noqa: B006 (read only)
) -> None:
    """y = x for one datatype (exercises every V2 datatype end to end); ``dims`` None:
    no shape in the file (the runtime takes any rank)."""
    import onnx
    from onnx import helper

    graph = helper.make_graph(
        [helper.make_node("Identity", [name_in], [name_out])],
        "identity",
        [helper.make_tensor_value_info(name_in, onnx_type, dims)],
        [helper.make_tensor_value_info(name_out, onnx_type, dims)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))


def unbatched_identity_config(datatype: str) -> str:
    """config.toml for a write_identity_model model taking any number of rows in one
    request (no batch dimension): big bodies for the stall tests and bench."""
    return (
        "max_batch_size = 0\n"
        f'[[input]]\nname = "x"\ndatatype = "{datatype}"\ndims = [-1, 3]\n'
        f'[[output]]\nname = "y"\ndatatype = "{datatype}"\ndims = [-1, 3]\n'
    )


def edge_agent(config: Path, *extra: str) -> ServerProcess:
    return ServerProcess(
        ["-m", "edge.cli", "run", "--config", str(config), "--api-port", "0", *extra],
        "ferry-edge ready",
    )


def write_softmax_model(path: Path, n: int = 4, flags: str = "") -> None:
    """probs = softmax(x): the input sets the top-1 confidence exactly (cascade tests).

    ``flags`` "first" or "last" adds a BOOL output ``pos`` = x > 0 before or after
    ``probs`` (a cascade's default output is the model's first)."""
    import onnx
    from onnx import TensorProto, helper

    nodes = [helper.make_node("Softmax", ["x"], ["probs"], axis=1)]
    outputs = [helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["N", n])]
    if flags:
        zero = helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0])
        nodes += [
            helper.make_node("Constant", [], ["z"], value=zero),
            helper.make_node("Greater", ["x", "z"], ["pos"]),
        ]
        pos = helper.make_tensor_value_info("pos", TensorProto.BOOL, ["N", n])
        outputs = [pos, *outputs] if flags == "first" else [*outputs, pos]
    graph = helper.make_graph(
        nodes,
        "softmax",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", n])],
        outputs,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))


def write_slow_model(path: Path, size: int = 512, layers: int = 36, n: int = 4) -> None:
    """y = x (to float32 precision), after ``layers`` real size x size MatMuls per run.

    The chain starts from a constant scaled by mean(x), so ONNX Runtime cannot
    fold it away; its cost does not depend on the batch size.  Shutdown,
    backpressure and hot-reload tests use it to hold requests in flight in a
    server process they cannot gate from outside.
    """
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(11)
    c = (rng.standard_normal((size, size)) / np.sqrt(size)).astype(np.float32)
    nodes = [
        helper.make_node("ReduceMean", ["x"], ["s"], keepdims=0),
        helper.make_node("Mul", ["C", "s"], ["m0"]),
    ]
    for i in range(layers):
        nodes.append(helper.make_node("MatMul", [f"m{i}", "C"], [f"p{i}"]))
        nodes.append(helper.make_node("Tanh", [f"p{i}"], [f"m{i + 1}"]))
    nodes += [
        helper.make_node("ReduceSum", [f"m{layers}"], ["r"], keepdims=0),
        helper.make_node("Mul", ["r", "tiny"], ["rt"]),
        helper.make_node("Add", ["x", "rt"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "slow",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", n])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", n])],
        initializer=[
            numpy_helper.from_array(c, "C"),
            numpy_helper.from_array(np.array(1e-30, np.float32), "tiny"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_test_ca(folder: Path, host: str = "127.0.0.1") -> tuple[Path, Path, Path]:
    """A throwaway CA and a server certificate for ``host`` (openssl CLI).

    Returns (ca.crt, server.crt, server.key); the certificate names the host
    as an IP address and ``localhost`` so hostname checks pass on loopback.
    """
    if not shutil.which("openssl"):
        raise RuntimeError("the openssl command is not installed")
    folder.mkdir(parents=True, exist_ok=True)
    # The extensions a CA and a server certificate carry (Python 3.13's default context
    # verifies strictly, X509_STRICT: a CA without keyUsage is refused there)
    _openssl(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
        "-keyout", "ca.key", "-out", "ca.crt", "-subj", "/CN=ferry-test-ca",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        "-addext", "subjectKeyIdentifier=hash",
        cwd=folder,
    )  # fmt: skip
    _openssl(
        "req", "-newkey", "rsa:2048", "-nodes",
        "-keyout", "server.key", "-out", "server.csr", "-subj", f"/CN={host}",
        cwd=folder,
    )  # fmt: skip
    (folder / "ext.cnf").write_text(
        f"subjectAltName=IP:{host},DNS:localhost\n"
        "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=serverAuth,clientAuth\nauthorityKeyIdentifier=keyid\n"
        "subjectKeyIdentifier=hash\n"
    )
    _openssl(
        "x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-out", "server.crt", "-days", "2", "-extfile", "ext.cnf",
        cwd=folder,
    )  # fmt: skip
    return folder / "ca.crt", folder / "server.crt", folder / "server.key"


class SecuredBroker(Broker):
    """Mosquitto with TLS (certificates from :func:`make_test_ca`) and a password file.

    Anonymous clients are refused; ``username``/``password`` are accepted.
    The password file is written by ``mosquitto_passwd``.
    """

    username = "ferry-node"
    password = "s3cret-pass"

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir)
        self.ca_file, cert, key = make_test_ca(workdir / "tls")
        passwd = workdir / "passwd"
        tool = shutil.which("mosquitto_passwd") or "/usr/bin/mosquitto_passwd"
        subprocess.run(
            [tool, "-c", "-b", str(passwd), self.username, self.password],
            check=True,
            capture_output=True,
        )
        base = [
            line
            for line in BROKER_CONF.read_text().splitlines()
            if not line.startswith("allow_anonymous")
        ]
        # As root, mosquitto drops to its own user, which cannot read pytest's 0700 folders.
        stay_root = ["user root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else []
        self.conf.write_text(
            "\n".join(
                [
                    *base,
                    *stay_root,
                    "allow_anonymous false",
                    f"password_file {passwd}",
                    f"listener {self.port} 127.0.0.1",
                    f"cafile {self.ca_file}",
                    f"certfile {cert}",
                    f"keyfile {key}",
                    f"persistence_location {workdir}/",
                ]
            )
            + "\n"
        )

    @property
    def url(self) -> str:
        return f"mqtts://127.0.0.1:{self.port}"


# ---- cellular traces: the real ones where they exist, generated ones otherwise ----------


@functools.cache
def cellular_trace_dir() -> Path:
    """A folder of mahimahi ``.up``/``.down`` pairs for tests that want real traces.

    ``../shared/traces`` (the real cellular traces) where the checkout has it;
    elsewhere (a clone outside the workspace) small traces of the same format
    generated here, with outages and fades, so those tests run rather than skip.
    """
    real = ROOT.parent / "shared" / "traces"
    if real.is_dir() and any(p.with_suffix(".down").exists() for p in real.glob("*.up")):
        return real
    from edge.netem.traces import commute, markov_fading, write_mahimahi

    folder = Path(tempfile.mkdtemp(prefix="ferry-traces-"))
    for name, up, down in (
        (
            "generated-fading",
            markov_fading(150, seed=11, bad_mbps=0.0),
            markov_fading(150, seed=12),
        ),
        ("generated-commute", commute(150, seed=13), commute(150, seed=14)),
    ):
        write_mahimahi(up, folder / f"{name}.up")
        write_mahimahi(down, folder / f"{name}.down")
    return folder


def cellular_trace_pairs() -> list[str]:
    folder = cellular_trace_dir()
    return sorted(p.stem for p in folder.glob("*.up") if p.with_suffix(".down").exists())


def mqtt_request(broker_url: str, model: str, payload: bytes, timeout: float = 60.0) -> bytes:
    """One raw MQTT v5 request (a MessagePack payload) and its reply payload, the way a
    device without the agent would send it: own client, Response Topic, QoS 1."""
    import paho.mqtt.client as mqtt
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    got: list[bytes] = []
    done = threading.Event()
    client_id = f"raw-{time.monotonic_ns()}"
    topic = f"ferry/v1/replies/{client_id}"
    client = mqtt.Client(
        callback_api_version=mqtt.CallbackAPIVersion.VERSION2,
        client_id=client_id,
        protocol=mqtt.MQTTv5,
    )
    client.on_message = lambda c, u, m: (got.append(m.payload), done.set())
    subscribed = threading.Event()
    client.on_subscribe = lambda *a: subscribed.set()
    host, port = broker_url.removeprefix("mqtt://").split(":")
    client.connect(host, int(port))
    client.subscribe(topic, qos=1)
    client.loop_start()
    try:
        if not subscribed.wait(10):
            raise RuntimeError("the broker did not confirm the reply subscription")
        props = Properties(PacketTypes.PUBLISH)
        props.ResponseTopic = topic
        props.CorrelationData = b"1"
        client.publish(f"ferry/v1/models/{model}/infer", payload, qos=1, properties=props)
        if not done.wait(timeout):
            raise RuntimeError(f"no MQTT reply within {timeout:g} s")
    finally:
        client.loop_stop()
        client.disconnect()
    return got[0]


def check_cancel_stops_a_run_halfway(load: Callable[[Path], Any], folder: Path) -> None:
    """A backend's ``run_cancellable``: a cancel a tenth into a slow run stops it (it
    ends with RunCancelled well before a whole run), the session serves on, and a run
    cancelled before it starts never starts."""
    import pytest

    from shared.errors import RunCancelled
    from shared.runtimes.base import Cancel, cancellable

    path = folder / "slow.onnx"
    write_slow_model(path, size=512, layers=120)
    session = load(path)
    assert cancellable(session)
    x = np.ones((1, 4), np.float32)
    session.run({"x": x})  # warm
    started = time.perf_counter()
    session.run({"x": x})
    whole = time.perf_counter() - started
    cancel = Cancel()
    timer = threading.Timer(whole / 10, cancel.cancel)
    timer.start()
    started = time.perf_counter()
    with pytest.raises(RunCancelled):
        session.run_cancellable({"x": x}, None, cancel)
    stopped = time.perf_counter() - started
    timer.join()
    assert stopped < whole  # it did not run to the end
    out = session.run_cancellable({"x": x}, None, Cancel())  # a fresh run is unaffected
    np.testing.assert_allclose(out["y"], x, rtol=1e-5)
    first = out["y"].copy()
    session.run({"x": 2 * x})
    np.testing.assert_array_equal(out["y"], first)  # the caller's copy, not reused memory
    done = Cancel()
    done.cancel()
    with pytest.raises(RunCancelled, match="before it started"):
        session.run_cancellable({"x": x}, None, done)
