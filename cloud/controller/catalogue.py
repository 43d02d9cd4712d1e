"""The models the controller places, read from the shared model repository.

Each model's ``[placement]`` table (latency objective, min/max copies, a rate
to plan for until one is observed, allowed backends) is the operator's word;
the backends it can run on are the ones its files allow (a config that names
a backend pins it, unless ``[placement] backends`` names the ones the fleet may use).  A model whose folder is broken is reported, not fatal:
the rest of the fleet still gets placed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from shared.errors import FerryError
from shared.repository import ModelRepository, PlacementPolicy
from shared.repository.capacity import SESSION_MEMORY_FACTOR, model_file_bytes

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelEntry:
    name: str
    policy: PlacementPolicy
    backends: tuple[str, ...]  # where its files can run, in preference order
    memory_bytes: int  # estimate from the files until a node measures it
    max_batch: int


def read_catalogue(repository: ModelRepository) -> tuple[dict[str, ModelEntry], dict[str, str]]:
    """(entries by name, problems by name) for every model in the repository."""
    entries: dict[str, ModelEntry] = {}
    problems: dict[str, str] = {}
    for name in repository.model_names():
        try:
            entries[name] = _entry(repository, name)
        except FerryError as exc:
            problems[name] = exc.message
            log.warning("model %s cannot be placed: %s", name, exc.message)
        except Exception as exc:  # one odd folder must not stop the fleet's placement
            problems[name] = f"cannot be read: {type(exc).__name__}: {exc}"
            log.warning("model %s cannot be placed: %s", name, problems[name])
    return entries, problems


def _entry(repository: ModelRepository, name: str) -> ModelEntry:
    config = repository.read_config(name)
    versions = repository.selected_versions(name, config)
    if not versions:
        raise FerryError(f"model {name!r} has no version with a model file")
    folder = repository.model_dir(name) / str(versions[-1])
    # (OpenVINO serves a model.onnx: a model configured so had been placed nowhere)
    present = repository.backends(name, versions[-1])
    if config.placement.backends:
        # the operator's word for the fleet: it overrides the config's own backend (the
        # one a standalone node serves), as tune, which measures and picks among them,
        # reads it; each copy's backend goes with the placement to its node
        backends = [b for b in present if b in config.placement.backends]
    elif config.backend is not None:
        backends = [config.backend] if config.backend in present else []
    else:
        backends = list(present)  # a folder may hold the same model for several runtimes
    if not backends:
        raise FerryError(
            f"model {name!r}: no backend both allowed ([placement] backends "
            f"{list(config.placement.backends) or 'any'}, backend "
            f"{config.backend or 'any'}) and present in {folder} ({', '.join(present) or 'none'})"
        )
    # (the file the first allowed backend serves: the config's own backend may have none)
    _, path = repository.model_file(name, versions[-1], backends[0])
    memory = model_file_bytes(path) * SESSION_MEMORY_FACTOR * len(versions)
    memory *= config.instance_group.count
    return ModelEntry(
        name=name,
        policy=config.placement,
        backends=tuple(backends),
        memory_bytes=memory,
        max_batch=max(1, config.max_batch_size or 1),
    )
