"""``tune --apply``: write the chosen settings into each model's ``config.toml``.

Only the keys tuning decides change (``backend``, ``max_batch_size`` kept or
set, ``[runtime] threads``, ``[dynamic_batching] preferred_batch_sizes``); every
other key and value of the file is kept.  The file is rewritten from its
parsed form (comments are not kept: a copy is left as ``config.toml.bak``) and
the result is checked with the repository's own loader before it replaces
the original.
"""

from __future__ import annotations

import os
import shutil
import tomllib
from pathlib import Path
from typing import Any

from shared.errors import ConfigError
from shared.repository import parse_config


def merged(data: dict[str, Any], chosen: dict[str, Any]) -> dict[str, Any]:
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items()}
    out["backend"] = chosen["backend"]
    runtime = out.setdefault("runtime", {})
    runtime["threads"] = int(chosen["threads"])
    batch = int(chosen["batch"])
    if out.get("max_batch_size", 1) != 0 and batch > 1:
        if "max_batch_size" in out and out["max_batch_size"] < batch:
            out["max_batch_size"] = batch
        batching = out.setdefault("dynamic_batching", {})
        batching["preferred_batch_sizes"] = [batch]
    return out


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    raise ConfigError(f"cannot write {v!r} to TOML")


def dumps(data: dict[str, Any]) -> str:
    """TOML for a config: scalars, then tables, then arrays of tables ([[input]])."""
    lines = []
    tables, arrays = [], []
    for key, value in data.items():
        if isinstance(value, dict):
            tables.append((key, value))
        elif isinstance(value, list) and value and all(isinstance(x, dict) for x in value):
            arrays.append((key, value))
        else:
            lines.append(f"{key} = {_value(value)}")
    for key, items in arrays:
        for item in items:
            lines.append(f"\n[[{key}]]")
            lines.extend(f"{k} = {_value(v)}" for k, v in item.items())
    for key, table in tables:
        lines.append(f"\n[{key}]")
        lines.extend(f"{k} = {_value(v)}" for k, v in table.items())
    return "\n".join(lines).lstrip("\n") + "\n"


def apply_choice(model_dir: Path, name: str, chosen: dict[str, Any]) -> Path:
    path = model_dir / "config.toml"
    data = tomllib.loads(path.read_text()) if path.is_file() else {}
    text = dumps(merged(data, chosen))
    tmp = path.with_suffix(".toml.tmp")
    tmp.write_text(text)
    try:
        parse_config(tmp, name)  # the loader's own checks, before anything is replaced
    except ConfigError:
        tmp.unlink()
        raise
    if path.is_file():
        shutil.copy2(path, path.with_suffix(".toml.bak"))
    os.replace(tmp, path)
    return path
