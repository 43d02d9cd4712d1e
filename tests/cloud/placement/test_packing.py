"""Batching-aware packing: always feasible, never below the lower bound, optimal on
small instances, honest about what it cannot place, and incremental (few moves)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cloud.placement.bounds import bound_sums
from cloud.placement.packing import Headroom, check, lower_bounds, moves, optimal_nodes, place
from cloud.placement.sizing import fits, full_rate, occupancy, size, together
from cloud.placement.turns import SAFETY
from cloud.placement.types import LatencyProfile, ModelDemand, NodeSpec, Placement

GIB = 1 << 30
MIB = 1 << 20
MEANS = Headroom(quantile=0.5, cv=0.0)
SETTINGS = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}


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


BACKENDS = [["onnxruntime"], ["openvino"], ["onnxruntime", "openvino"]]


@st.composite
def instances(draw, max_models: int = 12, max_nodes: int = 8):
    models = []
    for i in range(draw(st.integers(1, max_models))):
        profiles = []
        for backend in draw(st.sampled_from(BACKENDS)):
            profiles.append(
                _profile(
                    backend,
                    a_ms=draw(st.floats(0.5, 10)),
                    beta_ms=draw(st.floats(0.1, 5)),
                    memory_mib=draw(st.integers(10, 3000)),
                    max_batch=draw(st.sampled_from([1, 4, 8, 32])),
                )
            )
        models.append(
            _model(
                f"m{i}",
                draw(st.sampled_from([0.0, 0.5, 5.0, 50.0, 400.0, 2000.0])),
                slo_ms=draw(st.floats(20, 500)),
                profiles=tuple(profiles),
                min_copies=draw(st.integers(0, 3)),
                max_copies=draw(st.sampled_from([0, 0, 2, 4])),
            )
        )
    nodes = [
        NodeSpec(
            f"n{i}",
            draw(st.sampled_from([2 * GIB, 4 * GIB, 8 * GIB])),
            frozenset(draw(st.sampled_from(BACKENDS))),
            speed=draw(st.sampled_from([1.0, 1.0, 2.0])),
        )
        for i in range(draw(st.integers(1, max_nodes)))
    ]
    headroom = draw(st.sampled_from([Headroom(), MEANS, Headroom(cv=2.0)]))
    return models, nodes, headroom


@settings(max_examples=120, **SETTINGS)
@given(instances())
def test_every_placement_keeps_memory_backend_latency_and_copy_rules(instance) -> None:
    models, nodes, headroom = instance
    placement = place(models, nodes, headroom=headroom)
    assert check(placement, models, nodes, headroom) == []
    for m in models:  # placed in full, or the reason is given
        assert m.name in placement.unplaced or placement.copies_of(m.name), m.name
    assert Placement.from_dict(placement.to_dict()) == placement


@settings(max_examples=100, **SETTINGS)
@given(instances())
def test_a_complete_placement_never_uses_fewer_nodes_than_the_lower_bound(instance) -> None:
    models, nodes, headroom = instance
    placement = place(models, nodes, headroom=headroom)
    assert placement.bounds == lower_bounds(models, nodes, headroom)
    if any(why != "idle" for why in placement.unplaced.values()):
        return  # the bound is for placements that serve every model
    assert len(placement.nodes_used()) >= placement.bounds.nodes


@st.composite
def small_instances(draw):
    """Mostly feasible instances with copies of a tenth to a whole node each: where
    greedy packing can go wrong and brute force is still cheap."""
    models = []
    for i in range(draw(st.integers(2, 6))):
        backends = draw(st.sampled_from([["onnxruntime"], ["onnxruntime", "openvino"]]))
        profiles = tuple(
            _profile(
                b,
                a_ms=draw(st.floats(0.5, 8)),
                beta_ms=draw(st.floats(0.2, 1.5)),
                memory_mib=draw(st.integers(10, 1000)),
                max_batch=draw(st.sampled_from([4, 8, 32])),
            )
            for b in backends
        )
        models.append(
            _model(
                f"m{i}",
                draw(st.floats(5, 400)),
                slo_ms=draw(st.floats(30, 500)),
                profiles=profiles,
                min_copies=draw(st.sampled_from([0, 1, 1, 2])),
            )
        )
    nodes = [
        NodeSpec(
            f"n{i}",
            draw(st.sampled_from([2 * GIB, 4 * GIB])),
            frozenset(draw(st.sampled_from(BACKENDS[::2]))),
            speed=draw(st.sampled_from([1.0, 1.0, 1.5])),
        )
        for i in range(draw(st.integers(3, 5)))
    ]
    return models, nodes, draw(st.sampled_from([Headroom(), MEANS]))


@settings(max_examples=100, **SETTINGS)
@given(small_instances())
def test_small_instances_use_the_exact_minimum_of_nodes(instance) -> None:
    models, nodes, headroom = instance
    placement = place(models, nodes, headroom=headroom)
    if any(why != "idle" for why in placement.unplaced.values()) or len(placement.copies) > 7:
        return
    assert len(placement.nodes_used()) == optimal_nodes(models, nodes, headroom)


@settings(max_examples=100, **SETTINGS)
@given(small_instances())
def test_brute_force_never_beats_the_lower_bound(instance) -> None:
    models, nodes, headroom = instance
    placement = place(models, nodes, headroom=headroom)
    if any(why != "idle" for why in placement.unplaced.values()) or len(placement.copies) > 7:
        return
    best = optimal_nodes(models, nodes, headroom)
    assert best is not None
    assert best >= lower_bounds(models, nodes, headroom).nodes


def test_the_lower_bound_is_at_least_designs_and_below_one_models_placement() -> None:
    model = _model("m", 100.0, slo_ms=50.0, profiles=(_profile(a_ms=2.0, beta_ms=1.0),))
    design = 100 * 0.001 * 0.05 / (0.05 - 0.002)  # DESIGN.md: r*beta*L/(L - a)
    compute, _ = bound_sums([model], _nodes(3))
    assert compute >= design
    # the batching overhead at the most any schedule can batch: windows of L - l(1)
    windows = 100 / (1 + 100 * (0.05 - 0.003)) - 0.01 * 100
    assert compute == pytest.approx(100 * 0.001 + 0.002 * windows)
    placed = place([model], _nodes(3)).copies[0]
    assert placed.occupancy >= compute  # Ferry's batcher on a node batches less


def test_a_hot_model_is_split_into_whole_node_copies_plus_a_shared_rest() -> None:
    models = [_model("hot", 3000.0), _model("cold", 2.0)]
    nodes = _nodes(10)
    placement = place(models, nodes)
    hot = placement.copies_of("hot")
    top = full_rate(_profile(), 0.1, 1.0, Headroom())
    assert len(hot) >= math.ceil(3000 / top) >= 3
    assert sum(c.rate for c in hot) >= 3000 - 1e-6
    alone = [c for c in hot if placement.on_node(c.node) == [c]]
    assert sum(1 for c in alone if c.rate == pytest.approx(top)) >= 2  # whole-node copies
    assert len({c.node for c in hot}) == len(hot)
    assert check(placement, models, nodes) == []


def test_copies_with_like_objectives_share_a_node_and_take_turns() -> None:
    models = [_model(f"m{i}", 40.0, slo_ms=100.0) for i in range(6)]
    placement = place(models, _nodes(6))
    assert len(placement.nodes_used()) == 1  # six models, one node: they take turns
    cycle = {c.duty_cycle_s for c in placement.copies}
    assert len(cycle) == 1  # one cycle of turns for the node
    (duty,) = cycle
    for c in placement.copies:  # each runs what arrives in a cycle
        assert c.batch == max(1, math.ceil(c.rate * duty - 1e-9))
    assert check(placement, models, _nodes(6)) == []


def test_min_copies_go_to_distinct_nodes_and_max_copies_caps() -> None:
    models = [_model("spread", 1.0, min_copies=3), _model("capped", 5000.0, max_copies=2)]
    nodes = _nodes(6)
    placement = place(models, nodes)
    assert len({c.node for c in placement.copies_of("spread")}) == 3
    assert len(placement.copies_of("capped")) == 2
    assert "capped at max_copies 2" in placement.unplaced["capped"]
    assert check(placement, models, nodes) == []


def test_absurd_rates_and_copy_counts_plan_what_the_nodes_hold_at_once() -> None:
    # rate = 1e300 built a list of 1e300 copies (OverflowError, the controller died);
    # min_copies = 1e9 a list of a billion (the loop froze, 3.6 GB in 10 s).
    nodes = _nodes(3)
    flood = place([_model("flood", 1e300)], nodes)
    assert len(flood.copies_of("flood")) == 3 and "only 3 nodes" in flood.unplaced["flood"]
    many = place([_model("many", 1.0, min_copies=10**9)], nodes)
    assert len(many.copies_of("many")) == 3
    assert "3 of min_copies 1000000000" in many.unplaced["many"]


def test_infeasible_models_are_reported_with_a_reason_never_dropped() -> None:
    models = [
        _model("huge", 1.0, profiles=(_profile(memory_mib=9000),)),
        _model("gpu-only", 1.0, profiles=(_profile("tensorrt"),)),
        _model("too-tight", 1.0, slo_ms=3.0, profiles=(_profile(a_ms=3.0),)),
        _model("idle", 0.0, min_copies=0),
        _model("fine", 1.0),
    ]
    nodes = _nodes(2)
    placement = place(models, nodes)
    assert placement.unplaced["huge"] == (
        "needs 8.8 GiB, the largest node that runs it offers 4.0 GiB"
    )
    assert placement.unplaced["gpu-only"] == "no node runs backend tensorrt"
    assert placement.unplaced["too-tight"].startswith("SLO 3.0 ms below 3.8 ms")
    assert placement.unplaced["idle"] == "idle"
    assert [c.model for c in placement.copies] == ["fine"]
    assert check(placement, models, nodes) == []


def test_a_full_fleet_keeps_a_copy_of_each_model_and_says_what_found_no_room() -> None:
    # min_copies holds while there is room at all: a model left with no copy answered
    # every request 503, where one planned below its rate serves what the room allows
    models = [_model(f"m{i}", 700.0) for i in range(4)]  # over half a node each
    nodes = _nodes(1)
    placement = place(models, nodes)
    assert sorted(c.model for c in placement.copies) == ["m0", "m1", "m2", "m3"]
    assert placement.copies_of("m0")[0].rate == 700.0
    assert sorted(placement.unplaced) == ["m1", "m2", "m3"]
    for name in ("m1", "m2", "m3"):
        planned = placement.copies_of(name)[0].rate
        assert 0 < planned < 700.0
        assert placement.unplaced[name] == (
            f"no room on the 1 nodes for 700.0 req/s: one copy planned for {planned:.1f} req/s"
        )
    assert check(placement, models, nodes) == []


def test_a_rate_past_the_fleet_neither_unplaces_that_model_nor_crowds_out_the_rest() -> None:
    # [placement] rate = 50000 on a 3-node fleet: first its whole-node copies took every
    # node and the models that fit went unserved; then, packed last, it found no room and
    # its only copy was unloaded
    models = [_model("hot", 50_000.0), *(_model(n, 300.0) for n in ("a", "b", "c"))]
    nodes = _nodes(3)
    placement = place(models, nodes)
    assert {c.model for c in placement.copies} == {"hot", "a", "b", "c"}
    assert all(placement.copies_of(n)[0].rate == 300.0 for n in ("a", "b", "c"))
    assert sorted(placement.unplaced) == ["hot"]
    assert "plans" in placement.unplaced["hot"] and "of 50000.0 req/s" in placement.unplaced["hot"]
    again = place(models, nodes, placement)
    assert again.copies == placement.copies and again.generation == placement.generation
    # the model alone past what the room left holds: one copy, planned for what fits
    crowded = [_model("hot", 50_000.0), *(_model(f"f{i}", 900.0) for i in range(3))]
    squeezed = place(crowded, nodes)
    assert len(squeezed.copies_of("hot")) == 1
    assert "one copy planned for" in squeezed.unplaced["hot"]
    assert check(squeezed, crowded, nodes) == []


def test_a_model_its_own_max_copies_caps_packs_as_any_other() -> None:
    # max_copies is the operator's cap, not the fleet's reach: such a model went in last
    # and lost the room its copies had (2 whole-node copies became 1)
    models = [_model("hot", 2500.0, max_copies=2), _model("s0", 700.0), _model("s1", 700.0)]
    placement = place(models, _nodes(3))
    assert len(placement.copies_of("hot")) == 2
    assert placement.unplaced["hot"].startswith("capped at max_copies 2: plans")


def test_a_placement_recomputed_from_the_same_input_is_equal_and_moves_nothing() -> None:
    models = [_model(f"m{i}", rate=float(i * 40), min_copies=i % 3) for i in range(15)]
    nodes = _nodes(8)
    first = place(models, nodes)
    again = place(models, nodes, first)
    assert again == first
    assert moves(first, again) == []
    restarted = place(models, nodes, Placement.from_dict(first.to_dict()))
    assert restarted == first


@settings(max_examples=80, **SETTINGS)
@given(instances())
def test_re_placing_unchanged_input_is_a_fixed_point(instance) -> None:
    models, nodes, headroom = instance
    first = place(models, nodes, headroom=headroom)
    again = place(list(reversed(models)), list(reversed(nodes)), first, headroom=headroom)
    assert again == first


@settings(max_examples=80, **SETTINGS)
@given(instances(), st.data())
def test_re_placing_after_a_change_keeps_every_invariant(instance, data) -> None:
    models, nodes, headroom = instance
    first = place(models, nodes, headroom=headroom)
    if len(nodes) > 1 and data.draw(st.booleans()):
        nodes = nodes[:-1]
    else:
        i = data.draw(st.integers(0, len(models) - 1))
        models = [*models[:i], _model(models[i].name, 300.0, profiles=models[i].profiles)]
    second = place(models, nodes, first, headroom=headroom)
    assert check(second, models, nodes, headroom) == []
    assert second.generation in (first.generation, first.generation + 1)


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


def test_a_rate_change_on_one_model_moves_only_that_model() -> None:
    models = [_model(f"m{i}", rate=30.0, slo_ms=100.0 + 10 * i) for i in range(20)]
    nodes = _nodes(10, memory=GIB)
    first = place(models, nodes)
    busier = [*models[:-1], _model("m19", rate=900.0, slo_ms=290.0)]
    second = place(busier, nodes, first)
    assert check(second, busier, nodes) == []
    assert {m.model for m in moves(first, second)} == {"m19"}


def test_a_new_node_takes_the_copy_min_copies_could_not_place_before() -> None:
    models = [_model("spread", 1.0, min_copies=3)]
    first = place(models, _nodes(2))
    assert len(first.copies_of("spread")) == 2
    assert "only 2 nodes" in first.unplaced["spread"]
    second = place(models, _nodes(3), first)
    assert [(m.op, m.node) for m in moves(first, second)] == [("load", "n2")]
    assert second.unplaced == {}


def test_bursty_headroom_plans_more_than_poisson_which_plans_more_than_means() -> None:
    needs = [
        size(_profile(), 300.0, 0.1, 1.0, h).theta for h in (MEANS, Headroom(), Headroom(cv=2))
    ]
    assert needs[0] < needs[1] < needs[2] <= 1
    models = [_model(f"m{i}", 150.0) for i in range(6)]
    used = [len(place(models, _nodes(8), headroom=h).nodes_used()) for h in (MEANS, Headroom())]
    assert used[0] <= used[1]


def test_headroom_is_the_share_in_time_and_its_normal_quantile() -> None:
    assert Headroom().late == pytest.approx(0.01)
    assert Headroom().z == pytest.approx(2.3263, abs=1e-4)
    assert MEANS.z == 0 and MEANS.late == 0.5
    assert Headroom(cv=2).burst == 4 and Headroom(cv=0.5).burst == 1


def test_a_nodes_copies_fit_while_their_turns_keep_each_in_time_and_not_after() -> None:
    headroom = Headroom()
    slots = [
        size(_profile(a_ms=2, beta_ms=0.5), 100.0, 0.05, 1.0, headroom),
        size(_profile(a_ms=1, beta_ms=1.0), 20.0, 0.2, 1.0, headroom),
        size(_profile(a_ms=3, beta_ms=0.3), 200.0, 0.3, 1.0, headroom),
    ]
    found = together(slots)
    assert found.fits and occupancy(slots) <= 1
    # the mean cycle is the copies' mean work in one cycle, and at least one batch
    work = sum(
        s.a * -math.expm1(-s.rate * found.mean) + s.beta * s.rate * found.mean for s in slots
    )
    one = max(s.a + s.beta for s in slots)
    assert found.mean == pytest.approx(max(work, one), rel=1e-5)
    assert np.all(found.late <= headroom.late / SAFETY)
    # one more copy only lengthens the cycle and adds to every copy's late share
    more = together([*slots, size(_profile(a_ms=2, beta_ms=0.5), 150.0, 0.3, 1.0, headroom)])
    assert more.mean > found.mean and np.all(more.late[:3] >= found.late - 1e-12)
    # keep adding copies with the tightest objective: at some point they no longer fit
    crowd = list(slots)
    while fits(crowd):
        crowd.append(size(_profile(a_ms=2, beta_ms=0.5), 60.0, 0.05, 1.0, headroom))
    assert len(crowd) > len(slots) + 1 and occupancy(crowd) > 1


def test_check_reports_broken_invariants_in_words() -> None:
    models = [_model("a", 10.0)]
    nodes = _nodes(1, memory=50 * MIB)
    placement = place(models, _nodes(1))
    problems = check(placement, models, nodes)
    assert any("bytes placed" in p for p in problems)
    assert check(Placement(), models, nodes) == ["a missing without a reason"]


def test_moves_loads_before_unloads_and_reloads_a_backend_change() -> None:
    old = place([_model("a", 10.0)], _nodes(1))
    copy = old.copies[0]
    other = Placement((type(copy)(**{**copy.to_dict(), "backend": "openvino"}),))
    assert [(m.op, m.model, m.node) for m in moves(old, other)] == [
        ("load", "a", "n0"),
        ("unload", "a", "n0"),
    ]


def test_models_without_batching_share_a_node_and_keep_their_objectives() -> None:
    # A copy's mean arrivals per cycle had to fit max_batch - 1 with one to spare: at
    # max_batch 1 nothing was left, so an unbatched model shared no node at any rate
    # above 0 and was unloaded as soon as it had traffic.
    from bench._packing_sim import Result, simulate_node

    node = NodeSpec("n1", 24 << 30, frozenset({"onnxruntime"}), cores=2)
    demands = [
        ModelDemand("nobatch", 6.7, 0.1, (_profile(a_ms=1, beta_ms=5, max_batch=1),)),
        ModelDemand("other", 20.0, 0.1, (_profile(a_ms=2, beta_ms=3, max_batch=4),)),
        ModelDemand("idle", 0.0, 0.1, (_profile(a_ms=1, beta_ms=5, max_batch=1),)),
    ]
    placement = place(demands, [node])
    assert not placement.unplaced and {c.model for c in placement.on_node("n1")} == {
        "nobatch",
        "other",
        "idle",
    }
    result = Result()
    copies = [
        (c.model, c.rate, 0.1, p.max_batch, p.a_s, p.beta_s, 0.0)
        for c in placement.on_node("n1")
        for p in [next(d for d in demands if d.name == c.model).profiles[0]]
    ]
    simulate_node(np.random.default_rng(5), node, copies, 1.0, 600.0, result)
    for model in ("nobatch", "other"):
        assert result.within[model] >= 0.99 * result.sent[model]
    # and a hot unbatched model (its requests alone fill most of the node) is not
    # crammed beside others: past half a turn's mean arrivals it goes elsewhere
    hot = ModelDemand("hot", 150.0, 0.05, (_profile(a_ms=1, beta_ms=5, max_batch=1),))
    crowded = place([hot, demands[1]], [node])
    assert "hot" in crowded.unplaced or "other" in crowded.unplaced


def test_the_packers_inputs_refuse_what_it_cannot_plan_and_zero_memory_nodes_plan_nothing() -> None:
    with pytest.raises(ValueError, match="speed"):
        NodeSpec("n", 1 << 30, frozenset({"onnxruntime"}), speed=0.0)
    with pytest.raises(ValueError, match="rate"):
        ModelDemand("m", math.inf, 0.1, (_profile(),))
    capped = ModelDemand("m", 1.0, 0.1, (_profile(),), min_copies=2, max_copies=1)
    two = [NodeSpec(f"n{i}", 1 << 30, frozenset({"onnxruntime"})) for i in range(2)]
    assert "capped at max_copies 1" in place([capped], two).unplaced["m"]  # (said, not silent)
    # every node offering 0 bytes: nothing fits, said, and the bounds are 0 (it had
    # divided by the largest node's memory)
    nodes = [NodeSpec(f"n{i}", 0, frozenset({"onnxruntime"})) for i in range(2)]
    placement = place([ModelDemand("m", 1.0, 0.1, (_profile(memory_mib=0),))], nodes)
    assert bound_sums([ModelDemand("m", 1.0, 0.1, (_profile(memory_mib=0),))], nodes)[1] == 0.0
    assert placement.copies or placement.unplaced


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("a_s", math.nan),
        ("beta_s", math.inf),
        ("memory_bytes", -(10**12)),
        ("threads", -4),
        ("max_batch", 8.9),
        ("max_batch", True),
        ("spread_s", math.nan),
        ("backend", ""),
    ],
)
def test_a_hand_edited_profile_with_a_value_the_packer_cannot_use_is_refused(key, value) -> None:
    from shared.errors import ConfigError

    good = _profile().to_dict()
    assert LatencyProfile.from_dict(good) == _profile()
    with pytest.raises(ConfigError, match=key):
        LatencyProfile.from_dict({**good, key: value})
