import numpy as np
import pytest

from shared.datatypes import DATATYPES, element_size, numpy_dtype, v2_datatype
from shared.errors import HTTP_STATUS, ErrorCode, InvalidInput, error_from_code


def test_every_v2_datatype_has_a_numpy_dtype_that_maps_back():
    for name in DATATYPES:
        assert v2_datatype(numpy_dtype(name)) == name


def test_element_sizes_follow_the_v2_table():
    assert element_size("BF16") == 2 and element_size("FP64") == 8
    assert element_size("BOOL") == 1 and element_size("BYTES") == 0


def test_strings_map_to_bytes_and_big_endian_is_accepted():
    assert v2_datatype(np.array(["a"]).dtype) == "BYTES"
    assert v2_datatype(np.dtype(">f4")) == "FP32"


def test_unknown_datatype_is_an_invalid_input():
    with pytest.raises(InvalidInput, match="unknown datatype"):
        numpy_dtype("FP8")


def test_every_error_code_has_an_http_status_and_round_trips():
    for code in ErrorCode:
        assert code in HTTP_STATUS
        assert error_from_code(code.value, "m").code is code
    assert error_from_code("weird", "m").code is ErrorCode.INTERNAL
