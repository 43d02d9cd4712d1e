"""GpuMonitor: reports "no GPU" without a driver, real figures with one."""

from __future__ import annotations

import pytest

from cloud.gpu import GpuMonitor


def _nvml_works() -> bool:
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


HAS_NVML = _nvml_works()


@pytest.mark.skipif(HAS_NVML, reason="this machine has an NVIDIA driver")
def test_without_a_driver_the_monitor_reports_no_gpu_and_never_raises():
    monitor = GpuMonitor()
    assert monitor.start() is False
    assert monitor.available is False
    assert monitor.reason.startswith("no GPU")
    assert "NVML library not found" in monitor.reason
    assert monitor.sample() == []
    monitor.close()
    monitor.close()  # idempotent, and nvmlShutdown is never called without nvmlInit


def test_sample_before_start_is_empty():
    monitor = GpuMonitor()
    assert monitor.available is False
    assert monitor.sample() == []
    assert "not started" in monitor.reason


@pytest.mark.skipif(not HAS_NVML, reason="needs an NVIDIA driver (NVML)")
def test_with_a_gpu_samples_are_in_range_and_cached():
    monitor = GpuMonitor(cache_s=60)
    try:
        assert monitor.start() is True
        samples = monitor.sample()
        assert samples
        for g in samples:
            assert g.uuid.startswith("GPU-")
            assert 0.0 <= g.utilization <= 1.0
            assert 0 <= g.memory_used <= g.memory_total and g.memory_total > 0
            assert g.power_w is None or g.power_w > 0
        assert monitor.sample() == samples  # within cache_s: no new NVML reads
    finally:
        monitor.close()
    assert monitor.available is False
    assert monitor.sample() == []
