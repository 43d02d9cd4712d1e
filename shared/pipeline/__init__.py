"""Declarative pre- and post-processing shared by both tiers.

A model's ``config.toml`` may turn an image input into the tensor the model
takes (``[[preprocess]]``) and an output into scores, labels or an index
(``[[postprocess]]``); :func:`open_session` loads a model file with them, so
the agent and the cloud run the same code on the same request.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shared.runtimes import RuntimeOptions, Session, load_session

if TYPE_CHECKING:
    from shared.pipeline.session import PipelineSession, decode_pool, wrap
    from shared.pipeline.spec import ImageInput, OutputStage
    from shared.repository.config import ModelConfig

# The stages (and the image decoders under them) load with the first model that has
# any: an agent whose models take tensors never imports them.
_LAZY = {
    "PipelineSession": "shared.pipeline.session",
    "decode_pool": "shared.pipeline.session",
    "wrap": "shared.pipeline.session",
    "ImageInput": "shared.pipeline.spec",
    "OutputStage": "shared.pipeline.spec",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


def open_session(backend: str, path: Path, options: RuntimeOptions, config: ModelConfig) -> Session:
    """Load ``path`` and put the config's stages around it.

    Labels files are read from the folder of the config file (else ``path``'s
    grandparent, ``<model>/<version>/model.*``), so a converted copy of the
    model file elsewhere still finds them.
    """
    if options.precision_hint and backend != "openvino":
        # (OpenVINO's INFERENCE_PRECISION_HINT: another runtime computes as its file says)
        where = str(config.source) if config.source else f"model {config.name!r}"
        logging.getLogger(__name__).warning(
            "%s: key 'runtime.precision_hint' applies to the openvino backend only; %s ignores it",
            where,
            backend,
        )
    session = load_session(backend, path, options)
    if any(t.reshape is not None for t in (*config.inputs, *config.outputs)):
        from shared.runtimes.reshape import reshaped

        where = str(config.source) if config.source else f"model {config.name!r}"
        try:
            session = reshaped(
                session, [*config.inputs, *config.outputs], config.max_batch_size, where
            )
        except BaseException:
            session.close()
            raise
    if not config.preprocess and not config.postprocess:
        return session
    from shared.pipeline.session import wrap

    where = str(config.source) if config.source else f"model {config.name!r}"
    try:
        # (the config file's folder: a converted copy elsewhere, as tune makes in a
        # temporary folder, read /tmp/labels.txt)
        folder = Path(config.source).parent if config.source else Path(path).parent.parent
        return wrap(session, config.preprocess, config.postprocess, folder, where)
    except BaseException:
        session.close()
        raise


def sample_inputs(session: Session, config: ModelConfig, batch: int = 1) -> dict:
    """Valid inputs for a warm-up or a timing run: zeros, or a photo-like image per item
    for an image input (BYTES would otherwise hold nothing a decoder accepts)."""
    stages = sys.modules.get("shared.pipeline.session")  # no stages loaded: not one of theirs
    if stages is not None and isinstance(session, stages.PipelineSession):
        return session.sample_inputs(batch)
    from shared.repository import warm_up_inputs

    return warm_up_inputs(config)


__all__ = [
    "ImageInput",
    "OutputStage",
    "PipelineSession",
    "decode_pool",
    "open_session",
    "sample_inputs",
    "wrap",
]
