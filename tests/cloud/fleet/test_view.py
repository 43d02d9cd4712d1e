"""FleetView folds node statuses into rates, hosts and membership (no broker)."""

from __future__ import annotations

import json

import msgspec
import pytest

from cloud.fleet.view import FleetView
from shared.errors import ConfigError
from shared.mqtt.documents import decode_document


def _status(uptime: float, requests: int, *, models: tuple[str, ...] = ("m",), misses=None):
    return {
        "node": "n1",
        "state": "online",
        "uptime_s": uptime,
        "models": [
            {
                "name": m,
                "requests": requests,
                "executions": requests,
                "compute_ns": requests * 10**6,
            }
            for m in models
        ],
        "capacity": {"memory_bytes": 1 << 30, "backends": ["onnxruntime"], "cores": 2},
        "misses": misses or {},
    }


def test_rate_comes_from_counter_deltas_over_the_nodes_own_uptime() -> None:
    view = FleetView()
    assert view.on_status("n1", _status(10.0, 100)) is True  # joined
    assert view.rate("m") == 0.0 and not view.rate_known("m")
    view.on_status("n1", _status(12.0, 140))
    assert view.rate("m") == pytest.approx(20.0)
    assert view.rate_known("m")
    view.on_status("n1", _status(14.0, 140))
    assert view.rate("m") == pytest.approx(10.0)  # smoothed toward 0


def test_a_restarted_node_does_not_produce_a_negative_or_huge_rate() -> None:
    view = FleetView()
    view.on_status("n1", _status(100.0, 1000))
    view.on_status("n1", _status(102.0, 1100))
    view.on_status("n1", _status(1.0, 5))  # restarted: counters and uptime reset
    assert view.rate("m") == pytest.approx(50.0)  # kept, not recomputed from the reset


def test_last_will_takes_a_node_and_its_models_offline() -> None:
    view = FleetView()
    view.on_status("n1", _status(1.0, 0))
    assert view.hosts("m") == ["n1"]
    assert view.on_status("n1", {"node": "n1", "state": "offline"}) is True
    assert view.hosts("m") == []
    assert view.specs() == []
    assert view.on_status("n1", None) is False  # a cleared retained topic: no change


def test_hosts_excludes_the_asking_node_and_specs_come_from_capacity() -> None:
    view = FleetView()
    view.on_status("n1", _status(1.0, 0))
    view.on_status("n2", {**_status(1.0, 0), "node": "n2"})
    assert view.hosts("m", exclude="n1") == ["n2"]
    spec = view.specs()[0]
    assert spec.memory_bytes == 1 << 30 and spec.backends == frozenset({"onnxruntime"})


def test_misses_count_as_demand_for_a_model_no_node_hosts() -> None:
    view = FleetView()
    view.on_status("n1", _status(1.0, 0, models=(), misses={"cold": 0}))
    view.on_status("n1", _status(3.0, 0, models=(), misses={"cold": 10}))
    assert view.rate("cold") == pytest.approx(5.0)
    assert view.misses("cold") == 10


def test_the_misses_counter_never_goes_down_as_nodes_leave_come_back_or_restart() -> None:
    # It summed the online nodes' counts: a node that left took its misses with it, and
    # Prometheus read ferry_model_misses_total going 3 -> 0 as a reset
    view = FleetView()
    view.on_status("n1", _status(1.0, 0, models=(), misses={"cold": 3}))
    view.on_status("n2", {**_status(1.0, 0, models=(), misses={"cold": 2}), "node": "n2"})
    assert view.misses("cold") == 5
    view.on_status("n1", {"state": "offline"})
    assert view.misses("cold") == 5
    view.on_status("n1", _status(9.0, 0, models=(), misses={"cold": 4}))  # back, same run
    assert view.misses("cold") == 6
    view.on_status("n2", {**_status(0.5, 0, models=(), misses={"cold": 1}), "node": "n2"})
    assert view.misses("cold") == 7  # n2 restarted: its count began again at 0


def test_documents_decode_from_json_or_messagepack_and_garbage_is_a_config_error() -> None:
    doc = {"generation": 3, "copies": []}
    assert decode_document(json.dumps(doc).encode()) == doc
    assert decode_document(msgspec.msgpack.encode(doc)) == doc
    assert decode_document(b"") is None
    with pytest.raises(ConfigError):
        decode_document(b"{not json")


def test_an_older_placement_generation_is_ignored_never_followed() -> None:
    # two controllers published 5 and 4 by turns; nodes followed 5 -> 4 -> 5
    from cloud.placement.types import Copy, Placement

    def doc(generation: int, node: str) -> dict:
        copy = Copy("m", node, "onnxruntime", 1.0, 1, 0.1, 0.1, 1 << 20)
        return Placement(copies=(copy,), generation=generation).to_dict()

    view = FleetView()
    assert view.on_placement(doc(5, "n1")) is not None
    assert view.on_placement(doc(4, "n2")) is None
    assert view.placement is not None and view.placement.generation == 5
    assert view.placement.copies[0].node == "n1"
    assert view.on_placement(doc(6, "n2")) is not None and view.placement.generation == 6


def test_one_report_shows_the_rate_the_node_measured_itself() -> None:
    # ferry-cloud fleet waits 1.5 s; statuses come every 5 s: it always showed 0.00
    view = FleetView()
    status = _status(10.0, 500)
    status["models"][0]["rate"] = 42.5
    view.on_status("n1", status)
    assert view.rate("m") == 42.5 and not view.rate_known("m")  # the controller waits


def test_a_silent_node_expires_after_three_of_its_intervals_and_untimed_ones_never() -> None:
    view = FleetView()
    status = _status(1.0, 0)
    view.on_status("n1", {**status, "interval_s": 10.0}, now=0.0)
    view.on_status("n2", status)  # not timed (a caller without a clock): never expired
    assert view.expire(29.0) == [] and view.nodes["n1"].online
    assert view.expire(31.0) == ["n1"]
    assert not view.nodes["n1"].online and not view.nodes["n1"].models
    assert [n.name for n in view.online()] == ["n2"]
    view.on_status("n1", {**status, "interval_s": 1.0}, now=40.0)  # back: a short interval
    assert view.expire(54.0) == [] and view.expire(55.5) == ["n1"]  # (15 s at the least)


def test_a_models_measured_memory_outlives_its_hosts() -> None:
    """Re-placing a dead host's models fell back to their file sizes (a node was filled
    to 2.2x its memory)."""
    view = FleetView()
    status = _status(1.0, 0, models=("m",))
    status["models"][0]["memory_bytes"] = 98_000_000
    view.on_status("n1", status, now=0.0)
    assert view.memory_of("m") == 98_000_000
    view.on_status("n1", {"node": "n1", "state": "offline"})
    assert view.online() == [] and view.memory_of("m") == 98_000_000


@pytest.mark.parametrize(
    "bad",
    [
        {"uptime_s": "soon"},
        {"models": 7},
        {"models": [{"name": "m", "requests": -3}]},
        {"misses": {"m": "many"}},
        {"capacity": {"memory_bytes": "lots"}},
        {"uptime_s": float("nan")},
        # a speed the packer divides by: 0 had crashed the controller (at every restart
        # while the status stayed retained), infinity too
        {"capacity": {"memory_bytes": 1 << 30, "backends": ["onnxruntime"], "speed": 0.0}},
        {"capacity": {"memory_bytes": 1 << 30, "speed": float("inf")}},
        {"models": [{"name": "m", "rate": float("inf")}]},
    ],
)
def test_a_malformed_status_changes_nothing_and_makes_no_node(bad: dict) -> None:
    """Folded halfway, one had left a phantom node online for good, placed on."""
    view = FleetView()
    assert view.on_status("bad", {**_status(1.0, 0), **bad}) is False
    assert view.nodes == {} and view.specs() == []
    view.on_status("n1", _status(10.0, 100))
    assert view.on_status("n1", {**_status(12.0, 999), **bad}) is False
    view.on_status("n1", _status(12.0, 140))
    assert view.rate("m") == pytest.approx(20.0)  # as if the bad one never came


def test_a_node_back_with_a_new_boot_is_a_restart_however_long_it_has_been_up() -> None:
    # Restarts were told by an uptime that went back: a node heard again only after
    # running longer than before had its new counters read against the old ones.
    view = FleetView()
    view.on_status("n1", {**_status(100.0, 1000, misses={"cold": 50}), "boot": "a"})
    view.on_status("n1", {**_status(102.0, 1100, misses={"cold": 50}), "boot": "a"})
    assert view.rate("m") == pytest.approx(50.0)
    view.on_status("n1", {**_status(500.0, 30, misses={"cold": 3}), "boot": "b"})
    assert view.misses("cold") == 53  # its 3 new misses count (they were under the old 50)
    assert view.rate("m") == pytest.approx(50.0)  # kept, not recomputed across processes
    view.on_status("n1", {**_status(502.0, 130, misses={"cold": 3}), "boot": "b"})
    assert view.rate("m") == pytest.approx(50.0)  # (100 requests in 2 s: the same process)


def test_a_status_that_leaves_out_the_descriptions_keeps_the_last_ones() -> None:
    # (one too big for the broker is sent without them: other nodes went blind to its models)
    view = FleetView()
    described = {**_status(1.0, 0), "metadata": {"m": {"name": "m"}}, "configs": {"m": {"x": 1}}}
    view.on_status("n1", described)
    view.on_status("n1", _status(2.0, 0))
    assert view.metadata("m") == {"name": "m"} and view.config("m") == {"x": 1}
