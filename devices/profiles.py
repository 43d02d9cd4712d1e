"""Device and link profiles: the numbers the energy model and the policy start from.

A profile is a small TOML file whose keys are exactly the dataclass fields
below; each shipped number carries its source in a comment next to it, so a
reader can judge it and a user can replace it with a measurement of their own
(pass a path instead of a built-in name).  Built-ins live in
``devices/profiles/*.toml`` and ``devices/links/*.toml`` beside this module
(installed as package data); only a zipped install, where they are no files,
falls back to :mod:`importlib.resources`, which an agent otherwise never
imports (with what it pulls in, ~0.9 MiB resident on a device).

Strict on purpose: an unknown key (a typo such as ``idle_power`` for
``idle_power_w``) or a value of the wrong type is a :class:`ConfigError`
naming the file and the key, never a silently ignored setting.
"""

from __future__ import annotations

import math
import re
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from shared.errors import ConfigError

LINK_KINDS = ("wifi", "lte", "3g", "ethernet")
_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]*$")


@dataclass(frozen=True)
class DeviceProfile:
    """An edge device's power envelope and relative speed.

    ``compute_power_w`` is whole-device power while running inference (on the
    CPU, or on the accelerator where there is one), so local energy is simply
    ``compute_power_w * t_exec``; ``idle_power_w`` is what the device draws
    while it waits for a cloud reply.  ``battery_wh`` is None on mains power.
    ``speed_factor`` scales latencies measured on the development machine's
    CPU to this device (>1: slower); it is an estimate, see each profile.
    """

    name: str
    description: str
    cores: int
    accelerator: str | None
    idle_power_w: float
    compute_power_w: float
    accelerator_power_w: float | None
    battery_wh: float | None
    speed_factor: float = 1.0


@dataclass(frozen=True)
class LinkProfile:
    """A network link's nominal speed and its radio power model (Huang et al., MobiSys 2012).

    While transferring at ``r`` Mbps the radio draws ``base_power_w +
    alpha * r``; leaving idle costs a promotion (``promotion_s`` at
    ``promotion_power_w``) and every burst is followed by a tail
    (``tail_s`` at ``tail_power_w``) before the radio sleeps again.
    """

    name: str
    kind: str
    up_mbps: float
    down_mbps: float
    rtt_ms: float
    alpha_up_w_per_mbps: float
    alpha_down_w_per_mbps: float
    base_power_w: float
    promotion_s: float
    promotion_power_w: float
    tail_s: float
    tail_power_w: float
    metered: bool = False
    cost_per_mb: float = 0.0


# key -> (type name, optional).  Optional keys may be left out of the file.
_DEVICE_KEYS: dict[str, tuple[str, bool]] = {
    "name": ("str", True),
    "description": ("str", True),
    "cores": ("int", False),
    "accelerator": ("str", True),
    "idle_power_w": ("float", False),
    "compute_power_w": ("float", False),
    "accelerator_power_w": ("float", True),
    "battery_wh": ("float", True),
    "speed_factor": ("float", True),
}
_LINK_KEYS: dict[str, tuple[str, bool]] = {
    "name": ("str", True),
    "kind": ("str", False),
    "up_mbps": ("float", False),
    "down_mbps": ("float", False),
    "rtt_ms": ("float", False),
    "alpha_up_w_per_mbps": ("float", False),
    "alpha_down_w_per_mbps": ("float", False),
    "base_power_w": ("float", False),
    "promotion_s": ("float", False),
    "promotion_power_w": ("float", False),
    "tail_s": ("float", False),
    "tail_power_w": ("float", False),
    "metered": ("bool", True),
    "cost_per_mb": ("float", True),
}
assert set(_DEVICE_KEYS) == {f.name for f in fields(DeviceProfile)}
assert set(_LINK_KEYS) == {f.name for f in fields(LinkProfile)}


def load_device(name_or_path: str | Path) -> DeviceProfile:
    """A built-in device ("raspberry-pi-4b", ...) or a device TOML file."""
    source, data = _read("device", "profiles", name_or_path, list_devices)
    values = _check(source, data, _DEVICE_KEYS)
    values.setdefault("name", _stem(name_or_path))
    values.setdefault("description", "")
    for key in ("accelerator", "accelerator_power_w", "battery_wh"):
        values.setdefault(key, None)
    _positive(source, values, "cores", "compute_power_w")
    _non_negative(source, values, "idle_power_w", "accelerator_power_w")
    _positive(source, values, "battery_wh", "speed_factor")
    if values["compute_power_w"] < values["idle_power_w"]:
        raise ConfigError(
            f"{source}: key 'compute_power_w' ({values['compute_power_w']} W) is below "
            f"'idle_power_w' ({values['idle_power_w']} W); both are whole-device power"
        )
    return DeviceProfile(**values)


def load_link(name_or_path: str | Path) -> LinkProfile:
    """A built-in link ("wifi", "lte", "3g", "ethernet") or a link TOML file."""
    source, data = _read("link", "links", name_or_path, list_links)
    values = _check(source, data, _LINK_KEYS)
    values.setdefault("name", _stem(name_or_path))
    if values["kind"] not in LINK_KINDS:
        raise ConfigError(
            f"{source}: key 'kind' must be one of {', '.join(LINK_KINDS)}, got {values['kind']!r}"
        )
    _positive(source, values, "up_mbps", "down_mbps")
    _non_negative(
        source,
        values,
        *(
            k
            for k, (t, _) in _LINK_KEYS.items()
            if t == "float" and k not in ("up_mbps", "down_mbps")
        ),
    )
    return LinkProfile(**values)


def list_devices() -> list[str]:
    """Names of the built-in device profiles."""
    return _list("profiles")


def list_links() -> list[str]:
    """Names of the built-in link profiles."""
    return _list("links")


# ---- helpers -------------------------------------------------------------------


def _builtin(*parts: str) -> Any:
    """A built-in profile folder or file: a Path beside this module, else a resource."""
    here = Path(__file__).resolve().parent
    if here.is_dir():
        return here.joinpath(*parts)
    from importlib import resources  # a zipped install

    return resources.files("devices").joinpath(*parts)


def _list(folder: str) -> list[str]:
    root = _builtin(folder)
    if not root.is_dir():
        return []
    return sorted(p.name[: -len(".toml")] for p in root.iterdir() if p.name.endswith(".toml"))


def _stem(name_or_path: str | Path) -> str:
    return Path(name_or_path).stem if _is_path(name_or_path) else str(name_or_path)


def _is_path(name_or_path: str | Path) -> bool:
    if isinstance(name_or_path, Path):
        return True
    return name_or_path.endswith(".toml") or "/" in name_or_path or "\\" in name_or_path


def _read(what: str, folder: str, name_or_path: str | Path, known: Any) -> tuple[str, dict]:
    """(a name for messages, the parsed TOML) of a built-in name or a file path."""
    if _is_path(name_or_path):
        path = Path(name_or_path)
        source = str(path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(
                f"{source}: cannot read {what} profile: {exc.strerror or exc}"
            ) from exc
    else:
        name = str(name_or_path)
        source = f"built-in {what} profile {name!r}"
        entry = _builtin(folder, f"{name}.toml")
        if not _NAME.match(name) or not entry.is_file():
            raise ConfigError(
                f"unknown {what} profile {name!r}: built-in ones are {', '.join(known())}; "
                f"or give the path of a .toml file"
            )
        text = entry.read_text(encoding="utf-8")
    try:
        return source, tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from exc


def _check(source: str, data: dict[str, Any], schema: dict[str, tuple[str, bool]]) -> dict:
    """Exactly the schema's keys, each of its type; ints are accepted where floats are."""
    for key in data:
        if key not in schema:
            raise ConfigError(
                f"{source}: unknown key {key!r} (expected one of {', '.join(schema)})"
            )
    out: dict[str, Any] = {}
    for key, (kind, optional) in schema.items():
        if key not in data:
            if not optional:
                raise ConfigError(f"{source}: missing required key {key!r}")
            continue
        value = data[key]
        ok = {
            "str": isinstance(value, str),
            "int": isinstance(value, int) and not isinstance(value, bool),
            "float": isinstance(value, (int, float)) and not isinstance(value, bool),
            "bool": isinstance(value, bool),
        }[kind]
        if ok and kind == "float" and not math.isfinite(value):
            raise ConfigError(f"{source}: key {key!r} must be a finite number, got {value!r}")
        if not ok:
            article = "an" if kind == "int" else "a"
            raise ConfigError(
                f"{source}: key {key!r} must be {article} {kind}, "
                f"got {type(value).__name__} {value!r}"
            )
        out[key] = float(value) if kind == "float" else value
    return out


def _positive(source: str, values: dict[str, Any], *keys: str) -> None:
    for key in keys:
        value = values.get(key)
        if value is not None and not value > 0:
            raise ConfigError(f"{source}: key {key!r} must be > 0, got {value}")


def _non_negative(source: str, values: dict[str, Any], *keys: str) -> None:
    for key in keys:
        value = values.get(key)
        if value is not None and not value >= 0:
            raise ConfigError(f"{source}: key {key!r} must be >= 0, got {value}")
