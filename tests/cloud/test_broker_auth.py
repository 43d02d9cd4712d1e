"""``ferry-cloud auth`` against a real Mosquitto: who may connect, publish and read what.

Every test starts the broker on the configuration the generator wrote (plus
``user root`` when the tests run as root, since Mosquitto would otherwise
drop to a user that cannot read pytest's 0700 folders) and asserts on what
the broker really answers: CONNACK, SUBACK and PUBACK reason codes, and which
messages are delivered.

What Mosquitto 2.0's ``acl_file`` really does, as measured here: a denied
PUBLISH gets PUBACK 0x87 and goes nowhere; a SUBSCRIBE is never refused (the
SUBACK grants it, see eclipse/mosquitto#744), the ACL filters each message
at delivery instead, so a subscription to a topic the client may not read
stays empty.  A last will is not checked at CONNECT but when it is published.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import ssl
import stat
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.reasoncodes import ReasonCode

from cloud import broker_auth
from cloud.broker_auth import AuthFiles, Principal, write_broker_auth
from cloud.cli import main as cloud_main
from edge.transports.mqtt import MqttTransport
from shared.errors import ConfigError
from shared.messages import InferRequest
from shared.mqtt import (
    ALERTS_TOPIC,
    CONTROLLER_TOPIC,
    PLACEMENT_TOPIC,
    BrokerAddress,
    reply_topic,
    request_topic,
    shared_request_topics,
    status_topic,
)
from shared.tensors import Tensor
from tests.support import (
    ROOT,
    cloud_server,
    free_port,
    linear_reference,
    make_test_ca,
    mosquitto_binary,
    wait_port,
    write_linear_model,
)

NOT_AUTHORIZED = 0x87
#: SUBACK of any QoS 1 subscription, allowed or not: acl_file filters at delivery
SUBSCRIBED = 1
ACCEPTED = 0  # PUBACK 0x00 success or 0x10 no matching subscribers
BAD_CREDENTIALS = 0x86
DEVICES = ["dev-a", "dev-b"]
NODE = "node-1"
CONTROLLER = "ctl"


# ---- a broker on the generated configuration -------------------------------------------
class AuthBroker:
    """Mosquitto run on ``files.conf`` as written, on its loopback port."""

    def __init__(self, files: AuthFiles, port: int) -> None:
        self.files = files
        self.port = port
        self.workdir = files.conf.parent
        self.proc: subprocess.Popen[bytes] | None = None
        self.users = {p.name: p for p in files.principals}

    def start(self) -> AuthBroker:
        conf = self.files.conf
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            conf = self.workdir / "run-as-root.conf"
            conf.write_text(self.files.conf.read_text() + "user root\n")
        self.log = self.workdir / "mosquitto.log"
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [mosquitto_binary(), "-c", str(conf)], stdout=log, stderr=subprocess.STDOUT
            )
        try:
            wait_port(self.port)
        except TimeoutError:
            self.stop()
            raise RuntimeError("mosquitto did not start:\n" + self.log.read_text()) from None
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def password(self, name: str) -> str:
        return self.users[name].password


def _generate(out: Path, **kwargs: Any) -> tuple[AuthFiles, int]:
    port = free_port()
    files = write_broker_auth(
        out, DEVICES, [NODE], CONTROLLER, port=port, bind="127.0.0.1", **kwargs
    )
    return files, port


@pytest.fixture
def locked(tmp_path: Path) -> Iterator[AuthBroker]:
    files, port = _generate(tmp_path / "auth")
    broker = AuthBroker(files, port).start()
    yield broker
    broker.stop()


# ---- a synchronous MQTT v5 client that records every acknowledgement -----------------
class Peer:
    def __init__(
        self,
        broker: AuthBroker,
        username: str | None,
        password: str | None = None,
        *,
        client_id: str = "",
        ca_file: Path | None = None,
        will_topic: str | None = None,
    ) -> None:
        self.client = mqtt.Client(
            callback_api_version=mqtt.CallbackAPIVersion.VERSION2,
            client_id=client_id or f"peer-{uuid.uuid4().hex[:8]}",
            protocol=mqtt.MQTTv5,
        )
        if username is not None:
            self.client.username_pw_set(username, password)
        if ca_file is not None:
            self.client.tls_set(ca_certs=str(ca_file))
        if will_topic is not None:
            self.client.will_set(will_topic, b'{"state": "offline"}', qos=1, retain=True)
        self.broker = broker
        self.connack: ReasonCode | None = None
        self.subacks: dict[int, list[ReasonCode]] = {}
        self.pubacks: dict[int, ReasonCode] = {}
        self.messages: list[mqtt.MQTTMessage] = []
        self._lock = threading.Lock()
        self.client.on_connect = self._on_connect
        self.client.on_subscribe = self._on_subscribe
        self.client.on_publish = self._on_publish
        self.client.on_message = self._on_message

    def _on_connect(self, client: Any, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        self.connack = reason
        if reason.is_failure:
            client.disconnect()  # no reconnect loop against a broker that said no

    def _on_subscribe(self, client: Any, userdata: Any, mid: int, reasons: Any, props: Any) -> None:
        self.subacks[mid] = list(reasons)

    def _on_publish(self, client: Any, userdata: Any, mid: int, reason: Any, props: Any) -> None:
        self.pubacks[mid] = reason

    def _on_message(self, client: Any, userdata: Any, message: mqtt.MQTTMessage) -> None:
        with self._lock:
            self.messages.append(message)

    def connect(self) -> ReasonCode:
        self.client.connect("127.0.0.1", self.broker.port)
        self.client.loop_start()
        _wait(lambda: self.connack is not None, "no CONNACK")
        assert self.connack is not None
        return self.connack

    def subscribe(self, topic: str) -> int:
        """The SUBACK reason code's value (1: granted QoS 1, 0x87: not authorized)."""
        _, mid = self.client.subscribe(topic, qos=1)
        _wait(lambda: mid in self.subacks, f"no SUBACK for {topic}")
        (code,) = self.subacks[mid]
        return code.value

    def publish(self, topic: str, payload: bytes, retain: bool = False) -> int:
        """The PUBACK reason code's value (QoS 1): 0 or 0x10 (accepted, no subscriber
        yet) is ACCEPTED, 0x87 is not authorized."""
        info = self.client.publish(topic, payload, qos=1, retain=retain)
        _wait(lambda: info.mid in self.pubacks, f"no PUBACK for {topic}")
        code = self.pubacks[info.mid].value
        return ACCEPTED if code in (0x00, 0x10) else code

    def ask(self, topic: str, payload: bytes, response_topic: str, correlation: bytes) -> int:
        """Publish a request (QoS 1) naming ``response_topic``; the PUBACK as publish()."""
        from paho.mqtt.properties import Properties

        props = Properties(PacketTypes.PUBLISH)
        props.ResponseTopic, props.CorrelationData = response_topic, correlation
        info = self.client.publish(topic, payload, qos=1, properties=props)
        _wait(lambda: info.mid in self.pubacks, f"no PUBACK for {topic}")
        code = self.pubacks[info.mid].value
        return ACCEPTED if code in (0x00, 0x10) else code

    def payloads(self, topic: str | None = None) -> list[bytes]:
        with self._lock:
            return [m.payload for m in self.messages if topic is None or m.topic == topic]

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def _wait(cond: Any, what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(what)
        time.sleep(0.01)


def _peer(broker: AuthBroker, name: str, **kwargs: Any) -> Peer:
    peer = Peer(broker, name, broker.password(name), **kwargs)
    code = peer.connect()
    assert not code.is_failure, f"{name} refused: {code}"
    return peer


def _connack(broker: AuthBroker, username: str | None, password: str | None, **kw: Any) -> Any:
    peer = Peer(broker, username, password, **kw)
    try:
        return peer.connect()
    finally:
        peer.close()


# ---- tests ---------------------------------------------------------------------------
def test_a_device_publishes_a_request_and_the_node_receives_it(locked):
    node = _peer(locked, NODE, will_topic=status_topic(NODE))  # will checked at CONNECT
    device = _peer(locked, "dev-a", client_id="ferry-edge-aaaa")
    try:
        for topic in shared_request_topics("linear"):
            assert node.subscribe(topic) == SUBSCRIBED
        assert node.publish(status_topic(NODE), b'{"state": "online"}', retain=True) == ACCEPTED
        assert device.subscribe(status_topic("+")) == SUBSCRIBED  # the agent follows them
        assert device.publish(request_topic("linear", "dev-a"), b"request") == ACCEPTED
        _wait(lambda: node.payloads() == [b"request"], "the node got no request")
        _wait(lambda: device.payloads() == [b'{"state": "online"}'], "no retained status")
        # Only under its own name: a node takes the sender from the topic, so a request
        # on the plain topic or another user's would let it pose as someone else.
        assert device.publish(request_topic("linear"), b"plain") == NOT_AUTHORIZED
        assert device.publish(request_topic("linear", "dev-b"), b"posing") == NOT_AUTHORIZED
        # a node forwards under its own name
        assert node.publish(request_topic("linear", NODE), b"forwarded") == ACCEPTED
        _wait(lambda: b"forwarded" in node.payloads(), "the forwarded request got nowhere")
    finally:
        device.close()
        node.close()


def test_another_devices_reply_topic_is_refused(locked):
    a_topic = reply_topic("ferry-edge-aaaa", "dev-a")
    b_topic = reply_topic("ferry-edge-bbbb", "dev-b")
    node = _peer(locked, NODE)
    a = _peer(locked, "dev-a", client_id="ferry-edge-aaaa")
    b = _peer(locked, "dev-b", client_id="ferry-edge-bbbb")
    try:
        assert a.subscribe(a_topic) == SUBSCRIBED
        assert b.subscribe(b_topic) == SUBSCRIBED
        # B asks for A's replies, directly and by wildcards.  The SUBACK grants
        # them (acl_file does not check SUBSCRIBE); what matters is delivery, below.
        assert b.subscribe(a_topic) == SUBSCRIBED
        assert b.subscribe(reply_topic("#")) == SUBSCRIBED
        assert b.subscribe(reply_topic("+")) == SUBSCRIBED
        assert b.subscribe("#") == SUBSCRIBED
        # B cannot forge a reply to A either.
        assert b.publish(a_topic, b"forged") == NOT_AUTHORIZED
        # The node answers A, then B; B's own reply arriving shows A's had its chance.
        assert node.publish(a_topic, b"for-a") == ACCEPTED
        assert node.publish(b_topic, b"for-b") == ACCEPTED
        _wait(lambda: a.payloads() == [b"for-a"], "A did not get its reply")
        # (B's overlapping subscriptions each get a copy of its own reply)
        _wait(lambda: b"for-b" in b.payloads(), "B did not get its own reply")
        time.sleep(0.2)
        assert set(b.payloads()) == {b"for-b"}
        assert a.payloads() == [b"for-a"]  # and never the forged one
    finally:
        for peer in (a, b, node):
            peer.close()


def test_a_client_id_gains_nothing_and_cannot_take_over_another_session(locked):
    """Replies are bound to the user name (a %u pattern), and every connection's client
    id is its user name: a device posing as A's client id, or as the node's, neither
    reads A's replies nor knocks the node off."""
    a_topic = reply_topic("ferry-edge-aaaa", "dev-a")
    node = _peer(locked, NODE, client_id=f"ferry-cloud-{NODE}")
    a = _peer(locked, "dev-a", client_id="ferry-edge-aaaa")
    sneaky = _peer(locked, "dev-b", client_id=f"ferry-cloud-{NODE}")
    try:
        assert a.subscribe(a_topic) == SUBSCRIBED
        assert sneaky.subscribe(a_topic) == SUBSCRIBED
        assert sneaky.subscribe(reply_topic("#")) == SUBSCRIBED
        assert sneaky.publish(a_topic, b"x") == NOT_AUTHORIZED
        assert node.publish(a_topic, b"for-a") == ACCEPTED  # the node is still connected
        _wait(lambda: a.payloads() == [b"for-a"], "A did not get its reply")
        time.sleep(0.2)
        assert sneaky.payloads() == []
    finally:
        for peer in (sneaky, a, node):
            peer.close()


def test_wrong_password_unknown_user_and_anonymous_are_refused(locked):
    refused = {BAD_CREDENTIALS, NOT_AUTHORIZED}
    assert _connack(locked, "dev-a", "not-the-password").value in refused
    assert _connack(locked, "dev-a", locked.password("dev-b")).value in refused
    assert _connack(locked, "nobody", "whatever").value in refused
    assert _connack(locked, None, None).value in refused
    assert _connack(locked, "dev-a", locked.password("dev-a")).value == 0


def test_a_device_cannot_pose_as_a_node_or_the_controller(locked):
    ctl = _peer(locked, CONTROLLER)
    device = _peer(locked, "dev-a")
    try:
        assert ctl.subscribe(status_topic("+")) == SUBSCRIBED
        assert ctl.subscribe(PLACEMENT_TOPIC) == SUBSCRIBED
        fake = b'{"state": "online", "models": []}'
        assert device.publish(status_topic(NODE), fake, retain=True) == NOT_AUTHORIZED
        assert device.publish(PLACEMENT_TOPIC, b"{}", retain=True) == NOT_AUTHORIZED
        # the controller's own placement goes through (it reads it back, retained)
        assert ctl.publish(PLACEMENT_TOPIC, b'{"v": 1}', retain=True) == ACCEPTED
        _wait(lambda: ctl.payloads(PLACEMENT_TOPIC) == [b'{"v": 1}'], "no placement")
        time.sleep(0.2)
        assert ctl.payloads(status_topic(NODE)) == []
        assert ctl.payloads(PLACEMENT_TOPIC) == [b'{"v": 1}']
        # its status (read back: other controllers stand by) and its alerts; not a device's
        assert ctl.subscribe(CONTROLLER_TOPIC) == SUBSCRIBED
        assert ctl.publish(CONTROLLER_TOPIC, b'{"state": "online"}', retain=True) == ACCEPTED
        assert ctl.publish(ALERTS_TOPIC, b"[]", retain=True) == ACCEPTED
        assert device.publish(CONTROLLER_TOPIC, b'{"state": "offline"}') == NOT_AUTHORIZED
        assert device.publish(ALERTS_TOPIC, b"[]") == NOT_AUTHORIZED
        _wait(lambda: ctl.payloads(CONTROLLER_TOPIC) == [b'{"state": "online"}'], "no status")
    finally:
        device.close()
        ctl.close()


def test_a_device_reads_no_requests_not_even_from_the_share_group(locked):
    """A device may join the nodes' share group (acl_file cannot refuse a SUBSCRIBE)
    but receives none of the requests: the read check drops them at delivery.
    Mosquitto still counts it in the group, so requests it is dealt are lost:
    README "Locking the broker" names this limit."""
    node = _peer(locked, NODE)
    spy = _peer(locked, "dev-b")
    device = _peer(locked, "dev-a")
    try:
        for topic in shared_request_topics("m"):
            assert node.subscribe(topic) == SUBSCRIBED
            assert spy.subscribe(topic) == SUBSCRIBED
        assert spy.subscribe(request_topic("+", "+")) == SUBSCRIBED
        for i in range(10):
            assert device.publish(request_topic("m", "dev-a"), b"%d" % i) == ACCEPTED
        _wait(lambda: len(node.payloads()) >= 1, "the node got no request")
        time.sleep(0.2)
        assert spy.payloads() == []
    finally:
        for peer in (device, spy, node):
            peer.close()


def test_a_node_reads_the_other_nodes_status_to_forward_and_describe(locked):
    # Without the read rule, on a locked broker no node knew what the others hosted:
    # every forwarded request was a 503 and /ready false for models hosted elsewhere.
    reader, other = _peer(locked, NODE), _peer(locked, "dev-a")
    try:
        assert reader.subscribe(status_topic("+")) == SUBSCRIBED
        assert reader.publish(status_topic(NODE), b'{"state": "online"}', retain=True) == ACCEPTED
        _wait(lambda: reader.payloads(status_topic(NODE)), "a node read no status")
    finally:
        reader.close()
        other.close()
    assert (
        "topic read ferry/v1/nodes/+/status"
        in locked.files.acl.read_text().split(f"user {NODE}")[1].split("user ")[0]
    )


def test_a_node_owns_only_its_own_status(locked):
    node = _peer(locked, NODE)
    try:
        assert node.publish(status_topic(NODE), b"ok", retain=True) == ACCEPTED
        assert node.publish(status_topic("node-2"), b"x", retain=True) == NOT_AUTHORIZED
        assert node.publish(PLACEMENT_TOPIC, b"x", retain=True) == NOT_AUTHORIZED
        assert node.publish(request_topic("linear"), b"x") == NOT_AUTHORIZED
        assert node.subscribe(PLACEMENT_TOPIC) == SUBSCRIBED
    finally:
        node.close()


def test_a_nodes_last_will_reaches_only_its_own_status_topic(locked):
    ctl = _peer(locked, CONTROLLER)
    try:
        assert ctl.subscribe(status_topic("+")) == SUBSCRIBED
        for topic in (status_topic("node-2"), status_topic(NODE)):
            node = _peer(locked, NODE, will_topic=topic)  # CONNECT accepts either
            # MQTT v5 DISCONNECT 0x04 asks the broker to publish the will, as a crash would.
            node.client.disconnect(reasoncode=ReasonCode(PacketTypes.DISCONNECT, identifier=4))
            node.client.loop_stop()
        _wait(lambda: ctl.payloads(status_topic(NODE)), "the node's own will never came")
        time.sleep(0.2)
        assert ctl.payloads(status_topic("node-2")) == []
    finally:
        ctl.close()


def test_hashes_made_without_mosquitto_passwd_are_accepted_by_the_broker(tmp_path):
    files, port = _generate(tmp_path / "auth", hasher="hashlib")
    assert all(
        line.split(":", 1)[1].startswith("$7$101$") for line in files.passwd.read_text().split()
    )
    broker = AuthBroker(files, port).start()
    try:
        for name in (*DEVICES, NODE, CONTROLLER):
            assert _connack(broker, name, broker.password(name)).value == 0
        assert _connack(broker, "dev-a", "wrong").value in {BAD_CREDENTIALS, NOT_AUTHORIZED}
    finally:
        broker.stop()


def test_our_hash_check_reads_mosquitto_passwd_output(tmp_path):
    assert broker_auth.mosquitto_passwd_binary(), "mosquitto_passwd is not installed"
    files = write_broker_auth(tmp_path, ["d"], [], hasher="mosquitto_passwd")
    (principal,) = files.principals
    name, encoded = files.passwd.read_text().strip().split(":", 1)
    assert name == "d" and encoded.startswith("$7$")
    assert broker_auth.verify_password(principal.password, encoded)
    assert not broker_auth.verify_password(principal.password + "x", encoded)
    mine = broker_auth.hash_password("secret", salt=b"0123456789ab")
    assert broker_auth.verify_password("secret", mine)


def test_tls_listener_with_certificates_made_now(tmp_path):
    ca, cert, key = make_test_ca(tmp_path / "tls")
    port = free_port()
    files = write_broker_auth(
        tmp_path / "auth",
        ["dev-a"],
        [NODE],
        port=port,
        bind="127.0.0.1",
        tls=broker_auth.tls_files(cert, key, ca),
    )
    conf = files.conf.read_text()
    assert f"certfile {cert.resolve()}" in conf and f"keyfile {key.resolve()}" in conf
    # what the broker holds for a client that does not read is bounded (a device that
    # subscribed to its own replies and never read had grown it to gigabytes)
    assert "max_inflight_bytes 67108864" in conf and "max_queued_bytes 67108864" in conf
    broker = AuthBroker(files, port).start()
    try:
        assert _connack(broker, "dev-a", broker.password("dev-a"), ca_file=ca).value == 0
        refused = _connack(broker, "dev-a", "wrong", ca_file=ca).value
        assert refused in {BAD_CREDENTIALS, NOT_AUTHORIZED}
        assert _connack(broker, None, None, ca_file=ca).value in {BAD_CREDENTIALS, NOT_AUTHORIZED}
        # plain MQTT to the TLS port gets no CONNACK at all
        plain = mqtt.Client(callback_api_version=mqtt.CallbackAPIVersion.VERSION2,
                            protocol=mqtt.MQTTv5)  # fmt: skip
        plain.username_pw_set("dev-a", broker.password("dev-a"))
        codes: list[Any] = []
        plain.on_connect = lambda c, u, f, reason, p: codes.append(reason)
        try:
            plain.connect("127.0.0.1", port)
            for _ in range(10):
                plain.loop(timeout=0.1)
        except (OSError, ssl.SSLError):
            pass
        plain.disconnect()
        assert codes == []
    finally:
        broker.stop()


CLOUD_CLI = [sys.executable, "-m", "cloud.cli"]


def test_fleet_and_the_controller_reach_a_tls_broker_with_a_password_file(tmp_path, capsys):
    """Both took only --broker: no CA, no client certificate, a password only in the URL
    (so in the process list); the controller looped on certificate errors for good."""
    ca, cert, key = make_test_ca(tmp_path / "tls")
    port = free_port()
    files = write_broker_auth(
        tmp_path / "auth",
        ["dev-a"],
        [NODE],
        CONTROLLER,
        port=port,
        bind="127.0.0.1",
        tls=broker_auth.tls_files(cert, key, ca),
        viewers=["dash"],  # fleet's own user: the controller's would knock it off
    )
    broker = AuthBroker(files, port).start()
    configs = {}
    for user in (CONTROLLER, "dash"):
        configs[user] = tmp_path / f"{user}.toml"
        secret = files.passwords_dir / f"{user}.pass"
        configs[user].write_text(
            f'[mqtt]\nurl = "mqtts://localhost:{port}"\nusername = "{user}"\n'
            f'password_file = "{secret}"\nca_file = "{ca}"\nkeepalive_s = 20\n'
        )
    config = configs["dash"]
    (tmp_path / "repo").mkdir()
    controller = subprocess.Popen(
        [*CLOUD_CLI, "controller", "--config", str(configs[CONTROLLER]), "--repository", str(tmp_path / "repo"),
         "--http-port", "-1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
    )  # fmt: skip
    try:
        assert cloud_main(["fleet", "--config", str(config), "--json", "--wait-s", "0.2"]) == 0
        assert "nodes" in json.loads(capsys.readouterr().out)
        # the broker's own log: the controller in, as its user, with the keepalive asked for
        _wait(
            lambda: f"k20, u'{CONTROLLER}'" in broker.log.read_text(errors="replace"),
            "the controller never connected through the TLS broker",
            timeout=30,
        )
        assert cloud_main(["fleet", "--config", str(config), "--wait-s", "0.2"]) == 0
        assert "closing old connection" not in broker.log.read_text(errors="replace")
        # another CA (the server's own certificate would do on Python 3.13, whose
        # default context takes a partial chain: a trusted leaf)
        other_ca, _, _ = make_test_ca(tmp_path / "other-ca")
        config.write_text(config.read_text().replace(f"{ca}", f"{other_ca}"))
        assert cloud_main(["fleet", "--config", str(config), "--wait-s", "0"]) == 2
        assert "did not accept" in capsys.readouterr().err
    finally:
        controller.terminate()
        out, _ = controller.communicate(timeout=30)
        broker.stop()
    assert "CERTIFICATE_VERIFY_FAILED" not in out and secret.read_text().strip() not in out


def test_a_viewer_reads_the_fleet_and_writes_nothing_and_client_certs_can_be_required(
    tmp_path,
):
    ca, cert, key = make_test_ca(tmp_path / "tls")
    files = write_broker_auth(
        tmp_path / "auth",
        [],
        [],
        viewers=["dash"],
        tls=broker_auth.tls_files(cert, key, ca, require_client_cert=True),
    )
    acl = files.acl.read_text().split("user dash\n")[1]
    assert "topic read ferry/v1/placement" in acl and "write" not in acl
    assert "require_certificate true" in files.conf.read_text()
    with pytest.raises(ConfigError, match="needs --tls-ca"):
        broker_auth.tls_files(cert, key, None, require_client_cert=True)


def test_cli_writes_private_files_and_never_prints_a_password(tmp_path, capsys):
    out = tmp_path / "auth"
    rc = cloud_main(
        ["auth", "--devices", "dev-a,dev-b", "--nodes", NODE, "--controller", CONTROLLER,
         "--out", str(out), "--port", "18883"]
    )  # fmt: skip
    printed = capsys.readouterr()
    assert rc == 0, printed.err
    creds = broker_auth.read_credentials(out / "credentials")
    assert sorted(creds) == sorted([*DEVICES, NODE, CONTROLLER])
    assert {p.role for p in creds.values()} == {"device", "node", "controller"}
    mode = lambda p: stat.S_IMODE(p.stat().st_mode)  # noqa: E731
    assert mode(out / "credentials") == 0o600
    assert mode(out / "passwd") == 0o600
    assert mode(out / "passwords") == 0o700
    for name, principal in creds.items():
        own = out / "passwords" / f"{name}.pass"
        assert mode(own) == 0o600 and own.read_text().strip() == principal.password
    public = (
        printed.out
        + printed.err
        + "".join((out / f).read_text() for f in ("passwd", "acl", "mosquitto.conf"))
    )
    for principal in creds.values():
        assert principal.password not in public
        assert principal.password not in repr(principal)
    assert str(out / "credentials") in printed.out
    conf = (out / "mosquitto.conf").read_text().splitlines()
    for line in ("allow_anonymous false", "set_tcp_nodelay true", "listener 18883"):
        assert line in conf
    assert not any(line.startswith(("cafile", "certfile")) for line in conf)


def test_a_second_run_keeps_passwords_and_revokes_names_left_out(tmp_path):
    first = write_broker_auth(tmp_path, ["a", "b"], ["n"], hasher="hashlib")
    before = {p.name: p.password for p in first.principals}
    second = write_broker_auth(tmp_path, ["a", "c"], [], "n", hasher="hashlib")
    after = {p.name: p for p in second.principals}
    assert after["a"].password == before["a"]  # same name, same role: kept
    assert after["n"].role == "controller" and after["n"].password != before["n"]
    assert second.kept == ("a",) and second.removed == ("b",)
    assert not (tmp_path / "passwords" / "b.pass").exists()
    assert [line.split(":")[0] for line in second.passwd.read_text().split()] == ["a", "c", "n"]
    assert "user b\n" not in second.acl.read_text()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--devices", "a/b"], "device name 'a/b'"),
        (["--devices", "a,,b"], "device name ''"),
        (["--devices", "x", "--nodes", "x"], "listed twice"),
        ([], "no broker users"),
        (["--devices", "x", "--tls-key", "k.pem"], "needs both --tls-cert and --tls-key"),
        (["--devices", "x", "--tls-cert", "nope.pem", "--tls-key", "k.pem"], "no such file"),
        (["--devices", "x", "--port", "70000"], "--port 70000"),
        (["--devices", "x", "--bind", "0.0.0.0 allow_anonymous"], "--bind"),
    ],
)
def test_bad_options_are_config_errors(tmp_path, capsys, argv, message):
    assert cloud_main(["auth", "--out", str(tmp_path / "o"), *argv]) == 2
    err = capsys.readouterr().err
    assert "invalid_config" in err and message in err
    assert not (tmp_path / "o" / "credentials").exists()


def test_principal_repr_hides_the_password():
    principal = Principal("d", "device", "hunter2-secret")
    assert "hunter2-secret" not in repr(principal)
    with pytest.raises(ConfigError):
        broker_auth.make_principals(["ok", "bad name"], [])


def _locked_node(locked: AuthBroker, tmp_path: Path) -> tuple[Any, tuple[Any, Any]]:
    """A real node logged in to the locked broker, serving ``linear``; and its (W, b)."""
    weights = write_linear_model(tmp_path / "repo" / "linear" / "1" / "model.onnx")
    cfg = tmp_path / "cloud.toml"
    cfg.write_text(
        f'repository = "{tmp_path / "repo"}"\nnode = "{NODE}"\n[http]\nenabled = false\n'
        f'[mqtt]\nurl = "mqtt://127.0.0.1:{locked.port}"\nusername = "{NODE}"\n'
        f'password_file = "{locked.files.passwords_dir / f"{NODE}.pass"}"\n'
    )
    return cloud_server(tmp_path / "repo", "--config", str(cfg)).start(), weights


async def test_the_real_agent_and_node_work_through_the_locked_broker(locked, tmp_path):
    """The ACL fits what the programs really do: the node's shared subscription,
    will and status; the agent's random client id, reply topic, status and probe."""
    node, (w, b) = _locked_node(locked, tmp_path)
    address = BrokerAddress("127.0.0.1", locked.port, False, "dev-a", locked.password("dev-a"))
    agent = MqttTransport(address)
    try:
        await agent.start()
        assert agent.connected and agent.reply_topic == reply_topic(agent.client_id, "dev-a")
        for _ in range(100):
            if agent.serves("linear"):
                break
            await asyncio.sleep(0.05)
        assert agent.serves("linear"), "the device could not read the node's status"
        assert await agent.probe(time.monotonic() + 5) < 5  # its own reply topic, both ways
        x = np.arange(8, dtype=np.float32).reshape(2, 4)
        request = InferRequest(inputs=[Tensor.from_array("x", x)])
        result = await agent.infer("linear", request, time.monotonic() + 20)
        np.testing.assert_allclose(
            result.response.outputs[0].data, linear_reference(x, w, b), rtol=1e-5
        )
    finally:
        await agent.close()
        node.terminate()


def test_a_device_cannot_aim_a_nodes_replies_outside_its_own_subtree(locked, tmp_path):
    """The node may write every reply topic, and MQTT never says who published: a
    device named another device's reply topic (replies and idempotency keys matched
    to that device's requests) or the node's status topic (its models blanked in the
    fleet view), and the node published there.  It now answers into the sender's
    own subtree only, the sender being the user whose request topic it came on."""
    from shared import envelope
    from shared.envelope import decode_reply

    node, _ = _locked_node(locked, tmp_path)
    a, b = _peer(locked, "dev-a"), _peer(locked, "dev-b")
    a_home, b_home = reply_topic("app", "dev-a"), reply_topic("app", "dev-b")
    x = np.ones((1, 4), np.float32)

    def request(rid: str) -> bytes:
        return envelope.encode_request(InferRequest(inputs=[Tensor.from_array("x", x)], id=rid))

    try:
        assert a.subscribe(a_home) == SUBSCRIBED and b.subscribe(b_home) == SUBSCRIBED
        assert b.subscribe(status_topic("+")) == SUBSCRIBED
        _wait(lambda: b.payloads(status_topic(NODE)), "the node published no status")
        topic = request_topic("linear", "dev-a")
        assert a.ask(topic, request("forged"), b_home, b"c1") == ACCEPTED
        assert a.ask(topic, request("spoof"), status_topic(NODE), b"c2") == ACCEPTED
        assert a.ask(topic, request("mine"), a_home, b"c3") == ACCEPTED
        _wait(lambda: a.payloads(a_home), "the sender's own request got no reply")
        (rid, response) = decode_reply(a.payloads(a_home)[0])
        assert rid == "mine" and response.outputs
        time.sleep(0.3)
        assert b.payloads(b_home) == []
        statuses = b.payloads(status_topic(NODE))
        assert all(s.startswith(b"{") for s in statuses)  # JSON statuses only, no reply
    finally:
        a.close()
        b.close()
        node.terminate()
    assert node.output().count("outside ferry/v1/replies/dev-a/#") == 2


def test_a_transitional_acl_also_grants_devices_the_plain_request_topics():
    from cloud.broker_auth import acl_text

    principals = [Principal("dev-a", "device", "pw"), Principal(NODE, "node", "pw")]
    strict = acl_text(principals).splitlines()
    transitional = acl_text(principals, transitional=True).splitlines()
    plain = f"topic write {request_topic('+')}"
    own = f"topic write {request_topic('+', 'dev-a')}"
    assert own in strict and plain not in strict
    assert own in transitional and plain in transitional


def test_a_node_named_other_than_its_user_and_a_controller_without_the_role_are_told(
    locked, tmp_path
):
    """The broker refused their publishes (PUBACK 0x87) and neither said a word: the node
    was invisible to the fleet, the controller logged placements no node ever read."""
    write_linear_model(tmp_path / "repo" / "linear" / "1" / "model.onnx")
    cfg = tmp_path / "cloud.toml"
    cfg.write_text(
        f'repository = "{tmp_path / "repo"}"\nnode = "elsewhere"\n[http]\nenabled = false\n'
        f'[mqtt]\nurl = "mqtt://127.0.0.1:{locked.port}"\nusername = "{NODE}"\n'
        f'password_file = "{locked.files.passwords_dir / f"{NODE}.pass"}"\n'
    )
    node = cloud_server(tmp_path / "repo", "--config", str(cfg)).start()
    try:
        _wait(lambda: "refused this node's status" in node.output(), node.output(), 20)
    finally:
        node.terminate()
    ctl = tmp_path / "ctl.toml"
    ctl.write_text(
        f'[mqtt]\nurl = "mqtt://127.0.0.1:{locked.port}"\nusername = "{NODE}"\n'
        f'password_file = "{locked.files.passwords_dir / f"{NODE}.pass"}"\n'
    )
    controller = subprocess.Popen(
        [*CLOUD_CLI, "controller", "--config", str(ctl), "--repository", str(tmp_path / "repo"),
         "--http-port", "-1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
    )  # fmt: skip
    try:
        time.sleep(4)
    finally:
        controller.terminate()
        out, _ = controller.communicate(timeout=30)
    assert "the broker refused the controller's publish" in out and "0x87" in out, out


async def test_a_refused_login_is_said_with_its_reason_where_the_agent_shows_its_links(locked):
    """Only "connected": false had shown, and the log said a bare "reason 0x86"."""
    address = BrokerAddress("127.0.0.1", locked.port, False, "dev-a", "wrong")
    agent = MqttTransport(address)
    try:
        await agent.start(wait_s=1.0)
        assert not agent.connected
        assert agent.last_error is not None
        assert (
            "bad user name or password" in agent.last_error or "not authorized" in agent.last_error
        )
    finally:
        await agent.close()
