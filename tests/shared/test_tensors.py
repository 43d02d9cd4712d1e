import numpy as np
import pytest

from shared.datatypes import numpy_dtype
from shared.errors import InvalidInput, PayloadTooLarge
from shared.tensors import (
    DEFAULT_LIMITS,
    Limits,
    array_from_buffer,
    cast_json_data,
    check_shape,
    json_data,
)


def test_a_valid_shape_comes_back_as_a_tuple():
    assert check_shape([2, 0, 3], "x", DEFAULT_LIMITS) == (2, 0, 3)
    assert check_shape([], "x", DEFAULT_LIMITS) == ()


def test_every_dimension_is_capped_even_when_another_is_zero():
    limits = Limits(max_elements=100)
    assert check_shape([0, 100], "x", limits) == (0, 100)
    with pytest.raises(PayloadTooLarge, match="dimension 101"):
        check_shape([0, 101], "x", limits)


def test_zero_element_shapes_numpy_cannot_describe_are_refused():
    limits = Limits(max_elements=2**40)
    with pytest.raises(InvalidInput, match="cannot be represented"):
        check_shape([0, 2**40, 2**40], "x", limits)


@pytest.mark.parametrize("shape", [[-1], [1.0], [True], ["2"], [None], 3, "2,2", {"a": 1}])
def test_a_shape_that_is_not_a_list_of_non_negative_ints_is_refused(shape):
    with pytest.raises(InvalidInput, match="shape"):
        check_shape(shape, "x", DEFAULT_LIMITS)


def test_a_string_among_numbers_is_refused_before_numpy_builds_a_unicode_array():
    # numpy would size a unicode array at elements x longest string: 400 GB here.
    data = ["x" * 1_000_000] + [0.0] * 100_000
    with pytest.raises(InvalidInput, match="must hold numbers"):
        cast_json_data("x", "FP32", (len(data),), data)


@pytest.mark.parametrize(
    "datatype, data, message",
    [
        ("INT32", [1, True], "integer numbers"),
        ("INT32", [1, 1.0], "integer numbers"),
        ("FP32", [1.0, False], "numbers"),
        ("FP32", [1.0, None], "numbers"),
        ("BOOL", [True, 0], "true/false"),
        ("INT8", [1, 128], "out of range for INT8"),
        ("UINT64", [-1, 2**64 - 1], "out of range for UINT64"),
        ("INT64", [[1], [2**70]], "out of range for INT64"),
        ("FP16", [1.0, 65520.0], "out of range for FP16"),
        ("BF16", [1.0, 3.4e38], "out of range for BF16"),
        ("FP32", [[1.0, 2.0], [3.0]], "regular"),
        ("FP32", [1.0, [2.0]], "numbers"),
    ],
)
def test_json_data_that_does_not_fit_the_datatype_is_refused(datatype, data, message):
    with pytest.raises(InvalidInput, match=message):
        cast_json_data("x", datatype, (2,), data)


def test_json_values_at_the_edge_of_each_range_are_kept_exactly():
    assert cast_json_data("x", "UINT64", (2,), [0, 2**64 - 1]).tolist() == [0, 2**64 - 1]
    assert cast_json_data("x", "INT64", (1,), [-(2**63)]).tolist() == [-(2**63)]
    assert cast_json_data("x", "FP16", (1,), [65504.0]).tolist() == [65504.0]
    assert cast_json_data("x", "FP64", (1,), [1.7e308]).tolist() == [1.7e308]
    assert cast_json_data("x", "FP32", (2,), [1, 2**70]).dtype == np.float32


def test_non_finite_tokens_are_floats_and_only_the_exact_spellings_count():
    out = cast_json_data("x", "BF16", (3,), ["NaN", "Infinity", "-Infinity"])
    assert out.dtype == numpy_dtype("BF16")
    assert np.isnan(out[0]) and out[1] == np.inf and out[2] == -np.inf
    for word in ("nan", "Inf", "+Infinity", "infinity"):
        with pytest.raises(InvalidInput):
            cast_json_data("x", "FP32", (1,), [word])


def test_json_data_writes_non_finite_floats_as_tokens():
    array = np.array([[np.nan, -np.inf], [np.inf, 0.5]], np.float16)
    assert json_data(array, "FP16") == ["NaN", "-Infinity", "Infinity", 0.5]
    assert json_data(np.array([1, 2], np.int64), "INT64") == [1, 2]


def test_binary_bool_accepts_only_0_and_1():
    assert array_from_buffer("x", "BOOL", (2,), b"\x00\x01").tolist() == [False, True]
    assert array_from_buffer("x", "BOOL", (0,), b"").shape == (0,)
    with pytest.raises(InvalidInput, match="found 255"):
        array_from_buffer("x", "BOOL", (2,), b"\x01\xff")


def test_the_json_limit_is_below_the_body_limit_by_default():
    assert DEFAULT_LIMITS.max_json_body_bytes < DEFAULT_LIMITS.max_body_bytes
