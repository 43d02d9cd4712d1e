from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import write_linear_model, write_softmax_model


def build_edge_repositories(root: Path) -> tuple[Path, Path]:
    """A cloud repository and a local one with the same weights (results must agree)."""
    cloud, local = root / "cloud", root / "local"
    write_linear_model(cloud / "lin" / "1" / "model.onnx", seed=4)
    write_linear_model(local / "lin-local" / "1" / "model.onnx", seed=4)
    write_linear_model(cloud / "cloudonly" / "1" / "model.onnx", seed=5)
    write_softmax_model(cloud / "soft" / "1" / "model.onnx")
    write_softmax_model(local / "soft-local" / "1" / "model.onnx")
    # (a cascade's scores: its first output, or one named; "pos" is BOOL)
    write_softmax_model(cloud / "two" / "1" / "model.onnx", flags="last")
    write_softmax_model(local / "two-local" / "1" / "model.onnx", flags="last")
    write_softmax_model(local / "flags-local" / "1" / "model.onnx", flags="first")
    return cloud, local


@pytest.fixture(scope="module")
def edge_repos(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return build_edge_repositories(tmp_path_factory.mktemp("edge-repos"))


#: the example's energy weight: an offload's local run then waits until the deadline needs
#: it (a fallback), where with latency alone it starts beside the offload
PRICED_ENERGY = "[policy.weights]\nlatency_s = 1.0\nenergy_j = 0.05\n"


def agent_toml(
    folder: Path,
    local_repo: Path,
    *,
    http: str | None = None,
    mqtt: str | None = None,
    models: str = "",
    policy: str = "",
    extra: str = "",
) -> Path:
    cloud = ""
    if http or mqtt:
        cloud = (
            "[cloud]\n"
            + (f'http = "{http}"\n' if http else "")
            + (f'mqtt = "{mqtt}"\n' if mqtt else "")
        )
    text = (
        f'repository = "{local_repo}"\nstate_dir = "{folder / "state"}"\ndevice = "raspberry-pi-4b"\n'
        f"probe_interval_s = 0.5\n{extra}\n{cloud}\n[policy]\ndeadline_ms = 2000\n{policy}\n{models}\n"
    )
    path = folder / "agent.toml"
    path.write_text(text)
    return path
