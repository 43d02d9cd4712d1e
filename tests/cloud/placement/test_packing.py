"""Batching-aware packing: always feasible, never below the lower bound, optimal on
small instances, and incremental (few moves)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cloud.placement.bounds import lower_bounds
from cloud.placement.packing import Headroom, check, moves, optimal_nodes, place
from cloud.placement.types import LatencyProfile, ModelDemand, NodeSpec, Placement

GIB = 1 << 30
MIB = 1 << 20


def _profile(
    backend: str = "onnxruntime",
    a_ms: float = 2.0,
    beta_ms: float = 0.8,
    memory_mib: int = 100,
    max_batch: int = 32,
) -> LatencyProfile:
    return LatencyProfile(backend, a_ms / 1000, beta_ms / 1000, max_batch, memory_mib * MIB)


def _model(name: str, rate: float, slo_ms: float = 100.0, **kw) -> ModelDemand:
    profiles = kw.pop("profiles", None) or (_profile(),)
    return ModelDemand(name, rate, slo_ms / 1000, tuple(profiles), **kw)


def _nodes(n: int, memory: int = 4 * GIB, backends=("onnxruntime",)) -> list[NodeSpec]:
    return [NodeSpec(f"n{i}", memory, frozenset(backends)) for i in range(n)]


@st.composite
def instances(draw, max_models: int = 12, max_nodes: int = 8):
    count = draw(st.integers(1, max_models))
    models = []
    for i in range(count):
        backend = draw(st.sampled_from(["onnxruntime", "openvino"]))
        profile = _profile(
            backend,
            a_ms=draw(st.floats(0.5, 10)),
            beta_ms=draw(st.floats(0.1, 5)),
            memory_mib=draw(st.integers(10, 3000)),
            max_batch=draw(st.sampled_from([1, 4, 8, 32])),
        )
        models.append(
            _model(
                f"m{i}",
                draw(st.sampled_from([0.0, 0.5, 5.0, 50.0, 400.0, 2000.0])),
                slo_ms=draw(st.floats(20, 500)),
                profiles=(profile,),
                min_copies=draw(st.integers(0, 3)),
                max_copies=draw(st.sampled_from([0, 0, 2, 4])),
            )
        )
    nodes = []
    for i in range(draw(st.integers(1, max_nodes))):
        nodes.append(
            NodeSpec(
                f"n{i}",
                draw(st.sampled_from([2 * GIB, 4 * GIB, 8 * GIB])),
                frozenset(
                    draw(
                        st.sampled_from(
                            [["onnxruntime"], ["openvino"], ["onnxruntime", "openvino"]]
                        )
                    )
                ),
                speed=draw(st.sampled_from([1.0, 1.0, 2.0])),
            )
        )
    return models, nodes


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances())
def test_every_placement_keeps_memory_backend_and_latency_feasible(instance) -> None:
    models, nodes = instance
    placement = place(models, nodes)
    assert check(placement, models, nodes) == []
    placed = {c.model for c in placement.copies}
    for m in models:
        assert m.name in placed or m.name in placement.unplaced, m.name


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances())
def test_never_fewer_nodes_than_the_lower_bound(instance) -> None:
    models, nodes = instance
    placement = place(models, nodes)
    if placement.unplaced:
        return  # the bound counts only placeable models; partial fleets are not graded
    assert len(placement.nodes_used()) >= lower_bounds(models, nodes).nodes


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances(max_models=5, max_nodes=4))
def test_small_instances_use_the_exact_minimum_of_nodes(instance) -> None:
    models, nodes = instance
    placement = place(models, nodes)
    if placement.unplaced or sum(len(placement.copies_of(m.name)) for m in models) > 7:
        return
    assert len(placement.nodes_used()) == optimal_nodes(models, nodes)


def test_a_hot_model_is_split_into_whole_node_copies_plus_a_shared_rest() -> None:
    models = [_model("hot", 3000.0), _model("cold", 2.0)]
    placement = place(models, _nodes(10))
    hot = placement.copies_of("hot")
    assert len(hot) >= 2
    assert sum(c.rate for c in hot) >= 3000 - 1e-6
    assert len({c.node for c in hot}) == len(hot)  # one copy per node
    assert check(placement, models, _nodes(10)) == []


def test_min_copies_go_to_distinct_nodes_and_max_copies_caps() -> None:
    models = [_model("spread", 1.0, min_copies=3), _model("capped", 5000.0, max_copies=2)]
    placement = place(models, _nodes(6))
    assert len({c.node for c in placement.copies_of("spread")}) == 3
    assert len(placement.copies_of("capped")) == 2


def test_infeasible_models_are_reported_with_a_reason_never_dropped() -> None:
    models = [
        _model("huge", 1.0, profiles=(_profile(memory_mib=9000),)),
        _model("gpu-only", 1.0, profiles=(_profile("tensorrt"),)),
        _model("too-tight", 1.0, slo_ms=3.0, profiles=(_profile(a_ms=5.0),)),
        _model("idle", 0.0, min_copies=0),
        _model("fine", 1.0),
    ]
    placement = place(models, _nodes(2))
    assert "9000 MiB" in placement.unplaced["huge"]
    assert "tensorrt" in placement.unplaced["gpu-only"]
    assert "below twice the batch-1 latency" in placement.unplaced["too-tight"]
    assert placement.unplaced["idle"] == "idle"
    assert [c.model for c in placement.copies] == ["fine"]


def test_a_placement_recomputed_from_the_same_input_is_the_same_and_moves_nothing() -> None:
    models = [_model(f"m{i}", rate=float(i * 40), min_copies=i % 3) for i in range(15)]
    nodes = _nodes(8)
    first = place(models, nodes)
    again = place(models, nodes, first)
    assert again == first
    assert moves(first, again) == []


def test_losing_a_node_moves_only_that_nodes_copies() -> None:
    models = [_model(f"m{i}", rate=float(20 + i * 30)) for i in range(12)]
    nodes = _nodes(8, memory=GIB)
    first = place(models, nodes)
    victim = sorted(first.nodes_used())[0]
    survivors = [n for n in nodes if n.name != victim]
    second = place(models, survivors, first)
    assert check(second, models, survivors) == []
    changed = moves(first, second)
    lost = {c.model for c in first.on_node(victim)}
    assert {m.model for m in changed if m.op == "load"} <= lost
    assert {m.node for m in changed if m.op == "unload"} == {victim}
    assert second.generation == first.generation + 1


def test_a_rate_change_on_one_model_moves_few_models() -> None:
    models = [_model(f"m{i}", rate=30.0) for i in range(20)]
    nodes = _nodes(10, memory=GIB)
    first = place(models, nodes)
    busier = [*models[:-1], _model("m19", rate=900.0)]
    second = place(busier, nodes, first)
    assert check(second, busier, nodes) == []
    assert all(m.model == "m19" for m in moves(first, second))


def test_a_new_node_takes_the_copy_min_copies_could_not_place_before() -> None:
    models = [_model("spread", 1.0, min_copies=3)]
    first = place(models, _nodes(2))
    assert len(first.copies_of("spread")) == 2
    second = place(models, _nodes(3), first)
    assert [(m.op, m.node) for m in moves(first, second)] == [("load", "n2")]


def test_bursty_headroom_plans_bigger_batches_than_poisson() -> None:
    models = [_model("m", 300.0)]
    poisson = place(models, _nodes(4), headroom=Headroom(cv=1.0)).copies[0]
    bursty = place(models, _nodes(4), headroom=Headroom(cv=2.0)).copies[0]
    assert bursty.batch / bursty.duty_cycle_s >= poisson.batch / poisson.duty_cycle_s * 0.99
    assert bursty.batch >= poisson.batch or bursty.duty_cycle_s < poisson.duty_cycle_s


def test_the_placement_round_trips_through_its_document() -> None:
    placement = place([_model("a", 10.0), _model("b", 100.0)], _nodes(2))
    assert Placement.from_dict(placement.to_dict()) == placement
