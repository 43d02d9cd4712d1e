"""Compile the decision core (``edge.core``) with mypyc: ``ferry-edge build-native``.

The per-request decision is plain arithmetic over small objects, which
CPython runs an order of magnitude slower than C: compiled, one cost-mode
decision with two transports takes about a quarter of the time
(bench/policy_quality.py, target 4).  The same sources run unchanged where
no C compiler is at hand; ``edge.core`` picks the build only while it
matches them (see its docstring).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import sys
import tempfile
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

from shared.errors import ConfigError

#: The modules compiled: everything a request's decision runs through.
MODULES = ("accounting", "breaker", "energy", "estimators", "flow", "normal", "policy", "quantile")
#: The library the compiled modules share (a submodule of edge.core, so it is found
#: along the package's path like them).
GROUP = "edge.core.native"


def core_dir() -> Path:
    return Path(__file__).resolve().parent / "core"


def status() -> tuple[bool, str]:
    """Whether the compiled build on disk matches the sources now (read afresh)."""
    from edge.core import COMPILED, native_status

    return native_status(COMPILED, str(core_dir()))


def build(force: bool = False, log: io.TextIOBase | None = None) -> str:
    """Build the compiled core unless a current build is there; returns what was done.

    Raises ConfigError when mypyc or a C compiler is missing, or mypyc
    refuses the sources (type errors it prints to ``log``).
    """
    from edge.core import COMPILED, MANIFEST, digest

    current, why = status()
    if current and not force:
        return f"up to date: {why}"
    try:
        from mypyc.build import mypycify
        from setuptools import Distribution
    except ImportError as exc:
        raise ConfigError(
            f"building the compiled core needs mypy and setuptools ({exc}): "
            "pip install 'ferry[native]'"
        ) from None
    if shutil.which(os.environ.get("CC", "cc")) is None and shutil.which("gcc") is None:
        raise ConfigError("building the compiled core needs a C compiler (cc or gcc)")
    root = core_dir().parent.parent  # mypyc names modules by their path from here
    out = log if log is not None else io.StringIO()
    with tempfile.TemporaryDirectory(prefix="ferry-native-") as tmp:
        cwd = os.getcwd()
        os.chdir(root)
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                extensions = mypycify(
                    [f"edge/core/{m}.py" for m in MODULES]
                    # (errors in the modules they import are not theirs to fix here)
                    + ["--follow-imports", "silent", "--ignore-missing-imports"]
                    + ["--cache-dir", os.path.join(tmp, "mypy-cache")],
                    opt_level="3",
                    group_name=GROUP,
                    target_dir=os.path.join(tmp, "c"),
                )
                dist = Distribution({"name": "ferry-native", "ext_modules": extensions})
                dist.verbose = 0
                cmd = dist.get_command_obj("build_ext")
                cmd.build_lib = os.path.join(tmp, "lib")
                cmd.build_temp = os.path.join(tmp, "tmp")
                dist.run_command("build_ext")
        except SystemExit as exc:  # mypyc exits on type errors (printed to ``out``)
            detail = out.getvalue()[-2000:] if isinstance(out, io.StringIO) else ""
            raise ConfigError(f"mypyc refused edge/core (exit {exc.code}): {detail}") from None
        except Exception as exc:  # a compiler failure: setuptools' CompileError and kin
            raise ConfigError(f"compiling edge/core failed: {type(exc).__name__}: {exc}") from None
        finally:
            os.chdir(cwd)
        built = Path(tmp, "lib", "edge", "core")
        libraries = sorted(
            p.name for p in built.iterdir() if any(p.name.endswith(s) for s in EXTENSION_SUFFIXES)
        )
        if not libraries:
            raise ConfigError(f"compiling edge/core left no extension modules in {built}")
        suffix = next(s for s in EXTENSION_SUFFIXES if libraries[0].endswith(s))
        sources = {f"{m}.py": digest((core_dir() / f"{m}.py").read_bytes()) for m in MODULES}
        # Swap the whole folder in: a reader sees the old build or the new one, never a mix.
        staging = Path(tempfile.mkdtemp(prefix="_compiled.", dir=core_dir()))
        for name in libraries:
            shutil.copy2(built / name, staging / name)
        manifest = {"suffix": suffix, "libraries": libraries, "sources": sources}
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        old = Path(COMPILED)
        if old.exists():
            trash = old.with_name(f"_compiled.old.{os.getpid()}")
            old.rename(trash)
            staging.rename(old)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            staging.rename(old)
    return f"built {len(MODULES)} modules into {COMPILED} ({why})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ferry-edge build-native", description=__doc__)
    add_arguments(p)
    return run(p.parse_args(argv))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--force", action="store_true", help="rebuild even when up to date")
    p.add_argument(
        "--check", action="store_true", help="only say whether the build is current (exit 1 if not)"
    )


def run(args: argparse.Namespace) -> int:
    if getattr(args, "check", False):
        current, why = status()
        print(f"edge.core: {why}")
        return 0 if current else 1
    try:
        print(f"edge.core: {build(force=getattr(args, 'force', False))}", flush=True)
    except ConfigError as exc:
        print(f"ferry-edge build-native: error [{exc.code.value}]: {exc.message}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
