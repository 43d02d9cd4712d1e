"""An app sends the agent a JPEG: the same answer locally and in the cloud, and an
offload carries the encoded bytes, not the 602 KB tensor."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edge.agent import Agent
from edge.config import load_agent_config
from shared.errors import InvalidInput
from shared.modeltools.samples import orientation_jpegs
from tests.edge.conftest import agent_toml
from tests.support import cloud_server

MODELS = (
    '[models.pages]\nlocal = "orientation-int8-jpeg"\ncloud = "orientation-jpeg"\nmode = "{mode}"\n'
)


@pytest.fixture(scope="module")
def cloud(example_repository: Path):
    proc = cloud_server(example_repository, "--models", "orientation-jpeg").start()
    yield proc
    proc.terminate()


async def test_a_jpeg_gets_the_same_angle_locally_and_in_the_cloud_and_only_its_bytes_travel(
    tmp_path: Path, example_repository: Path, cloud
) -> None:
    blobs, labels = orientation_jpegs(4, seed=21, quality=80)
    answers = {}
    for mode in ("local", "cloud"):
        cfg = agent_toml(
            tmp_path, example_repository, http=cloud.http_url, models=MODELS.format(mode=mode)
        )
        async with Agent(load_agent_config(cfg)) as agent:
            rows = []
            for blob in blobs:
                response = await agent.infer("pages", {"image": np.array([[blob]], dtype=object)})
                outputs = {t.name: t.data for t in response.outputs}
                rows.append(outputs["angle"][0, 0])
                if mode == "cloud":
                    p = response.parameters
                    assert p["where"] == "cloud-http"
                    # the JPEG and framing, not 3x224x224 float32 (602,112 bytes)
                    assert len(blob) < p["bytes_sent"] < len(blob) + 4096
            answers[mode] = rows
    assert answers["local"] == answers["cloud"]
    right = sum(
        a == str((0, 90, 180, 270)[k]).encode()
        for a, k in zip(answers["local"], labels, strict=True)
    )
    assert right >= 3


async def test_a_bad_image_sent_to_the_agent_is_an_invalid_input(
    tmp_path: Path, example_repository: Path
) -> None:
    cfg = agent_toml(tmp_path, example_repository, models=MODELS.format(mode="local"))
    async with Agent(load_agent_config(cfg)) as agent:
        with pytest.raises(InvalidInput, match="not a JPEG"):
            await agent.infer("pages", {"image": np.array([[b"text, not pixels"]], dtype=object)})


async def test_an_empty_batch_or_one_over_the_local_max_is_refused_as_the_cloud_refuses_it(
    tmp_path: Path, example_repository: Path
) -> None:
    cfg = agent_toml(tmp_path, example_repository, models=MODELS.format(mode="local"))
    blob = orientation_jpegs(1, seed=3)[0][0]
    async with Agent(load_agent_config(cfg)) as agent:
        for rows in (0, 33):  # the local variant's max_batch_size is 32, as the cloud's
            images = np.array([[blob]] * rows, dtype=object).reshape(rows, 1)
            with pytest.raises(InvalidInput, match=r"batch dimension must be 1\.\.32"):
                await agent.infer("pages", {"image": images})
        # and the agent still answers
        response = await agent.infer("pages", {"image": np.array([[blob]], dtype=object)})
        assert response.parameters["where"] == "local"


async def test_classification_is_answered_locally_as_the_cloud_answers_it(
    tmp_path: Path, example_repository: Path, cloud
) -> None:
    from shared.messages import InferRequest, RequestedOutput
    from shared.tensors import Tensor

    blob = orientation_jpegs(1, seed=5, quality=80)[0][0]
    asked = [RequestedOutput("fetch_name_0", parameters={"classification": 2})]
    got = {}
    for mode in ("local", "cloud"):
        cfg = agent_toml(
            tmp_path, example_repository, http=cloud.http_url, models=MODELS.format(mode=mode)
        )
        async with Agent(load_agent_config(cfg)) as agent:
            image = Tensor("image", "BYTES", np.array([[blob]], dtype=object))
            response = await agent.dataplane.infer(
                "pages", InferRequest(inputs=[image], outputs=asked)
            )
            (out,) = response.outputs
            assert out.datatype == "BYTES" and out.data.shape == (1, 2)
            got[mode] = [s.split(b":")[1:] for s in out.data[0]]  # index and label
            bad = [RequestedOutput("fetch_name_0", parameters={"classification": -1})]
            with pytest.raises(InvalidInput, match="classification must be"):
                await agent.dataplane.infer("pages", InferRequest(inputs=[image], outputs=bad))
    assert got["local"][0] == got["cloud"][0]  # the same top class (int8 beside FP32)


async def test_a_request_the_cloud_refuses_as_invalid_is_not_answered_by_a_local_fallback(
    tmp_path: Path, example_repository: Path, cloud
) -> None:
    cfg = agent_toml(
        tmp_path, example_repository, http=cloud.http_url, models=MODELS.format(mode="cloud")
    )
    blob = orientation_jpegs(1, seed=3)[0][0]
    async with Agent(load_agent_config(cfg)) as agent:
        with pytest.raises(InvalidInput, match=r"batch dimension must be 1\.\.32"):
            await agent.infer("pages", {"image": np.array([[blob]] * 33, dtype=object)})


async def test_a_model_the_agent_does_not_know_is_not_found_not_offloaded_or_deferred(
    tmp_path: Path, example_repository: Path, cloud
) -> None:
    from shared.errors import ModelNotFound

    cfg = agent_toml(
        tmp_path, example_repository, http=cloud.http_url, models=MODELS.format(mode="cost")
    )
    x = {"x": np.zeros((1, 3, 224, 224), np.float32)}
    async with Agent(load_agent_config(cfg)) as agent:
        assert not agent.dataplane.model_ready("nosuch")
        for deferrable in (False, True):
            with pytest.raises(ModelNotFound, match="unknown model 'nosuch'"):
                await agent.infer("nosuch", x, deferrable=deferrable)


async def test_classification_asked_of_an_mqtt_offload_comes_back_classified(
    tmp_path: Path, example_repository: Path, broker
) -> None:
    # The envelope carried output names only: the cloud got no class_count and sent
    # the raw probabilities back.
    import asyncio

    from shared.messages import InferRequest, RequestedOutput
    from shared.tensors import Tensor

    node = cloud_server(
        example_repository, "--models", "orientation-jpeg", "--node", "cls", "--mqtt", broker.url
    ).start()
    try:
        cfg = agent_toml(
            tmp_path, example_repository, mqtt=broker.url, models=MODELS.format(mode="cloud")
        )
        async with Agent(load_agent_config(cfg)) as agent:
            for _ in range(100):
                if agent.transports["mqtt"].serves("orientation-jpeg"):
                    break
                await asyncio.sleep(0.05)
            blob = orientation_jpegs(1, seed=5, quality=80)[0][0]
            image = Tensor("image", "BYTES", np.array([[blob]], dtype=object))
            asked = [RequestedOutput("fetch_name_0", parameters={"classification": 2})]
            response = await agent.dataplane.infer(
                "pages", InferRequest(inputs=[image], outputs=asked)
            )
            assert response.parameters["where"] == "cloud-mqtt"
            (out,) = response.outputs
            assert out.datatype == "BYTES" and out.data.shape == (1, 2)
            assert out.data[0, 0].count(b":") == 2  # "score:index:label"
    finally:
        node.terminate()
