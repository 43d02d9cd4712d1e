from edge.core.breaker import CircuitBreaker


def test_opens_after_consecutive_failures_and_probes_back():
    b = CircuitBreaker(failures=3, cooldown_s=2.0)
    for t in (0.0, 0.1):
        b.record_failure(t)
    assert b.state == "closed" and b.allow(0.2)
    b.record_success(0.3)  # a success resets the count
    for t in (1.0, 1.1, 1.2):
        b.record_failure(t)
    assert b.state == "open" and b.opened_count == 1
    assert not b.allow(2.0)
    assert b.allow(3.3) and b.state == "half_open"
    assert not b.allow(3.4)  # exactly one trial at a time
    b.record_success(3.5)
    assert b.state == "closed" and b.allow(3.6)


def test_failed_trials_back_off_exponentially_up_to_the_cap():
    b = CircuitBreaker(failures=1, cooldown_s=1.0, max_cooldown_s=4.0)
    b.record_failure(0.0)
    t = 0.0
    waits = []
    for _ in range(4):
        opened_at = t
        while not b.allow(t):
            t += 0.25
        waits.append(t - opened_at)
        b.record_failure(t)
    assert waits == [1.0, 2.0, 4.0, 4.0]


def test_a_closed_breaker_forgets_its_backoff_and_the_next_outage_opens_for_the_base_cooldown():
    b = CircuitBreaker(failures=1, cooldown_s=1.0, max_cooldown_s=8.0)
    b.record_failure(0.0)  # open until 1
    now = 0.0
    for _ in range(5):  # every trial fails: backed off to the cap
        now = now + 9.0
        assert b.allow(now)
        b.record_failure(now)
    assert not b.allow(now + 7.9)  # the cap: 8 s
    assert b.allow(now + 8.1)
    b.record_success(now + 8.1)  # back: closed
    b.record_failure(100.0)  # a new outage
    assert not b.allow(100.9) and b.allow(101.1)  # the base cooldown again, not 8 s
