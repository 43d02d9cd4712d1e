"""The energy model: hand-computed LTE cost, promotion and tail rules, local vs WiFi vs LTE."""

from __future__ import annotations

import math
import time

import pytest

from devices.profiles import load_device, load_link
from edge.core.energy import (
    RadioState,
    expected_tail_s,
    local_energy_j,
    tail_extension_s,
    transfer_energy_j,
)
from shared.errors import InvalidInput

IMAGE = 602_112  # a 1x3x224x224 FP32 tensor
REPLY = 4_000


def test_lte_transfer_of_an_image_costs_what_the_huang_model_says():
    lte, pi = load_link("lte"), load_device("raspberry-pi-4b")
    up_bps, down_bps, wait = 5e6, 13e6, 0.08
    # By hand, with the paper's numbers (W, s):
    t_up = 602_112 * 8 / 5e6  # 0.9633792 s
    t_down = 4_000 * 8 / 13e6  # 0.0024615 s
    radio = (1.28804 + 0.43839 * 5) * t_up + (1.28804 + 0.05197 * 13) * t_down
    waiting = (2.7 + 1.28804) * wait
    device_on = 2.7 * (t_up + t_down + 0.2601)  # the Pi stays on through promotion and transfer
    promotion = 1.2107 * 0.2601
    tail = 1.06 * 11.576
    expected = radio + waiting + device_on + promotion + tail
    got = transfer_energy_j(lte, IMAGE, REPLY, up_bps, down_bps, wait, pi, None)
    assert got == pytest.approx(expected, rel=1e-12)
    assert got == pytest.approx(19.57, abs=0.01)  # the tail alone is 12.27 J of it


def test_promotion_is_charged_only_once_the_radio_has_idled_past_its_tail():
    lte, pi = load_link("lte"), load_device("raspberry-pi-4b")

    def cost(idle):
        return transfer_energy_j(lte, IMAGE, REPLY, 5e6, 13e6, 0.05, pi, idle)

    promotion_and_tail = lte.promotion_power_w * lte.promotion_s + pi.idle_power_w * lte.promotion_s
    promotion_and_tail += lte.tail_power_w * lte.tail_s
    asleep = cost(None)
    assert cost(lte.tail_s) == pytest.approx(asleep)
    assert cost(lte.tail_s + 60) == pytest.approx(asleep)
    # Still inside the tail: no promotion, and the tail is only extended by the idle time.
    for idle in (0.0, 1.0, 5.0, lte.tail_s - 0.01):
        assert cost(idle) == pytest.approx(asleep - promotion_and_tail + lte.tail_power_w * idle)
    assert cost(0.0) < cost(5.0) < cost(lte.tail_s - 0.01) < asleep


def test_local_energy_is_linear_in_time():
    for name in ("raspberry-pi-4b", "jetson-nano", "coral-dev-board", "x86-laptop"):
        d = load_device(name)
        assert local_energy_j(d, 0.0) == 0.0
        assert local_energy_j(d, 0.1) == pytest.approx(d.compute_power_w * 0.1)
        assert local_energy_j(d, 0.3) == pytest.approx(3 * local_energy_j(d, 0.1))
    assert local_energy_j(load_device("raspberry-pi-4b"), 0.12) == pytest.approx(0.768)


def test_wifi_is_much_cheaper_than_lte_for_the_same_transfer():
    pi = load_device("raspberry-pi-4b")
    wifi, lte, g3 = load_link("wifi"), load_link("lte"), load_link("3g")
    args = (IMAGE, REPLY, 10e6, 20e6, 0.05, pi)
    e_wifi, e_lte = transfer_energy_j(wifi, *args), transfer_energy_j(lte, *args)
    assert e_lte > 3 * e_wifi
    # Radio energy alone (device idle excluded: a device with no baseline) the gap is wider.
    bare = type(pi)("bare", "", 1, None, 0.0, 1.0, None, None)
    assert transfer_energy_j(lte, *args[:5], bare) > 10 * transfer_energy_j(wifi, *args[:5], bare)
    # 3G's tail is shorter and cheaper than LTE's: the same small request costs less.
    small = (1_000, 1_000, 1e6, 2e6, 0.05, bare)
    assert transfer_energy_j(g3, *small) < transfer_energy_j(lte, *small)


def test_ethernet_has_no_promotion_or_tail():
    eth, pi = load_link("ethernet"), load_device("raspberry-pi-4b")
    cold = transfer_energy_j(eth, IMAGE, REPLY, 900e6, 900e6, 0.01, pi, None)
    warm = transfer_energy_j(eth, IMAGE, REPLY, 900e6, 900e6, 0.01, pi, 0.0)
    assert cold == pytest.approx(warm) and cold < 0.2


def test_energy_grows_with_bytes_and_wait_and_offloading_a_cheap_model_over_lte_loses():
    lte, pi = load_link("lte"), load_device("raspberry-pi-4b")
    base = transfer_energy_j(lte, IMAGE, REPLY, 5e6, 13e6, 0.05, pi, 0.0)
    assert transfer_energy_j(lte, 2 * IMAGE, REPLY, 5e6, 13e6, 0.05, pi, 0.0) > base
    assert transfer_energy_j(lte, IMAGE, REPLY, 5e6, 13e6, 0.50, pi, 0.0) > base
    assert transfer_energy_j(lte, 0, 0, 5e6, 13e6, 0.0, pi, 0.0) == 0.0
    assert local_energy_j(pi, 0.12) < transfer_energy_j(lte, IMAGE, REPLY, 30e6, 120e6, 0.01, pi)


def test_zero_throughput_with_bytes_to_move_is_a_clear_error():
    lte, pi = load_link("lte"), load_device("raspberry-pi-4b")
    with pytest.raises(InvalidInput, match="uplink throughput"):
        transfer_energy_j(lte, 10, 0, 0.0, 1e6, 0.0, pi)
    with pytest.raises(InvalidInput, match="downlink throughput"):
        transfer_energy_j(lte, 0, 10, 1e6, 0.0, 0.0, pi)


def test_an_offload_from_a_radio_that_is_up_adds_only_the_tail_past_the_one_running():
    lte = load_link("lte")
    rate = 0.2
    paid = expected_tail_s(lte, rate)
    # asleep (or never used): the whole tail it opens is new
    assert tail_extension_s(lte, rate, paid, None) == paid
    assert tail_extension_s(lte, rate, paid, lte.tail_s + 1.0) == paid
    # up for 4 s: 7.6 s of the running tail would burn anyway, up to the next transfer
    left = lte.tail_s - 4.0
    running = (1.0 - math.exp(-rate * left)) / rate
    assert tail_extension_s(lte, rate, paid, 4.0) == pytest.approx(paid - running)
    assert tail_extension_s(lte, rate, paid, 4.0) == pytest.approx(
        (math.exp(-rate * left) - math.exp(-rate * lte.tail_s)) / rate
    )
    # the sooner after the last transfer, the less it adds; right after it, nothing
    added = [tail_extension_s(lte, rate, paid, idle) for idle in (0.0, 1.0, 4.0, 8.0, 11.0)]
    assert added == sorted(added) and added[0] == pytest.approx(0.0, abs=1e-12)
    assert all(0.0 <= a <= paid for a in added)


def test_radio_state_reports_idle_time_since_the_last_transfer():
    radio = RadioState()
    assert radio.radio_idle_s(1000.0) is None
    radio.transfer_done(1000.0)
    assert radio.radio_idle_s(1003.5) == pytest.approx(3.5)
    radio.transfer_done(999.0)  # a late report of an older transfer does not move time back
    assert radio.radio_idle_s(1003.5) == pytest.approx(3.5)
    assert radio.radio_idle_s(999.5) == 0.0
    now = time.monotonic()
    radio.transfer_done(now)
    assert 0.0 <= radio.radio_idle_s(time.monotonic()) < 1.0


def test_energy_functions_take_microseconds():
    lte, pi = load_link("lte"), load_device("raspberry-pi-4b")
    n = 20_000
    start = time.perf_counter()
    for i in range(n):
        transfer_energy_j(lte, IMAGE, REPLY, 5e6, 13e6, 0.05, pi, float(i % 20))
        local_energy_j(pi, 0.05)
    per_call_us = (time.perf_counter() - start) / n * 1e6
    assert per_call_us < 20, per_call_us
