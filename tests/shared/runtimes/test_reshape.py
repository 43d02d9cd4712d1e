"""Triton's reshape around a real session: the declared dims in, the model's shape fed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from shared.errors import ConfigError
from shared.runtimes import RuntimeOptions, load_session
from shared.runtimes.base import TensorSpec
from shared.runtimes.reshape import reshaped
from tests.shared.repository import write_identity_model


@pytest.fixture
def square(tmp_path: Path):
    path = write_identity_model(tmp_path / "m.onnx", [("x", "FP32", ["N", 2, 2])])
    session = load_session("onnxruntime", path, RuntimeOptions(threads=1))
    yield session
    session.close()


def test_an_empty_batch_is_reshaped_where_numpy_cannot_work_out_the_minus_one(tmp_path):
    """Each -1 takes its counterpart's size: numpy cannot with two -1s, nor with one in
    an empty batch (every request of 0 items had been a 400)."""
    path = write_identity_model(tmp_path / "v.onnx", [("x", "FP32", ["N", "M"])])
    inner = load_session("onnxruntime", path, RuntimeOptions(threads=1))
    declared = [TensorSpec("x", "FP32", (-1, 1), reshape=(-1,))]
    session = reshaped(inner, declared, 8, "model 'v'")
    assert session.inputs[0].dims == (-1, -1, 1)
    assert session.run({"x": np.zeros((0, 3, 1), np.float32)})["x_out"].shape == (0, 3)
    x = np.arange(6, dtype=np.float32).reshape(2, 3, 1)
    np.testing.assert_array_equal(session.run({"x": x})["x_out"], x.reshape(2, 3))
    session.close()


def test_triton_refuses_what_does_not_hold_the_same_values_and_so_does_ferry(square):
    for dims, shape in (((4,), (-1, 2)), ((-1,), (2, 2)), ((2, -1), (-1, 2))):
        with pytest.raises(ConfigError, match="do not hold the same values"):
            reshaped(square, [TensorSpec("x", "FP32", dims, reshape=shape)], 8, "model 'm'")


def test_a_reshape_the_model_file_cannot_take_is_refused_at_load(square):
    with pytest.raises(ConfigError, match="not the reshape"):
        reshaped(square, [TensorSpec("x", "FP32", (4,), reshape=(4,))], 8, "model 'm'")
