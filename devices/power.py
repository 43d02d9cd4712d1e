"""Live power readers: battery, hwmon sensors, Intel/AMD RAPL, NVIDIA NVML.

Each reader returns a :class:`PowerReading`; hardware that is absent, a
driver that misbehaves or a file only root may read gives ``available=False``
with a ``reason`` a person can act on, never an exception, because the edge
agent polls these on whatever board it lands on and must keep serving.

The sysfs readers take the root of the tree they read, so tests (and odd
systems with sysfs mounted elsewhere) point them at another directory; the
files are parsed exactly as the kernel writes them (integers in micro units:
uW, uA, uV, uWh, uJ).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PowerReading:
    source: str
    available: bool
    watts: float | None = None
    battery_percent: float | None = None
    on_battery: bool | None = None
    reason: str = ""


def _read_text(path: Path) -> str | None:
    """A sysfs attribute's text, or None when absent or unreadable (EIO, ENODATA, EACCES)."""
    try:
        return path.read_text(encoding="ascii", errors="replace").strip()
    except OSError:
        return None


def _read_int(path: Path) -> int | None:
    text = _read_text(path)
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        return None


# ---- battery ---------------------------------------------------------------------


def read_battery(root: Path = Path("/sys/class/power_supply")) -> PowerReading:
    """Battery level, drain and whether the device runs on it.

    Drain comes from ``power_now`` (uW) or ``current_now * voltage_now``
    (uA x uV), whichever the driver offers; the level from ``capacity`` (%) or
    ``energy_now/energy_full`` (uWh) or ``charge_now/charge_full`` (uAh).
    Several batteries (some laptops have two) are summed.  ``on_battery`` is
    the battery's ``status`` where it says Discharging/Charging/Full, else the
    inverse of any mains/USB supply's ``online``.
    """
    source = "battery"
    if not root.is_dir():
        return PowerReading(source, False, reason=f"{root} does not exist (no power_supply class)")
    batteries: list[Path] = []
    mains_online: bool | None = None
    try:
        supplies = sorted(root.iterdir())
    except OSError as exc:
        return PowerReading(source, False, reason=f"cannot list {root}: {exc}")
    for supply in supplies:
        kind = _read_text(supply / "type")
        if kind == "Battery":
            if _read_text(supply / "present") != "0" and _read_text(supply / "scope") != "Device":
                batteries.append(supply)  # scope=Device: a mouse or a pen, not the system battery
        elif kind in ("Mains", "USB", "USB_C", "USB_PD", "Wireless"):
            online = _read_int(supply / "online")
            if online is not None:
                mains_online = bool(mains_online) or online == 1
    if not batteries:
        return PowerReading(
            source,
            False,
            on_battery=False if mains_online else None,
            reason=f"no system battery under {root}" + (" (on mains)" if mains_online else ""),
        )
    watts_total: float | None = None
    levels: list[tuple[float, float]] = []  # (percent, weight)
    statuses: list[str] = []
    for bat in batteries:
        watts = _battery_watts(bat)
        if watts is not None:
            watts_total = (watts_total or 0.0) + watts
        level = _battery_level(bat)
        if level is not None:
            levels.append(level)
        status = _read_text(bat / "status")
        if status:
            statuses.append(status)
    percent = None
    if levels:
        total_weight = sum(w for _, w in levels)
        percent = sum(p * w for p, w in levels) / total_weight
    if "Discharging" in statuses:
        on_battery: bool | None = True
    elif any(s in ("Charging", "Full") for s in statuses):
        on_battery = False
    elif mains_online is not None:
        on_battery = not mains_online
    else:
        on_battery = None
    name = ",".join(b.name for b in batteries)
    if watts_total is None and percent is None:
        return PowerReading(
            f"battery:{name}",
            False,
            on_battery=on_battery,
            reason="battery present but reports neither power nor level",
        )
    return PowerReading(f"battery:{name}", True, watts_total, percent, on_battery)


def _battery_watts(bat: Path) -> float | None:
    power = _read_int(bat / "power_now")
    if power is not None:
        return abs(power) / 1e6
    current, voltage = _read_int(bat / "current_now"), _read_int(bat / "voltage_now")
    if current is not None and voltage is not None:
        return abs(current) * voltage / 1e12
    return None


def _battery_level(bat: Path) -> tuple[float, float] | None:
    """(percent, weight for averaging several batteries) from the best attribute present."""
    energy_now, energy_full = _read_int(bat / "energy_now"), _read_int(bat / "energy_full")
    charge_now, charge_full = _read_int(bat / "charge_now"), _read_int(bat / "charge_full")
    capacity = _read_int(bat / "capacity")
    if capacity is not None:
        return float(min(max(capacity, 0), 100)), float(energy_full or charge_full or 1)
    if energy_now is not None and energy_full:
        return min(100.0, 100.0 * energy_now / energy_full), float(energy_full)
    if charge_now is not None and charge_full:
        return min(100.0, 100.0 * charge_now / charge_full), float(charge_full)
    return None


# ---- hwmon -----------------------------------------------------------------------

_POWER_FILE = re.compile(r"^power\d+_(input|average)$")


def read_hwmon(root: Path = Path("/sys/class/hwmon")) -> PowerReading:
    """The largest hwmon power sensor (``power*_input`` / ``power*_average``, uW).

    The largest is taken, not the sum: boards expose a total rail next to its
    sub-rails (Jetson's INA3221: VDD_IN beside VDD_CPU_GPU_CV), so summing
    would count power twice; the total is the biggest.
    """
    source = "hwmon"
    if not root.is_dir():
        return PowerReading(source, False, reason=f"{root} does not exist (no hwmon class)")
    best: tuple[float, str] | None = None
    try:
        chips = sorted(root.iterdir())
        for chip in chips:
            chip_name = _read_text(chip / "name") or chip.name
            try:
                entries = sorted(chip.iterdir())
            except OSError:
                continue
            for entry in entries:
                if not _POWER_FILE.match(entry.name):
                    continue
                microwatts = _read_int(entry)
                if microwatts is None or microwatts < 0:
                    continue
                label = _read_text(
                    chip / entry.name.replace("_input", "_label").replace("_average", "_label")
                )
                where = f"{chip_name}/{label or entry.name.split('_')[0]}"
                if best is None or microwatts / 1e6 > best[0]:
                    best = (microwatts / 1e6, where)
    except OSError as exc:
        return PowerReading(source, False, reason=f"cannot list {root}: {exc}")
    if best is None:
        return PowerReading(source, False, reason=f"no readable power*_input sensor under {root}")
    return PowerReading(f"hwmon:{best[1]}", True, best[0])


# ---- RAPL ------------------------------------------------------------------------

_TOP_ZONE = re.compile(r"^intel-rapl:\d+$")


class RaplReader:
    """Package (or platform) power from the powercap RAPL energy counters.

    RAPL gives a cumulative ``energy_uj`` counter, so power is a difference
    over time: each :meth:`read` uses the previous sample when there is one
    (a poller pays no sleep), else samples twice ``interval_s`` apart.  The
    counter wraps at ``max_energy_range_uj``; a negative difference is
    corrected by one range.  Only top-level zones are summed (subzones such as
    core/uncore/dram lie inside their package); a ``psys`` zone, where present,
    already covers the whole platform and is used alone.  Since Linux 5.10
    ``energy_uj`` is readable by root only: that reads as unavailable.
    """

    def __init__(
        self,
        root: Path = Path("/sys/class/powercap"),
        interval_s: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.root = root
        self.interval_s = interval_s
        self._clock = clock
        self._last: tuple[float, dict[str, int]] | None = None

    def _zones(self) -> list[Path]:
        zones = sorted(p for p in self.root.iterdir() if _TOP_ZONE.match(p.name))
        psys = [z for z in zones if _read_text(z / "name") == "psys"]
        return psys or zones

    def _sample(self, zones: list[Path]) -> tuple[float, dict[str, int]]:
        counters: dict[str, int] = {}
        for zone in zones:
            try:
                text = (zone / "energy_uj").read_text(encoding="ascii").strip()
            except PermissionError as exc:
                raise _Unreadable(
                    f"{zone / 'energy_uj'} is readable by root only (Linux >= 5.10)"
                ) from exc
            except OSError as exc:
                raise _Unreadable(f"cannot read {zone / 'energy_uj'}: {exc}") from exc
            try:
                counters[zone.name] = int(text)
            except ValueError as exc:
                raise _Unreadable(f"{zone / 'energy_uj'} holds {text!r}, not an integer") from exc
        return self._clock(), counters

    def read(self) -> PowerReading:
        source = "rapl"
        if not self.root.is_dir():
            return PowerReading(source, False, reason=f"{self.root} does not exist (no powercap)")
        try:
            zones = self._zones()
            if not zones:
                return PowerReading(source, False, reason=f"no intel-rapl zone under {self.root}")
            names = ",".join(_read_text(z / "name") or z.name for z in zones)
            source = f"rapl:{names}"
            now = self._sample(zones)
            if self._last is None or set(self._last[1]) != set(now[1]):
                time.sleep(self.interval_s)
                prev, now = now, self._sample(zones)
            else:
                prev = self._last
        except _Unreadable as exc:
            return PowerReading(source, False, reason=str(exc))
        except OSError as exc:
            return PowerReading(source, False, reason=f"cannot list {self.root}: {exc}")
        self._last = now
        elapsed = now[0] - prev[0]
        if elapsed <= 0:
            return PowerReading(source, False, reason="no time passed between RAPL samples")
        joules = 0.0
        for zone in zones:
            delta = now[1][zone.name] - prev[1][zone.name]
            if delta < 0:  # the counter wrapped past max_energy_range_uj
                span = _read_int(zone / "max_energy_range_uj")
                if not span:
                    return PowerReading(
                        source,
                        False,
                        reason=f"{zone.name} counter went back "
                        "and max_energy_range_uj is unreadable",
                    )
                delta += span
            joules += delta / 1e6
        return PowerReading(source, True, joules / elapsed)


class _Unreadable(Exception):
    """A RAPL counter could not be read; the message becomes the reading's reason."""


# ---- NVML ------------------------------------------------------------------------


def read_nvml() -> PowerReading:
    """Total board power of the NVIDIA GPUs (NVML reports milliwatts per device)."""
    source = "nvml"
    try:
        import pynvml
    except ImportError:
        return PowerReading(source, False, reason="nvidia-ml-py (pynvml) is not installed")
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound / DriverNotLoaded and the like
        return PowerReading(source, False, reason=f"no NVIDIA driver: {exc}")
    try:
        count = pynvml.nvmlDeviceGetCount()
        if count == 0:
            return PowerReading(source, False, reason="NVML found no NVIDIA GPU")
        milliwatts = 0
        for i in range(count):
            milliwatts += pynvml.nvmlDeviceGetPowerUsage(pynvml.nvmlDeviceGetHandleByIndex(i))
        return PowerReading(f"nvml:{count} GPU(s)", True, milliwatts / 1000.0)
    except Exception as exc:  # a GPU without power readout (NotSupported) or a driver fault
        return PowerReading(source, False, reason=f"NVML cannot read power: {exc}")
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


# ---- all -------------------------------------------------------------------------


def read_all(rapl: RaplReader | None = None) -> list[PowerReading]:
    """Every reader once, in a fixed order (battery, hwmon, rapl, nvml).

    Pass a long-lived :class:`RaplReader` when polling, so RAPL does not sleep
    for a second sample each time.
    """
    readers: list[tuple[str, Callable[[], PowerReading]]] = [
        ("battery", read_battery),
        ("hwmon", read_hwmon),
        ("rapl", (rapl or RaplReader()).read),
        ("nvml", read_nvml),
    ]
    out = []
    for name, reader in readers:
        try:
            out.append(reader())
        except Exception as exc:  # a reader bug must not take the agent down
            out.append(
                PowerReading(name, False, reason=f"reader failed: {type(exc).__name__}: {exc}")
            )
    return out
