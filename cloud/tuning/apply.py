"""``tune --apply``: write the chosen settings into each model's ``config.toml``.

Only the keys tuning decides change: ``backend``, ``[runtime] threads``,
``[dynamic_batching] preferred_batch_sizes`` and ``max_queue_delay_us``
(``max_batch_size`` only ever grows: shrinking it would refuse clients' larger
requests).  Every other key and value is kept.  The file is rewritten from its
parsed form, so comments are lost: the original stays as ``config.toml.bak``.
The result is checked with the repository's own loader, and the chosen backend
against the files of every served version, before it replaces the original.
"""

from __future__ import annotations

import copy
import datetime as dt
import math
import os
import re
import shutil
import tomllib
from pathlib import Path
from typing import Any

from cloud.tuning.fit import queue_delay_us
from shared.errors import ConfigError
from shared.repository import ModelRepository, parse_config
from shared.repository.pbtxt import TRITON_CONFIG_FILE, parse_text_proto, triton_config_dict
from shared.repository.repository import CONFIG_FILE, LEGACY_CONFIG_FILE

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def merged(data: dict[str, Any], chosen: dict[str, Any], latency_ms: float) -> dict[str, Any]:
    """``data`` (a parsed config.toml) with ``chosen`` (profiles.json's) written in."""
    out = copy.deepcopy(data)
    out["backend"] = chosen["backend"]
    out.setdefault("runtime", {})["threads"] = int(chosen["threads"])
    batch = int(chosen["batch"])
    if out.get("max_batch_size") == 0:  # no batch dimension: nothing to batch
        return out
    if isinstance(out.get("max_batch_size"), int) and out["max_batch_size"] < batch:
        out["max_batch_size"] = batch
    batching = out.get("dynamic_batching")
    if batch > 1:
        batching = out.setdefault("dynamic_batching", {})
        batching["preferred_batch_sizes"] = [batch]
        current = batching.get("max_queue_delay_us")
        current = current if isinstance(current, int) and not isinstance(current, bool) else None
        p99_s = float(chosen["p99_ms"]) / 1000
        batching["max_queue_delay_us"] = queue_delay_us(latency_ms / 1000, p99_s, current)
    elif isinstance(batching, dict):  # batch 1 is best: waiting to batch only costs latency
        batching.pop("preferred_batch_sizes", None)
        batching["max_queue_delay_us"] = 0
    return out


def _from_pbtxt(path: Path, name: str) -> dict[str, Any]:
    """config.toml's keys for what a config.pbtxt says (the repository reads it so)."""
    text = path.read_text(encoding="utf-8")
    return triton_config_dict(parse_text_proto(text, str(path)), str(path), name)


def _key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else _string(key)


def _string(text: str) -> str:
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch < " " or ch == "\x7f":
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return _string(v)
    if isinstance(v, dt.date | dt.time):  # datetime is a date
        return v.isoformat()
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_key(k)} = {_value(x)}" for k, x in v.items()) + "}"
    raise ConfigError(f"cannot write {v!r} to TOML")


def _is_table_array(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(x, dict) for x in value)


def _emit(data: dict[str, Any], prefix: str, lines: list[str]) -> None:
    """Scalars first (they belong to the current header), then sub-tables, then
    arrays of tables, each under its full dotted name."""
    for key, value in data.items():
        if not isinstance(value, dict) and not _is_table_array(value):
            lines.append(f"{_key(key)} = {_value(value)}")
    for key, value in data.items():
        name = f"{prefix}{_key(key)}"
        if isinstance(value, dict):
            lines.extend(["", f"[{name}]"])
            _emit(value, name + ".", lines)
        elif _is_table_array(value):
            for item in value:
                lines.extend(["", f"[[{name}]]"])
                _emit(item, name + ".", lines)


def dumps(data: dict[str, Any]) -> str:
    """TOML text for what ``tomllib`` parsed (``tomllib.loads(dumps(d)) == d``)."""
    lines: list[str] = []
    _emit(data, "", lines)
    return "\n".join(lines).lstrip("\n") + "\n"


def apply_choice(
    repository: ModelRepository,
    name: str,
    chosen: dict[str, Any],
    latency_ms: float,
    cores: int = 0,
) -> tuple[Path, list[str]]:
    """Write ``chosen`` into ``name``'s config.toml; returns the path and warnings.
    ConfigError (and nothing written) when the result would not load."""
    folder = repository.model_dir(name)
    path = folder / CONFIG_FILE
    if not path.is_file() and (folder / LEGACY_CONFIG_FILE).is_file():
        raise ConfigError(
            f"{folder / LEGACY_CONFIG_FILE}: a dl_inference config is not rewritten; "
            f"write a {CONFIG_FILE} for {name!r} first"
        )
    warnings = []
    triton = folder / TRITON_CONFIG_FILE
    try:
        if path.is_file():
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        elif triton.is_file():
            # config.toml is read first: one holding only tuning's keys had silently
            # replaced everything the config.pbtxt said (batch size, instances, policy)
            data = _from_pbtxt(triton, name)
            warnings.append(
                f"{triton} converted: {path} holds all it says plus the tuned keys, and is "
                "read in its place from now on"
            )
        else:
            data = {}
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read: {exc}") from None
    out = merged(data, chosen, latency_ms)
    group = out.get("instance_group")
    count = group.get("count", 1) if isinstance(group, dict) else 1
    threads = int(chosen["threads"])
    if cores and isinstance(count, int) and count * threads > cores:
        # The choice was measured as one session alone: copies that together want more
        # threads than the cores would undo it (two 2-thread sessions on 2 cores).
        fewer = max(1, cores // threads)
        out.setdefault("instance_group", {})["count"] = fewer
        warnings.append(
            f"{name}: instance_group.count {count} -> {fewer}, so {fewer} x {threads} threads "
            f"fit the {cores} cores (tuning measured one session alone)"
        )
    tmp = path.with_suffix(".toml.tmp")
    try:
        tmp.write_text(dumps(out), encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: not applied: cannot write: {exc.strerror or exc}") from None
    try:
        config = parse_config(tmp, name)  # the loader's own checks, before anything changes
        for version in repository.selected_versions(name, config):
            repository.model_file(name, version, config.backend)
    except ConfigError as exc:
        tmp.unlink()
        raise ConfigError(f"{path}: not applied: {exc.message}") from None
    backup = path.with_suffix(".toml.bak")
    made = False
    try:
        if path.is_file():
            # The first one kept stays: it holds the user's own file and its comments,
            # which a rewrite does not carry over (a second --apply overwrote it).
            if not backup.exists():
                shutil.copy2(path, backup)
                made = True
            # (a symlink shared between model folders becomes this model's own file:
            # the choice was measured and checked for this model only)
            shutil.copymode(path, tmp)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        if made:  # (nothing was applied: no backup of it either)
            backup.unlink(missing_ok=True)
        raise ConfigError(f"{path}: not applied: cannot write: {exc.strerror or exc}") from None
    return path, warnings
