"""ferry-cloud fleet reads the retained fleet state from a real broker."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import paho.mqtt.client as mqtt

from cloud.controller.table import fleet_document, render_fleet
from cloud.fleet.view import FleetView
from cloud.placement.types import Copy, Placement
from tests.support import ROOT, Broker

STATUS = {
    "node": "n1",
    "state": "online",
    "uptime_s": 5.0,
    "capacity": {"memory_bytes": 1 << 30, "backends": ["onnxruntime"], "cores": 2},
    "models": [{"name": "m", "requests": 10, "memory_bytes": 1 << 20}],
    "following": 3,
}
PLACEMENT = Placement(
    copies=(Copy("m", "n1", "onnxruntime", 40.0, 2, 0.05, 0.3, 1 << 20),),
    unplaced={"big": "needs 9000 MiB, the largest node offers 1024 MiB"},
    generation=3,
)
ALERTS = [{"model": "m", "kind": "over-provisioned", "message": "m: 0.10 req/s against 40"}]


def _retain(broker: Broker) -> None:
    client = mqtt.Client(
        callback_api_version=mqtt.CallbackAPIVersion.VERSION2,
        client_id=f"seed-{time.monotonic_ns()}",
        protocol=mqtt.MQTTv5,
    )
    client.connect("127.0.0.1", broker.port)
    client.loop_start()
    for topic, doc in (
        ("ferry/v1/nodes/n1/status", STATUS),
        ("ferry/v1/placement", PLACEMENT.to_dict()),
        ("ferry/v1/fleet/alerts", ALERTS),
    ):
        client.publish(topic, json.dumps(doc), qos=1, retain=True).wait_for_publish(5)
    client.loop_stop()
    client.disconnect()


def test_fleet_prints_nodes_models_copies_and_alerts(broker: Broker) -> None:
    _retain(broker)
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "cloud.cli",
            "fleet",
            "--broker",
            broker.url,
            "--json",
            "--wait-s",
            "1",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    doc = json.loads(run.stdout)
    assert doc["generation"] == 3 and doc["nodes_used"] == 1
    (node,) = doc["nodes"]
    assert node["node"] == "n1" and node["online"] and node["following"] == 3
    models = {m["model"]: m for m in doc["models"]}
    assert models["m"]["copies"] == 1 and models["m"]["alerts"] == ["over-provisioned"]
    assert "9000 MiB" in models["big"]["unplaced"]
    table = subprocess.run(
        [sys.executable, "-m", "cloud.cli", "fleet", "--broker", broker.url, "--wait-s", "1"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    ).stdout
    assert "placement generation 3" in table and "over-provisioned" in table


def test_fleet_without_a_broker_is_a_clear_error() -> None:
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "cloud.cli",
            "fleet",
            "--broker",
            "mqtt://127.0.0.1:1",
            "--wait-s",
            "0",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert run.returncode == 2 and "error [" in run.stderr


def test_the_table_renders_an_empty_fleet() -> None:
    text = render_fleet(fleet_document(FleetView(), []))
    assert "placement generation None" in text and "alerts:\n  none" in text


def test_a_controller_flag_out_of_range_is_a_clear_error_not_a_traceback(tmp_path) -> None:
    run = subprocess.run(
        [
            *(sys.executable, "-m", "cloud.cli", "controller", "--broker", "mqtt://127.0.0.1:1"),
            *("--repository", str(tmp_path), "--burst-cv", "-1"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert run.returncode == 2 and "error [invalid_config]: --burst-cv" in run.stderr
    assert "Traceback" not in run.stderr


def test_a_node_that_follows_no_placement_shows_a_dash_not_none() -> None:
    from cloud.fleet.view import FleetView

    view = FleetView()
    view.on_status("n1", {**STATUS, "following": None})
    view.on_placement(PLACEMENT.to_dict())
    table = render_fleet(fleet_document(view, ALERTS))
    assert "None" not in table
