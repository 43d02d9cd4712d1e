"""Prometheus exposition under Triton's metric names (DESIGN.md section 5).

A custom collector reads the live :class:`~cloud.stats.ModelStats` objects at
scrape time, so the request path never touches prometheus_client.  Each server
builds its own ``CollectorRegistry``; the process-global default registry is
never used (two servers in one test process must not share counters).

Cumulative values are typed ``counter`` under Triton's exact names, without
the ``_total`` suffix (Triton's exposition: ``# TYPE nv_inference_count
counter`` then ``nv_inference_count{...} 12``).  prometheus_client's writer
appends ``_total`` to every counter, so :func:`render_metrics` writes the
text format 0.0.4 itself.  ``nv_inference_request_failure`` carries Triton's
``reason`` label (REJECTED, CANCELED, BACKEND, OTHER).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from cloud.cpu import CpuMonitor
from cloud.gpu import GpuMonitor
from cloud.stats import FAILURE_REASONS, ModelStats, StatsSnapshot

#: upper bounds of ferry_inference_batch_size (plus +Inf)
BATCH_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)

#: text format 0.0.4, which every Prometheus version scrapes
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LABELS = ["model", "version"]

# (name, help, value from a snapshot) for the cumulative per-model families
_COUNTERS: tuple[tuple[str, str, Callable[[StatsSnapshot], float]], ...] = (
    (
        "nv_inference_request_success",
        "Number of successful inference requests, all batch sizes",
        lambda s: s.success_count,
    ),
    (
        "nv_inference_count",
        "Number of inferences performed (a batch of n counts n)",
        lambda s: s.inference_count,
    ),
    (
        "nv_inference_exec_count",
        "Number of model executions performed (batches run)",
        lambda s: s.execution_count,
    ),
    (
        "nv_inference_request_duration_us",
        "Cumulative inference request duration in microseconds (successful requests)",
        lambda s: s.success_ns // 1000,
    ),
    (
        "nv_inference_queue_duration_us",
        "Cumulative inference queuing duration in microseconds",
        lambda s: s.queue_ns // 1000,
    ),
    (
        "nv_inference_compute_input_duration_us",
        "Cumulative compute input duration in microseconds (batch concatenation)",
        lambda s: s.compute_input_ns // 1000,
    ),
    (
        "nv_inference_compute_infer_duration_us",
        "Cumulative compute inference duration in microseconds",
        lambda s: s.compute_infer_ns // 1000,
    ),
    (
        "nv_inference_compute_output_duration_us",
        "Cumulative compute output duration in microseconds (batch split)",
        lambda s: s.compute_output_ns // 1000,
    ),
    (
        "ferry_inference_request_duplicate",
        "Retried requests answered from the idempotency cache without running the model",
        lambda s: s.duplicate_count,
    ),
)


def _counter(name: str, doc: str) -> Metric:
    return Metric(name, doc, "counter")


class MetricsCollector:
    """prometheus_client collector over the server's ModelStats, CPU and GPU monitors."""

    def __init__(
        self,
        stats_source: Callable[[], Iterable[ModelStats]],
        gpu: GpuMonitor | None,
        cpu: CpuMonitor | None = None,
    ) -> None:
        self._stats_source = stats_source
        self._gpu = gpu
        self._cpu = cpu

    def describe(self) -> list[Metric]:
        # Families depend on what is loaded at scrape time; registering must not collect.
        return []

    def collect(self) -> Iterator[Metric]:
        snaps = [stats.snapshot() for stats in self._stats_source()]
        yield from self._model_families(snaps)
        yield from self._cpu_families()
        yield from self._gpu_families()

    def _model_families(self, snaps: list[StatsSnapshot]) -> Iterator[Metric]:
        failure = _counter(
            "nv_inference_request_failure",
            "Number of failed inference requests, all batch sizes",
        )
        for s in snaps:
            for reason in FAILURE_REASONS:
                labels = {"model": s.name, "reason": reason, "version": str(s.version)}
                failure.add_sample(failure.name, labels, s.fail_reasons.get(reason, 0))
        yield failure
        for name, doc, value in _COUNTERS:
            family = _counter(name, doc)
            for s in snaps:
                family.add_sample(name, {"model": s.name, "version": str(s.version)}, value(s))
            yield family

        pending = GaugeMetricFamily(
            "nv_inference_pending_request_count",
            "Instantaneous number of pending requests awaiting execution per-model",
            labels=_LABELS,
        )
        memory = GaugeMetricFamily(
            "ferry_model_memory_bytes",
            "Estimated memory of the loaded model version (growth while loading + first run)",
            labels=_LABELS,
        )
        batches = HistogramMetricFamily(
            "ferry_inference_batch_size",
            "Size (items) of the batches executed",
            labels=_LABELS,
        )
        for s in snaps:
            labels = [s.name, str(s.version)]
            pending.add_metric(labels, s.pending)
            if s.memory_bytes is not None:
                memory.add_metric(labels, s.memory_bytes)
            buckets, total = batch_buckets(s.batch)
            batches.add_metric(labels, buckets, total)
        yield pending
        yield memory
        yield batches

    def _cpu_families(self) -> Iterator[Metric]:
        if self._cpu is None:
            return
        util = self._cpu.utilization()
        if util is not None:
            family = GaugeMetricFamily("nv_cpu_utilization", "CPU utilization rate [0.0 - 1.0]")
            family.add_metric([], util)
            yield family
        memory = self._cpu.memory()
        if memory is not None:
            total = GaugeMetricFamily(
                "nv_cpu_memory_total_bytes", "CPU total memory (RAM), in bytes"
            )
            total.add_metric([], memory[0])
            used = GaugeMetricFamily("nv_cpu_memory_used_bytes", "CPU used memory (RAM), in bytes")
            used.add_metric([], memory[1])
            yield total
            yield used

    def _gpu_families(self) -> Iterator[Metric]:
        samples = self._gpu.sample() if self._gpu is not None else []
        available = GaugeMetricFamily(
            "ferry_gpu_available", "1 when NVML reports at least one usable GPU, else 0"
        )
        available.add_metric([], 1 if self._gpu is not None and self._gpu.available else 0)
        yield available
        if not samples:
            return
        labels = ["gpu_uuid"]
        util = GaugeMetricFamily(
            "nv_gpu_utilization", "GPU utilization rate [0.0 - 1.0)", labels=labels
        )
        total = GaugeMetricFamily(
            "nv_gpu_memory_total_bytes", "GPU total memory, in bytes", labels=labels
        )
        used = GaugeMetricFamily(
            "nv_gpu_memory_used_bytes", "GPU used memory, in bytes", labels=labels
        )
        power = GaugeMetricFamily("nv_gpu_power_usage", "GPU power usage in watts", labels=labels)
        for g in samples:
            util.add_metric([g.uuid], g.utilization)
            total.add_metric([g.uuid], g.memory_total)
            used.add_metric([g.uuid], g.memory_used)
            if g.power_w is not None:
                power.add_metric([g.uuid], g.power_w)
        yield from (util, total, used, power)


def batch_buckets(batch: dict[int, tuple[int, int]]) -> tuple[list[tuple[str, float]], float]:
    """Cumulative histogram buckets and sum from per-batch-size counts."""
    buckets: list[tuple[str, float]] = []
    for bound in BATCH_BUCKETS:
        buckets.append((str(bound), sum(c for size, (c, _) in batch.items() if size <= bound)))
    buckets.append(("+Inf", sum(c for c, _ in batch.values())))
    total = float(sum(size * c for size, (c, _) in batch.items()))
    return buckets, total


def make_registry(
    stats_source: Callable[[], Iterable[ModelStats]],
    gpu: GpuMonitor | None,
    cpu: CpuMonitor | None = None,
) -> CollectorRegistry:
    """A fresh registry holding one MetricsCollector (one per server)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(MetricsCollector(stats_source, gpu, cpu))
    return registry


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def render_metrics(registry: CollectorRegistry) -> tuple[bytes, str]:
    """Body and Content-Type of a ``GET /metrics`` answer (text format 0.0.4).

    Samples are written under their own names, so a counter family keeps
    Triton's name (no ``_total``) in both its ``# TYPE`` line and its samples.
    """
    lines: list[str] = []
    for family in registry.collect():
        doc = family.documentation.replace("\\", r"\\").replace("\n", r"\n")
        lines.append(f"# HELP {family.name} {doc}")
        lines.append(f"# TYPE {family.name} {family.type}")
        for sample in family.samples:
            if sample.labels:
                labels = ",".join(f'{k}="{_escape(str(v))}"' for k, v in sample.labels.items())
                lines.append(f"{sample.name}{{{labels}}} {floatToGoString(sample.value)}")
            else:
                lines.append(f"{sample.name} {floatToGoString(sample.value)}")
    return ("\n".join(lines) + "\n").encode(), CONTENT_TYPE
