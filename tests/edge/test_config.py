from pathlib import Path

import pytest

from edge.config import load_agent_config, load_policy_file
from shared.errors import ConfigError
from tests.support import ROOT


def test_the_shipped_example_agent_config_parses():
    config = load_agent_config(ROOT / "examples" / "agent.toml")
    assert config.repository == (ROOT / "examples" / "repository").resolve()
    assert config.policy.models["orientation"].local_model == "orientation-int8"
    assert load_policy_file(ROOT / "examples" / "agent.toml").weights.energy_j == 0.05


@pytest.mark.parametrize(
    "text, message",
    [
        ('repository = "r"\nbogus = 1\n', "unknown key 'bogus'"),
        (
            'repository = "r"\n[policy]\ndeadline_ms = "soon"\n',
            "'policy.deadline_ms': expected a number",
        ),
        (
            'repository = "r"\n[policy.weights]\nlatency = 1\n',
            "unknown key 'policy.weights.latency'",
        ),
        ('repository = "r"\n[models.m]\nmode = "fast"\n', "'models.m.mode'"),
        ('repository = "r"\n[policy.weights]\nenergy_j = nan\n', "'policy.weights.energy_j'"),
        (
            'repository = "r"\n[cloud]\nhttp = "http://127.0.0.1:8000"\ntls_insecure = true\n',
            "'cloud.tls_insecure': TLS options need",
        ),
        (
            'repository = "r"\n[cloud]\nhttp = "https://127.0.0.1:8000"\nkey_file = "k.pem"\n',
            "'cloud.key_file': needs cloud.cert_file",
        ),
        ('repository = "r"\n[policy.weights]\nlatency_s = inf\n', "'policy.weights.latency_s'"),
        # (1e308 made costs inf and their differences NaN: "P(better) nan")
        ('repository = "r"\n[policy.weights]\nmoney = 1e308\n', "only the weights' ratios"),
        ('repository = "r"\n[models.m]\nmode = "local"\n', "'models.m.local'"),
        (
            'repository = "r"\n[models.m]\nlocal = "a"\ntransports = ["carrier-pigeon"]\n',
            "'models.m.transports'",
        ),
        ('repository = "r"\n[models.m]\nlocal = "a"\ncascade_threshold = 2\n', "cascade_threshold"),
        ('repository = "r"\n[policy]\ndeadline_quantile = 1.5\n', "deadline_quantile"),
        ('repository = "r"\n[emulation]\nlocal_slowdown = 0.5\n', "local_slowdown"),
        ('repository = "r"\n[emulation]\nlocal_latency_ms = -1\n', "local_latency_ms"),
        ('repository = "r"\ndevice = "toaster-9000"\n', "key 'device': unknown device profile"),
        ('repository = "r"\n[links]\nhttp = "carrier-pigeon"\n', "key 'links.http'"),
        ('repository = "r"\ndevice = "nope.toml"\n', "key 'device'.*cannot read"),
        ('repository = "r"\n[cloud]\nmqtt = "amqp://broker"\n', "key 'cloud.mqtt'"),
        ('repository = "r"\n[cloud]\nhttp = "ftp://cloud"\n', "key 'cloud.http'"),
        ('repository = "r"\n[cloud]\nca_file = "missing.pem"\n', "key 'cloud.ca_file'"),
        ('repository = "r"\n[cloud]\npassword_file = "missing"\n', "key 'cloud.password_file'"),
        ('repository = "r"\n[api]\nport = 99999\n', "key 'api.port'"),
        ('repository = "r"\n[cloud]\nkeepalive_s = 70000\n', "key 'cloud.keepalive_s'"),
        ('repository = "r"\n[cloud]\nclient_id = "a/b"\n', "key 'cloud.client_id'"),
        ('repository = "r"\nprobe_interval_s = 0\n', "key 'probe_interval_s'"),
        ('repository = "r"\nlocal_threads = -3\n', "key 'local_threads'"),
        ('repository = "r"\nlocal_inline_us = -1\n', "key 'local_inline_us'"),
        ('repository = "r"\n[policy]\ndata_cap_mb_per_day = -5\n', "data_cap_mb_per_day"),
        ('repository = "r"\n[policy]\nbattery_floor_percent = 400\n', "battery_floor_percent"),
        ('repository = "r"\n[policy]\ndeadline_ms = -1\n', "key 'policy.deadline_ms'"),
        ('repository = "r"\n[policy]\ndeadline_ms = inf\n', "'policy.deadline_ms': .*finite"),
        (
            'repository = "r"\n[models.m]\nlocal = "a"\ndeadline_ms = inf\n',
            "'models.m.deadline_ms': .*finite",
        ),
        ('repository = "r"\n[models.m]\nlocal = "a"\noutput_bytes = -7\n', "output_bytes"),
        ('repository = "r"\n[models.m]\nmode = "cost"\n', "needs a local model, a cloud model"),
        ('repository = "r"\n[store]\nmax_attempts = 0\n', "key 'store.max_attempts'"),
        ('repository = "r"\n[policy]\nwarm_up_runs = 0\n', "key 'policy.warm_up_runs'"),
        ("[policy]\n", "'repository' is required"),
        ("repository =\n", "not valid TOML"),
    ],
)
def test_bad_agent_config_names_file_and_key(tmp_path: Path, text: str, message: str):
    path = tmp_path / "agent.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message) as info:
        load_agent_config(path)
    assert str(path) in info.value.message


async def test_a_bad_edit_is_ignored_and_a_good_one_swapped_in(tmp_path, edge_repos):
    import os

    from edge.agent import Agent
    from tests.edge.conftest import agent_toml

    path = agent_toml(tmp_path, edge_repos[1], models='[models.lin]\nlocal = "lin-local"\n')
    agent = Agent(load_agent_config(path))
    await agent.start()
    try:
        path.write_text(path.read_text() + "\nnot valid = = toml\n")
        os.utime(path, (1, 1))
        await agent._watch_config()
        assert agent.dataplane.policy.config.default_deadline_ms == 2000
        path.write_text(
            path.read_text()
            .replace("not valid = = toml", "")
            .replace("deadline_ms = 2000", "deadline_ms = 750")
        )
        os.utime(path, (2, 2))
        await agent._watch_config()
        assert agent.dataplane.policy.config.default_deadline_ms == 750
    finally:
        await agent.stop()


async def test_an_edit_that_failed_for_want_of_its_model_is_applied_once_the_model_is_there(
    tmp_path, edge_repos, monkeypatch, caplog
):
    # The mtime was taken as handled before the reload: an edit naming a model folder
    # still being copied in failed once and stayed unapplied until the file changed.
    import os
    import shutil

    from edge import agent as agent_module
    from edge.agent import Agent
    from tests.edge.conftest import agent_toml

    local = tmp_path / "local"
    shutil.copytree(edge_repos[1] / "lin-local", local / "lin-local")
    path = agent_toml(tmp_path, local, models='[models.lin]\nlocal = "lin-local"\n')
    monkeypatch.setattr(agent_module, "RELOAD_RETRY_S", 0.0)
    agent = Agent(load_agent_config(path))
    await agent.start()
    try:
        path.write_text(path.read_text() + '[models.soft]\nlocal = "soft-local"\n')
        os.utime(path, (5, 5))
        await agent._watch_config()
        await agent._watch_config()  # tried again: the same failure, logged once
        assert "soft" not in agent.dataplane.policy.config.models
        assert caplog.text.count("agent config not reloaded") == 1
        shutil.copytree(edge_repos[1] / "soft-local", local / "soft-local")
        await agent._watch_config()  # the file is as it was: the retry applies it
        assert "soft" in agent.dataplane.policy.config.models
    finally:
        await agent.stop()


async def test_a_local_variant_the_config_drops_is_unloaded_once_idle(
    tmp_path, edge_repos, monkeypatch
):
    # Reloads only ever loaded: each remap kept the old variant's memory for good.
    import os

    from edge import agent as agent_module
    from edge.agent import Agent
    from tests.edge.conftest import agent_toml

    both = '[models.lin]\nlocal = "lin-local"\n[models.soft]\nlocal = "soft-local"\n'
    path = agent_toml(tmp_path, edge_repos[1], models=both)
    monkeypatch.setattr(agent_module, "RETIRE_AFTER_S", 0.0)
    agent = Agent(load_agent_config(path))
    await agent.start()
    try:
        assert agent.local.names() == ["lin-local", "soft-local"]
        path.write_text(path.read_text().replace('[models.soft]\nlocal = "soft-local"\n', ""))
        os.utime(path, (7, 7))
        await agent._watch_config()  # reloaded: soft-local retired
        await agent._watch_config()  # idle and past its time: unloaded
        assert agent.local.names() == ["lin-local"]
        assert not await agent.model_ready("soft-local")
        assert await agent.model_ready("lin")
    finally:
        await agent.stop()


async def test_reloads_run_one_at_a_time_and_load_a_new_model_once(tmp_path, edge_repos):
    # A SIGHUP's reload beside the watcher's loaded the same model twice.
    import asyncio

    from edge.agent import Agent
    from tests.edge.conftest import agent_toml

    path = agent_toml(tmp_path, edge_repos[1], models='[models.lin]\nlocal = "lin-local"\n')
    agent = Agent(load_agent_config(path))
    await agent.start()
    loads = []
    load = agent.local.load
    agent.local.load = lambda name: (loads.append(name), load(name))[1]
    try:
        path.write_text(path.read_text() + '[models.soft]\nlocal = "soft-local"\n')
        await asyncio.gather(*(agent._watch_config(force=True) for _ in range(3)))
        assert loads == ["soft-local"]
    finally:
        await agent.stop()


def test_profile_paths_resolve_against_the_config_folder(tmp_path: Path):
    (tmp_path / "my-link.toml").write_text(
        (ROOT / "devices" / "links" / "lte.toml")
        .read_text()
        .replace('name = "lte"', 'name = "mine"')
    )
    path = tmp_path / "agent.toml"
    path.write_text('repository = "r"\n[links]\nhttp = "my-link.toml"\n')
    assert load_agent_config(path).links["http"] == str(tmp_path / "my-link.toml")


async def test_a_reload_applies_device_emulation_store_bounds_and_quantile_live(
    tmp_path, edge_repos
):
    import os

    from edge.agent import Agent
    from tests.edge.conftest import agent_toml

    path = agent_toml(tmp_path, edge_repos[1], models='[models.lin]\nlocal = "lin-local"\n')
    agent = Agent(load_agent_config(path))
    await agent.start()
    try:
        assert agent.device.name == "raspberry-pi-4b"
        path.write_text(
            path.read_text()
            .replace('device = "raspberry-pi-4b"', 'device = "jetson-orin-nano"')
            .replace(
                "[policy]\n",
                "[emulation]\nlocal_latency_ms = 50\n[store]\nmax_requests = 7\nmax_bytes = 9000\n"
                "[policy]\ndeadline_quantile = 0.9\n",
            )
        )
        os.utime(path, (3, 3))
        await agent._watch_config()
        assert agent.device.name == "jetson-orin-nano"
        assert agent.dataplane.policy.device.name == "jetson-orin-nano"
        assert agent.local.latency_floor_s == 0.05
        assert agent.estimators.local("lin-local").q == 0.9
        assert (agent.store.max_rows, agent.store.max_bytes) == (7, 9000)
    finally:
        await agent.stop()


async def test_requests_in_flight_across_a_reload_that_remaps_the_model_are_all_answered(
    tmp_path, edge_repos
):
    import asyncio
    import os

    import numpy as np

    from edge.agent import Agent
    from tests.edge.conftest import agent_toml

    path = agent_toml(
        tmp_path,
        edge_repos[1],
        models='[models.lin]\nlocal = "lin-local"\nmode = "local"\n',
        extra="[emulation]\nlocal_latency_ms = 200\n",
    )
    agent = Agent(load_agent_config(path))
    await agent.start()
    try:
        x = np.ones((1, 4), np.float32)
        flights = [asyncio.create_task(agent.infer("lin", {"x": x})) for _ in range(5)]
        await asyncio.sleep(0.05)
        # The model loses its local variant while those requests wait for the device.
        path.write_text(
            path.read_text().replace(
                'local = "lin-local"\nmode = "local"\n', 'local = "soft-local"\n'
            )
        )
        os.utime(path, (4, 4))
        await agent._watch_config()
        assert agent.dataplane.policy.model_policy("lin").local_model == "soft-local"
        answers = await asyncio.gather(*flights)
        assert all(a.outputs[0].data.shape == (1, 3) for a in answers)  # lin-local's outputs
    finally:
        await agent.stop()


async def test_a_reload_cannot_send_a_model_to_a_cloud_endpoint_the_agent_did_not_start_with(
    tmp_path, edge_repos, caplog
):
    # [cloud] waits for a restart, but the reload checked the new models against the
    # file's new [cloud]: a model sent only over the new endpoint was taken, listed as
    # ready and answered 503 on every request.
    import os

    from edge.agent import Agent
    from tests.edge.conftest import agent_toml

    path = agent_toml(tmp_path, edge_repos[1], models='[models.lin]\nlocal = "lin-local"\n')
    agent = Agent(load_agent_config(path))
    await agent.start()
    try:
        path.write_text(
            path.read_text().replace("[policy]", '[cloud]\nmqtt = "mqtt://127.0.0.1:1"\n[policy]')
            + '[models.far]\ncloud = "lin"\nmode = "cloud"\ntransports = ["mqtt"]\n'
        )
        os.utime(path, (9, 9))
        await agent._watch_config()
        assert "far" not in agent.dataplane.policy.config.models
        assert "models.far.transports" in caplog.text and "as running" in caplog.text
        path.write_text(path.read_text().replace("deadline_ms = 2000", "deadline_ms = 900"))
        path.write_text(path.read_text().split("[models.far]")[0])
        os.utime(path, (10, 10))
        await agent._watch_config()  # applied; [cloud] waits for a restart
        assert agent.dataplane.policy.config.default_deadline_ms == 900
        assert agent.config.cloud.mqtt_url is None  # what runs, compared with next time
        assert (await agent.status())["restart_pending"] == ["cloud"]  # (not only a log line)
    finally:
        await agent.stop()


def test_the_mqtt_client_id_and_keepalive_reach_the_transport(tmp_path: Path):
    """A device on LTE picks its keepalive (a NAT's idle timeout, the battery): the keys
    had been refused as unknown, though the transport takes both."""
    from edge.agent import build_transports

    path = tmp_path / "agent.toml"
    path.write_text(
        'repository = "r"\n[cloud]\nmqtt = "mqtt://127.0.0.1:1883"\n'
        'client_id = "edge-7.pump"\nkeepalive_s = 240\n'
    )
    transport = build_transports(load_agent_config(path))["mqtt"]
    assert transport.client_id == "edge-7.pump" and transport.keepalive_s == 240


async def test_a_config_file_that_goes_away_is_said_once_and_its_return_reloaded(
    tmp_path, edge_repos, caplog
):
    # Deleting agent.toml under a running agent logged nothing at all.
    import os

    from edge.agent import Agent
    from tests.edge.conftest import agent_toml

    path = agent_toml(tmp_path, edge_repos[1], models='[models.lin]\nlocal = "lin-local"\n')
    text = path.read_text()
    agent = Agent(load_agent_config(path))
    await agent.start()
    try:
        path.unlink()
        for _ in range(3):
            await agent._watch_config()
        assert caplog.text.count("cannot be read: the running config stays in force") == 1
        path.write_text(text + '[models.soft]\nlocal = "soft-local"\n')
        os.utime(path, (7, 7))
        await agent._watch_config()
        assert "soft" in agent.dataplane.policy.config.models
    finally:
        await agent.stop()


@pytest.mark.parametrize("name", ["中文", "a.b/versions/1", "a%2Eb", "a.b?x=1", "#", "x+y"])
@pytest.mark.parametrize("part", ["cloud", "local"])
def test_a_model_name_no_repository_can_hold_is_refused_naming_its_key(tmp_path, part, name):
    # A cloud name went into the URL as it was: '中文' a 500, 'a.b/versions/1' served by
    # model 'a.b', and '#' over MQTT "no node serves it now" for good.
    path = tmp_path / "agent.toml"
    other = "cloud" if part == "local" else "local"
    path.write_text(
        f'repository = "{tmp_path}"\n[models.m]\n{part} = "{name}"\n{other} = "fine"\n'
    )
    with pytest.raises(ConfigError, match=f"key 'models.m.{part}'"):
        load_agent_config(path)
