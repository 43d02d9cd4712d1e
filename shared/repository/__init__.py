"""The model repository: folder layout, ``config.toml`` schema, Triton rendering.

``ModelRepository(root)`` reads folders; :func:`parse_config` and
:func:`complete_config` turn a config file plus a loaded session into a
checked :class:`ModelConfig`; :func:`triton_model_config` renders it for
Triton-speaking tools.
"""

from shared.repository.config import (
    DEFAULT_MAX_BATCH_SIZE,
    DynamicBatching,
    InstanceGroup,
    ModelConfig,
    PlacementPolicy,
    RuntimeConfig,
    VersionPolicy,
    parse_config,
    parse_config_dict,
    parse_config_json,
)
from shared.repository.legacy import parse_legacy_config
from shared.repository.repository import (
    ModelRepository,
    complete_config,
    parse_version,
    validate_model_name,
)
from shared.repository.triton import (
    triton_datatype,
    triton_model_config,
    v2_model_metadata,
    warm_up_inputs,
)

__all__ = [
    "DEFAULT_MAX_BATCH_SIZE",
    "DynamicBatching",
    "InstanceGroup",
    "ModelConfig",
    "ModelRepository",
    "PlacementPolicy",
    "RuntimeConfig",
    "VersionPolicy",
    "complete_config",
    "parse_config",
    "parse_config_dict",
    "parse_config_json",
    "parse_legacy_config",
    "parse_version",
    "triton_datatype",
    "triton_model_config",
    "v2_model_metadata",
    "validate_model_name",
    "warm_up_inputs",
]
