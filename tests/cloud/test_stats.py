"""ModelStats: Triton statistics-extension shape and thread safety."""

from __future__ import annotations

import threading
import time

from cloud.stats import ModelStats


def test_to_triton_reports_the_statistics_extension_entry():
    stats = ModelStats("resnet", 3)
    before_ms = time.time_ns() // 1_000_000
    stats.record_success(request_ns=5_000, queue_ns=1_000, compute_ns=3_000, items=2)
    stats.record_success(request_ns=7_000, queue_ns=2_000, compute_ns=3_000, items=1)
    stats.record_failure(request_ns=400)
    stats.record_execution(batch_size=3, compute_ns=3_000)
    stats.record_execution(batch_size=1, compute_ns=900)
    stats.record_execution(batch_size=3, compute_ns=2_000)
    entry = stats.to_triton()
    assert before_ms <= entry.pop("last_inference") <= time.time_ns() // 1_000_000
    assert entry == {
        "name": "resnet",
        "version": "3",
        "inference_count": 3,
        "execution_count": 3,
        "inference_stats": {
            "success": {"count": 2, "ns": 12_000},
            "fail": {"count": 1, "ns": 400},
            "queue": {"count": 2, "ns": 3_000},
            "compute_input": {"count": 2, "ns": 0},
            "compute_infer": {"count": 2, "ns": 6_000},
            "compute_output": {"count": 2, "ns": 0},
        },
        "batch_stats": [
            {"batch_size": 1, "compute_infer": {"count": 1, "ns": 900}},
            {"batch_size": 3, "compute_infer": {"count": 2, "ns": 5_000}},
        ],
        "memory_usage": [],
    }


def test_memory_usage_appears_once_the_dataplane_sets_it():
    stats = ModelStats("m", 1)
    stats.memory_bytes = 4096
    assert stats.to_triton()["memory_usage"] == [{"type": "CPU", "id": 0, "byte_size": 4096}]
    assert stats.snapshot().memory_bytes == 4096


def test_fresh_stats_have_never_run():
    entry = ModelStats("m", 1).to_triton()
    assert entry["last_inference"] == 0
    assert entry["inference_count"] == entry["execution_count"] == 0
    assert entry["batch_stats"] == []


def test_counters_stay_exact_under_concurrent_updates():
    stats = ModelStats("m", 1)
    rounds, threads = 5_000, 4

    def hammer() -> None:
        for i in range(rounds):
            stats.record_success(10, 2, 5, 2)
            stats.record_execution(1 + i % 4, 5)
            stats.record_failure(1)

    workers = [threading.Thread(target=hammer) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    snap = stats.snapshot()
    total = rounds * threads
    assert (snap.success_count, snap.fail_count, snap.execution_count) == (total, total, total)
    assert snap.inference_count == 2 * total
    assert snap.success_ns == 10 * total and snap.queue_ns == 2 * total
    assert sum(c for c, _ in snap.batch.values()) == total
    assert snap.batch == {size: (total // 4, 5 * total // 4) for size in (1, 2, 3, 4)}
