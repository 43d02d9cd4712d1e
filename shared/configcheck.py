"""Checking a parsed TOML document against a nested key schema.

Both tiers' configuration files use it, so an unknown key or a wrong type
reads the same way everywhere: file, dotted key, what was expected.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any

from shared.errors import ConfigError

#: schema value for "an int or a float"
NUMBER = (int, float)


def type_name(expected: Any) -> str:
    if isinstance(expected, tuple):
        return "a number"
    return {
        str: "a string",
        int: "an integer",
        bool: "true or false",
        list: "a list",
        dict: "a table",
    }[expected]


def loads_toml(text: str, source: str) -> dict[str, Any]:
    """Parse TOML; every way it can fail is a ConfigError naming ``source``."""
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from None
    except RecursionError:
        raise ConfigError(f"{source}: not valid TOML: nested too deeply") from None


def read_config_text(path: Path | str) -> str:
    """A configuration file's text (unreadable or not UTF-8: ConfigError)."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text: {exc.reason} at byte {exc.start}") from None


def read_toml(path: Path | str) -> dict[str, Any]:
    """Read and parse a TOML file (unreadable, not UTF-8, not TOML: ConfigError)."""
    return loads_toml(read_config_text(path), str(path))


def _no_nul(value: Any, source: str, dotted: str) -> None:
    """A NUL byte is never meant: it cuts paths and C strings short where it is passed on."""
    if isinstance(value, str) and "\0" in value:
        raise ConfigError(f"{source}: key {dotted!r}: a NUL character is not allowed")
    if isinstance(value, list):
        for item in value:
            _no_nul(item, source, dotted)


def check_keys(data: dict[str, Any], schema: dict[str, Any], source: str, prefix: str = "") -> None:
    """Raise ConfigError for the first unknown key or mistyped value (bools are not numbers)."""
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if key not in schema:
            raise ConfigError(f"{source}: unknown key {dotted!r}; expected one of {sorted(schema)}")
        expected = schema[key]
        if isinstance(expected, dict):
            if not isinstance(value, dict):
                raise ConfigError(f"{source}: key {dotted!r}: expected a table")
            check_keys(value, expected, source, dotted + ".")
        elif (isinstance(value, bool) and expected is not bool) or not isinstance(value, expected):
            raise ConfigError(
                f"{source}: key {dotted!r}: expected {type_name(expected)}, got {value!r}"
            )
        else:
            _no_nul(value, source, dotted)


def writable_folder(path: Path, flag: str) -> Path:
    """``path`` as a folder outputs can be written to (made if missing), checked before
    the work that fills it: a long run must not end in a traceback at its last step."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{flag}: cannot make the folder {path}: {exc.strerror or exc}") from None
    if not os.access(path, os.W_OK):
        raise ConfigError(f"{flag}: the folder {path} is not writable")
    return path


def writable_file(path: Path, flag: str) -> Path:
    """``path`` as a file that can be written (its folder made if missing), checked
    before the work (see :func:`writable_folder`)."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{flag}: {path} is a folder; give a file name")
    writable_folder(path.parent, flag)  # (Path("x").parent is ".")
    return path
