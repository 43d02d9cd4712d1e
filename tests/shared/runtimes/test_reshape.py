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


def test_an_empty_batch_is_reshaped_where_numpy_cannot_work_out_the_minus_one(square):
    """(0, -1, 2) is ambiguous to numpy: every request of 0 items had been a 400."""
    declared = [TensorSpec("x", "FP32", (4,), reshape=(-1, 2))]
    session = reshaped(square, declared, 8, "model 'm'")
    assert session.inputs[0].dims == (-1, 4)
    out = session.run({"x": np.zeros((0, 4), np.float32)})
    assert out["x_out"].shape == (0, 2, 2)
    two = np.arange(8, dtype=np.float32).reshape(2, 4)
    np.testing.assert_array_equal(session.run({"x": two})["x_out"], two.reshape(2, 2, 2))


def test_a_reshape_the_model_file_cannot_take_is_refused_at_load(square):
    with pytest.raises(ConfigError, match="not the reshape"):
        reshaped(square, [TensorSpec("x", "FP32", (4,), reshape=(4,))], 8, "model 'm'")
