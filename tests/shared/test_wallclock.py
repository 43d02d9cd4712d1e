from shared.wallclock import WallClock


def test_a_step_is_told_once_with_when_its_old_stamps_began():
    t = {"wall": 5000.0, "elapsed": 10.0}
    clock = WallClock(lambda: t["wall"], lambda: t["elapsed"])
    t["wall"] += 86_400.0
    now, step = clock.read()
    assert now == 86_400.0 + 5000.0 and step is not None
    assert step.delta_s == 86_400.0 and step.since == 5000.0
    assert clock.read()[1] is None  # told once
    t["wall"] -= 3600.0  # stepped back: the stamps since the last step move back
    now, step = clock.read()
    assert step is not None and step.delta_s == -3600.0 and step.since == 86_400.0 + 5000.0


def test_time_passing_a_suspend_or_a_slew_is_no_step():
    t = {"wall": 5000.0, "elapsed": 10.0}
    clock = WallClock(lambda: t["wall"], lambda: t["elapsed"])
    for _ in range(100):  # a suspend runs both clocks; NTP's slew moves one by 1 s a read
        t["wall"] += 600.0 + 1.0
        t["elapsed"] += 600.0
        assert clock.read()[1] is None


def test_the_default_clocks_read_without_a_step():
    assert WallClock().read()[1] is None


def test_a_mark_of_the_same_boot_tells_a_step_taken_between_two_processes():
    t = {"wall": 5000.0, "elapsed": 10.0}
    before = WallClock(lambda: t["wall"], lambda: t["elapsed"], boot="b")
    mark = before.mark()
    t["wall"] += 3600.0 + 1.0  # stepped while no process ran; a second passed
    t["elapsed"] += 1.0
    step = WallClock(lambda: t["wall"], lambda: t["elapsed"], boot="b").resume(mark)
    assert step is not None and step.delta_s == 3600.0 and step.since == 5000.0
    assert WallClock(lambda: t["wall"], lambda: t["elapsed"], boot="c").resume(mark) is None
    # no step: the new process's clock began with the old one's
    same = WallClock(lambda: t["wall"], lambda: t["elapsed"], boot="b")
    assert same.resume((*same.mark()[:2], 4000.0)) is None and same.mark()[2] == 4000.0


def test_a_second_step_moves_the_stamps_the_first_one_moved():
    t = {"wall": 5000.0, "elapsed": 10.0}
    clock = WallClock(lambda: t["wall"], lambda: t["elapsed"], boot="b")
    t["wall"] += 86_400.0
    first = clock.read()[1]
    t["wall"] += 86_400.0
    second = clock.read()[1]
    assert first is not None and second is not None
    assert second.since == first.since + first.delta_s  # where the first left them
    # across processes alike
    mark = clock.mark()
    t["wall"] += 3600.0
    later = WallClock(lambda: t["wall"], lambda: t["elapsed"], boot="b")
    step = later.resume(mark)
    assert step is not None and later.mark()[2] <= step.since + step.delta_s
