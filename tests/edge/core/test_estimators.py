import json
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edge.core.estimators import Estimators, LatencyEstimator, LinkEstimator
from edge.core.quantile import Ewma, P2Quantile


@pytest.mark.parametrize("kind", ["normal", "lognormal", "sorted"])
def test_p2_quantile_tracks_numpy_percentile(kind):
    rng = np.random.default_rng(0)
    data = {
        "normal": rng.normal(10, 2, 20_000),
        "lognormal": rng.lognormal(0, 0.7, 20_000),
        "sorted": np.sort(rng.random(20_000)),
    }[kind]
    q = P2Quantile(0.95)
    for x in data:
        q.add(float(x))
    assert q.value == pytest.approx(np.percentile(data, 95), rel=0.03)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(0, 1e3), min_size=1, max_size=5))
def test_p2_quantile_is_exact_on_few_samples(xs):
    q = P2Quantile(0.5)
    for x in xs:
        q.add(x)
    assert q.value in xs


def test_ewma_moves_towards_new_samples():
    e = Ewma(0.5)
    e.add(10)
    e.add(20)
    assert e.value == 15 and e.count == 2


def test_link_estimator_recovers_a_known_link():
    rtt, up, down = 0.04, 5e6, 20e6
    link = LinkEstimator(1e6, 1e6, 0.2)
    rng = np.random.default_rng(1)
    for i in range(300):
        if i % 3 == 0:
            sent, recv = 300, 500  # small exchanges: RTT samples
        else:
            sent, recv = 600_000, 1_000
        elapsed = rtt + sent * 8 / up + recv * 8 / down + 0.005
        link.observe(sent, recv, elapsed * rng.uniform(0.97, 1.03), 0.005, float(i))
    assert link.rtt_s == pytest.approx(rtt, rel=0.1)
    assert link.up_bps == pytest.approx(up, rel=0.1)
    assert link.transfer_time(600_000, 1_000) == pytest.approx(rtt + 0.96 + 0.0004, rel=0.1)


def test_estimates_go_stale_and_survive_a_restart(tmp_path):
    est = Estimators()
    est.set_link_prior("http", 8e6, 16e6, 0.02)
    for i in range(50):
        est.local("m").add(0.01 + i * 1e-4, 100.0)
    est.link("http").observe_probe(0.015, 100.0)
    est.observe_reply("cloud", 300, 4000, 100.0)
    assert not est.local("m").stale(110.0, 30.0) and est.local("m").stale(200.0, 30.0)
    path = tmp_path / "estimates.json"
    est.save(path)
    # A new process: a different monotonic clock, the same ages.
    back = Estimators.load(path, now=5000.0)
    assert back.local("m").mean == pytest.approx(est.local("m").mean)
    assert back.local("m").quantile == pytest.approx(est.local("m").quantile)
    assert back.link("http").rtt_s == pytest.approx(est.link("http").rtt_s)
    assert back.cloud_compute("cloud").mean == pytest.approx(0.004)
    assert back.stale_links(5000.0 + 31, 30.0) == ["http"]


def test_a_corrupt_state_file_gives_fresh_estimates(tmp_path):
    path = tmp_path / "estimates.json"
    path.write_text("{not json")
    assert Estimators.load(path, 0.0).local("m").count == 0
    path.write_text(json.dumps({"local": {"m": {"ewma": {}, "q": {"q": 2}}}}))
    assert Estimators.load(path, 0.0).local("m").count == 0


def test_a_local_models_mean_is_not_thrown_by_two_slow_runs():
    # The policy prices the local run at this mean, and an agent that offloads runs
    # nothing locally to correct it: two slow draws at alpha 0.2 made a 0.7 s model
    # look like a 0.95 s one, and the agent offloaded at a loss from then on.
    est = Estimators()
    now = time.monotonic()
    for _ in range(20):
        est.local("m").add(0.7, now)
    est.local("m").add(1.4, now)
    est.local("m").add(1.4, now)
    assert est.local("m").mean < 0.7 * 1.2
    # a state file written with another weight is read with this one
    doc = est.to_dict(now)
    doc["local"]["m"]["ewma"]["alpha"] = 0.2
    restored = Estimators.from_dict(doc, now).local("m")
    restored.add(1.4, now)
    assert restored.mean == pytest.approx(est.local("m").mean + 0.1 * (1.4 - est.local("m").mean))


def test_latency_estimator_ignores_garbage():
    e = LatencyEstimator()
    e.add(float("nan"), 0.0)
    e.add(-1.0, 0.0)
    assert e.count == 0 and e.mean is None


def test_bandwidth_age_survives_a_restart(tmp_path):
    est = Estimators()
    est.link("http").observe(600_000, 1_000, 0.5, 0.01, 100.0)
    assert est.link("http").bandwidth_update == 100.0
    path = tmp_path / "estimates.json"
    est.save(path)
    now = time.monotonic()
    age = now - 100.0  # how old the sample was when saved, in the saving clock
    back = Estimators.load(path, now=5000.0)
    assert back.link("http").bandwidth_update == pytest.approx(5000.0 - age, abs=1.0)
    assert back.link("http").up_bps == pytest.approx(est.link("http").up_bps)


def test_a_few_samples_give_a_conservative_quantile_not_their_largest():
    est = Estimators(quantile=0.95).local("m")
    for s in (1.0, 1.02, 0.98):
        est.add(s, 0.0)
    # three samples cannot resolve a 95th percentile: the prior spread keeps a margin
    assert est.quantile > 1.2
    for i in range(200):
        est.add(1.0 + 0.001 * (i % 10), 0.0)
    assert est.quantile == pytest.approx(1.009, abs=0.01)  # measured: P-square alone


def test_five_steady_warm_up_runs_outweigh_the_prior_spread():
    # The agent seeds a local model with five warm-up runs (policy.warm_up_runs); an
    # agent that then offloads learns no more, and a race's local run starts a
    # reserve of this quantile before the deadline.  Five runs that agree to 1%
    # must count for more than a guessed 20% spread: the old weight (five samples)
    # kept the reserve at 1.26x the mean and started races that were not needed.
    steady = Estimators(quantile=0.95).local("m")
    for s in (1.0, 1.01, 0.99, 1.0, 1.005):
        steady.add(s, 0.0)
    assert 1.1 < steady.quantile < 1.22
    one = Estimators(quantile=0.95).local("m")
    one.add(1.0, 0.0)
    assert one.quantile > 1.3  # one run says nothing of the spread: the prior's margin stays


def test_the_policy_quantile_is_what_every_estimator_tracks(tmp_path):
    est = Estimators(quantile=0.5)
    for i in range(100):
        est.local("m").add(float(i), 0.0)
    assert est.local("m").quantile == pytest.approx(49.5, abs=3)
    est.set_quantile(0.9)  # a reloaded policy: means kept, the quantile tracker restarts
    local = est.local("m")
    # until the new tracker has samples, the log-normal estimate answers (never None)
    assert local._q.value is None and local.quantile is not None and local.mean is not None
    for i in range(200):
        est.local("m").add(float(i % 100), 0.0)
    assert est.local("m").quantile == pytest.approx(90, abs=5)
    assert est.link("http")._rtt_q.q == 0.9 and est.cloud_queue("c").q == 0.9
    path = tmp_path / "estimates.json"
    est.save(path)
    assert Estimators.load(path, 0.0, quantile=0.99).local("m").q == 0.99


def test_timeouts_at_the_same_bound_keep_a_faded_belief_down():
    link = LinkEstimator(prior_up_bps=8e6, prior_down_bps=20e6, prior_rtt_s=0.05)
    link.observe_timeout(600_000, 4.0, now=0.0)  # at most 1.2 Mbit/s
    assert link.up_belief.rate(link.up_bps, link.prior_up_bps, 0.0) == pytest.approx(1.2e6)
    faded = link.up_belief.rate(link.up_bps, link.prior_up_bps, 120.0)
    assert faded > 3e6  # two minutes unobserved: back towards the prior
    link.observe_timeout(600_000, 4.0, now=120.0)  # the same bound again: still true
    assert link.up_belief.rate(link.up_bps, link.prior_up_bps, 120.0) == pytest.approx(1.2e6)


def test_a_link_whose_outages_come_and_go_keeps_its_long_run_loss_rate():
    # every 40 attempts an outage eats two replies: the last minute forgets each one,
    # the long memory prices the next outage's first losses
    link, now = LinkEstimator(), 0.0
    for i in range(400):
        now += 2.0
        if i % 40 < 2:
            link.observe_failure(now)
        else:
            link.observe(60_000, 1_000, 0.1, 0.01, now)
    assert link.failure_rate(now) == pytest.approx(2 / 40, rel=0.35)
    recent_only = (link._lost + 0.1) / (link._tries + 10.1)
    assert recent_only < 0.02  # what the recent attempts alone would say
    # a link that never lost a reply reads as before: the prior diluted by its answers
    steady = LinkEstimator()
    for i in range(100):
        steady.observe(60_000, 1_000, 0.1, 0.01, 2.0 * i)
    assert steady.failure_rate(200.0) < 0.005
    # and the long memory fades too, over half an hour
    assert link.failure_rate(now + 4 * 3600) < 0.02


def test_a_corrupt_estimates_file_starts_fresh_on_either_core(tmp_path):
    """A short "log" pair crashed the agent at start (IndexError); a string where a
    number belongs was taken by the Python sources and crashed the first warm-up."""
    import json as _json

    from edge.core.estimators import Estimators

    est = Estimators()
    est.local("m").add(0.1, 1.0)
    est.link("http").observe(60_000, 1_000, 0.2, 0.01, 1.0)
    path = tmp_path / "estimates.json"
    est.save(path)
    doc = _json.loads(path.read_text())

    def mangle(node):  # every "log" pair cut short, every EWMA value made a string
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "log" and isinstance(value, list):
                    node[key] = value[:1]
                elif key == "value":
                    node[key] = "x"
                else:
                    mangle(value)
        elif isinstance(node, list):
            for value in node:
                mangle(value)

    mangle(doc)
    path.write_text(_json.dumps(doc))
    fresh = Estimators.load(path, 2.0)
    assert fresh.local_known("m", 1) is None  # started fresh, and it works:
    fresh.local("m").add(0.1, 2.0)
    assert fresh.local("m").mean is not None


def test_an_rtt_seen_in_a_bad_spell_fades_into_the_links_long_run(tmp_path):
    link = LinkEstimator(prior_rtt_s=0.02)
    for i in range(30):
        link.observe_probe(0.03, float(i))  # the link's usual RTT
    for i in range(5):
        link.observe(1_000, 1_000, 2.5, 0.0, 30.0 + i)  # an outage's late replies
    spell = link.rtt_at(35.0)[0]
    assert spell > 0.5  # believed at once: the policy must stop offloading now
    mean, quantile = link.rtt_at(35.0 + 600)
    assert mean < 0.1  # ten minutes on: near the link's own again
    # its tail the long run's: wide (a spell in its past, an old estimate), not the mean's
    assert 2 * mean < quantile < link.rtt_at(35.0)[1]
    assert link.rtt_s >= spell  # (what was learnt is kept: only the belief fades)
    # the spell's age survives a restart (a new monotonic clock)
    est = Estimators()
    est._links["http"] = link
    back = Estimators.from_dict(json.loads(json.dumps(est.to_dict(now=40.0))), now=9000.0)
    assert back.link("http").rtt_at(9000.0)[0] == pytest.approx(link.rtt_at(40.0)[0])
    assert back.link("http").rtt_at(9600.0)[0] == pytest.approx(mean, rel=0.01)


def test_a_restart_after_a_day_down_ages_every_estimate_by_the_downtime(tmp_path):
    est = Estimators()
    link = est.link("http")
    for i in range(20):
        link.observe(60_000, 1_000, 0.2, 0.01, float(i))
    for i in range(20):
        link.observe_failure(20.0 + i)  # it stopped in an outage
    assert link.failure_rate(40.0) > 0.4
    path = tmp_path / "estimates.json"
    assert json.loads(est.snapshot())["saved_wall"] == pytest.approx(time.time(), abs=60)
    saved = 1.7e9
    path.write_text(json.dumps({**est.to_dict(now=40.0), "saved_wall": saved}))
    back = Estimators.load(path, now=5.0, wall=saved + 86_400).link("http")
    assert back.failure_rate(5.0) < 0.02  # a day on: the outage is long past
    assert back.up_belief.weight(5.0) < 0.01  # and the rate it learnt is old news
    # a quick restart keeps what was learnt; a clock stepped back counts no downtime
    for wall in (saved + 1.0, saved - 3600.0):
        again = Estimators.load(path, now=5.0, wall=wall).link("http")
        assert again.failure_rate(5.0) > 0.4 and again.up_belief.weight(5.0) > 0.6
