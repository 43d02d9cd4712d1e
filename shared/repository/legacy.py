"""Read a dl_inference ``config.txt`` so teams can migrate without rewriting it.

58.com's dl_inference (TisPredictOnline) describes a model with a JSON file
named ``config.txt``::

    {
        "batch_size": 0,
        "input": [{"name": "image", "data_type": "float",
                   "dims": [-1, 224, 224, 3], "node_name": "input_1:0"}],
        "output": [{"name": "probs", "data_type": "float",
                    "dims": [-1, 19], "node_name": "dense_1/Softmax:0"}]
    }

Mapping to Ferry:

- ``batch_size`` is Triton's ``max_batch_size`` (dl_inference generates a
  Triton config from it): 0 means the dims are the full shape (as in the
  example, batch dimension -1 included); above 0 the dims leave the batch
  dimension out.  Absent: decided from the model file.
- ``node_name``, when present, is the tensor's name inside the model file,
  so it becomes the tensor name (``name`` was only dl_inference's alias).
- ``data_type`` is accepted in every spelling seen in such files: the V2
  name (``FP32``), Triton's (``TYPE_FP32``, ``TYPE_STRING``), TensorFlow's
  (``DT_FLOAT``) and lowercase numpy/TF names (``float``, ``float32``,
  ``int64``, ``string``), case-insensitively.

Everything else (batching, instances, versions) takes Ferry's defaults;
unknown keys are errors, as in ``config.toml``.
"""

from __future__ import annotations

import json
from pathlib import Path

from shared.datatypes import DATATYPES
from shared.errors import ConfigError
from shared.repository.checks import (
    check_dims,
    check_int,
    check_name,
    check_table,
    check_unique,
    fail,
)
from shared.repository.config import ModelConfig
from shared.repository.triton import triton_datatype
from shared.runtimes.base import TensorSpec

_TF = {
    "DT_FLOAT": "FP32",
    "DT_DOUBLE": "FP64",
    "DT_HALF": "FP16",
    "DT_BFLOAT16": "BF16",
    "DT_BOOL": "BOOL",
    "DT_STRING": "BYTES",
    **{f"DT_{k}": k for k in ("INT8", "INT16", "INT32", "INT64")},
    **{f"DT_{k}": k for k in ("UINT8", "UINT16", "UINT32", "UINT64")},
}
_PLAIN = {
    "FLOAT": "FP32",
    "FLOAT32": "FP32",
    "DOUBLE": "FP64",
    "FLOAT64": "FP64",
    "HALF": "FP16",
    "FLOAT16": "FP16",
    "BFLOAT16": "BF16",
    "STRING": "BYTES",
    "BYTES": "BYTES",
}
_TRITON = {triton_datatype(k): k for k in DATATYPES}


def legacy_datatype(value: object, source: str, key: str) -> str:
    """The V2 datatype for any of the accepted spellings."""
    if isinstance(value, str):
        upper = value.strip().upper()
        for table in (_TF, _TRITON, _PLAIN):
            if upper in table:
                return table[upper]
        if upper in DATATYPES:
            return upper
    fail(source, key, "a datatype such as 'FP32', 'TYPE_FP32', 'DT_FLOAT' or 'float'", value)


def parse_legacy_config(path: Path, name: str) -> ModelConfig:
    """Read a dl_inference ``config.txt``; errors name ``path`` and the key."""
    path = Path(path)
    source = str(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: not valid JSON (dl_inference config.txt): {exc}") from None
    check_table(data, source, "", ("batch_size", "input", "output"))
    batch = None
    if "batch_size" in data:
        batch = check_int(data["batch_size"], source, "batch_size")
    return ModelConfig(
        name=name,
        max_batch_size=batch,
        inputs=_tensors(data.get("input", []), source, "input"),
        outputs=_tensors(data.get("output", []), source, "output"),
        source=path,
    )


def _tensors(value: object, source: str, key: str) -> tuple[TensorSpec, ...]:
    if not isinstance(value, list):
        fail(source, key, "a list of tensor objects", value)
    specs = []
    for i, item in enumerate(value):
        at = f"{key}[{i}]"
        t = check_table(item, source, at, ("name", "data_type", "dims", "node_name"))
        for required in ("data_type", "dims"):
            if required not in t:
                raise ConfigError(f"{source}: key '{at}.{required}' is required")
        if "node_name" in t:
            tensor_name = check_name(t["node_name"], source, f"{at}.node_name")
        elif "name" in t:
            tensor_name = check_name(t["name"], source, f"{at}.name")
        else:
            raise ConfigError(f"{source}: key '{at}.name' is required (or '{at}.node_name')")
        specs.append(
            TensorSpec(
                name=tensor_name,
                datatype=legacy_datatype(t["data_type"], source, f"{at}.data_type"),
                dims=check_dims(t["dims"], source, f"{at}.dims"),
            )
        )
    result = tuple(specs)
    check_unique(result, source, key)
    return result
