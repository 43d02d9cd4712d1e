"""``ferry-edge profile``: measured samples, and whether the local runtime can stop a run."""

from __future__ import annotations

import json

from edge.cli import main
from edge.evaluation.profile import read_profile


def test_a_profile_records_the_samples_and_that_the_local_run_can_be_cancelled(
    tmp_path, edge_repos
):
    cloud, local = edge_repos
    out = tmp_path / "profile.json"
    rc = main(
        [
            "profile",
            "--repository",
            str(local),
            "--local-model",
            "lin-local",
            "--cloud-repository",
            str(cloud),
            "--cloud-model",
            "lin",
            "--runs",
            "12",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    doc = json.loads(out.read_text())
    assert len(doc["local_s"]) == 12 and len(doc["cloud_s"]) == 12
    assert doc["local_cancellable"] is True  # ONNX Runtime takes a cancel
    profile = read_profile(out)
    assert profile.local_cancellable and all(s > 0 for s in profile.local_s)
    # a profile written before the flag existed reads as a runtime that cannot stop
    del doc["local_cancellable"]
    out.write_text(json.dumps(doc))
    assert not read_profile(out).local_cancellable


def test_a_profile_without_usable_run_times_is_refused_naming_the_key(tmp_path) -> None:
    import pytest

    from shared.errors import ConfigError

    for local, key in (([], "local_s"), ([float("nan")], "local_s"), ([-1.0, 0.0], "local_s")):
        path = tmp_path / "p.json"
        path.write_text(json.dumps({"local_s": local, "cloud_s": [0.1]}))
        with pytest.raises(ConfigError, match=key):
            read_profile(path)


def test_a_profile_that_is_not_a_json_object_is_refused_not_a_traceback(tmp_path) -> None:
    import pytest

    from shared.errors import ConfigError

    for doc in ("[]", '"x"', "3"):
        path = tmp_path / "p.json"
        path.write_text(doc)
        with pytest.raises(ConfigError, match="expected a JSON object"):
            read_profile(path)
    path.write_text('{"local_s": [true], "cloud_s": [0.1]}')  # not a run of 1 s
    with pytest.raises(ConfigError, match="'local_s': expected numbers"):
        read_profile(path)
