"""Which models a node catches (takes requests for, to answer "not ready" and count the
miss): driven with statuses on a real fleet view, the broker side stubbed."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

from cloud.fleet.follower import PlacementFollower
from cloud.fleet.view import FleetView
from shared.mqtt import status_topic


def _status(node: str, models: list[str]) -> bytes:
    return json.dumps(
        {
            "node": node,
            "state": "online",
            "uptime_s": 1.0,
            "interval_s": 2.0,
            "models": [{"name": m} for m in models],
            "capacity": {"memory_bytes": 1 << 30, "backends": ["onnxruntime"], "cores": 2},
        }
    ).encode()


class _Front:
    def __init__(self, follower: SimpleNamespace) -> None:
        self.follower, self.caught = follower, set()

    def resync(self) -> None:  # as MqttFront: what to catch, read afresh (nothing loaded here)
        self.caught = set(self.follower._catching())


def _follower() -> SimpleNamespace:
    me = SimpleNamespace(
        node="a",
        view=FleetView(),
        _wake=SimpleNamespace(set=lambda: None),
        forwarder=SimpleNamespace(node_lost=lambda n: None, hosts_changed=lambda: None),
    )
    me._catching = lambda: PlacementFollower._catching(me)
    me.front = _Front(me)
    return me


def test_a_host_that_falls_silent_has_its_models_caught_by_the_survivors(monkeypatch) -> None:
    # Expired by the survivor's own status (no other node speaks in a two-node fleet):
    # nothing resynced, so its model had no subscriber until the next placement.
    me = _follower()
    copy = {
        "model": "m",
        "node": "h",
        "backend": "onnxruntime",
        "rate": 1.0,
        "batch": 1,
        "duty_cycle_s": 0.1,
        "occupancy": 0.1,
        "memory_bytes": 1,
    }
    me.view.on_placement({"generation": 1, "copies": [copy], "unplaced": {}})
    t0 = time.monotonic()
    monkeypatch.setattr(time, "monotonic", lambda: t0)
    PlacementFollower._on_status(me, status_topic("h"), _status("h", ["m"]), None)
    assert me.front.caught == set()  # h serves m
    monkeypatch.setattr(time, "monotonic", lambda: t0 + 60)  # h died without a will
    PlacementFollower._on_status(me, status_topic("a"), _status("a", []), None)
    assert not me.view.nodes["h"].online
    assert me.front.caught == {"m"}
