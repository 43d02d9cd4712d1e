"""The local runtimes' queue: bounded, and a request past the bound is refused at once."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from edge.local import LocalModels
from shared.errors import Overloaded
from shared.repository import ModelRepository
from tests.support import write_linear_model


async def test_requests_past_the_local_backlog_are_refused_not_queued(tmp_path):
    write_linear_model(tmp_path / "lin" / "1" / "model.onnx", seed=1)
    local = LocalModels(ModelRepository(tmp_path), latency_floor_s=0.3, max_backlog=2)
    await asyncio.to_thread(local.load, "lin")
    x = {"x": np.ones((1, 4), np.float32)}
    running = [asyncio.ensure_future(local.run("lin", x)) for _ in range(2)]
    await asyncio.sleep(0.05)
    with pytest.raises(Overloaded, match="2 requests waiting"):
        await local.run("lin", x)
    results = await asyncio.gather(*running)
    assert all(out["y"].shape == (1, 3) for out, _ in results)
    assert local.backlog("lin") == 0
    await local.run("lin", x)  # room again
    local.close()
