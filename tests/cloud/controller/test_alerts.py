"""Utilisation alerts flag models far below or above what they were planned for."""

from __future__ import annotations

from cloud.controller.alerts import OVER, UNDER, UNPLACED, AlertSettings, UtilisationTracker
from cloud.placement.types import Placement


def _tracker(observed: float, planned: float, samples: int = 5) -> UtilisationTracker:
    tracker = UtilisationTracker(AlertSettings(window_s=60, low=0.25, high=1.25, min_samples=3))
    for t in range(samples):  # (one every 10 s: the window is 60 s)
        tracker.observe(10.0 * t, "m", observed, planned)
    return tracker


def test_a_model_using_a_tenth_of_its_plan_is_over_provisioned() -> None:
    alerts = _tracker(1.0, 10.0).alerts(None)
    assert [(a.model, a.kind) for a in alerts] == [("m", OVER)]
    assert alerts[0].utilisation == 0.1


def test_a_model_above_its_plan_is_under_provisioned() -> None:
    assert [a.kind for a in _tracker(15.0, 10.0).alerts(None)] == [UNDER]
    assert _tracker(11.0, 10.0).alerts(None) == []  # within the re-placement tolerance


def test_a_model_within_its_plan_raises_nothing() -> None:
    assert _tracker(6.0, 10.0).alerts(None) == []


def test_a_model_planned_at_next_to_nothing_is_not_over_provisioned() -> None:
    # an idle model woken by a request is planned at ~0: "lower min_copies" was noise
    assert _tracker(0.0, 3e-11).alerts(None) == []


def test_a_short_window_does_not_speak_yet() -> None:
    assert _tracker(1.0, 10.0, samples=2).alerts(None) == []


def test_old_samples_leave_the_window() -> None:
    tracker = _tracker(1.0, 10.0)
    for t in range(100, 105):
        tracker.observe(10.0 * t, "m", 8.0, 10.0)
    assert tracker.alerts(None) == []
    assert tracker.window("m")[2] == 5


def test_a_new_plan_is_judged_on_its_own_samples_over_half_a_window() -> None:
    # Alerts fired half a second after the first placement, the samples taken before
    # it (planned 0) averaged in: "0.00 req/s measured against 4.00 planned" for a plan
    # of 10.
    tracker = UtilisationTracker(AlertSettings(window_s=60, min_samples=3))
    for t in range(20):
        tracker.observe(float(t), "m", 0.0, 0.0)  # before any placement
    for t in range(20, 24):
        tracker.observe(t + 0.1, "m", 0.0, 10.0)  # placed: nothing measured yet
    assert tracker.window("m")[1] == 10.0  # the new plan alone
    assert tracker.alerts(None) == []  # 3 s of it: too soon to say
    for t in range(24, 60):
        tracker.observe(float(t), "m", 0.0, 10.0)
    assert [a.kind for a in tracker.alerts(None)] == [OVER]


def test_an_unplaced_model_is_an_alert_but_an_idle_one_is_not() -> None:
    placement = Placement(unplaced={"big": "needs 9 GiB, largest node has 8 GiB", "cold": "idle"})
    alerts = UtilisationTracker().alerts(placement)
    assert [(a.model, a.kind) for a in alerts] == [("big", UNPLACED)]
    assert "9 GiB" in alerts[0].message


def test_tracked_models_are_bounded() -> None:
    tracker = UtilisationTracker(AlertSettings(max_models=2))
    for name in "abc":
        tracker.observe(0.0, name, 1.0, 1.0)
    assert tracker.window("c")[2] == 0
