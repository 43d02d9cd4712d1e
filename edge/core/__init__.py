"""The agent's sans-IO decision core: policy, estimators, energy, breaker, the flow.

Every request runs through this package (a cost-mode decision prices each
transport, races it against the local run and weighs exploring it), so it
may be compiled: ``ferry-edge build-native`` (run by scripts/setup.sh)
builds its modules with mypyc into ``_compiled/``, beside a manifest of the
sources' hashes.  The compiled modules are used only while every source
they were built from is unchanged, so an edit is never shadowed by a stale
build: the package then runs its Python sources, and :data:`NATIVE` says
why.  ``FERRY_NATIVE=0`` keeps the Python sources regardless.
"""

from __future__ import annotations

import importlib
import json
import os
import zlib
from importlib.machinery import EXTENSION_SUFFIXES

#: Where ``ferry-edge build-native`` puts the compiled modules and their manifest.
COMPILED = os.path.join(os.path.dirname(__file__), "_compiled")
MANIFEST = "manifest.json"
#: The modules compiled: everything a request's decision runs through.
MODULES = ("accounting", "breaker", "energy", "estimators", "flow", "normal", "policy", "quantile")
#: The mypyc group the modules are compiled as: their shared library is this package's
#: ``native__mypyc`` submodule, found along its path like them.
GROUP = "native"
_OFF = ("0", "false", "no", "off")


def digest(data: bytes) -> str:
    """A source's fingerprint in the manifest: a change check, not a defence (CRC-32 and
    length: hashlib would load OpenSSL into every agent, 3.5 MiB of resident memory)."""
    return f"{zlib.crc32(data):08x}-{len(data)}"


def native_status(compiled: str, sources: str) -> tuple[str, str]:
    """(state, why): whether ``compiled`` holds a build of ``sources`` as they are now.

    ``state`` is "current", "absent" (nothing built) or "stale" (a build is
    there but may not be used: a source changed, the module list changed,
    another interpreter built it, it cannot be read).  All or nothing: the
    compiled modules share one library, so one mismatch rules out every one.
    """
    try:
        with open(os.path.join(compiled, MANIFEST), encoding="utf-8") as f:
            manifest = json.load(f)
        suffix, modules = manifest["suffix"], manifest["sources"]
        libraries = manifest["libraries"]
    except FileNotFoundError:
        return "absent", "not built (ferry-edge build-native)"
    except PermissionError as exc:
        return "stale", f"the build is not readable by this user ({exc}): make it readable"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return "stale", f"unreadable build manifest ({exc}): rebuild with ferry-edge build-native"
    if suffix not in EXTENSION_SUFFIXES:
        return "stale", f"built for another interpreter ({suffix}): rebuild"
    if sorted(modules) != sorted(f"{m}.py" for m in MODULES):
        return "stale", "built from another list of modules: rebuild"
    for library in libraries:
        if not os.access(os.path.join(compiled, library), os.R_OK):
            return "stale", f"{library} is missing from the build or unreadable: rebuild"
    for name, built in modules.items():
        try:
            with open(os.path.join(sources, name), "rb") as f:
                now = digest(f.read())
        except OSError:
            return "stale", f"{name} is gone since the build: rebuild"
        if now != built:
            return "stale", f"{name} changed since the build: rebuild with ferry-edge build-native"
    return "current", f"compiled ({len(modules)} modules)"


def _choose() -> tuple[str, str]:
    if os.environ.get("FERRY_NATIVE", "").strip().lower() in _OFF:
        return "off", "off (FERRY_NATIVE=0)"
    state, why = native_status(COMPILED, os.path.dirname(__file__))
    if state != "current":
        return state, why
    # Submodules are looked up along the package's __path__: the compiled ones first.
    # The shared library is loaded now, so a build that matches its manifest but cannot
    # load here (truncated, another libc or architecture, a noexec mount) is not used.
    __path__.insert(0, COMPILED)
    try:
        importlib.import_module(f"{__name__}.{GROUP}__mypyc")
    except (ImportError, OSError) as exc:
        __path__.remove(COMPILED)
        return "stale", f"the build does not load ({exc}): rebuild with --force"
    return state, why


_state, _why = _choose()
#: "compiled (N modules)" or "python: <why the compiled build is not used>".
NATIVE: str = _why if _state == "current" else f"python: {_why}"
#: A build is there but is not used (see native_status): the agent says so at start,
#: since it then decides at a fraction of the compiled speed.
STALE_BUILD: bool = _state == "stale"
