"""GPU figures for ``/metrics`` and node status, from NVML (nvidia-ml-py).

NVML is optional: on a machine without the NVIDIA driver ``nvmlInit`` raises
NVMLError_LibraryNotFound, and the node must keep serving on CPU.  So
:meth:`GpuMonitor.start` never raises; it records ``available`` and a
``reason`` a person can read, and :meth:`GpuMonitor.sample` then returns ``[]``.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GpuSample:
    index: int
    uuid: str
    name: str
    utilization: float  # 0..1, over NVML's last sample period
    memory_used: int  # bytes
    memory_total: int  # bytes
    power_w: float | None  # None where the board does not report power


class GpuMonitor:
    """Reads all NVIDIA GPUs of this node; samples are cached for ``cache_s``.

    The cache keeps frequent scrapes and status publications from hammering
    NVML (each query is a driver call).
    """

    def __init__(self, cache_s: float = 1.0) -> None:
        self.cache_s = cache_s
        self.available = False
        self.reason = "GPU monitor not started"
        self._nvml: Any = None  # the pynvml module once nvmlInit succeeded
        self._lock = threading.Lock()
        self._cached: list[GpuSample] = []
        self._cached_at = -float("inf")

    def start(self) -> bool:
        """Initialise NVML; returns ``available``. Never raises."""
        if self._nvml is not None:
            return self.available
        try:
            import pynvml
        except ImportError:
            self.reason = "no GPU: nvidia-ml-py (pynvml) is not installed"
            return False
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            self.reason = _describe(pynvml, exc)
            return False
        except Exception as exc:  # a broken install must not take the node down
            self.reason = f"no GPU: NVML failed to initialise: {exc}"
            return False  # (the caller says why, once)
        self._nvml = pynvml
        try:
            count = pynvml.nvmlDeviceGetCount()
        except pynvml.NVMLError as exc:
            self.reason = f"no GPU: cannot count devices: {exc}"
            return False
        if count == 0:
            self.reason = "no GPU: NVML found no NVIDIA devices"
            return False
        self.available = True
        self.reason = f"{count} NVIDIA GPU(s)"
        return True

    def sample(self) -> list[GpuSample]:
        """Current figures for every GPU (``[]`` without one)."""
        if not self.available:
            return []
        with self._lock:
            now = time.monotonic()
            if now - self._cached_at >= self.cache_s:
                self._cached = self._read()
                self._cached_at = now
            return list(self._cached)

    def close(self) -> None:
        if self._nvml is None:
            return
        try:
            self._nvml.nvmlShutdown()
        except Exception as exc:
            log.warning("nvmlShutdown failed: %s", exc)
        self._nvml = None
        self.available = False
        self.reason = "GPU monitor closed"

    def _read(self) -> list[GpuSample]:
        nv = self._nvml
        samples = []
        try:
            count = nv.nvmlDeviceGetCount()
        except nv.NVMLError as exc:
            log.warning("NVML device count failed: %s", exc)
            return []
        for i in range(count):
            try:
                handle = nv.nvmlDeviceGetHandleByIndex(i)
                util = nv.nvmlDeviceGetUtilizationRates(handle)
                used, total = _memory(nv, handle)
                samples.append(
                    GpuSample(
                        index=i,
                        uuid=_text(nv.nvmlDeviceGetUUID(handle)),
                        name=_text(nv.nvmlDeviceGetName(handle)),
                        utilization=util.gpu / 100.0,
                        memory_used=used,
                        memory_total=total,
                        power_w=_power(nv, handle),
                    )
                )
            except nv.NVMLError as exc:  # one bad board should not hide the others
                log.warning("NVML query of GPU %d failed: %s", i, exc)
        return samples


def _memory(nv: Any, handle: Any) -> tuple[int, int]:
    """(used, total) bytes, ``used`` without the driver's own reservation.

    NVML's first memory call counts the memory the driver reserves for itself
    as used: on an idle H100 that read 0.47 GiB where nvidia-smi (and DCGM)
    showed 0.  The v2 call reports the reservation apart, so an operator sees
    here what nvidia-smi shows; a driver or binding without it falls back.
    """
    v2 = getattr(nv, "nvmlMemory_v2", None)
    if v2 is not None:
        try:
            mem = nv.nvmlDeviceGetMemoryInfo(handle, version=v2)
            return int(mem.used), int(mem.total)
        except (nv.NVMLError, TypeError):
            pass
    mem = nv.nvmlDeviceGetMemoryInfo(handle)
    return int(mem.used), int(mem.total)


def _power(nv: Any, handle: Any) -> float | None:
    try:
        return nv.nvmlDeviceGetPowerUsage(handle) / 1000.0  # mW -> W
    except nv.NVMLError:
        return None


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _describe(pynvml: Any, exc: Exception) -> str:
    if isinstance(exc, pynvml.NVMLError_LibraryNotFound):
        return "no GPU: NVML library not found (no NVIDIA driver installed)"
    if isinstance(exc, pynvml.NVMLError_DriverNotLoaded):
        return "no GPU: NVIDIA driver not loaded"
    return f"no GPU: NVML error: {exc}"
