"""Real pretrained models from PyPI wheels, served from bare folders on every path.

The rule (issue 12): whatever the runtime itself accepts, Ferry accepts, and
answers what the runtime answers.  For each model in tests/compat/models.py:
``ferry-cloud model inspect``; the V2 metadata of both tiers; one
tritonclient request over JSON and one over binary to the cloud node and to
the edge agent's local V2 API; one request over the cloud's MQTT front, and
one the agent offloads there; every answer equal to the raw runtime's within
the model's tolerance.  docs/compatibility.md is the same checks as a
table (``python scripts/compat_table.py`` regenerates it).
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from tests.compat.harness import PATHS, Stack, check_path, inspect_model, model_path
from tests.compat.models import MODELS, CompatModel
from tests.support import ROOT

pytestmark = pytest.mark.slow

SERVED_PATHS = [p for p in PATHS if p != "inspect"]


def _ids(models: list[CompatModel]) -> list[str]:
    return [m.id for m in models]


@pytest.mark.parametrize("model", MODELS, ids=_ids(MODELS))
def test_inspect_exits_0_and_lists_every_input(model: CompatModel, compat_repository: Path) -> None:
    described = inspect_model(model_path(compat_repository, model))
    assert sorted(t["name"] for t in described["inputs"]) == sorted(model.feeds)
    assert described["outputs"], "inspect lists no outputs"
    for tensor in described["inputs"] + described["outputs"]:
        assert not tensor["datatype"].startswith("onnx:"), tensor


def test_every_model_of_the_bare_repository_is_ready_on_both_tiers(compat_stack: Stack) -> None:
    with urllib.request.urlopen(
        urllib.request.Request(compat_stack.cloud.http_url + "/v2/repository/index", b"{}"),
        timeout=30,
    ) as reply:
        index = json.loads(reply.read())
    states = {entry["name"]: entry["state"] for entry in index}
    assert states == {m.id: "READY" for m in MODELS}
    local = compat_stack.agent.field("local").split(",")
    assert sorted(local) == sorted(_ids(MODELS))


@pytest.mark.parametrize("path", SERVED_PATHS)
@pytest.mark.parametrize("model", MODELS, ids=_ids(MODELS))
def test_served_answers_equal_the_runtime(
    model: CompatModel, path: str, compat_repository: Path, compat_stack: Stack, compat_cases
) -> None:
    inputs, want = compat_cases[model.id]
    check_path(path, model, compat_repository, compat_stack, inputs, want)


def test_the_compatibility_table_lists_every_model() -> None:
    table = (ROOT / "docs" / "compatibility.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    for model in MODELS:
        row = next((r for r in rows if r.startswith(f"| `{model.id}`")), None)
        assert row is not None, f"docs/compatibility.md has no row for {model.id}"
        assert f"{model.package}=={model.version}" in row, row
