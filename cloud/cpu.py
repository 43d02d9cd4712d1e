"""Node CPU figures for ``/metrics`` (Triton's nv_cpu_* families), read from /proc.

``nv_cpu_utilization`` is the busy share of all cores between two scrapes
(from ``/proc/stat``; the first scrape covers the time since the monitor was
built), ``nv_cpu_memory_*`` come from ``/proc/meminfo`` (used = total -
available), as Triton reports them.  Where /proc is missing nothing is
reported, never a made-up zero.
"""

from __future__ import annotations

import threading


def _read_stat(path: str = "/proc/stat") -> tuple[int, int] | None:
    """(busy jiffies, total jiffies) over all cores, or None."""
    try:
        with open(path) as f:
            first = f.readline().split()
    except OSError:
        return None
    if not first or first[0] != "cpu":
        return None
    try:
        values = [int(v) for v in first[1:]]
    except ValueError:
        return None
    total = sum(values[:8])  # user nice system idle iowait irq softirq steal
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    return total - idle, total


def read_meminfo(path: str = "/proc/meminfo") -> tuple[int, int] | None:
    """(total bytes, used bytes) of the node, or None."""
    fields: dict[str, int] = {}
    try:
        with open(path) as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    fields[key] = int(parts[0]) * 1024
    except OSError:
        return None
    total = fields.get("MemTotal")
    available = fields.get("MemAvailable")
    if total is None or available is None:
        return None
    return total, max(total - available, 0)


class CpuMonitor:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last = _read_stat()

    def utilization(self) -> float | None:
        """Busy share of all cores since the previous call, 0.0-1.0 (None: unknown)."""
        now = _read_stat()
        if now is None:
            return None
        with self._lock:
            last, self._last = self._last, now
        if last is None:
            return None
        busy, total = now[0] - last[0], now[1] - last[1]
        if total <= 0:
            return 0.0
        return min(1.0, max(0.0, busy / total))

    def memory(self) -> tuple[int, int] | None:
        return read_meminfo()
