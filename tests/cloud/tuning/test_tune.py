"""ferry-cloud tune on real models: profiles, report, --apply, errors."""

from __future__ import annotations

import json
import shutil
import tomllib
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from onnx import TensorProto

from cloud.cli import main
from cloud.placement.types import LatencyProfile
from cloud.tuning.apply import apply_choice, dumps, merged
from cloud.tuning.profiles import chosen_profile, load_profiles
from shared.errors import ConfigError
from shared.repository import ModelRepository
from shared.runtimes import installed_backends
from tests.support import write_identity_model, write_linear_model

LIN_CONFIG = """\
# a comment the rewrite cannot keep (the .bak does)
max_batch_size = 8

[dynamic_batching]
max_queue_delay_us = 500
max_queue_size = 64

[instance_group]
count = 1

[placement]
rate = 3.0
backends = ["onnxruntime", "openvino"]
"""


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    write_linear_model(root / "lin" / "1" / "model.onnx")
    (root / "lin" / "config.toml").write_text(LIN_CONFIG)
    write_identity_model(root / "text" / "1" / "model.onnx", TensorProto.STRING)
    return root


def _tune(repo: Path, out: Path, *extra: str) -> int:
    args = ["tune", "--repository", str(repo), "--duration-s", "0.03", "--out", str(out)]
    return main([*args, "--max-threads", "2", "--no-progress", *extra])


def test_tune_writes_profiles_report_and_applies_the_choice(
    repo: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out" / "profiles.json"
    report = tmp_path / "report"
    assert _tune(repo, out, "--report", str(report), "--apply") == 0
    doc = json.loads(out.read_text())
    assert doc["version"] == 1 and doc["machine"]["cores"] >= 1
    assert doc["machine"]["gpu"] is None or isinstance(doc["machine"]["gpu"], str)
    assert doc["machine"]["memory_bytes"] > 0 and doc["machine"]["cpu"]
    entry = doc["models"]["lin"]
    ort = [t for t in entry["trials"] if t["backend"] == "onnxruntime"]
    assert [t["threads"] for t in ort] == [1, 2] or [t["threads"] for t in ort] == [1]
    assert [p["batch"] for p in ort[0]["points"]] == [1, 2, 4, 8]
    assert all(p["runs"] >= 5 and p["p99_ms"] >= p["p50_ms"] > 0 for p in ort[0]["points"])
    assert ort[0]["memory_bytes"] > 0 and ort[0]["beta_s"] > 0
    chosen = entry["chosen"]
    # (OpenVINO serves the model.onnx as it is: either may be chosen, as measured)
    assert chosen["backend"] in installed_backends() and chosen["p99_ms"] <= 50
    if "openvino" in installed_backends():  # measured on the ONNX file itself
        assert any(t["backend"] == "openvino" and not t["converted"] for t in entry["trials"])
        assert not (repo / "lin" / "1" / "model.xml").exists()
    assert "tensorrt" not in [t["backend"] for t in entry["trials"]]

    # profiles.json round-trips to the placement's records, the chosen one first
    profiles = load_profiles(out)["lin"]
    assert [p.to_dict() for p in profiles][: len(entry["profiles"])] == sorted(
        entry["profiles"], key=lambda p: p["backend"] != "onnxruntime"
    )
    first = chosen_profile(out, "lin")
    assert isinstance(first, LatencyProfile) and first == profiles[0]
    assert (first.backend, first.threads) == (chosen["backend"], chosen["threads"])
    assert first.max_batch == 8 and first.memory_bytes > 0 and first.beta_s > 0

    # the BYTES model is skipped with its reason, not fatal
    assert doc["models"]["text"]["chosen"] is None
    assert "BYTES" in doc["models"]["text"]["skipped"]["onnxruntime"]
    assert "text" not in load_profiles(out) and chosen_profile(out, "text") is None

    # report: a table and a well-formed SVG per model
    table = (report / "lin.txt").read_text()
    assert "<- chosen" in table and "l(b) =" in table
    svg = ET.parse(report / "lin.svg").getroot()
    assert svg.tag.endswith("svg")
    assert len(svg.findall("{http://www.w3.org/2000/svg}polyline")) == len(entry["trials"])
    assert "best: onnxruntime" in capsys.readouterr().out

    # --apply: the chosen keys written, the user's kept, the loader accepts it
    config = ModelRepository(repo).read_config("lin")
    assert config.backend == "onnxruntime"
    assert config.runtime.threads == chosen["threads"]
    assert config.placement.rate == 3.0 and config.placement.backends == ("onnxruntime", "openvino")
    assert config.instance_group.count == 1 and config.max_batch_size == 8
    assert config.dynamic_batching.max_queue_size == 64
    if chosen["batch"] > 1:
        assert config.dynamic_batching.preferred_batch_sizes == (chosen["batch"],)
        assert config.dynamic_batching.max_queue_delay_us <= 500  # the user's value at most
    assert (repo / "lin" / "config.toml.bak").read_text() == LIN_CONFIG


def test_an_unknown_model_or_bad_flag_is_a_clear_error(
    repo: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "p.json"
    assert _tune(repo, out, "--models", "lin,nope") == 2
    err = capsys.readouterr().err
    assert "nope" in err and "lin" in err
    assert _tune(repo, out, "--backends", "onnxruntime,tensorflow") == 2
    assert "tensorflow" in capsys.readouterr().err
    assert _tune(repo, out, "--shape", "x:3,zero") == 2
    assert "--shape" in capsys.readouterr().err
    assert not out.exists()


def test_a_broken_model_is_reported_and_the_others_still_tuned(repo: Path, tmp_path: Path) -> None:
    (repo / "bad").mkdir()
    (repo / "bad" / "config.toml").write_text("max_batch_size = -1\n")
    out = tmp_path / "p.json"
    assert _tune(repo, out, "--models", "bad,lin", "--backends", "onnxruntime") == 1
    doc = json.loads(out.read_text())
    assert "max_batch_size" in doc["models"]["bad"]["error"]
    assert doc["models"]["lin"]["chosen"]["backend"] == "onnxruntime"
    assert doc["models"]["lin"]["skipped"]["openvino"] == "not asked for (--backends)"


def test_ctrl_c_keeps_the_models_measured_so_far_beside_the_profiles_and_applies_nothing(
    repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # It ended in a KeyboardInterrupt traceback, and every model already measured was lost
    import cloud.tuning.sweep as sweep

    write_linear_model(repo / "lin2" / "1" / "model.onnx")
    real, calls = sweep.measure_model, []

    def interrupted_on_the_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # as SIGINT raises it, mid-sweep
        return real(*args, **kwargs)

    monkeypatch.setattr(sweep, "measure_model", interrupted_on_the_second)
    before = (repo / "lin" / "config.toml").read_text()
    out = tmp_path / "p.json"
    out.write_text('{"the profiles": "a controller reads"}')
    assert _tune(repo, out, "--models", "lin,lin2", "--backends", "onnxruntime", "--apply") == 130
    assert out.read_text() == '{"the profiles": "a controller reads"}'  # not replaced
    doc = json.loads((tmp_path / "p.json.partial").read_text())
    assert list(doc["models"]) == ["lin"] and doc["models"]["lin"]["chosen"] is not None
    assert (repo / "lin" / "config.toml").read_text() == before  # nothing applied


def test_a_profile_missing_a_key_names_it() -> None:
    with pytest.raises(ConfigError, match="key 'beta_s' is missing"):
        LatencyProfile.from_dict({"backend": "onnxruntime", "a_s": 0.001, "max_batch": 4})


def test_a_broken_profiles_file_names_file_and_key(tmp_path: Path) -> None:
    bad = tmp_path / "p.json"
    bad.write_text(json.dumps({"version": 1, "models": {"m": {"profiles": [{"backend": "x"}]}}}))
    with pytest.raises(ConfigError, match=r"p.json: key 'models.m.profiles\[0\]'"):
        load_profiles(bad)
    bad.write_text(json.dumps({"version": 2, "models": {}}))
    with pytest.raises(ConfigError, match=r"p.json: key 'version'"):
        load_profiles(bad)
    bad.write_text("{")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_profiles(bad)


def test_the_toml_writer_round_trips_what_tomllib_reads() -> None:
    text = """\
backend = "onnxruntime"
"odd key" = "quote \\" back\\\\slash \\u0001 tab\\t"
ratio = 0.5
big = inf
[[input]]
name = "a/b"
dims = [3, 224, 224]
[[input]]
name = "c"
dims = [-1]
[input.extra]
deep = {x = 1, y = [true, false]}
[runtime]
threads = 2
[runtime.nested]
when = 1979-05-27T07:32:00Z
"""
    data = tomllib.loads(text)
    assert tomllib.loads(dumps(data)) == data


def test_merging_a_choice_never_drops_keys_and_never_shrinks_the_batch() -> None:
    data = {"max_batch_size": 16, "input": [{"name": "x"}], "dynamic_batching": {"x": 1}}
    chosen = {"backend": "openvino", "threads": 1, "batch": 4, "p99_ms": 10.0}
    out = merged(data, chosen, 100.0)
    assert out["max_batch_size"] == 16 and out["input"] == [{"name": "x"}]
    assert out["dynamic_batching"] == {
        "x": 1,
        "preferred_batch_sizes": [4],
        "max_queue_delay_us": 10_000,
    }
    assert data["dynamic_batching"] == {"x": 1}  # the input is not modified
    one = merged(
        {"dynamic_batching": {"preferred_batch_sizes": [8], "max_queue_delay_us": 2000}},
        {**chosen, "batch": 1},
        100.0,
    )
    assert one["dynamic_batching"] == {"max_queue_delay_us": 0}
    assert "dynamic_batching" not in merged({"max_batch_size": 0}, chosen, 100.0)


def test_apply_refuses_a_legacy_config_and_a_backend_without_its_file(repo: Path) -> None:
    repository = ModelRepository(repo)
    # (OpenVINO serves the model.onnx as it is: a backend with no file of its own is one
    # that needs its engine, TensorRT's model.plan)
    chosen = {"backend": "tensorrt", "threads": 1, "batch": 2, "p99_ms": 1.0}
    with pytest.raises(ConfigError, match=r"not applied.*tensorrt"):
        apply_choice(repository, "lin", chosen, 100.0)
    assert (repo / "lin" / "config.toml").read_text() == LIN_CONFIG
    assert not (repo / "lin" / "config.toml.tmp").exists()
    write_linear_model(repo / "old" / "1" / "model.onnx")
    (repo / "old" / "config.txt").write_text('{"batch_size": 4}')
    with pytest.raises(ConfigError, match=r"config\.txt"):
        apply_choice(repository, "old", {**chosen, "backend": "onnxruntime"}, 100.0)


def test_apply_on_a_triton_folder_keeps_everything_its_config_pbtxt_says(repo: Path) -> None:
    # With no config.toml, --apply wrote one holding only the tuned keys; read before
    # the config.pbtxt, it silently replaced it (max_batch_size 8 served as 32).
    write_linear_model(repo / "trt" / "1" / "model.onnx")
    (repo / "trt" / "config.pbtxt").write_text(
        "max_batch_size: 8\ninstance_group [{ count: 1, kind: KIND_CPU }]\n"
        "dynamic_batching { max_queue_delay_microseconds: 300 }\n"
    )
    repository = ModelRepository(repo)
    before = repository.read_config("trt")
    chosen = {"backend": "onnxruntime", "threads": 1, "batch": 4, "p99_ms": 1.0}
    path, warnings = apply_choice(repository, "trt", chosen, 100.0)
    assert path.name == "config.toml" and any("config.pbtxt converted" in w for w in warnings)
    after = repository.read_config("trt")
    assert after.max_batch_size == before.max_batch_size == 8
    assert after.instance_group.count == 1 and after.runtime.threads == 1
    assert after.dynamic_batching.preferred_batch_sizes == (4,)


def test_an_apply_that_cannot_write_leaves_no_backup_behind(repo: Path, monkeypatch) -> None:
    # (an immutable config.toml: the rename over it fails after the backup was made)
    import cloud.tuning.apply as apply

    def refused(src, dst):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(apply.os, "replace", refused)
    chosen = {"backend": "onnxruntime", "threads": 1, "batch": 2, "p99_ms": 1.0}
    with pytest.raises(ConfigError, match="not applied: cannot write"):
        apply_choice(ModelRepository(repo), "lin", chosen, 100.0)
    assert not (repo / "lin" / "config.toml.bak").exists()
    assert (repo / "lin" / "config.toml").read_text() == LIN_CONFIG


def test_apply_keeps_the_first_backup_and_leaves_a_shared_symlinked_config_alone(
    repo: Path, tmp_path: Path
) -> None:
    # A second --apply overwrote config.toml.bak with the first one's comment-free
    # output; a symlinked config.toml was replaced by a plain file.
    repository = ModelRepository(repo)
    chosen = {"backend": "onnxruntime", "threads": 1, "batch": 2, "p99_ms": 1.0}
    for _ in range(2):
        apply_choice(repository, "lin", chosen, 100.0)
    assert (repo / "lin" / "config.toml.bak").read_text() == LIN_CONFIG
    shared = tmp_path / "shared" / "lin.toml"
    shared.parent.mkdir()
    shared.write_text(LIN_CONFIG)
    shared.chmod(0o640)
    (repo / "lin" / "config.toml").unlink()
    (repo / "lin" / "config.toml").symlink_to(shared)
    path, _ = apply_choice(repository, "lin", chosen, 100.0)
    # the shared file (other models' too) is left alone: the model gets its own
    assert not path.is_symlink() and "threads = 1" in path.read_text()
    assert shared.read_text() == LIN_CONFIG and (path.stat().st_mode & 0o777) == 0o640


def test_apply_lowers_the_instance_count_so_the_chosen_threads_fit_the_cores(
    repo: Path,
) -> None:
    # threads = 2 applied beside count = 2 on 2 cores, then a warning that it oversubscribes
    repository = ModelRepository(repo)
    cfg = repo / "lin" / "config.toml"
    cfg.write_text(LIN_CONFIG.replace("count = 1", "count = 2"))
    chosen = {"backend": "onnxruntime", "threads": 2, "batch": 1, "p99_ms": 1.0}
    _, warnings = apply_choice(repository, "lin", chosen, 100.0, cores=2)
    config = repository.read_config("lin")
    assert (config.instance_group.count, config.runtime.threads) == (1, 2)
    assert any("instance_group.count 2 -> 1" in w for w in warnings)


def test_a_model_no_runtime_can_load_fails_the_run(repo: Path, tmp_path: Path) -> None:
    # every backend "skipped" and exit 0, though the docs say a model that cannot be
    # read fails the run
    (repo / "garbage" / "1").mkdir(parents=True)
    (repo / "garbage" / "1" / "model.onnx").write_bytes(b"not a model")
    out = tmp_path / "p.json"
    assert _tune(repo, out, "--models", "garbage,lin", "--backends", "onnxruntime") == 1
    doc = json.loads(out.read_text())
    assert "no runtime could load and run it" in doc["models"]["garbage"]["error"]
    assert doc["models"]["lin"]["chosen"] is not None


def test_the_real_example_model_is_tuned_on_onnxruntime(
    example_repository: Path, tmp_path: Path
) -> None:
    repo = tmp_path / "repo"
    shutil.copytree(example_repository / "orientation", repo / "orientation")
    out = tmp_path / "profiles.json"
    code = _tune(repo, out, "--backends", "onnxruntime", "--max-threads", "1", "--max-batch", "2")
    assert code == 0
    (profile,) = load_profiles(out)["orientation"]
    assert profile.backend == "onnxruntime" and profile.threads == 1
    assert profile.max_batch == 32  # the model's, not the sweep's limit
    assert profile.a_s + 2 * profile.beta_s > 0.0005  # a real CNN, not a no-op
    entry = json.loads(out.read_text())["models"]["orientation"]
    assert [p["batch"] for p in entry["trials"][0]["points"]] == [1, 2]
    assert entry["sessions"] == 2  # [instance_group] count = 2: a copy's memory is two
    assert profile.memory_bytes == 2 * entry["trials"][0]["memory_bytes"]


def test_a_model_with_an_image_input_is_tuned_on_encoded_images(tmp_path: Path) -> None:
    from tests.shared.pipeline.conftest import write_image_model

    root = tmp_path / "repo"
    write_image_model(root / "img" / "1" / "model.onnx", ["N", 3, 16, 16])
    (root / "img" / "labels.txt").write_text("a\nb\nc\nd\n")
    (root / "img" / "config.toml").write_text(
        "max_batch_size = 4\n[[preprocess]]\n"
        '[[postprocess]]\noutput = "y"\nsoftmax = true\ntop_k = 1\nlabels = "labels.txt"\n'
    )
    out = tmp_path / "profiles.json"
    backends = "onnxruntime,openvino" if "openvino" in installed_backends() else "onnxruntime"
    assert _tune(root, out, "--backends", backends, "--max-batch", "2") == 0
    profiles = load_profiles(out)["img"]
    assert profiles and profiles[0].backend in ("onnxruntime", "openvino")
    doc = json.loads(out.read_text())
    assert "error" not in json.dumps(doc["models"]["img"]).lower()
    # OpenVINO still reads the model folder's labels (a temporary IR had looked for
    # /tmp/.../labels.txt and skipped OpenVINO)
    assert "labels" not in json.dumps(doc["models"]["img"].get("skipped", {}))


def test_on_a_gpu_node_tensorrt_is_listed_with_why_it_was_not_tried(repo: Path) -> None:
    from cloud.tuning.sweep import plan_model

    repository = ModelRepository(repo)
    text = plan_model(repository, "text", cores=2, gpu=True, gpu_reason="1 NVIDIA GPU(s)")
    expected = "runtime not installed"
    if "tensorrt" in installed_backends():
        expected = "no model.plan in version 1"
    assert text.skipped["tensorrt"].startswith(expected)
    assert "tensorrt" not in [t.backend for t in text.targets]
    # the model's own [placement] backends are said first, as for any backend
    lin = plan_model(repository, "lin", cores=2, gpu=True)
    assert lin.skipped["tensorrt"].startswith("not in [placement] backends")
    # a CPU node does not pad every model's table with a backend it can never run
    assert "tensorrt" not in plan_model(repository, "text", cores=2).skipped


def test_an_output_that_cannot_be_written_is_refused_before_the_sweep(
    repo: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "already-a-folder"
    folder.mkdir()
    assert _tune(repo, folder, "--models", "lin") == 2
    assert "--out" in capsys.readouterr().err
    assert not list(tmp_path.glob("*.tmp"))
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    assert _tune(repo, tmp_path / "p.json", "--models", "lin", "--report", str(blocker / "r")) == 2
    assert "--report" in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()


def test_a_shape_for_an_input_the_model_lacks_is_noted_not_passed_off_as_measured(
    repo: Path, tmp_path: Path
) -> None:
    out = tmp_path / "p.json"
    assert (
        _tune(repo, out, "--models", "lin", "--backends", "onnxruntime", "--shape", "nosuch:4") == 0
    )
    notes = json.loads(out.read_text())["models"]["lin"]["notes"]
    assert any("--shape ['nosuch'] names no input" in n for n in notes), notes


def test_a_profile_choosing_batch_1_records_no_queue_delay_as_apply_writes() -> None:
    from cloud.tuning.fit import Candidate, Point
    from cloud.tuning.profiles import _choice

    one = _choice(Candidate("onnxruntime", 2, Point(1, 0.004, 0.006, 0.004, 50)), 0.2)
    assert one is not None and one["max_queue_delay_us"] == 0  # (11220 had been recorded)
    four = _choice(Candidate("onnxruntime", 2, Point(4, 0.01, 0.012, 0.01, 50)), 0.2)
    assert four is not None and four["max_queue_delay_us"] > 0


def test_tune_refuses_an_empty_models_list_and_fails_when_nothing_is_measured(
    repo: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # --models '' tuned every model; --backends naming only what is missing here said
    # "nothing could be measured" and exited 0
    out = tmp_path / "p.json"
    assert _tune(repo, out, "--models", "") == 2
    assert "--models: no model named" in capsys.readouterr().err
    missing = next(b for b in ("tensorrt", "openvino", "tflite") if b not in installed_backends())
    assert _tune(repo, out, "--models", "lin", "--backends", missing) == 1
    assert "nothing could be measured" in capsys.readouterr().err


@pytest.mark.skipif("openvino" not in installed_backends(), reason="needs OpenVINO")
def test_a_backend_that_answers_otherwise_is_not_measured_in_the_models_place(
    tmp_path: Path,
) -> None:
    # OpenVINO's CPU plugin computes FP64 as FP32 and INT64 as INT32: tuning must not
    # move a model served exactly on ONNX Runtime onto it for speed.
    import onnx
    from onnx import helper

    repo = tmp_path / "repo"
    write_identity_model(repo / "double" / "1" / "model.onnx", TensorProto.DOUBLE)
    # FP32 at its ports, INT64 inside: x + 1 + (2**31 - 1) wraps on INT32 arithmetic
    big = helper.make_tensor("big", TensorProto.INT64, [1], [2**31 - 1])
    one = helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])
    graph = helper.make_graph(
        [
            helper.make_node("Add", ["x", "one"], ["x1"]),
            helper.make_node("Cast", ["x1"], ["i"], to=TensorProto.INT64),
            helper.make_node("Add", ["i", "big"], ["s"]),
            helper.make_node("Cast", ["s"], ["y"], to=TensorProto.FLOAT),
        ],
        "wrap",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])],
        [big, one],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    (repo / "wrap" / "1").mkdir(parents=True)
    onnx.save(model, str(repo / "wrap" / "1" / "model.onnx"))
    # INT64 ids (an embedding's lookup) stay a candidate: past INT32 they are refused
    table = helper.make_tensor("table", TensorProto.FLOAT, [4, 2], [float(i) for i in range(8)])
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "ids"], ["y"], axis=0)],
        "ids",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["N", 1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 1, 2])],
        [table],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    (repo / "ids" / "1").mkdir(parents=True)
    onnx.save(model, str(repo / "ids" / "1" / "model.onnx"))
    out = tmp_path / "profiles.json"
    assert _tune(repo, out, "--max-threads", "1", "--max-batch", "1") == 0
    models = json.loads(out.read_text())["models"]
    assert {t["backend"] for t in models["ids"]["trials"]} == {"onnxruntime", "openvino"}
    for name in ("double", "wrap"):
        assert {t["backend"] for t in models[name]["trials"]} == {"onnxruntime"}, name
    assert "computes x FP64 as FP32" in models["double"]["skipped"]["openvino"]
    assert "differ from onnxruntime's" in models["wrap"]["skipped"]["openvino"]
    assert load_profiles(out)["wrap"][0].backend == "onnxruntime"
