"""The controller's decisions, driven with statuses and a fake clock (no broker)."""

from __future__ import annotations

from cloud.controller.catalogue import ModelEntry, read_catalogue
from cloud.controller.core import ControllerCore, ControllerSettings
from cloud.placement.packing import check
from cloud.placement.types import LatencyProfile
from shared.repository import ModelRepository, PlacementPolicy
from tests.support import write_linear_model

GIB = 1 << 30


def _entry(name: str, rate: float = 5.0, min_copies: int = 1) -> ModelEntry:
    return ModelEntry(
        name,
        PlacementPolicy(latency_objective_ms=200, rate=rate, min_copies=min_copies),
        ("onnxruntime",),
        50 << 20,
        8,
    )


def _status(node: str, uptime: float, hosted: dict[str, int] | None = None) -> dict:
    return {
        "node": node,
        "state": "online",
        "uptime_s": uptime,
        "capacity": {"memory_bytes": GIB, "backends": ["onnxruntime"], "cores": 2},
        "models": [{"name": m, "requests": n} for m, n in (hosted or {}).items()],
    }


def _core(entries: list[ModelEntry], **settings) -> ControllerCore:
    profiles = {e.name: [LatencyProfile("onnxruntime", 0.004, 0.002, 8, 50 << 20)] for e in entries}
    return ControllerCore(
        {e.name: e for e in entries},
        profiles,
        ControllerSettings(**{"settle_s": 1.0, "interval_s": 5.0, **settings}),
        started=0.0,
    )


def test_nothing_is_published_before_settling_or_without_nodes() -> None:
    core = _core([_entry("a")])
    assert core.step(0.5) is None  # still settling
    assert core.step(2.0) is None  # no node yet
    core.on_status("n1", _status("n1", 1.0))
    step = core.step(2.5)
    assert step is not None and step.placement.generation >= 1
    assert [(c.model, c.node) for c in step.placement.copies] == [("a", "n1")]
    assert [(m.op, m.model, m.node) for m in step.moves] == [("load", "a", "n1")]


def test_a_dead_nodes_models_are_replaced_on_the_survivors_at_once() -> None:
    core = _core([_entry("a"), _entry("b"), _entry("c", min_copies=2)])
    core.on_status("n1", _status("n1", 1.0))
    core.on_status("n2", _status("n2", 1.0))
    first = core.step(2.0)
    assert first is not None
    victim = first.placement.copies[0].node
    survivor = "n2" if victim == "n1" else "n1"
    core.on_status(victim, {"node": victim, "state": "offline"})
    step = core.step(2.1)  # membership change: no interval wait
    assert step is not None
    assert {c.node for c in step.placement.copies} == {survivor}
    assert {c.model for c in step.placement.copies} == {"a", "b", "c"}
    assert step.placement.generation > first.placement.generation


def test_a_placement_that_raises_leaves_its_reason_for_the_next_try(monkeypatch) -> None:
    # The reason (a node gone) was spent before place() ran: after one that raised, the
    # retry found nothing to do and the gone node's models stayed planned on it.
    import cloud.controller.core as core_module

    core = _core([_entry("a"), _entry("b")])
    core.on_status("n1", _status("n1", 1.0))
    core.on_status("n2", _status("n2", 1.0))
    first = core.step(2.0)
    assert first is not None
    victim = first.placement.copies[0].node
    real = core_module.place
    calls = []

    def once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a bug in the packer")
        return real(*args, **kwargs)

    monkeypatch.setattr(core_module, "place", once)
    core.on_status(victim, {"node": victim, "state": "offline"})
    try:
        core.step(2.1)
    except RuntimeError:
        pass
    step = core.step(7.5)  # (the service tries again an interval later)
    assert step is not None and victim not in {c.node for c in step.placement.copies}


async def test_the_controller_service_outlives_a_placement_that_raises(monkeypatch, caplog):
    from cloud.controller.service import ControllerOptions, ControllerService
    from shared.mqtt import parse_broker_url

    core = _core([_entry("a")])
    service = ControllerService(core, ControllerOptions(parse_broker_url("mqtt://127.0.0.1:1")))
    monkeypatch.setattr(type(service), "connected", property(lambda self: True))
    service.active = True
    service._beat = float("inf")  # (no heartbeat to publish: no broker here)
    service._alerts_key = "[]"  # (nor alerts)

    def broken(now):
        raise RuntimeError("a bug in the packer")

    monkeypatch.setattr(core, "step", broken)
    service.tick(10.0)  # logged, not raised
    assert "placement not recomputed; the one in force stands" in caplog.text
    calls = []
    monkeypatch.setattr(core, "step", lambda now: calls.append(now))
    service.tick(11.0)  # within the interval: not tried again at each tick
    service.tick(10.0 + core.settings.interval_s)
    assert calls == [10.0 + core.settings.interval_s]


def test_a_restarted_controller_republishes_nothing_for_the_same_fleet() -> None:
    entries = [_entry("a", rate=40), _entry("b", rate=3), _entry("c", min_copies=2)]
    core = _core(entries)
    core.on_status("n1", _status("n1", 1.0))
    core.on_status("n2", _status("n2", 1.0))
    step = core.step(2.0)
    assert step is not None
    retained = step.placement.to_dict()
    # the restarted controller: retained placement first, then the retained statuses
    again = _core(entries)
    again.on_retained_placement(retained)
    hosting = {n: {c.model: 100 for c in step.placement.on_node(n)} for n in ("n1", "n2")}
    again.on_status("n1", _status("n1", 50.0, hosting["n1"]))
    again.on_status("n2", _status("n2", 50.0, hosting["n2"]))
    assert again.step(2.0) is None  # same input, same placement: nothing moves
    assert again.current is not None and again.current.generation == step.placement.generation


def test_a_controller_that_finds_no_placement_retained_counts_on_from_what_nodes_follow() -> None:
    # a broker that lost its store: the nodes still follow generation 7
    core = _core([_entry("a")])
    for node in ("n1", "n2"):
        core.on_status(node, {**_status(node, 50.0, {"a": 10}), "following": 7})
    step = core.step(2.0)
    assert step is not None and step.placement.generation == 8


def test_a_model_added_to_the_repository_is_placed_and_a_removed_one_freed() -> None:
    core = _core([_entry("a")])
    core.on_status("n1", _status("n1", 1.0))
    assert core.step(2.0) is not None
    assert core.on_catalogue({"a": _entry("a"), "b": _entry("b")}) == (["b"], [])
    step = core.step(2.5)  # at once, not after the interval
    assert step is not None and {c.model for c in step.placement.copies} == {"a", "b"}
    assert core.on_catalogue({"b": _entry("b")}) == ([], ["a"])
    step = core.step(3.0)
    assert step is not None and {c.model for c in step.placement.copies} == {"b"}
    assert [(m.op, m.model) for m in step.moves] == [("unload", "a")]
    assert core.on_catalogue({"b": _entry("b")}) == ([], []) and core.step(3.5) is None


def test_a_model_that_fails_to_load_goes_elsewhere_and_is_unplaced_where_it_fails_everywhere() -> (
    None
):
    # It stayed placed on the node that could not load it, for good, with no alert
    # (and that node unready for good).
    from cloud.controller.core import FAILED_LOAD_HOLD_S

    core = _core([_entry("bad"), _entry("ok")])
    core.on_status("n1", _status("n1", 1.0))
    core.on_status("n2", _status("n2", 1.0))
    first = core.step(2.0)
    assert first is not None
    home = first.placement.copies_of("bad")[0].node
    other = "n2" if home == "n1" else "n1"
    core.on_status(home, {**_status(home, 2.0), "load_failures": {"bad": "corrupt file"}})
    step = core.step(2.5)  # at once
    assert step is not None and [c.node for c in step.placement.copies_of("bad")] == [other]
    core.on_status(other, {**_status(other, 3.0), "load_failures": {"bad": "corrupt file"}})
    step = core.step(3.0)
    assert step is not None and not step.placement.copies_of("bad")
    assert step.placement.unplaced["bad"].startswith("failed to load on n1, n2")
    assert step.placement.copies_of("ok")
    assert any(a.model == "bad" and a.kind == "unplaced" for a in core.alerts())
    # the nodes forget a failure once it is placed elsewhere; after the hold it is tried again
    for node in ("n1", "n2"):
        core.on_status(node, _status(node, 4.0))
    assert core.step(3.5 + FAILED_LOAD_HOLD_S / 2) is None
    step = core.step(4.0 + FAILED_LOAD_HOLD_S)
    assert step is not None and len(step.placement.copies_of("bad")) == 1


def test_a_measured_rate_far_above_the_plan_triggers_a_replacement_after_the_interval() -> None:
    core = _core([_entry("a", rate=1.0)])
    core.on_status("n1", _status("n1", 1.0, {"a": 0}))
    first = core.step(2.0)
    assert first is not None
    core.on_status("n1", _status("n1", 3.0, {"a": 200}))  # 100 req/s measured
    assert core.step(3.0) is None  # inside the interval
    step = core.step(8.0)
    assert step is not None and "rate of a" in step.reason
    assert sum(c.rate for c in step.placement.copies_of("a")) >= 99


def test_a_measured_rate_within_the_tolerance_of_the_plan_moves_nothing() -> None:
    # 10 -> 11 req/s is past min_rate_change (0.5) but inside rate_tolerance (25%): a
    # re-placement for it would churn copies on every wobble of a busy model's rate
    core = _core([_entry("a", rate=10.0)])
    core.on_status("n1", _status("n1", 1.0, {"a": 0}))
    assert core.step(2.0) is not None
    core.on_status("n1", _status("n1", 3.0, {"a": 22}))  # 11 req/s
    assert core.step(8.0) is None
    core.on_status("n1", _status("n1", 5.0, {"a": 62}))  # 20 req/s
    step = core.step(14.0)
    assert step is not None and "rate of a" in step.reason


def test_every_published_placement_is_feasible() -> None:
    entries = [_entry(f"m{i}", rate=float(i * 7 % 50), min_copies=i % 3) for i in range(12)]
    core = _core(entries)
    for n in ("n1", "n2", "n3"):
        core.on_status(n, _status(n, 1.0))
    step = core.step(2.0)
    assert step is not None
    assert check(step.placement, core.demands(), core.view.specs()) == []


def test_the_catalogue_reads_placement_tables_and_reports_broken_models(tmp_path) -> None:
    write_linear_model(tmp_path / "good" / "1" / "model.onnx")
    (tmp_path / "good" / "config.toml").write_text(
        "[placement]\nlatency_objective_ms = 50\nrate = 12.5\nmin_copies = 2\n"
    )
    write_linear_model(tmp_path / "bad" / "1" / "model.onnx")
    (tmp_path / "bad" / "config.toml").write_text('backend = "tensorrt"\n')  # (no model.plan)
    write_linear_model(tmp_path / "ov" / "1" / "model.onnx")
    (tmp_path / "ov" / "config.toml").write_text('backend = "openvino"\n')
    # the fleet's backends override the config's own one (tune picks among them too):
    # with both set, the documented snippet had left the model placed nowhere
    write_linear_model(tmp_path / "fleet-ov" / "1" / "model.onnx")
    (tmp_path / "fleet-ov" / "config.toml").write_text(
        'backend = "onnxruntime"\n[placement]\nbackends = ["openvino"]\n'
    )
    write_linear_model(tmp_path / "fleet-ort" / "1" / "model.onnx")  # (no model.plan)
    (tmp_path / "fleet-ort" / "config.toml").write_text(
        'backend = "tensorrt"\n[placement]\nbackends = ["onnxruntime"]\n'
    )
    entries, problems = read_catalogue(ModelRepository(tmp_path))
    assert entries["fleet-ov"].backends == ("openvino",)
    assert entries["fleet-ort"].backends == ("onnxruntime",) and "fleet-ort" not in problems
    assert entries["good"].policy.rate == 12.5 and entries["good"].policy.min_copies == 2
    # (OpenVINO serves the model.onnx as it is: one so configured had been placed nowhere)
    assert entries["good"].backends == ("onnxruntime", "openvino")
    assert entries["ov"].backends == ("openvino",)
    assert "bad" in problems and "backend" in problems["bad"]


def test_metrics_report_copies_memory_bounds_and_moves() -> None:
    from cloud.controller.metrics import render_controller_metrics

    core = _core([_entry("a"), _entry("b", min_copies=2)])
    core.on_status("n1", _status("n1", 1.0))
    core.on_status("n2", _status("n2", 1.0))
    assert core.step(2.0) is not None
    body, content_type = render_controller_metrics(core)
    text = body.decode()
    assert content_type.startswith("text/plain")
    assert 'ferry_placement_copies{model="b"} 2.0' in text
    assert 'ferry_node_memory_capacity_bytes{node="n1"}' in text
    assert "ferry_placement_moves_total 3.0" in text
    assert "ferry_placement_lower_bound_nodes" in text
    assert 'ferry_model_alert{model="a",kind="unplaced"} 0.0' in text


def test_a_node_that_falls_silent_is_gone_though_no_last_will_came() -> None:
    """A node killed while the broker was down never has its will published: the
    controller counted it online for good and placed models on it."""
    core = _core([_entry("a"), _entry("b")])
    timed = {"interval_s": 5.0}  # (a node that says its interval is timed)
    core.on_status("n1", {**_status("n1", 1.0), **timed}, now=1.0)
    core.on_status("n2", {**_status("n2", 1.0), **timed}, now=1.0)
    first = core.step(2.0)
    assert first is not None
    victim = first.placement.copies[0].node
    survivor = "n2" if victim == "n1" else "n1"
    for t in range(6, 40, 5):  # the survivor reports every 5 s; the victim says nothing
        core.on_status(survivor, {**_status(survivor, float(t)), **timed}, now=float(t))
        step = core.step(float(t) + 0.1)
        if t + 0.1 - 1.0 <= 15.0:
            assert step is None  # silent for three intervals (15 s) is not yet gone
    assert [n.name for n in core.view.online()] == [survivor]
    assert core.current is not None
    assert {c.node for c in core.current.copies} == {survivor}
    assert {c.model for c in core.current.copies} == {"a", "b"}


def test_a_few_cold_runs_do_not_stand_for_a_models_speed() -> None:
    """The runs before a host's first report (a load's cold ones) are left out, and the
    mean needs OBSERVED_MIN_EXECUTIONS after them."""
    core = ControllerCore(
        {"a": _entry("a")}, {}, ControllerSettings(settle_s=1.0, interval_s=5.0), started=0.0
    )

    def report(uptime: float, runs: int, spent_ns: int) -> None:
        status = _status("n1", uptime, {"a": runs})
        status["models"][0].update(executions=runs, compute_ns=spent_ns)
        core.on_status("n1", status, now=uptime)

    cold = 8 * 150_000_000  # 8 cold runs at 150 ms each
    report(1.0, 8, cold)
    (profile,) = core.profiles_for(core.catalogue["a"])
    assert profile.a_s + profile.beta_s < 0.05  # the default plan, not 150 ms a run
    report(6.0, 8 + 10, cold + 10 * 21_000_000)  # 10 warm runs: too few yet
    (profile,) = core.profiles_for(core.catalogue["a"])
    assert profile.a_s + profile.beta_s < 0.01
    report(11.0, 8 + 60, cold + 60 * 21_000_000)
    (profile,) = core.profiles_for(core.catalogue["a"])
    assert abs(profile.a_s + profile.beta_s - 0.021) < 1e-9  # the warm runs' mean alone


def test_a_broker_outage_is_not_every_nodes_silence() -> None:
    """Nothing is heard while the broker is away: after a 20 s outage the first step
    took every node that had not reported yet offline, and unplaced their models."""
    core = _core([_entry("a"), _entry("b")])
    timed = {"interval_s": 5.0}
    core.on_status("n1", {**_status("n1", 1.0), **timed}, now=1.0)
    core.on_status("n2", {**_status("n2", 1.0), **timed}, now=1.0)
    assert core.step(2.0) is not None
    core.view.connected(25.0)  # the broker was away from 5 s to 25 s
    core.on_status("n1", {**_status("n1", 25.2), **timed}, now=25.2)
    assert core.step(25.5) is None and len(core.view.online()) == 2  # n2 not heard yet
    core.on_status("n2", {**_status("n2", 27.0), **timed}, now=27.0)
    assert core.step(27.5) is None and len(core.view.online()) == 2


def test_an_unhosted_models_memory_is_the_larger_of_its_measure_and_the_repositorys() -> None:
    core = ControllerCore(  # (no tuned profile: memory comes from measurements)
        {"a": _entry("a")}, {}, ControllerSettings(settle_s=1.0, interval_s=5.0), started=0.0
    )
    status = _status("n1", 1.0, {"a": 1})
    status["models"][0]["memory_bytes"] = 98_000_000
    core.on_status("n1", status, now=1.0)
    (hosted,) = core.profiles_for(core.catalogue["a"])
    assert hosted.memory_bytes == 98_000_000  # measured where it runs
    core.on_status("n1", {"node": "n1", "state": "offline"})
    (kept,) = core.profiles_for(core.catalogue["a"])
    assert kept.memory_bytes == 98_000_000  # remembered, not the file's 50 MiB
    bigger = ModelEntry("a", core.catalogue["a"].policy, ("onnxruntime",), 1_200_000_000, 8)
    core.on_catalogue({"a": bigger})
    (grown,) = core.profiles_for(core.catalogue["a"])
    assert grown.memory_bytes == 1_200_000_000  # a new, bigger version: the repository's


def test_a_broker_restart_moves_nothing_while_the_nodes_reconnect() -> None:
    """A broker that stops publishes every client's will: the controller, back first,
    read the fleet as offline and moved models off nodes back half a second later."""
    core = _core([_entry("a"), _entry("b")])
    core.on_status("n1", _status("n1", 1.0))
    core.on_status("n2", _status("n2", 1.0))
    first = core.step(2.0)
    assert first is not None
    hosting = {n: {c.model: 1 for c in first.placement.on_node(n)} for n in ("n1", "n2")}
    core.reconnected(30.0, nodes_back_within_s=8.0)
    core.on_status("n1", {"node": "n1", "state": "offline"})  # retained wills
    core.on_status("n2", {"node": "n2", "state": "offline"})
    core.on_status("n2", _status("n2", 31.0, hosting["n2"]))  # n2 is back first
    assert core.step(30.5) is None and core.step(34.0) is None  # not before n1 could be
    core.on_status("n1", _status("n1", 36.0, hosting["n1"]))
    assert core.step(38.5) is None  # the same fleet: nothing moves
    assert core.current is not None and core.current.generation == first.placement.generation


def _missing(node: str, uptime: float, misses: dict[str, int], hosted=None) -> dict:
    return {**_status(node, uptime, hosted), "misses": misses}


def test_an_idle_model_is_loaded_on_its_first_miss_and_unloaded_once_idle_again() -> None:
    # min_copies = 0: misses turned into a rate only, and a few a minute never moved it
    # by min_rate_change (0.5 req/s): the model was never loaded; once loaded by a burst,
    # its rate decayed to ~0 by less than that and it stayed loaded for good.
    entries = [_entry("a"), _entry("idle", rate=0.0, min_copies=0)]
    core = _core(entries, idle_unload_s=60.0, interval_s=60.0)
    core.on_status("n1", _status("n1", 1.0), now=1.0)
    first = core.step(2.0)
    assert first is not None and {c.model for c in first.placement.copies} == {"a"}
    assert core.step(20.0) is None  # no traffic: stays unloaded
    core.on_status("n1", _missing("n1", 21.0, {"idle": 1}), now=21.0)  # one request
    step = core.step(21.5)  # at once, not at the next interval (60 s on)
    assert step is not None and "idle" in step.reason
    assert ("idle", "n1") in {(c.model, c.node) for c in step.placement.copies}
    hosted = {"a": 0, "idle": 2}  # a few requests on its copy, then none
    for t in (30.0, 40.0, 60.0, 75.0):
        core.on_status("n1", _missing("n1", t, {"idle": 1}, hosted), now=t)
        assert core.step(t + 0.5) is None  # in use: kept
    for t in (100.0, 130.0, 141.0):
        core.on_status("n1", _missing("n1", t, {"idle": 1}, hosted), now=t)
        step = core.step(t + 0.5)
        if step is not None:
            break
    assert step is not None and "idle for 60 s" in step.reason
    assert {c.model for c in step.placement.copies} == {"a"}
    # (its tiny plan while in use raised no over-provisioned alert)
    assert all(alert.model != "idle" for alert in core.alerts())


def test_a_restarted_controller_takes_old_misses_as_no_news() -> None:
    # A node's miss counter only grows: a new controller had read its first status's
    # count as fresh misses and reloaded every idle min_copies = 0 model it ever missed.
    core = _core([_entry("a"), _entry("idle", rate=0.0, min_copies=0)], idle_unload_s=60.0)
    core.on_status("n1", _missing("n1", 500.0, {"idle": 7}), now=1.0)
    first = core.step(2.0)
    assert first is not None and {c.model for c in first.placement.copies} == {"a"}
    core.on_status("n1", _missing("n1", 505.0, {"idle": 7}), now=6.0)
    assert core.step(6.5) is None  # still no news
    core.on_status("n1", _missing("n1", 510.0, {"idle": 8}), now=11.0)  # a new miss
    step = core.step(11.5)
    assert step is not None and "idle" in {c.model for c in step.placement.copies}
