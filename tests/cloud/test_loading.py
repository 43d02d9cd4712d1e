"""Load-time helpers: warm-up inputs, thread budget, memory readings."""

from __future__ import annotations

import numpy as np

from cloud.loading import MemoryProbe, session_threads, warm_up
from shared.repository import ModelConfig, RuntimeConfig, warm_up_inputs
from shared.runtimes import RuntimeOptions, load_session
from shared.runtimes.base import TensorSpec
from tests.support import write_identity_model, write_linear_model


def test_warm_up_inputs_are_zeros_of_batch_one_with_dynamic_dims_as_one():
    config = ModelConfig(
        name="m",
        max_batch_size=8,
        inputs=(
            TensorSpec("img", "FP16", (3, -1, 4)),
            TensorSpec("text", "BYTES", (2,)),
        ),
    )
    inputs = warm_up_inputs(config)
    assert inputs["img"].shape == (1, 3, 1, 4) and inputs["img"].dtype == np.float16
    assert not inputs["img"].any()
    assert inputs["text"].shape == (1, 2) and inputs["text"].tolist() == [[b"", b""]]
    unbatched = warm_up_inputs(ModelConfig(name="m", max_batch_size=0, inputs=config.inputs))
    assert unbatched["img"].shape == (3, 1, 4)


def test_warm_up_runs_a_real_session_and_tolerates_a_model_that_rejects_zeros(tmp_path):
    from onnx import TensorProto

    write_linear_model(tmp_path / "l.onnx")
    session = load_session("onnxruntime", tmp_path / "l.onnx", RuntimeOptions(threads=1))
    config = ModelConfig(name="l", max_batch_size=4, inputs=(TensorSpec("x", "FP32", (4,)),))
    assert warm_up(session, config) is True
    wrong = ModelConfig(name="l", max_batch_size=4, inputs=(TensorSpec("x", "FP32", (5,)),))
    assert warm_up(session, wrong) is False  # logged, not raised
    write_identity_model(tmp_path / "s.onnx", TensorProto.STRING)
    strings = load_session("onnxruntime", tmp_path / "s.onnx", RuntimeOptions(threads=1))
    assert warm_up(
        strings, ModelConfig(name="s", max_batch_size=4, inputs=(TensorSpec("x", "BYTES", (3,)),))
    )


def test_thread_budget_divides_the_cores_unless_the_model_sets_its_own():
    plain = ModelConfig(name="m")
    assert session_threads(plain, cores=8, sessions_on_node=3) == 2
    assert session_threads(plain, cores=2, sessions_on_node=5) == 1
    assert session_threads(plain, cores=4, sessions_on_node=0) == 4
    own = ModelConfig(name="m", runtime=RuntimeConfig(threads=3))
    assert session_threads(own, cores=2, sessions_on_node=9) == 3


def test_memory_growth_sees_a_new_allocation_and_is_never_negative():
    probe = MemoryProbe()
    before = probe.read()
    assert before[0] > 0
    held = np.ones(4 * 1024 * 1024, np.uint8)  # 4 MiB, touched
    after = probe.read()
    assert MemoryProbe.growth(before, after) >= 4 * 1024 * 1024 * 0.9
    assert MemoryProbe.growth(after, before) == 0
    del held
