"""The compiled decision core: used only while it matches its sources, and deciding alike."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

import pytest

from edge import native
from edge.core import MANIFEST, MODULES, digest, native_status
from shared.errors import ConfigError

ROOT = Path(__file__).resolve().parents[3]
SUFFIX = EXTENSION_SUFFIXES[0]


def _build(folder: Path, src: Path, **override) -> None:
    """A build's manifest (and empty stand-ins for its libraries) for ``src``."""
    for m in MODULES:
        (src / f"{m}.py").write_text(f"{m.upper()} = 1\n")
    folder.mkdir()
    libraries = [f"policy{SUFFIX}", f"native__mypyc{SUFFIX}"]
    for name in libraries:
        (folder / name).write_bytes(b"")
    manifest = {
        "suffix": SUFFIX,
        "libraries": libraries,
        "sources": {f"{m}.py": digest((src / f"{m}.py").read_bytes()) for m in MODULES},
        **override,
    }
    (folder / MANIFEST).write_text(json.dumps(manifest))


def test_a_build_that_matches_its_sources_is_used(tmp_path):
    _build(tmp_path / "c", tmp_path)
    assert native_status(str(tmp_path / "c"), str(tmp_path)) == (
        "current",
        f"compiled ({len(MODULES)} modules)",
    )


def test_an_edited_source_rules_the_whole_build_out(tmp_path):
    _build(tmp_path / "c", tmp_path)
    (tmp_path / "flow.py").write_text("Y = 3\n")
    state, why = native_status(str(tmp_path / "c"), str(tmp_path))
    assert state == "stale" and "flow.py changed since the build" in why


def test_no_build_a_missing_library_or_another_interpreter_is_not_used(tmp_path):
    assert native_status(str(tmp_path / "none"), str(tmp_path)) == (
        "absent",
        "not built (ferry-edge build-native)",
    )
    _build(tmp_path / "c", tmp_path)
    (tmp_path / "c" / f"native__mypyc{SUFFIX}").unlink()
    state, why = native_status(str(tmp_path / "c"), str(tmp_path))
    assert state == "stale" and "missing" in why
    other = tmp_path / "o"
    other.mkdir()
    _build(other / "c", other, suffix=".cpython-299-foo.so")
    state, why = native_status(str(other / "c"), str(other))
    assert state == "stale" and "another interpreter" in why


def test_a_build_of_another_module_list_is_stale(tmp_path):
    _build(tmp_path / "c", tmp_path, sources={"policy.py": "0-0"})
    state, why = native_status(str(tmp_path / "c"), str(tmp_path))
    assert state == "stale" and "another list of modules" in why


def test_an_unreadable_manifest_is_reported_not_raised(tmp_path):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / MANIFEST).write_text("{not json")
    state, why = native_status(str(tmp_path / "c"), str(tmp_path))
    assert state == "stale" and "unreadable build manifest" in why


def _python(env_native: str | None, code: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "FERRY_NATIVE"}
    if env_native is not None:
        env["FERRY_NATIVE"] = env_native
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    )
    return out.stdout


def test_ferry_native_0_keeps_the_python_sources():
    code = "import edge.core, edge.core.policy as p; print(edge.core.NATIVE, p.__file__)"
    out = _python("0", code)
    assert out.startswith("python: off (FERRY_NATIVE=0)") and out.strip().endswith("policy.py")


def _needs_build() -> None:
    """The built core, wherever it can be built (scripts/setup.sh builds it): a failed
    build must not pass for a machine without the toolchain."""
    if importlib.util.find_spec("mypyc") is None:
        pytest.skip("the native extra (mypy) is not installed: the Python sources run")
    try:
        native._check_toolchain()
    except ConfigError as exc:
        pytest.skip(f"no toolchain to build the compiled core here: {exc.message}")
    state, why = native.status()
    assert state == "current", f"the compiled core is not current ({why}): ferry-edge build-native"


# A commute with a tunnel (outages, rate swings), a heavy model, both transports: races,
# hedges, explorations, wake-ups, breakers and fallbacks all happen in it.
REPLAY = """
import importlib.util
import json
from devices.profiles import load_device, load_link
from edge.core.policy import ModelPolicy, PolicyConfig, Weights
from edge.evaluation.evaluate import ComputeProfile, Workload, evaluate
from edge.netem.traces import commute
import edge.core, edge.core.policy as p
device = load_device("raspberry-pi-4b")
profile = ComputeProfile(
    tuple(0.1 + 0.001 * (i % 37) for i in range(200)),
    tuple(0.03 + 0.0007 * (i % 23) for i in range(200)),
    (0.95,), device.speed_factor,
)
config = PolicyConfig(
    weights=Weights(latency_s=1.0, energy_j=0.05, data_mb=0.01),
    models={"m": ModelPolicy(local_model="m-local", cloud_model="m")},
)
ev = evaluate(
    up=commute(240, seed=3), down=commute(240, seed=4), link=load_link("lte"),
    device=device, profile=profile, config=config, model="m",
    workload=Workload(count=200, rate_per_s=1.0, input_bytes=60_000, deadline_ms=1500.0),
    transports=("mqtt", "http"),
)
print(json.dumps({
    "core": edge.core.NATIVE, "file": p.__file__,
    "ferry": [repr(o) for o in ev.results["ferry"].outcomes],
}))
"""


def test_the_compiled_core_decides_exactly_as_the_python_sources():
    _needs_build()
    compiled = json.loads(_python(None, REPLAY))
    python = json.loads(_python("0", REPLAY))
    assert compiled["core"].startswith("compiled") and compiled["file"].endswith(SUFFIX)
    assert python["core"].startswith("python") and python["file"].endswith(".py")
    where = {o.split("where='")[1].split("'")[0] for o in python["ferry"]}
    assert len(where) >= 2, where  # decisions that matter: not one answer throughout
    assert compiled["ferry"] == python["ferry"]  # every outcome, to the last bit


def test_the_core_suite_passes_on_the_python_sources_too():
    """The rest of this folder runs on whichever core is current; here, on the sources."""
    env = {**os.environ, "FERRY_NATIVE": "0"}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            str(Path(__file__).parent),
            "--ignore",
            str(Path(__file__)),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]


def test_build_native_check_says_whether_the_build_is_current():
    _needs_build()
    out = subprocess.run(
        [sys.executable, "-m", "edge.cli", "build-native", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0 and out.stdout.startswith("edge.core: compiled"), out
    assert native.build().startswith("up to date")  # nothing to do: no rebuild


def _copied_core(tmp_path: Path) -> Path:
    """edge.core with its build, as a package of its own (the rest from the checkout)."""
    root = tmp_path / "pkg"
    (root / "edge").mkdir(parents=True)
    (root / "edge" / "__init__.py").write_text("")
    shutil.copytree(
        ROOT / "edge" / "core", root / "edge" / "core", ignore=shutil.ignore_patterns("__pycache__")
    )
    return root


def _load_copy(root: Path) -> list[str]:
    code = (
        "import edge.core as c, edge.core.policy as p, edge.core.flow as f; "
        "print(c.NATIVE); print(c.STALE_BUILD); print(p.__file__); print(f.__file__)"
    )
    env = {k: v for k, v in os.environ.items() if k != "FERRY_NATIVE"}
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(ROOT)])
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, check=True
    )
    return out.stdout.splitlines()


def test_the_package_runs_its_build_while_it_matches_and_its_sources_once_one_changes(tmp_path):
    _needs_build()
    root = _copied_core(tmp_path)
    core = root / "edge" / "core"
    native, stale, policy, flow = _load_copy(root)
    assert native.startswith("compiled") and stale == "False"
    assert policy == str(core / "_compiled" / f"policy{SUFFIX}")
    assert flow == str(core / "_compiled" / f"flow{SUFFIX}")
    with open(core / "estimators.py", "a") as f:
        f.write("\n# an edit after the build\n")
    native, stale, policy, flow = _load_copy(root)
    assert (
        native
        == "python: estimators.py changed since the build: rebuild with ferry-edge build-native"
    )
    assert stale == "True"
    assert policy == str(core / "policy.py") and flow == str(core / "flow.py")  # all of it


def test_a_build_that_does_not_load_leaves_the_python_sources_in_charge(tmp_path):
    _needs_build()
    root = _copied_core(tmp_path)
    core = root / "edge" / "core"
    (core / "_compiled" / f"native__mypyc{SUFFIX}").write_bytes(b"\x7fELF truncated")
    native, stale, policy, _ = _load_copy(root)
    assert native.startswith("python: the build does not load") and stale == "True"
    assert policy == str(core / "policy.py")


def test_the_cores_frozen_values_survive_pickle_and_copy():
    """A spawned worker pool pickles the config; compiled, a frozen class refused the
    field-by-field restore that pickle and copy do (FrozenInstanceError)."""
    import copy
    import pickle

    from edge.core.flow import Defer, RunLocal
    from edge.core.policy import ModelPolicy, Option, PolicyConfig, Weights

    config = PolicyConfig(
        weights=Weights(latency_s=2.0, energy_j=0.1),
        models={"m": ModelPolicy(local_model="a", cloud_model="b", transports=("http",))},
    )
    option = Option("local", None, 1.0, 1.2, 0.5, 0, 0, 0.0)
    values = [config, config.weights, config.models["m"], Defer("no link", 9.0)]
    values.append(RunLocal(option, "least cost", False))
    for value in values:
        for twin in (pickle.loads(pickle.dumps(value)), copy.deepcopy(value), copy.copy(value)):
            assert twin == value and type(twin) is type(value)


def test_build_native_check_says_which_core_runs_not_only_what_is_on_disk():
    env = {**os.environ, "FERRY_NATIVE": "0"}
    out = subprocess.run(
        [sys.executable, "-m", "edge.cli", "build-native", "--check"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 1 and out.stdout == "edge.core: python: off (FERRY_NATIVE=0)\n", out


def test_remove_deletes_a_copied_packages_build_and_it_then_runs_its_sources(tmp_path):
    _needs_build()
    root = _copied_core(tmp_path)
    shutil.copy2(ROOT / "edge" / "native.py", root / "edge" / "native.py")
    env = {k: v for k, v in os.environ.items() if k != "FERRY_NATIVE"}
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(ROOT)])
    code = (  # (the copy's own module: the checkout's editable finder answers for edge too)
        "import edge.native as n, sys; assert n.__file__.startswith(sys.argv[1]), n.__file__; "
        "print(n.remove()); print(n.remove())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(root)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.splitlines()[1] == "nothing to remove", out.stdout
    assert not (root / "edge" / "core" / "_compiled").exists()
    native, stale, policy, _ = _load_copy(root)
    assert native == "python: not built (ferry-edge build-native)" and stale == "False"
    assert policy == str(root / "edge" / "core" / "policy.py")
