"""Checks of decoded config values that name the file, the dotted key and what was expected.

Shared by ``config.toml``, the legacy ``config.pbtxt`` reader and the
pre/post-processing tables, so a mistake reads the same way in each.
"""

from __future__ import annotations

from typing import Any, NoReturn

from shared.errors import ConfigError
from shared.runtimes.base import TensorSpec


def fail(source: str, key: str, expected: str, value: object) -> NoReturn:
    shown = repr(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    raise ConfigError(f"{source}: key {key!r}: expected {expected}, got {shown}")


def check_table(value: object, source: str, key: str, allowed: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(value, dict):
        fail(source, key, "a table", value)
    for k in value:
        if k not in allowed:
            dotted = f"{key}.{k}" if key else str(k)
            raise ConfigError(
                f"{source}: unknown key {dotted!r}; expected one of {sorted(allowed)}"
            )
    return value


def check_int(value: object, source: str, key: str, minimum: int = 0) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        wanted = {0: "a non-negative integer", 1: "a positive integer"}.get(
            minimum, f"an integer >= {minimum}"
        )
        fail(source, key, wanted, value)
    return value


def check_bool(value: object, source: str, key: str) -> bool:
    if not isinstance(value, bool):
        fail(source, key, "true or false", value)
    return value


def check_choice(value: object, source: str, key: str, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in choices:
        fail(source, key, "one of " + ", ".join(repr(c) for c in choices), value)
    return value


def check_int_list(value: object, source: str, key: str, minimum: int = 0) -> tuple[int, ...]:
    if not isinstance(value, list):
        fail(source, key, "a list of integers", value)
    return tuple(check_int(v, source, f"{key}[{i}]", minimum) for i, v in enumerate(value))


def check_dims(value: object, source: str, key: str) -> tuple[int, ...]:
    expected = "a list of dimensions (positive integers, or -1 for a dynamic one)"
    if not isinstance(value, list):
        fail(source, key, expected, value)
    for v in value:
        if not isinstance(v, int) or isinstance(v, bool) or (v < 1 and v != -1):
            fail(source, key, expected, value)
    return tuple(value)


def check_name(value: object, source: str, key: str) -> str:
    if not isinstance(value, str) or not value:
        fail(source, key, "a non-empty string", value)
    return value


def check_unique(specs: tuple[TensorSpec, ...], source: str, key: str) -> None:
    seen: set[str] = set()
    for i, spec in enumerate(specs):
        if spec.name in seen:
            raise ConfigError(f"{source}: key '{key}[{i}].name': {spec.name!r} is declared twice")
        seen.add(spec.name)


def check_number(value: object, source: str, key: str, positive: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        fail(source, key, "a number", value)
    if value < 0 or (positive and value == 0) or value == float("inf"):
        fail(source, key, "a positive number" if positive else "a number >= 0", value)
    return float(value)
