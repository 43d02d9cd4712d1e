"""ferry-cloud tune on real models: profiles, report, --apply."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from cloud.cli import main
from cloud.tuning.profiles import load_profiles
from shared.errors import ConfigError
from shared.repository import ModelRepository
from tests.support import write_linear_model


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    write_linear_model(tmp_path / "repo" / "lin" / "1" / "model.onnx")
    (tmp_path / "repo" / "lin" / "config.toml").write_text(
        "max_batch_size = 8\n[instance_group]\ncount = 1\n[placement]\nrate = 3.0\n"
    )
    return tmp_path / "repo"


def test_tune_writes_profiles_report_and_applies_the_choice(
    repo: Path, tmp_path: Path, capsys
) -> None:
    out = tmp_path / "profiles.json"
    code = main(
        [
            "tune",
            "--repository",
            str(repo),
            "--duration-s",
            "0.05",
            "--max-threads",
            "2",
            "--out",
            str(out),
            "--report",
            str(tmp_path / "report"),
            "--apply",
            "--no-progress",
        ]
    )
    assert code == 0
    doc = json.loads(out.read_text())
    entry = doc["models"]["lin"]
    assert doc["version"] == 1 and doc["machine"]["cores"] >= 1
    assert [p["batch"] for p in entry["trials"][0]["points"]] == [1, 2, 4, 8]
    assert entry["chosen"]["backend"] == "onnxruntime"
    profiles = load_profiles(out)["lin"]
    assert profiles[0].backend == "onnxruntime" and profiles[0].beta_s > 0
    assert profiles[0].max_batch == 8 and profiles[0].memory_bytes > 0
    svg = (tmp_path / "report" / "lin.svg").read_text()
    assert svg.startswith("<svg") and "polyline" in svg
    assert "<- chosen" in (tmp_path / "report" / "lin.txt").read_text()
    config = ModelRepository(repo).read_config("lin")
    assert config.backend == "onnxruntime"
    assert config.runtime.threads == entry["chosen"]["threads"]
    assert config.placement.rate == 3.0  # the user's keys stay
    assert config.instance_group.count == 1
    assert (repo / "lin" / "config.toml.bak").is_file()
    assert "best: onnxruntime" in capsys.readouterr().out


def test_an_unknown_model_is_a_clear_error(repo: Path, tmp_path: Path, capsys) -> None:
    code = main(
        [
            "tune",
            "--repository",
            str(repo),
            "--models",
            "nope",
            "--out",
            str(tmp_path / "p.json"),
            "--no-progress",
        ]
    )
    assert code == 2
    assert "nope" in capsys.readouterr().err


def test_a_broken_profiles_file_names_file_and_key(tmp_path: Path) -> None:
    bad = tmp_path / "p.json"
    bad.write_text(json.dumps({"version": 1, "models": {"m": {"profiles": [{"backend": "x"}]}}}))
    with pytest.raises(ConfigError, match=r"p.json: key 'models.m.profiles'"):
        load_profiles(bad)


def test_the_real_example_model_is_tuned_on_onnxruntime(
    example_repository: Path, tmp_path: Path
) -> None:
    repo = tmp_path / "repo"
    shutil.copytree(example_repository / "orientation", repo / "orientation")
    out = tmp_path / "profiles.json"
    assert (
        main(
            [
                "tune",
                "--repository",
                str(repo),
                "--backends",
                "onnxruntime",
                "--max-threads",
                "1",
                "--max-batch",
                "2",
                "--duration-s",
                "0.05",
                "--out",
                str(out),
                "--no-progress",
            ]
        )
        == 0
    )
    (profile,) = load_profiles(out)["orientation"]
    assert profile.backend == "onnxruntime" and profile.a_s + profile.beta_s > 0.0005
