"""Energy of one request, run locally or offloaded (DESIGN.md section 4).

Local: the device runs the model at its whole-device compute power,
``E = compute_power_w * t_exec``.

Offloaded: the radio model of Huang et al., "A Close Examination of
Performance and Power Characteristics of 4G LTE Networks", MobiSys 2012
(its WiFi and 3G figures come from the same paper).  While a radio moves
data at ``r`` Mbps it draws ``base + alpha * r`` watts, so

    E = (base + alpha_up * r_up) * t_up + (base + alpha_down * r_down) * t_down
        + (device idle + base) * wait
        + device idle * (t_up + t_down)        # the device stays on meanwhile
        + promotion + tail

with ``t = bytes * 8 / bps`` and ``wait`` the time between the last byte
sent and the first byte received (network RTT and cloud queue + compute).
The device's idle power is charged for the whole request, not only the
wait: the local option's ``compute_power_w`` is whole-device power, so the
cloud option must carry the device's baseline too, or a slow upload would
look cheaper than it is.  A radio that had gone idle (``radio_idle_s`` None
or at least ``tail_s``) pays a promotion (``promotion_s`` at
``promotion_power_w``), and every burst leaves a tail (``tail_s`` at
``tail_power_w``) before the radio sleeps.  When a request follows the
previous transfer within its tail, the radio is still connected: no
promotion, and the tail already charged to the previous request is only
extended, by ``radio_idle_s`` (the part of it that ran), since a full new
tail starts after this transfer in place of the remainder of the old one.
For LTE the tail (~1.06 W for 11.6 s, ~12 J) dwarfs the transfer of a
small request, which is why batching requests within the tail pays off.

These are pure arithmetic on purpose: the policy calls them for every
option of every request, so each costs a microsecond or so.
"""

from __future__ import annotations

import math

from devices.profiles import DeviceProfile, LinkProfile
from shared.errors import InvalidInput


def local_energy_j(device: DeviceProfile, t_exec_s: float) -> float:
    """Joules to run a model locally for ``t_exec_s`` seconds."""
    return device.compute_power_w * max(t_exec_s, 0.0)


def transfer_energy_j(
    link: LinkProfile,
    up_bytes: int,
    down_bytes: int,
    up_bps: float,
    down_bps: float,
    wait_s: float,
    device: DeviceProfile,
    radio_idle_s: float | None = None,
    tail_after_s: float | None = None,
) -> float:
    """Joules the device spends to offload one request over ``link`` (see the module doc).

    ``up_bps``/``down_bps`` are the throughputs expected (or measured) for
    this transfer; ``radio_idle_s`` is how long ago the previous transfer
    ended (None: never, or unknown, so the radio is assumed asleep).

    The tail is attributed backwards by default (a transfer pays the tail
    that ran before it, or a whole one when it woke the radio): what a
    simulator charges.  ``tail_after_s`` attributes it forwards instead: the
    transfer pays the tail it opens, until the next transfer or the timer
    (the expected value a policy can price a decision with).  Summed over a
    run of transfers the two are equal.
    """
    base = link.base_power_w
    t_up = t_down = 0.0
    energy = 0.0
    if up_bytes > 0:
        if not up_bps > 0:
            raise InvalidInput(f"uplink throughput must be > 0 bps to send bytes, got {up_bps}")
        t_up = up_bytes * 8.0 / up_bps
        energy += (base + link.alpha_up_w_per_mbps * up_bps / 1e6) * t_up
    if down_bytes > 0:
        if not down_bps > 0:
            raise InvalidInput(f"downlink throughput must be > 0 bps to receive, got {down_bps}")
        t_down = down_bytes * 8.0 / down_bps
        energy += (base + link.alpha_down_w_per_mbps * down_bps / 1e6) * t_down
    wait = wait_s if wait_s > 0.0 else 0.0
    energy += (device.idle_power_w + base) * wait + device.idle_power_w * (t_up + t_down)
    asleep = radio_idle_s is None or radio_idle_s >= link.tail_s
    if asleep:
        energy += link.promotion_power_w * link.promotion_s
        energy += device.idle_power_w * link.promotion_s  # the request waits for the radio
    if tail_after_s is not None:
        tail = tail_after_s if tail_after_s < link.tail_s else link.tail_s
        energy += link.tail_power_w * (tail if tail > 0.0 else 0.0)
    elif asleep:
        energy += link.tail_power_w * link.tail_s
    else:
        energy += link.tail_power_w * max(radio_idle_s or 0.0, 0.0)
    return energy


def expected_tail_s(link: LinkProfile, rate_per_s: float) -> float:
    """E[min(gap, tail)] for Poisson arrivals at ``rate_per_s``: the tail one transfer opens."""
    if rate_per_s <= 0:
        return link.tail_s
    return (1.0 - math.exp(-rate_per_s * link.tail_s)) / rate_per_s


def tail_extension_s(
    link: LinkProfile, rate_per_s: float, paid_s: float, radio_idle_s: float | None
) -> float:
    """The seconds of tail a transfer now adds to the radio's time on: ``paid_s`` (the
    tail it opens, until the next transfer at ``rate_per_s`` or the timer) less what
    is left of the tail already running, up to that next transfer.

    That remainder burns whether this request offloads or runs locally, so it is
    not this offload's to pay: charged whole, an offload from a radio that is up
    looks as dear as one that keeps it up alone, local answers win, the radio
    goes idle, and the next offload must pay a wake-up (a warm link left unused
    for a minute on a steady trace here).  Summed over a run of transfers, the
    extensions are the radio's whole time in tails, as the forward shares are.
    ``E[min(G, tail)] - E[min(G, left)] = (e^(-rate*left) - e^(-rate*tail)) / rate``
    for an exponential gap ``G`` to the next transfer.
    """
    if radio_idle_s is None or radio_idle_s >= link.tail_s:
        return paid_s  # asleep: the whole tail is new
    left = link.tail_s - (radio_idle_s if radio_idle_s > 0.0 else 0.0)
    if rate_per_s <= 0:
        return link.tail_s - left
    running = (1.0 - math.exp(-rate_per_s * left)) / rate_per_s
    return paid_s - running if paid_s > running else 0.0


def wake_energy_j(link: LinkProfile) -> float:
    """Joules a transfer from an idle radio pays before moving a byte: promotion and tail."""
    return link.promotion_power_w * link.promotion_s + link.tail_power_w * link.tail_s


class RadioState:
    """When the radio last finished a transfer, to tell the energy model how idle it is.

    The agent calls :meth:`transfer_done` with ``time.monotonic()`` after each
    offload and :meth:`radio_idle_s` when it prices the next one.  Plain
    attribute writes: safe to share between the event loop and threads.
    """

    def __init__(self) -> None:
        self._last_end: float | None = None

    def transfer_done(self, now: float) -> None:
        """Record that a transfer ended at ``now`` (a ``time.monotonic()`` value)."""
        if self._last_end is None or now > self._last_end:
            self._last_end = now

    def radio_idle_s(self, now: float) -> float | None:
        """Seconds since the last transfer ended, or None if there has been none."""
        if self._last_end is None:
            return None
        idle = now - self._last_end
        return idle if idle > 0.0 else 0.0
