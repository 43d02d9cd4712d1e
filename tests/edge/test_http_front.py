import pytest

from edge.http_front import _steering
from shared.errors import InvalidInput


@pytest.mark.parametrize(
    "params",
    [{"timeout": "soon"}, {"timeout": -5}, {"timeout": 1.5}, {"deadline_ms": 0}, {"priority": -1}],
)
def test_bad_steering_parameters_are_a_clear_400_not_a_crash(params):
    with pytest.raises(InvalidInput):
        _steering(dict(params))


def test_tritons_timeout_in_microseconds_becomes_the_deadline():
    params = {"timeout": 250_000, "other": 1}
    assert _steering(params) == (250.0, None, False)
    assert params == {"other": 1}  # steering keys are not forwarded to the cloud
