"""The fault-injection suite (bench/faults.py) in quick mode: real processes, a real
broker, a steady request stream through a real agent; no request may be lost and no
process may die that the scenario did not kill.  About a minute for all of them."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench._faults import SCENARIOS, run_scenario

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name", list(SCENARIOS))
async def test_no_request_is_lost(name: str, tmp_path: Path) -> None:
    result = await run_scenario(name, quick=True, workdir=tmp_path)
    if result.skipped:
        pytest.skip(result.skipped)
    assert result.sent > 0
    assert not result.failed, result.explain()
    # the stream came back to normal after the fault (else the scenario is a problem above)
    assert result.recovery_s is not None
