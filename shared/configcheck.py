"""Checking a parsed TOML document against a nested key schema.

Both tiers' configuration files use it, so an unknown key or a wrong type
reads the same way everywhere: file, dotted key, what was expected.
"""

from __future__ import annotations

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
