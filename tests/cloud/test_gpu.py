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


@pytest.mark.skipif(not HAS_NVML, reason="needs an NVIDIA driver (NVML)")
def test_with_a_gpu_a_served_node_exports_each_gpu_under_its_uuid(tmp_path):
    """The node's /metrics carries what NVML reads, per board, beside the inference figures."""
    import urllib.request

    import pynvml
    from prometheus_client.parser import text_string_to_metric_families

    from tests.support import cloud_server, write_linear_model

    write_linear_model(tmp_path / "linear" / "1" / "model.onnx")
    server = cloud_server(tmp_path).start()
    try:
        with urllib.request.urlopen(server.http_url + "/metrics", timeout=10) as r:
            text = r.read().decode()
    finally:
        server.terminate()
    values: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            values[(s.name, s.labels.get("gpu_uuid", ""))] = s.value
    assert values[("ferry_gpu_available", "")] == 1.0
    pynvml.nvmlInit()
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            uuid = pynvml.nvmlDeviceGetUUID(handle)
            uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
            total = pynvml.nvmlDeviceGetMemoryInfo(handle).total
            assert values[("nv_gpu_memory_total_bytes", uuid)] == total
            assert 0 <= values[("nv_gpu_memory_used_bytes", uuid)] <= total  # idle reads 0
            assert 0.0 <= values[("nv_gpu_utilization", uuid)] <= 1.0
    finally:
        pynvml.nvmlShutdown()


class _Nvml:
    """NVML's calling shape for the memory read, standing in where no driver exists."""

    class NVMLError(Exception):
        pass

    nvmlMemory_v2 = 0x2000028

    def __init__(self, v2: bool) -> None:
        self.v2 = v2

    def nvmlDeviceGetMemoryInfo(self, handle, version=None):
        from types import SimpleNamespace

        if version is None:  # v1: the driver's reservation counted as used
            return SimpleNamespace(total=80, used=5 + 3, free=72)
        if not self.v2:
            raise self.NVMLError("Function Not Found")
        return SimpleNamespace(total=80, reserved=3, used=5, free=72)


def test_used_memory_leaves_out_the_drivers_reservation_and_falls_back_to_v1():
    from cloud.gpu import _memory

    assert _memory(_Nvml(v2=True), object()) == (5, 80)  # what nvidia-smi shows
    assert _memory(_Nvml(v2=False), object()) == (8, 80)
