"""``ferry-cloud auth``: lock a Mosquitto broker down to Ferry's roles.

An open broker lets any client read every device's requests and answers and
pose as a cloud node (DESIGN.md section 2 names the topics).  This module
writes the files that close it, from lists of names:

- ``passwd``: a Mosquitto password file (PBKDF2-SHA512, ``$7$``), written by
  ``mosquitto_passwd -U`` where the tool is installed, else hashed here in the
  same format (the broker accepts both; the tests check it);
- ``acl``: what each role may publish and read (see :func:`acl_text`);
- ``mosquitto.conf``: anonymous clients refused, the two files above,
  ``set_tcp_nodelay true`` and one listener, TLS when certificates are given;
- ``credentials`` (mode 0600): every generated password, and
  ``passwords/<name>.pass`` (0600): one per client, in the form the agent's and
  the node's ``password_file`` keys read.

Passwords are generated here, never taken on a command line (where ``ps``
shows them), never printed, never logged and kept out of reprs.  Running the
command again keeps the passwords of names that are still listed with the
same role, so adding a device does not lock the others out; a name no longer
listed loses its entry (revoked).  Nothing runs at import time.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import hmac
import logging
import os
import re
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from shared.errors import ConfigError
from shared.mqtt import (
    ALERTS_TOPIC,
    CONTROLLER_TOPIC,
    PLACEMENT_TOPIC,
    reply_topic,
    request_topic,
    status_topic,
)

log = logging.getLogger(__name__)

Role = Literal["device", "node", "controller", "viewer"]
ROLES: tuple[Role, ...] = ("device", "node", "controller", "viewer")

#: A user name doubles as a topic level (a node's status topic) and as the user
#: part of an ``mqtt://user@host`` URL: no ``/``, ``+``, ``#``, ``:``, ``@`` or blanks.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")

#: PBKDF2 iterations of mosquitto_passwd 2.0's ``$7$`` hashes.  The broker hashes
#: on every CONNECT, and generated passwords carry 192 random bits, so a larger
#: count would cost connection time without making the hashes harder to invert.
PBKDF2_ITERATIONS = 101
_SALT_BYTES = 12  # as mosquitto_passwd

CONF_NAME = "mosquitto.conf"
PASSWD_NAME = "passwd"
ACL_NAME = "acl"
CREDENTIALS_NAME = "credentials"
PASSWORDS_DIR = "passwords"


@dataclass(frozen=True)
class Principal:
    """One broker user: its name (the MQTT user name), role and password."""

    name: str
    role: Role
    password: str = field(repr=False)


@dataclass(frozen=True)
class TlsFiles:
    """Certificate files for a TLS listener (``cafile`` is needed only for client certs)."""

    cert: Path
    key: Path
    ca: Path | None = None
    #: refuse a client without a certificate the CA signed (else one is only checked)
    require_client_cert: bool = False


@dataclass(frozen=True)
class AuthFiles:
    """Where :func:`write_broker_auth` put things, and what changed."""

    conf: Path
    passwd: Path
    acl: Path
    credentials: Path
    passwords_dir: Path
    principals: tuple[Principal, ...]
    kept: tuple[str, ...]  # names whose earlier password was kept
    removed: tuple[str, ...]  # names in the earlier credentials no longer listed


# ---- names and passwords ------------------------------------------------------------
def check_name(name: str, role: str) -> str:
    """``name`` if it can be both a user name and a topic level, else ConfigError."""
    if not _NAME.fullmatch(name):
        raise ConfigError(
            f"{role} name {name!r}: use 1-64 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit (it becomes an MQTT user name and a topic level)"
        )
    return name


def new_password() -> str:
    """192 random bits, URL-safe so it fits an ``mqtt://user:pass@host`` URL unquoted."""
    return secrets.token_urlsafe(24)


def make_principals(
    devices: Iterable[str],
    nodes: Iterable[str],
    controller: str | Iterable[str] | None = None,
    existing: dict[str, Principal] | None = None,
    viewers: Iterable[str] = (),
) -> list[Principal]:
    """One principal per name, keeping the password of an ``existing`` same-role entry.

    A name may hold only one role: the ACL is per user name, so one name in two
    roles would get the union of both, which no role should have.
    """
    wanted: list[tuple[str, Role]] = [(n, "device") for n in devices]
    wanted += [(n, "node") for n in nodes]
    if controller:  # one name, or several (one places, the others stand by)
        names = [controller] if isinstance(controller, str) else list(controller)
        wanted += [(n, "controller") for n in names]
    wanted += [(n, "viewer") for n in viewers]
    if not wanted:
        raise ConfigError("no broker users: give at least one device, node or controller")
    seen: dict[str, Role] = {}
    principals = []
    for name, role in wanted:
        check_name(name, role)
        if name in seen:
            raise ConfigError(
                f"name {name!r} is listed twice ({seen[name]} and {role}); "
                "every broker user needs a name of its own"
            )
        seen[name] = role
        old = (existing or {}).get(name)
        password = old.password if old is not None and old.role == role else new_password()
        principals.append(Principal(name, role, password))
    return principals


def hash_password(password: str, *, salt: bytes | None = None) -> str:
    """Mosquitto's ``$7$`` hash: PBKDF2-HMAC-SHA512, ``$7$<iterations>$<salt>$<hash>``."""
    salt = secrets.token_bytes(_SALT_BYTES) if salt is None else salt
    digest = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, PBKDF2_ITERATIONS)
    b64 = base64.b64encode
    return f"$7${PBKDF2_ITERATIONS}${b64(salt).decode()}${b64(digest).decode()}"


def verify_password(password: str, encoded: str) -> bool:
    """Whether ``password`` matches a ``$7$`` hash (ours or mosquitto_passwd's)."""
    try:
        _, kind, iterations, salt, digest = encoded.split("$")
        if kind != "7":
            return False
        expected = base64.b64decode(digest, validate=True)
        got = hashlib.pbkdf2_hmac(
            "sha512",
            password.encode(),
            base64.b64decode(salt, validate=True),
            int(iterations),
            len(expected),
        )
    except ValueError:
        return False
    return hmac.compare_digest(got, expected)


def mosquitto_passwd_binary() -> str | None:
    """The ``mosquitto_passwd`` tool, where installed (Debian: /usr/bin)."""
    found = shutil.which("mosquitto_passwd")
    if found:
        return found
    return "/usr/bin/mosquitto_passwd" if Path("/usr/bin/mosquitto_passwd").exists() else None


def password_file_text(
    principals: Sequence[Principal],
    *,
    hasher: Literal["auto", "mosquitto_passwd", "hashlib"] = "auto",
    workdir: Path | None = None,
) -> str:
    """The ``passwd`` file: ``name:$7$...`` lines.

    With ``mosquitto_passwd`` the plain passwords go through a 0600 file in a
    private folder under ``workdir`` (``-U`` hashes it in place), never through
    argv as ``-b`` would, where other local users can read them.
    """
    tool = mosquitto_passwd_binary() if hasher != "hashlib" else None
    if hasher == "mosquitto_passwd" and tool is None:
        raise ConfigError("mosquitto_passwd is not installed (Debian package 'mosquitto')")
    if tool is None:
        return "".join(f"{p.name}:{hash_password(p.password)}\n" for p in principals)
    with tempfile.TemporaryDirectory(dir=workdir, prefix=".ferry-passwd-") as private:
        plain = Path(private) / "passwd"
        _write_private(plain, "".join(f"{p.name}:{p.password}\n" for p in principals), 0o600)
        try:
            done = subprocess.run(
                [tool, "-U", str(plain)], capture_output=True, text=True, timeout=60
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise ConfigError(f"{tool} -U failed: {exc}") from None
        if done.returncode != 0:
            # mosquitto_passwd names the file, never a password, in its messages.
            raise ConfigError(f"{tool} -U failed: {(done.stderr or done.stdout).strip()}")
        text = plain.read_text()
    hashed = [line.split(":", 1) for line in text.splitlines() if line]
    if [name for name, _ in hashed] != [p.name for p in principals] or not all(
        h.startswith("$") for _, h in hashed
    ):
        raise ConfigError(f"{tool} -U wrote a password file this program cannot read")
    log.debug("password hashes written by %s", tool)
    return text


# ---- ACL and listener configuration -----------------------------------------------
def acl_text(principals: Sequence[Principal], transitional: bool = False) -> str:
    """Mosquitto ACL: each role reaches exactly the topics its Ferry program uses.

    - device (edge agent): publishes requests to any model, on its own user's
      request topic only (``.../infer/<user>``: so a node knows who sent one,
      and answers only into that user's replies); reads the nodes' retained
      status (the agent follows it to know whether some live node serves a
      model); reads and writes only its own reply topic (the agent's RTT probe
      publishes to it).  It cannot read other devices' requests.
    - node (``ferry-cloud serve``): reads the request topics (its shared
      subscriptions ``$share/ferry/...``), publishes its forwarded requests on
      its own user's request topic, publishes to the reply topics (a node
      refuses a Response Topic outside the sender's own subtree), publishes its
      own status (also its last will, which the broker checks at CONNECT),
      reads every node's status (what each hosts: it forwards requests for the
      models it does not host and describes them) and the placement.
    - controller: reads every node status, publishes (and reads back) the
      retained placement.

    The edge agent's reply topic is ``ferry/v1/replies/<user>/<client id>``
    when it logs in, so the reply rule is a ``pattern`` on ``%u``: each device
    owns the subtree of its user name, whatever client id it connects with.
    ``use_username_as_clientid`` makes every connection's client id its user
    name, so nobody can take over another client's session (without it a
    device connecting as ``ferry-cloud-<node>`` would knock that node off).
    Mosquitto refuses patterns to user names holding ``+`` or ``#``.

    ``transitional`` also lets devices publish on the plain request topics, for a
    rolling upgrade while agents from before users' own topics remain: those
    topics name no sender, so a node cannot keep replies to their senders then.

    Mosquitto 2.0's acl_file never refuses a SUBSCRIBE (the SUBACK grants it);
    it drops each message the subscriber may not read at delivery.  So nobody
    reads what the rules deny, but a device can still join the nodes' share
    group, where the requests the broker deals to it are dropped (lost, not
    read).  Refusing the subscription itself needs Mosquitto's dynamic
    security plugin (see README, "Locking the broker").
    """
    lines = [
        "# Ferry broker ACL, written by `ferry-cloud auth` (topics: DESIGN.md section 2).",
        "# Topics not granted here are denied; anonymous clients get nothing.",
        "",
        "# Every client may read and write the replies under its own user name: the edge",
        "# agent's reply topic is ferry/v1/replies/<user>/<client id>, and it probes through it.",
        f"pattern readwrite {reply_topic('#', '%u')}",
    ]
    for p in principals:
        lines += ["", f"# {p.role}", f"user {p.name}"]
        if p.role == "device":
            lines += [f"topic write {request_topic('+', p.name)}"]
            if transitional:  # agents from before users' own topics still send on the plain one
                lines += [f"topic write {request_topic('+')}"]
            lines += [f"topic read {status_topic('+')}"]
        elif p.role == "node":
            lines += [
                f"topic read {request_topic('+')}",
                f"topic read {request_topic('+', '+')}",
                # (it forwards a request for a model it does not host, under its own name)
                f"topic write {request_topic('+', p.name)}",
                f"topic write {reply_topic('#')}",
                f"topic write {status_topic(p.name)}",
                # the fleet's: what each node hosts, to forward requests and describe models
                f"topic read {status_topic('+')}",
                f"topic read {PLACEMENT_TOPIC}",
            ]
        elif p.role == "viewer":  # ferry-cloud fleet, a dashboard: reads the fleet, no more
            lines += [
                f"topic read {status_topic('+')}",
                f"topic read {PLACEMENT_TOPIC}",
                f"topic read {CONTROLLER_TOPIC}",
                f"topic read {ALERTS_TOPIC}",
            ]
        else:
            lines += [
                f"topic read {status_topic('+')}",
                f"topic readwrite {PLACEMENT_TOPIC}",
                # who places: read too, so the others stand by (docs/scale-out.md)
                f"topic readwrite {CONTROLLER_TOPIC}",
                f"topic write {ALERTS_TOPIC}",
            ]
    return "\n".join(lines) + "\n"


def mosquitto_conf_text(
    *,
    passwd: Path,
    acl: Path,
    port: int | None = None,
    bind: str | None = None,
    tls: TlsFiles | None = None,
) -> str:
    """A ``mosquitto -c`` file (or a ``conf.d`` drop-in with per_listener_settings false).

    Paths are written absolute: Mosquitto resolves relative ones against its
    working folder, not against the configuration file.
    """
    port = port if port is not None else (8883 if tls else 1883)
    if bind is not None and (not bind or any(c.isspace() for c in bind)):
        raise ConfigError(f"--bind {bind!r}: expected a host name or address")
    files = [passwd, acl, *((tls.cert, tls.key, tls.ca) if tls else ())]
    for path in files:
        if path is not None and any(c in str(path) for c in "\r\n\0"):
            # One option per line: a line break would smuggle in another option.
            raise ConfigError(f"path {str(path)!r}: line breaks cannot go in mosquitto.conf")
    lines = [
        "# Ferry broker configuration, written by `ferry-cloud auth`.",
        "# Run `mosquitto -c` on it, or drop it into /etc/mosquitto/conf.d/.",
        "# Nagle's algorithm turns a 1 KB MQTT v5 round trip from 0.69 ms into 88 ms",
        "# (DESIGN.md section 2): keep TCP_NODELAY on.",
        "set_tcp_nodelay true",
        "# Offloaded tensors are large: 64 MiB, above the servers' default body limit",
        "# (16 MiB), so a request over that limit reaches a node and gets its",
        "# payload_too_large answer instead of vanishing at the broker.",
        "max_packet_size 67108864",
        "max_inflight_messages 0",
        "max_queued_messages 10000",
        "# What the broker holds per client for one that does not read, bounded: a device",
        "# subscribed to its own replies tree that never read grew the broker by all it",
        "# sent there (1.3 GB from 40 messages).  Past it a slow reader's QoS 1 messages",
        "# are dropped (a node's requests then time out at their senders).",
        "max_inflight_bytes 67108864",
        "max_queued_bytes 67108864",
        "",
        "per_listener_settings false",
        "allow_anonymous false",
        f"password_file {passwd.resolve()}",
        f"acl_file {acl.resolve()}",
        "",
        f"listener {port}{' ' + bind if bind else ''}",
        "# A client's id is its user name: nobody can take over another's session (a",
        "# device connecting as ferry-cloud-<node> would otherwise knock that node off).",
        "use_username_as_clientid true",
    ]
    if tls is not None:
        if tls.ca is not None:
            lines.append(f"cafile {tls.ca.resolve()}")
        if tls.require_client_cert:
            lines.append("require_certificate true")
        lines += [f"certfile {tls.cert.resolve()}", f"keyfile {tls.key.resolve()}"]
    return "\n".join(lines) + "\n"


def tls_files(
    cert: Path | None, key: Path | None, ca: Path | None, require_client_cert: bool = False
) -> TlsFiles | None:
    """Check the certificate options; None when none was given (a plain listener)."""
    if require_client_cert and ca is None:
        raise ConfigError("--tls-require-client-cert needs --tls-ca (the CA that signs them)")
    if cert is None and key is None and ca is None:
        return None
    if cert is None or key is None:
        raise ConfigError("a TLS listener needs both --tls-cert and --tls-key")
    for what, path in (("--tls-cert", cert), ("--tls-key", key), ("--tls-ca", ca)):
        if path is not None and not path.is_file():
            raise ConfigError(f"{what}: no such file {str(path)!r}")
    return TlsFiles(cert, key, ca, require_client_cert)


# ---- credentials ------------------------------------------------------------------
def credentials_text(principals: Sequence[Principal]) -> str:
    lines = [
        "# Ferry broker credentials, written by `ferry-cloud auth`. Secret: keep mode 0600.",
        "# role name password  (give each client only its own passwords/<name>.pass)",
    ]
    lines += [f"{p.role} {p.name} {p.password}" for p in principals]
    return "\n".join(lines) + "\n"


def read_credentials(path: Path) -> dict[str, Principal]:
    """The principals of an earlier run (empty when the file does not exist)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    found: dict[str, Principal] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 3 or parts[0] not in ROLES:
            # The line holds a password: name its number, never its text.
            raise ConfigError(f"{path}: line {number}: expected 'role name password'")
        role, name, password = parts
        if not _NAME.fullmatch(name):  # it names a file to delete when revoked
            raise ConfigError(f"{path}: line {number}: bad name {name!r}")
        found[name] = Principal(name, role, password)  # type: ignore[arg-type]
    return found


def _write_private(path: Path, text: str, mode: int) -> None:
    """Write ``text`` atomically; the file never exists with wider permissions."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "w") as out:
            out.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_broker_auth(
    out: Path,
    devices: Sequence[str],
    nodes: Sequence[str],
    controller: str | Iterable[str] | None = None,
    *,
    tls: TlsFiles | None = None,
    port: int | None = None,
    bind: str | None = None,
    hasher: Literal["auto", "mosquitto_passwd", "hashlib"] = "auto",
    transitional: bool = False,
    viewers: Sequence[str] = (),
) -> AuthFiles:
    """Write the broker's password file, ACL, configuration and the credentials into ``out``."""
    if port is not None and not 0 < port < 65536:
        raise ConfigError(f"--port {port}: expected 1-65535")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--out {str(out)!r}: cannot create: {exc.strerror}") from None
    credentials = out / CREDENTIALS_NAME
    previous = read_credentials(credentials)
    principals = make_principals(devices, nodes, controller, previous, viewers)
    names = {p.name for p in principals}
    kept = tuple(p.name for p in principals if p.name in previous and previous[p.name] == p)
    removed = tuple(sorted(set(previous) - names))

    passwd, acl, conf = out / PASSWD_NAME, out / ACL_NAME, out / CONF_NAME
    # Hash first: if that fails, the earlier files all stay as they were.
    passwd_text = password_file_text(principals, hasher=hasher, workdir=out)
    conf_text = mosquitto_conf_text(passwd=passwd, acl=acl, port=port, bind=bind, tls=tls)

    passwords_dir = out / PASSWORDS_DIR
    passwords_dir.mkdir(mode=0o700, exist_ok=True)
    os.chmod(passwords_dir, 0o700)
    _write_private(credentials, credentials_text(principals), 0o600)
    for p in principals:
        _write_private(passwords_dir / f"{p.name}.pass", p.password + "\n", 0o600)
    for name in removed:
        (passwords_dir / f"{name}.pass").unlink(missing_ok=True)
    _write_private(passwd, passwd_text, 0o600)
    _write_private(acl, acl_text(principals, transitional), 0o644)
    _write_private(conf, conf_text, 0o644)
    return AuthFiles(
        conf, passwd, acl, credentials, passwords_dir, tuple(principals), kept, removed
    )


# ---- command line ---------------------------------------------------------------------
def _names(value: str | None) -> list[str]:
    return [n.strip() for n in value.split(",")] if value else []


def add_auth_command(subparsers: argparse._SubParsersAction) -> None:
    """Add ``auth`` to ``ferry-cloud``'s sub-commands."""
    auth = subparsers.add_parser(
        "auth",
        help="write a Mosquitto password file, ACL and config for Ferry's devices and nodes",
    )
    auth.add_argument("--devices", metavar="D1,D2", help="edge devices (MQTT user names)")
    auth.add_argument("--nodes", metavar="N1,N2", help="cloud nodes (user name = node name)")
    auth.add_argument(
        "--controller",
        metavar="C1[,C2]",
        help="placement controller users (one places, the others stand by)",
    )
    auth.add_argument(
        "--viewers",
        metavar="V1,V2",
        help="read-only users for ferry-cloud fleet and dashboards (the controller's own "
        "name would knock the controller off: a client id is its user name)",
    )
    auth.add_argument("--out", type=Path, required=True, metavar="DIR", help="output folder")
    auth.add_argument("--port", type=int, help="listener port (1883; 8883 with TLS)")
    auth.add_argument("--bind", metavar="HOST", help="listener address (default: all)")
    auth.add_argument("--tls-cert", type=Path, metavar="PEM", help="server certificate")
    auth.add_argument("--tls-key", type=Path, metavar="PEM", help="server private key")
    auth.add_argument(
        "--tls-ca",
        type=Path,
        metavar="PEM",
        help="CA that signs client certificates (a client may present one)",
    )
    auth.add_argument(
        "--tls-require-client-cert",
        action="store_true",
        help="refuse clients without a certificate --tls-ca signed (require_certificate)",
    )
    auth.add_argument(
        "--transitional",
        action="store_true",
        help="also let devices publish on the plain request topics (a rolling upgrade: "
        "agents from before per-user topics); run auth again without it once all are new",
    )


def run_auth_command(args: argparse.Namespace) -> int:
    """Write the files and say where they are; the passwords themselves are never printed."""
    tls = tls_files(args.tls_cert, args.tls_key, args.tls_ca, args.tls_require_client_cert)
    files = write_broker_auth(
        args.out,
        _names(args.devices),
        _names(args.nodes),
        _names(args.controller),
        tls=tls,
        port=args.port,
        bind=args.bind,
        transitional=args.transitional,
        viewers=_names(args.viewers),
    )
    new = [p.name for p in files.principals if p.name not in files.kept]
    print(f"ferry-cloud auth: {len(files.principals)} broker users in {files.conf.parent}")
    print(f"  broker config  {files.conf}   (mosquitto -c {files.conf})")
    print(f"  password file  {files.passwd}")
    print(f"  ACL            {files.acl}")
    print(f"  credentials    {files.credentials} (mode 0600)")
    print(f"  per-client     {files.passwords_dir}/<name>.pass -> password_file")
    if files.kept:
        print(f"  kept earlier passwords: {', '.join(files.kept)}")
    if new:
        print(f"  new passwords: {', '.join(new)}")
    if files.removed:
        print(f"  revoked: {', '.join(files.removed)}")
    if os.geteuid() == 0:  # Debian's mosquitto drops to its own user, which must read them
        print(f"  as root: chown mosquitto {files.passwd} {files.acl}  (before mosquitto -c)")
    return 0
