"""What a node can hold, and the check that a model configuration fits in it.

Every size in a configuration is user input (a ``config.toml`` or the JSON
override of a load request), and several of them make the node allocate:
instances are whole runtime sessions, threads are OS threads, a priority
level is a queue.  A typo or a hostile ``instance_group.count = 1000000``
must be refused with the key's name before anything is built, not found
when the machine runs out of memory.  The bounds are generous (well past any
setting that makes a model faster) and scale with the node.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from shared.errors import ConfigError
from shared.repository.config import ModelConfig
from shared.tensors import Limits

#: the batcher keeps one queue per priority level
MAX_PRIORITY_LEVELS = 256
#: a queue bound past this is no bound (the node's byte budget bounds memory anyway)
MAX_QUEUE_SIZE = 1 << 20
#: an hour: longer delays and timeouts are typos
MAX_DELAY_US = 3_600_000_000
#: runtimes keep a few times the file's size resident per session (weights, arenas)
SESSION_MEMORY_FACTOR = 2


def _cgroup_room() -> int | None:
    """Bytes the process's cgroup (v2) still allows, where it sets a limit: in a
    container /proc/meminfo shows the host's memory, not the pod's."""
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit == "max":
            return None
        used = int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
        return max(0, int(limit) - used)
    except (OSError, ValueError):
        return None


def available_memory() -> int:
    """Bytes the node may still take: MemAvailable, or less where a cgroup limit is
    tighter (all of RAM where /proc is absent)."""
    room = _cgroup_room()
    host = _host_available()
    return min(host, room) if room is not None else host


def _host_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 1 << 40


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class NodeCapacity:
    """The node's cores, the memory models may take, and the codec's element bound."""

    cores: int
    memory_bytes: int
    max_elements: int = Limits.max_elements

    @classmethod
    def detect(cls, limits: Limits | None = None) -> NodeCapacity:
        return cls(
            cores=_cores(),
            memory_bytes=available_memory(),
            max_elements=(limits or Limits()).max_elements,
        )

    @property
    def max_instances(self) -> int:
        return max(8, 16 * self.cores)

    @property
    def max_threads(self) -> int:
        return max(8, 4 * self.cores)


def model_file_bytes(path: Path, external: bool = True) -> int:
    """Bytes of a model's files (an OpenVINO IR's weights live beside its .xml).
    ``external=False`` skips an ONNX file's external data (reading its names
    imports ``onnx``, which an agent on a device does not pay for)."""
    path = Path(path)
    total = path.stat().st_size if path.is_file() else 0
    if path.suffix == ".xml" and path.with_suffix(".bin").is_file():
        total += path.with_suffix(".bin").stat().st_size
    elif external and path.suffix == ".onnx" and 0 < total < _EXTERNAL_PROBE_BYTES:
        names = _external_names(path)
        total += sum(f.stat().st_size for f in (path.parent / n for n in names) if f.is_file())
    return total


#: an .onnx file this small may keep its weights in other files (ONNX's external data;
#: a model past 2 GB must): they are counted too.  Larger ones hold their weights.
_EXTERNAL_PROBE_BYTES = 64 << 20
#: path -> (mtime_ns, size, external names): the controller reads the repository every
#: 10 s, and a file is parsed again only when it changed (bounded: cleared when full)
_EXTERNAL_SEEN: dict[str, tuple[int, int, tuple[str, ...]]] = {}
_EXTERNAL_SEEN_MAX = 4096


def _external_names(path: Path) -> tuple[str, ...]:
    stat = path.stat()
    key = str(path)
    seen = _EXTERNAL_SEEN.get(key)
    if seen is not None and seen[:2] == (stat.st_mtime_ns, stat.st_size):
        return seen[2]
    folder = path.parent.resolve()
    names = []
    for found in onnx_external_files(path):
        try:  # (an absolute location, or one outside the folder, is not the model's)
            names.append(str(found.resolve().relative_to(folder)))
        except (ValueError, OSError):
            continue
    if len(_EXTERNAL_SEEN) >= _EXTERNAL_SEEN_MAX:
        _EXTERNAL_SEEN.clear()
    _EXTERNAL_SEEN[key] = (stat.st_mtime_ns, stat.st_size, tuple(sorted(names)))
    return _EXTERNAL_SEEN[key][2]


def onnx_external_files(path: Path) -> set[Path]:
    """The external data files an ONNX model names (beside it), read without the weights."""
    try:
        import onnx

        model = onnx.load(str(path), load_external_data=False)
    except Exception:  # not readable: whoever loads it says why
        return set()
    found = set()
    for init in model.graph.initializer:
        for entry in init.external_data:
            if entry.key == "location":
                found.add(path.parent / entry.value)
    return found


def _refuse(source: str, key: str, value: object, bound: str) -> ConfigError:
    return ConfigError(f"{source}: key {key!r}: {value} exceeds this node's bound ({bound})")


def check_capacity(
    config: ModelConfig,
    capacity: NodeCapacity,
    source: str,
    *,
    versions: int = 1,
    model_bytes: int = 0,
) -> None:
    """Refuse a configuration whose sizes this node cannot hold; name the key."""
    count = config.instance_group.count
    if count > capacity.max_instances:
        raise _refuse(
            source, "instance_group.count", count,
            f"{capacity.max_instances} instances for {capacity.cores} cores",
        )  # fmt: skip
    if config.runtime.threads > capacity.max_threads:
        raise _refuse(
            source, "runtime.threads", config.runtime.threads,
            f"{capacity.max_threads} threads for {capacity.cores} cores",
        )  # fmt: skip
    lone = config.runtime.lone_threads or 0
    if lone > capacity.max_threads:
        raise _refuse(
            source, "runtime.lone_threads", lone,
            f"{capacity.max_threads} threads for {capacity.cores} cores",
        )  # fmt: skip
    mbs = config.max_batch_size or 0
    if mbs > capacity.max_elements:
        raise _refuse(source, "max_batch_size", mbs, f"{capacity.max_elements} elements")
    batching = config.dynamic_batching
    if batching is not None:
        key = "dynamic_batching."
        if batching.max_queue_size > MAX_QUEUE_SIZE:
            raise _refuse(source, key + "max_queue_size", batching.max_queue_size, MAX_QUEUE_SIZE)
        if batching.priority_levels > MAX_PRIORITY_LEVELS:
            raise _refuse(
                source, key + "priority_levels", batching.priority_levels, MAX_PRIORITY_LEVELS
            )
        for field in ("max_queue_delay_us", "default_timeout_us"):
            value = getattr(batching, field)
            if value > MAX_DELAY_US:
                raise _refuse(source, key + field, value, f"{MAX_DELAY_US} us, one hour")
    for what, specs in (("input", config.inputs), ("output", config.outputs)):
        for i, spec in enumerate(specs):
            fixed = 1
            for dim in spec.dims:
                if dim > 0:
                    fixed *= dim
            if fixed * max(1, mbs) > capacity.max_elements:
                raise _refuse(
                    source, f"{what}[{i}].dims", list(spec.dims),
                    f"{capacity.max_elements} elements per tensor, batch included",
                )  # fmt: skip
    need = count * versions * model_bytes * SESSION_MEMORY_FACTOR
    if model_bytes and need > capacity.memory_bytes:
        raise ConfigError(
            f"{source}: key 'instance_group.count': {count} instance(s) x {versions} version(s) "
            f"of a {model_bytes} byte model need about {need >> 20} MiB; this node has "
            f"{capacity.memory_bytes >> 20} MiB available"
        )
