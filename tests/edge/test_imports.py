"""An agent imports only what its configuration uses (memory on small devices).

Each case starts a real agent in a fresh interpreter and reads ``sys.modules``
after its first answer: a runtime or a client library imported but unused
costs a device tens of MiB (ONNX Runtime alone is ~30 MiB resident).
"""

from __future__ import annotations

import importlib.resources
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ROOT, write_linear_model

HEAVY = (
    "onnxruntime",
    "openvino",
    "shared.aio.mqtt",
    "shared.aio.http_client",
    "paho",
    "aiohttp",
    "ai_edge_litert",
    "ml_dtypes",
    "onnx",
)
MQTT = "shared.aio.mqtt"
HTTP = "shared.aio.http_client"

PROBE = f"""
HEAVY = {HEAVY!r}
import asyncio, json, sys
from pathlib import Path
import numpy as np
from edge.agent import Agent
from edge.config import load_agent_config

async def main():
    agent = Agent(load_agent_config(Path(sys.argv[1])))
    await agent.start()
    try:
        if sys.argv[2] != "-":
            inputs = json.loads(sys.argv[3])
            arrays = {{k: np.zeros(v[0], v[1]) for k, v in inputs.items()}}
            reply = await agent.infer(sys.argv[2], arrays)
            assert reply.parameters["where"] == "local", reply.parameters
    finally:
        await agent.stop()
    print(json.dumps(sorted(m for m in HEAVY if m in sys.modules)))

asyncio.run(main())
"""


def imported(config: Path, model: str = "-", inputs: dict | None = None) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(config), model, json.dumps(inputs or {})],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def agent_config(folder: Path, body: str) -> Path:
    path = folder / "agent.toml"
    path.write_text(f'repository = "repo"\nstate_dir = "state"\n{body}')
    return path


def test_a_litert_only_agent_imports_neither_onnx_runtime_nor_openvino(tmp_path):
    wheel_model = importlib.resources.files("pymicro_wakeword") / "models" / "hey_mycroft.tflite"
    (tmp_path / "repo" / "kws" / "1").mkdir(parents=True)
    shutil.copy(str(wheel_model), tmp_path / "repo" / "kws" / "1" / "model.tflite")
    config = agent_config(tmp_path, '[models.kws]\nlocal = "kws"\nmode = "local"\n')
    mods = imported(config, "kws", {"serving_default_input_audio:0": [[1, 3, 40], "int8"]})
    assert "ai_edge_litert" in mods
    assert not mods & {"onnxruntime", "openvino", "onnx", MQTT, HTTP, "paho", "aiohttp", "ml_dtypes"}


def test_an_onnx_agent_with_an_http_cloud_imports_neither_mqtt_nor_aiohttp_nor_openvino(tmp_path):
    write_linear_model(tmp_path / "repo" / "lin" / "1" / "model.onnx")
    config = agent_config(
        tmp_path,
        '[cloud]\nhttp = "http://127.0.0.1:9"\n'
        '[models.lin]\nlocal = "lin"\ncloud = "lin"\nmode = "local"\n',
    )
    mods = imported(config, "lin", {"x": [[1, 4], "float32"]})
    assert {"onnxruntime", HTTP} <= mods
    assert not mods & {MQTT, "paho", "aiohttp", "openvino", "ai_edge_litert", "onnx"}


def test_an_mqtt_only_agent_imports_no_http_client(tmp_path):
    config = agent_config(
        tmp_path,
        '[cloud]\nmqtt = "mqtt://127.0.0.1:9"\n[models.m]\ncloud = "m"\nmode = "cloud"\n',
    )
    (tmp_path / "repo").mkdir()
    mods = imported(config)
    assert MQTT in mods
    assert not mods & {HTTP, "paho", "aiohttp", "onnxruntime", "openvino", "ai_edge_litert"}


@pytest.mark.parametrize(
    "module, needs", [("edge.agent", []), ("edge.cli", []), ("edge.http_front", [])]
)
def test_importing_the_agent_loads_no_runtime(module, needs):
    code = f"import sys, {module}; print([m for m in {HEAVY!r} if m in sys.modules])"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == repr(needs)


def test_parsing_the_run_command_imports_neither_the_replay_tools_nor_the_link_emulator():
    # `ferry-edge run` must not pay for `evaluate` and `emulate-link`'s options: their
    # modules pull in the replay, the simulator and the trace readers.
    code = (
        "import sys\nfrom edge.cli import build_parser\n"
        "args = build_parser(sys.argv[1:]).parse_args(sys.argv[1:])\n"
        "assert args.command == 'run', args\n"
        "print(sorted(m for m in sys.modules if m.startswith(('edge.evaluation', 'edge.netem'))))"
    )
    run = ["run", "--config", "agent.toml", "--api-port", "0"]
    out = subprocess.run(
        [sys.executable, "-c", code, *run], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
    # the other commands still get their options, and --help lists every command
    help_all = subprocess.run(
        [sys.executable, "-m", "edge.cli", "--help"], cwd=ROOT, capture_output=True, text=True
    )
    assert all(c in help_all.stdout for c in ("run", "emulate-link", "evaluate", "profile"))
    ev = subprocess.run(
        [sys.executable, "-m", "edge.cli", "evaluate", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert "--probe-interval-s" in ev.stdout
