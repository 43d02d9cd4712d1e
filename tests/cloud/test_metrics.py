"""Prometheus exposition: Triton's exact names, values read from ModelStats at scrape time."""

from __future__ import annotations

import asyncio

import numpy as np
import prometheus_client
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cloud.batcher import DynamicBatcher
from cloud.gpu import GpuMonitor
from cloud.metrics import CONTENT_TYPE, make_registry, render_metrics
from cloud.stats import ModelStats
from shared.errors import FerryError
from shared.repository.config import DynamicBatching
from shared.runtimes import RuntimeOptions, load_session
from tests.cloud.test_batcher import build_linear

TRITON_COUNTERS = (
    "nv_inference_request_success",
    "nv_inference_request_failure",
    "nv_inference_count",
    "nv_inference_exec_count",
    "nv_inference_request_duration_us",
    "nv_inference_queue_duration_us",
    "nv_inference_compute_input_duration_us",
    "nv_inference_compute_infer_duration_us",
    "nv_inference_compute_output_duration_us",
)


def scrape(registry) -> dict[tuple[str, tuple], float]:
    """Samples by (name, labels); counters under their exposed (Triton) names.

    prometheus_client's parser reports a counter's samples as ``<name>_total``;
    the family's own name is what the server wrote.
    """
    body, content_type = render_metrics(registry)
    assert content_type == CONTENT_TYPE
    samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            name = s.name
            if family.type == "counter" and name == family.name + "_total":
                name = family.name
            samples[(name, tuple(sorted(s.labels.items())))] = s.value
    return samples


LABELS = (("model", "lin"), ("version", "2"))


@pytest.fixture
async def served_stats(tmp_path):
    """Stats produced by a real batcher serving a real ONNX Runtime session."""
    session = load_session(
        "onnxruntime", build_linear(tmp_path / "m.onnx"), RuntimeOptions(threads=1)
    )
    stats = ModelStats("lin", 2)
    batcher = DynamicBatcher(
        model="lin",
        version=2,
        sessions=[session],
        max_batch_size=8,
        policy=DynamicBatching(max_queue_delay_us=1_000),
        stats=stats,
    )
    await batcher.start()
    x = np.ones((2, 4), np.float32)
    await asyncio.gather(*(batcher.infer({"x": x}) for _ in range(6)))
    with pytest.raises(FerryError):  # the runtime rejects the inner dim: one failure
        await batcher.infer({"x": np.ones((1, 7), np.float32)})
    await batcher.stop()
    session.close()
    stats.memory_bytes = 1234
    return stats


async def test_exposition_uses_triton_names_and_matches_the_stats(served_stats):
    stats = served_stats
    registry = make_registry(lambda: [stats], None)
    body = render_metrics(registry)[0].decode()
    snap = stats.snapshot()
    for name in TRITON_COUNTERS:
        assert f"# TYPE {name} counter\n" in body  # Triton's exact names, typed counter
        assert f"\n{name}{{model=" in body
    assert "_total" not in body
    assert '\nnv_inference_pending_request_count{model="lin",version="2"} 0.0\n' in body

    values = scrape(registry)
    expected = {
        "nv_inference_request_success": snap.success_count,
        "nv_inference_count": snap.inference_count,
        "nv_inference_exec_count": snap.execution_count,
        "nv_inference_request_duration_us": snap.success_ns // 1000,
        "nv_inference_queue_duration_us": snap.queue_ns // 1000,
        "nv_inference_compute_input_duration_us": snap.compute_input_ns // 1000,
        "nv_inference_compute_infer_duration_us": snap.compute_infer_ns // 1000,
        "nv_inference_compute_output_duration_us": snap.compute_output_ns // 1000,
        "ferry_model_memory_bytes": 1234,
    }
    for name, value in expected.items():
        assert values[(name, LABELS)] == value, name
    assert (snap.success_count, snap.fail_count, snap.inference_count) == (6, 1, 12)
    # the one failure is the runtime's (the inner dim passed the batcher): reason BACKEND
    failures = {
        reason: values[
            ("nv_inference_request_failure", tuple(sorted((*LABELS, ("reason", reason)))))
        ]
        for reason in ("REJECTED", "CANCELED", "BACKEND", "OTHER")
    }
    assert failures == {"REJECTED": 0, "CANCELED": 0, "BACKEND": 1, "OTHER": 0}
    assert values[("ferry_inference_batch_size_count", LABELS)] == snap.execution_count
    assert values[("ferry_inference_batch_size_sum", LABELS)] == sum(
        size * c for size, (c, _) in snap.batch.items()
    )


async def test_merged_batches_report_measured_input_and_output_time(tmp_path):
    """Requests merged into one batch are concatenated and split: both are timed, per request."""
    session = load_session(
        "onnxruntime", build_linear(tmp_path / "m.onnx"), RuntimeOptions(threads=1)
    )
    stats = ModelStats("lin", 1)
    batcher = DynamicBatcher(
        model="lin",
        version=1,
        sessions=[session],
        max_batch_size=8,
        policy=DynamicBatching(max_queue_delay_us=200_000, preferred_batch_sizes=(8,)),
        stats=stats,
    )
    await batcher.start()
    await asyncio.gather(*(batcher.infer({"x": np.ones((1, 4), np.float32)}) for _ in range(8)))
    await batcher.stop()
    session.close()
    snap = stats.snapshot()
    assert snap.batch == {8: (1, snap.batch[8][1])}  # one merged batch of 8
    assert snap.compute_input_ns > 0 and snap.compute_output_ns > 0
    entry = stats.to_triton()["inference_stats"]
    assert entry["compute_input"] == {"count": 8, "ns": snap.compute_input_ns}
    assert entry["compute_output"] == {"count": 8, "ns": snap.compute_output_ns}


def test_values_are_read_at_scrape_time():
    stats = ModelStats("m", 1)
    registry = make_registry(lambda: [stats], None)
    key = ("nv_inference_request_success", (("model", "m"), ("version", "1")))
    assert scrape(registry)[key] == 0
    stats.record_success(1_000, 0, 500, 1)
    stats.pending = 5
    values = scrape(registry)
    assert values[key] == 1
    assert values[("nv_inference_pending_request_count", (("model", "m"), ("version", "1")))] == 5


def test_batch_size_histogram_buckets_are_cumulative():
    stats = ModelStats("m", 1)
    for size, count in {1: 3, 3: 2, 8: 1, 200: 1}.items():
        for _ in range(count):
            stats.record_execution(size, 10)
    values = scrape(make_registry(lambda: [stats], None))
    labels = (("model", "m"), ("version", "1"))
    buckets = {
        le: values[("ferry_inference_batch_size_bucket", tuple(sorted((*labels, ("le", le)))))]
        for le in ("1", "2", "4", "8", "16", "32", "64", "128", "+Inf")
    }
    assert buckets == {
        "1": 3, "2": 3, "4": 5, "8": 6, "16": 6, "32": 6, "64": 6, "128": 6, "+Inf": 7
    }  # fmt: skip
    assert values[("ferry_inference_batch_size_count", labels)] == 7
    assert values[("ferry_inference_batch_size_sum", labels)] == 3 + 6 + 8 + 200


def test_cpu_figures_come_from_proc():
    from cloud.cpu import CpuMonitor, read_meminfo

    monitor = CpuMonitor()
    sum(i * i for i in range(200_000))  # some busy time between the two readings
    values = scrape(make_registry(lambda: [], None, monitor))
    util = values[("nv_cpu_utilization", ())]
    assert 0.0 <= util <= 1.0
    total, _ = read_meminfo()
    assert values[("nv_cpu_memory_total_bytes", ())] == total
    assert 0 < values[("nv_cpu_memory_used_bytes", ())] <= total
    # without a monitor, nothing is made up
    assert ("nv_cpu_utilization", ()) not in scrape(make_registry(lambda: [], None))


def test_without_a_gpu_metrics_say_so_and_carry_no_gpu_samples():
    monitor = GpuMonitor()
    monitor.start()
    if monitor.available:
        monitor.close()
        pytest.skip("this machine has a GPU")
    registry = make_registry(lambda: [], monitor)
    body = render_metrics(registry)[0].decode()
    assert "\nferry_gpu_available 0.0\n" in body
    assert "nv_gpu_utilization" not in body and "nv_gpu_memory_used_bytes" not in body
    assert scrape(make_registry(lambda: [], None))[("ferry_gpu_available", ())] == 0
    monitor.close()


def test_each_server_has_its_own_registry_and_the_global_one_stays_clean():
    a, b = ModelStats("a", 1), ModelStats("b", 1)
    a.record_failure(10)
    reg_a, reg_b = make_registry(lambda: [a], None), make_registry(lambda: [b], None)
    key = ("nv_inference_request_failure", (("model", "a"), ("reason", "OTHER"), ("version", "1")))
    assert scrape(reg_a)[key] == 1
    assert all(labels != (("model", "a"), ("version", "1")) for _, labels in scrape(reg_b))
    global_body = prometheus_client.generate_latest(prometheus_client.REGISTRY).decode()
    assert "nv_inference" not in global_body
