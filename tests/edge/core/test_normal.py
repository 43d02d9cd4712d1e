"""The normal quantile the estimators use, against the standard library's."""

from __future__ import annotations

from statistics import NormalDist

import pytest
from hypothesis import given
from hypothesis import strategies as st

from edge.core.normal import ppf


@given(st.floats(min_value=1e-15, max_value=1 - 1e-15))
def test_the_quantile_agrees_with_the_standard_library(p: float) -> None:
    assert ppf(p) == pytest.approx(NormalDist().inv_cdf(p), rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("p", [0.0, 1.0, -0.1, 1.5])
def test_a_quantile_outside_the_open_interval_is_refused(p: float) -> None:
    with pytest.raises(ValueError):
        ppf(p)
