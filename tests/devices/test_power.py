"""Power readers parse real sysfs-shaped trees and never crash on the real machine."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from devices.power import (
    PowerReading,
    RaplReader,
    read_all,
    read_battery,
    read_hwmon,
    read_nvml,
)


def _write(folder: Path, **attrs: object) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, value in attrs.items():
        (folder / name).write_text(f"{value}\n")
    return folder


# ---- battery ---------------------------------------------------------------------


def test_battery_power_now_and_capacity(tmp_path: Path):
    _write(
        tmp_path / "BAT0",
        type="Battery",
        present=1,
        status="Discharging",
        power_now=7_250_000,
        capacity=64,
    )
    _write(tmp_path / "AC", type="Mains", online=0)
    r = read_battery(tmp_path)
    assert r == PowerReading("battery:BAT0", True, 7.25, 64.0, True)


def test_battery_current_times_voltage_when_no_power_now(tmp_path: Path):
    # A phone-style fuel gauge: uA and uV, current negative while discharging.
    _write(
        tmp_path / "battery",
        type="Battery",
        status="Discharging",
        current_now=-850_000,
        voltage_now=3_900_000,
        capacity=41,
    )
    r = read_battery(tmp_path)
    assert r.available and r.watts == pytest.approx(0.85 * 3.9)
    assert r.battery_percent == 41.0 and r.on_battery is True


def test_battery_level_from_energy_now_over_energy_full(tmp_path: Path):
    _write(
        tmp_path / "BAT1",
        type="Battery",
        status="Charging",
        energy_now=30_000_000,
        energy_full=48_000_000,
        power_now=15_000_000,
    )
    _write(tmp_path / "ACAD", type="Mains", online=1)
    r = read_battery(tmp_path)
    assert r.battery_percent == pytest.approx(62.5) and r.watts == 15.0
    assert r.on_battery is False


def test_battery_level_from_charge_and_mains_decides_when_status_is_unknown(tmp_path: Path):
    _write(
        tmp_path / "BAT0",
        type="Battery",
        status="Unknown",
        charge_now=1_000_000,
        charge_full=4_000_000,
    )
    _write(tmp_path / "ucsi-source-psy", type="USB", online=0)
    r = read_battery(tmp_path)
    assert r.battery_percent == pytest.approx(25.0) and r.watts is None and r.on_battery is True


def test_two_batteries_are_summed_and_weighted_by_size(tmp_path: Path):
    _write(
        tmp_path / "BAT0",
        type="Battery",
        status="Discharging",
        power_now=4_000_000,
        capacity=100,
        energy_full=20_000_000,
    )
    _write(
        tmp_path / "BAT1",
        type="Battery",
        status="Discharging",
        power_now=2_000_000,
        capacity=40,
        energy_full=60_000_000,
    )
    r = read_battery(tmp_path)
    assert r.watts == pytest.approx(6.0) and r.battery_percent == pytest.approx(55.0)
    assert r.source == "battery:BAT0,BAT1"


def test_peripheral_battery_and_mains_only_mean_no_battery(tmp_path: Path):
    _write(tmp_path / "hid-mouse-battery", type="Battery", scope="Device", capacity=80)
    _write(tmp_path / "AC", type="Mains", online=1)
    r = read_battery(tmp_path)
    assert not r.available and r.on_battery is False and "no system battery" in r.reason


def test_battery_with_unreadable_attributes_is_unavailable_not_a_crash(tmp_path: Path):
    _write(tmp_path / "BAT0", type="Battery", power_now="garbage")
    (tmp_path / "BAT0" / "capacity").mkdir()  # reading a directory raises IsADirectoryError
    r = read_battery(tmp_path)
    assert not r.available and "neither power nor level" in r.reason


def test_missing_power_supply_class_is_unavailable(tmp_path: Path):
    r = read_battery(tmp_path / "nope")
    assert not r.available and "does not exist" in r.reason


# ---- hwmon -----------------------------------------------------------------------


def test_hwmon_takes_the_largest_power_sensor_with_its_label(tmp_path: Path):
    _write(tmp_path / "hwmon0", name="k10temp", temp1_input=45_000)
    _write(
        tmp_path / "hwmon1",
        name="ina3221",
        power1_input=5_120_000,
        power1_label="VDD_IN",
        power2_input=2_300_000,
        power2_label="VDD_CPU_GPU_CV",
    )
    _write(tmp_path / "hwmon2", name="amdgpu", power1_average=1_500_000)
    r = read_hwmon(tmp_path)
    assert r == PowerReading("hwmon:ina3221/VDD_IN", True, 5.12)


def test_hwmon_without_power_sensors_is_unavailable(tmp_path: Path):
    _write(tmp_path / "hwmon0", name="coretemp", temp1_input=40_000, power1_input="bad")
    r = read_hwmon(tmp_path)
    assert not r.available and "no readable power" in r.reason
    assert not read_hwmon(tmp_path / "absent").available


# ---- RAPL ------------------------------------------------------------------------


class _Clock:
    """A settable clock: the test decides how much time passes between samples."""

    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _rapl_tree(root: Path) -> None:
    _write(
        root / "intel-rapl:0",
        name="package-0",
        energy_uj=1_000_000,
        max_energy_range_uj=262_143_328_850,
    )
    _write(root / "intel-rapl:0" / "intel-rapl:0:0", name="core", energy_uj=5)  # inside package
    _write(
        root / "intel-rapl:1",
        name="package-1",
        energy_uj=2_000_000,
        max_energy_range_uj=262_143_328_850,
    )
    _write(root / "intel-rapl-mmio:0", name="package-0", energy_uj=9_999_999)  # duplicate view


def test_rapl_power_is_the_energy_delta_over_time_summed_over_packages(tmp_path: Path):
    _rapl_tree(tmp_path)
    clock = _Clock()
    reader = RaplReader(tmp_path, interval_s=0.0, clock=clock)
    first = reader.read()  # two back-to-back samples: no energy, no time
    assert not first.available and "no time passed" in first.reason
    clock.t += 0.5
    (tmp_path / "intel-rapl:0" / "energy_uj").write_text("11000000\n")  # +10 J
    (tmp_path / "intel-rapl:1" / "energy_uj").write_text("4500000\n")  # +2.5 J
    r = reader.read()
    assert r.available and r.watts == pytest.approx(12.5 / 0.5)
    assert r.source == "rapl:package-0,package-1"


def test_rapl_counter_wraparound_adds_one_range(tmp_path: Path):
    root = tmp_path
    _write(
        root / "intel-rapl:0",
        name="package-0",
        energy_uj=65_000_000,
        max_energy_range_uj=65_536_000,
    )
    clock = _Clock()
    reader = RaplReader(root, interval_s=0.0, clock=clock)
    reader.read()
    clock.t += 2.0
    (root / "intel-rapl:0" / "energy_uj").write_text("3464000\n")  # wrapped: 536 000 + 3 464 000 uJ
    r = reader.read()
    assert r.available and r.watts == pytest.approx(4.0 / 2.0)


def test_rapl_psys_zone_is_used_alone(tmp_path: Path):
    _write(tmp_path / "intel-rapl:0", name="package-0", energy_uj=0, max_energy_range_uj=10**9)
    _write(tmp_path / "intel-rapl:1", name="psys", energy_uj=0, max_energy_range_uj=10**9)
    clock = _Clock()
    reader = RaplReader(tmp_path, interval_s=0.0, clock=clock)
    reader.read()
    clock.t += 1.0
    (tmp_path / "intel-rapl:0" / "energy_uj").write_text("5000000\n")
    (tmp_path / "intel-rapl:1" / "energy_uj").write_text("9000000\n")
    r = reader.read()
    assert r.source == "rapl:psys" and r.watts == pytest.approx(9.0)


def test_rapl_one_shot_read_samples_twice_over_real_time(tmp_path: Path):
    _write(tmp_path / "intel-rapl:0", name="package-0", energy_uj=123, max_energy_range_uj=10**9)
    r = RaplReader(tmp_path, interval_s=0.02).read()
    assert r.available and r.watts == 0.0  # the counter did not move while it slept


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_rapl_root_only_counter_is_unavailable_with_the_reason(tmp_path: Path):
    zone = _write(tmp_path / "intel-rapl:0", name="package-0", energy_uj=1, max_energy_range_uj=10)
    (zone / "energy_uj").chmod(0o000)
    r = RaplReader(tmp_path, interval_s=0.0).read()
    assert not r.available and "root only" in r.reason


def test_rapl_garbage_counter_and_missing_zones_are_unavailable(tmp_path: Path):
    assert "no intel-rapl zone" in RaplReader(tmp_path).read().reason
    _write(tmp_path / "intel-rapl:0", name="package-0", energy_uj="n/a")
    r = RaplReader(tmp_path, interval_s=0.0).read()
    assert not r.available and "not an integer" in r.reason
    assert "does not exist" in RaplReader(tmp_path / "absent").read().reason


# ---- the real machine ------------------------------------------------------------


def _plausible(r: PowerReading) -> None:
    assert isinstance(r, PowerReading)
    if r.available:
        assert r.watts is not None or r.battery_percent is not None
        assert r.watts is None or 0 <= r.watts < 5_000
        assert r.battery_percent is None or 0 <= r.battery_percent <= 100
    else:
        assert r.reason, r


def test_every_reader_on_the_real_machine_answers_without_crashing():
    readings = read_all(RaplReader(interval_s=0.01))
    assert [r.source.split(":")[0] for r in readings] == ["battery", "hwmon", "rapl", "nvml"]
    for r in readings:
        _plausible(r)
    for r in (read_battery(), read_hwmon(), RaplReader(interval_s=0.01).read()):
        _plausible(r)


def test_nvml_without_a_driver_is_unavailable_with_a_reason():
    r = read_nvml()
    _plausible(r)
    if not Path("/proc/driver/nvidia").exists():
        assert not r.available and r.reason
