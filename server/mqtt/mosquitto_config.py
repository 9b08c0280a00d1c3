"""Mosquitto configuration for FedARA: password file, per-device ACL, mosquitto.conf and TLS material.

The text builders are pure functions; the `write_*` functions put their text on disk, owned by the user
mosquitto drops to (Debian's mosquitto starts as root, switches to user `mosquitto`, then reads the password
file and ACL). Password hashes use mosquitto's own "$7$" format (PBKDF2-SHA512), so no mosquitto_passwd
binary is needed where the credentials are generated.
"""

from __future__ import annotations

import base64
import hashlib
import os
import ipaddress
import secrets
import stat
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from device_runtime.topics import PAYLOAD_LEVEL, Topics, server_subscriptions, update_filter
from device_runtime.transport import OUTBOUND_WINDOW, PACKET_HEADROOM_BYTES

PBKDF2_ITERATIONS = 1000
PBKDF2_SALT_BYTES = 12
MOSQUITTO_HASH_ID = "7"
MAX_QUEUED_MESSAGES = 10_000
PASSWD_FILENAME = "passwd"
ACL_FILENAME = "acl"
CONF_FILENAME = "mosquitto.conf"
PASSWORDS_FILENAME = "passwords"
"""The operator's copy of the plaintext passwords ("user:password" lines), readable by its owner only."""
GENERATED_PASSWORD_BYTES = 18
TLS_DAYS = 825
_FORBIDDEN_USERNAME_CHARS = frozenset(":\n\r\t +#/")


@dataclass(frozen=True)
class TlsFiles:
    """PEM files of a TLS listener: the CA that signed the server certificate, and the server's pair."""

    cafile: Path
    certfile: Path
    keyfile: Path


def mosquitto_password_hash(password: str, salt: bytes | None = None,
                            iterations: int = PBKDF2_ITERATIONS) -> str:
    """Hash `password` the way mosquitto_passwd does: "$7$<iterations>$<b64 salt>$<b64 PBKDF2-SHA512>"."""
    if not password:
        raise ValueError("password must not be empty")
    if iterations < 1:
        raise ValueError(f"iterations must be >= 1, got {iterations}")
    salt = secrets.token_bytes(PBKDF2_SALT_BYTES) if salt is None else salt
    digest = hashlib.pbkdf2_hmac("sha512", password.encode("utf-8"), salt, iterations)
    b64 = base64.b64encode
    return f"${MOSQUITTO_HASH_ID}${iterations}${b64(salt).decode()}${b64(digest).decode()}"


def _check_username(username: str) -> None:
    if not username or _FORBIDDEN_USERNAME_CHARS & set(username):
        raise ValueError(f"invalid MQTT username {username!r}: must be non-empty, without ':', "
                         "whitespace, '/', '+' or '#'")


def password_file_text(users: Mapping[str, str]) -> str:
    """Lines "user:$7$..." for each (username, plaintext password)."""
    for username in users:
        _check_username(username)
    return "".join(f"{user}:{mosquitto_password_hash(pw)}\n" for user, pw in users.items())


def acl_text(prefix: str, server_user: str, device_ids: Iterable[str]) -> str:
    """ACL: the server reads every device's up, update and status topics and writes every down topic, and its
    aggregator processes (``server.aggregator``, connecting as the server user) read the update topics routed to
    them (``PREFIX/dev/+/update/<member>``) and speak with the engine on ``PREFIX/agg/#``; each device user
    (username == device id) writes only its own up/update/status (its update topic and the levels below it, one
    per aggregator) and reads only its own down and the plans' payloads (``PREFIX/payload/#``, which only the server
    writes: device_runtime/payload.py)."""
    _check_username(server_user)
    device_ids = list(device_ids)
    lines = [f"user {server_user}"]
    lines += [f"topic read {topic_filter}" for topic_filter in server_subscriptions(prefix)]
    lines += [f"topic read {update_filter(prefix)}/+", f"topic readwrite {prefix}/agg/#"]
    lines += [f"topic write {Topics(prefix, device_id).down}" for device_id in device_ids]
    lines += [f"topic write {prefix}/{PAYLOAD_LEVEL}/#"]
    for device_id in device_ids:
        topics = Topics(prefix, device_id)
        lines += ["", f"user {device_id}", f"topic write {topics.up}", f"topic write {topics.update}",
                  f"topic write {topics.update}/+", f"topic write {topics.status}", f"topic read {topics.down}",
                  f"topic read {prefix}/{PAYLOAD_LEVEL}/#"]
    return "\n".join(lines) + "\n"


def write_mosquitto_auth(directory: str | os.PathLike[str], server_user: str, server_password: str,
                         devices: Mapping[str, str], prefix: str) -> tuple[Path, Path]:
    """Write mosquitto's password file and ACL file into `directory`; returns (passwd_file, acl_file).

    `devices` maps device id (also its MQTT username) to its password. Both files are mode 0600.
    """
    if server_user in devices:
        raise ValueError(f"server user {server_user!r} collides with a device id")
    users = {server_user: server_password, **devices}
    passwd_text = password_file_text(users)
    acl = acl_text(prefix, server_user, devices)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    return (_write_private(directory / PASSWD_FILENAME, passwd_text),
            _write_private(directory / ACL_FILENAME, acl))


def mosquitto_conf_text(port: int, max_frame_bytes: int, *, persistence_dir: Path | None = None,
                        password_file: Path | None = None, acl_file: Path | None = None,
                        tls: TlsFiles | None = None, run_as_user: str | None = None,
                        bind: str = "127.0.0.1", max_inflight: int = OUTBOUND_WINDOW) -> str:
    """mosquitto.conf for one listener on `bind`:`port` (0.0.0.0: every interface).

    The size limit is `max_packet_size` (mosquitto 2.0 notes that `message_size_limit` should be
    replaced by it): a packet above a frame of `max_frame_bytes` plus topic headroom disconnects its
    sender; what fits is judged by the receivers' own limits (reassembly budget, message size,
    authentication), so at most 64 KiB more per frame gets through. Our clients never send
    such a packet: they check every frame before publishing (a rejected QoS 1 message would be
    re-sent by paho for ever). Anonymous access is allowed only when no password file is given.
    Without `persistence_dir`, sessions live in memory and vanish when the broker stops. `max_inflight`: the
    unacknowledged QoS 1 messages each way, announced to MQTT 5 clients as the broker's Receive Maximum.
    """
    if not 0 < port < 65536:
        raise ValueError(f"port must be in 1..65535, got {port}")
    if max_frame_bytes < 1:
        raise ValueError(f"max_frame_bytes must be positive, got {max_frame_bytes}")
    if acl_file is not None and password_file is None:
        raise ValueError("an acl_file needs a password_file: ACL users are password-file users")
    lines = ["per_listener_settings false",
             f"allow_anonymous {'false' if password_file else 'true'}",
             f"max_packet_size {max_frame_bytes + PACKET_HEADROOM_BYTES}",
             f"max_queued_messages {MAX_QUEUED_MESSAGES}",
             f"max_inflight_messages {max_inflight}",
             "set_tcp_nodelay true",
             "log_dest stderr",
             "log_type error",
             "log_type warning"]
    if run_as_user is not None:
        lines.append(f"user {run_as_user}")
    if persistence_dir is None:
        lines.append("persistence false")
    else:
        lines += ["persistence true", f"persistence_location {Path(persistence_dir).resolve()}/"]
    if password_file is not None:
        lines.append(f"password_file {Path(password_file).resolve()}")
    if acl_file is not None:
        lines.append(f"acl_file {Path(acl_file).resolve()}")
    lines.append(f"listener {port} {bind}")
    if tls is not None:
        lines += [f"cafile {tls.cafile.resolve()}", f"certfile {tls.certfile.resolve()}",
                  f"keyfile {tls.keyfile.resolve()}", "require_certificate false"]
    return "\n".join(lines) + "\n"


def write_mosquitto_conf(path: str | os.PathLike[str], port: int, max_frame_bytes: int, *,
                         persistence_dir: Path | None = None, password_file: Path | None = None,
                         acl_file: Path | None = None, tls: TlsFiles | None = None,
                         run_as_user: str | None = None, bind: str = "127.0.0.1",
                         max_inflight: int = OUTBOUND_WINDOW) -> Path:
    """Write `mosquitto_conf_text(...)` to `path` and return it."""
    text = mosquitto_conf_text(port, max_frame_bytes, persistence_dir=persistence_dir,
                               password_file=password_file, acl_file=acl_file, tls=tls,
                               run_as_user=run_as_user, bind=bind, max_inflight=max_inflight)
    return _write_private(Path(path), text)


@dataclass(frozen=True)
class Owner:
    """The user and group a file is handed to (mosquitto's, so that it can read it after dropping root)."""

    uid: int
    gid: int


@dataclass(frozen=True)
class MosquittoSetup:
    """What write_mosquitto_setup wrote."""

    conf: Path
    passwd: Path
    acl: Path
    passwords: Path
    tls: TlsFiles | None


def generate_password() -> str:
    """A random password for an MQTT user (URL-safe, 24 characters)."""
    return secrets.token_urlsafe(GENERATED_PASSWORD_BYTES)


def parse_passwords(text: str, source: str) -> dict[str, str]:
    """The users and passwords of "user:password" lines (blank lines and # comments skipped); raises ValueError
    naming ``source`` and the line that is not of that form."""
    users: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        user, sep, password = line.partition(":")
        if not sep or not user or not password:
            raise ValueError(f"{source} line {number}: expected user:password")
        users[user] = password
    return users


def passwords_text(users: Mapping[str, str]) -> str:
    """ "user:password" lines, the format parse_passwords reads back."""
    return "".join(f"{user}:{password}\n" for user, password in users.items())


def unreadable_ancestor(path: Path, uid: int, gids: Iterable[int]) -> Path | None:
    """The first folder above ``path`` (or ``path`` itself) that user ``uid`` with groups ``gids`` cannot enter;
    None when it can reach ``path``."""
    gids = set(gids)
    for folder in [*reversed(Path(path).resolve().parents), Path(path).resolve()]:
        if not folder.exists():
            break
        info = folder.stat()
        if info.st_uid == uid:
            allowed = info.st_mode & stat.S_IXUSR
        elif info.st_gid in gids:
            allowed = info.st_mode & stat.S_IXGRP
        else:
            allowed = info.st_mode & stat.S_IXOTH
        if uid != 0 and not allowed:
            return folder
    return None


def make_tls(directory: Path, host: str, owner: Owner | None) -> TlsFiles:
    """Make a CA (ca.pem; its key ca.key stays private to the caller) and a broker certificate for ``host``
    (an IP address or a DNS name) that it signed, with the openssl CLI. Devices verify the broker with ca.pem."""
    ca_key, ca_cert = directory / "ca.key", directory / "ca.pem"
    key, csr, cert = directory / "broker.key", directory / "broker.csr", directory / "broker.pem"
    try:
        ipaddress.ip_address(host)
        san = f"subjectAltName=IP:{host}"
    except ValueError:
        san = f"subjectAltName=DNS:{host}"
    curve = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl("req", "-x509", *curve, "-keyout", ca_key, "-out", ca_cert, "-days", TLS_DAYS,
             "-subj", "/CN=FedARA broker CA", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign")
    _openssl("req", *curve, "-keyout", key, "-out", csr, "-subj", f"/CN={host}")
    _openssl("x509", "-req", "-in", csr, "-CA", ca_cert, "-CAkey", ca_key, "-CAcreateserial", "-out", cert,
             "-days", TLS_DAYS, "-extfile", "/dev/stdin", stdin=san + "\n")
    csr.unlink()
    directory.joinpath("ca.srl").unlink(missing_ok=True)
    for path, mode in ((ca_key, 0o600), (ca_cert, 0o644), (key, 0o600), (cert, 0o644)):
        os.chmod(path, mode)
    _hand_over(key, owner)
    return TlsFiles(cafile=ca_cert, certfile=cert, keyfile=key)


def _openssl(*args: object, stdin: str | None = None) -> None:
    done = subprocess.run(["openssl", *map(str, args)], input=stdin, capture_output=True, text=True)
    if done.returncode != 0:
        raise OSError(f"openssl {args[0]} failed: {done.stderr.strip()}")


def write_mosquitto_setup(directory: str | os.PathLike[str], *, server_user: str, passwords: Mapping[str, str],
                          device_ids: Iterable[str], prefix: str, port: int, bind: str, max_frame_bytes: int,
                          run_as_user: str | None, owner: Owner | None, tls_host: str | None = None
                          ) -> MosquittoSetup:
    """Write a complete broker set-up into ``directory``: mosquitto.conf, passwd, acl (handed to ``owner``,
    mode 0600, so mosquitto can read them after dropping to ``run_as_user``), TLS material for ``tls_host``
    when given, and the operator's plaintext ``passwords`` (0600, kept by the caller).

    ``passwords`` holds every user's password: ``server_user``'s and each of ``device_ids``'.
    """
    device_ids = list(device_ids)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o755)
    passwd, acl = write_mosquitto_auth(directory, server_user, passwords[server_user],
                                       {d: passwords[d] for d in device_ids}, prefix)
    tls = make_tls(directory, tls_host, owner) if tls_host is not None else None
    conf = write_mosquitto_conf(directory / CONF_FILENAME, port, max_frame_bytes, password_file=passwd,
                                acl_file=acl, tls=tls, run_as_user=run_as_user, bind=bind)
    for path in (passwd, acl, conf):
        _hand_over(path, owner)
    operator_copy = _write_private(directory / PASSWORDS_FILENAME,
                                   passwords_text({u: passwords[u] for u in (server_user, *device_ids)}))
    return MosquittoSetup(conf=conf, passwd=passwd, acl=acl, passwords=operator_copy, tls=tls)


def _hand_over(path: Path, owner: Owner | None) -> None:
    if owner is not None:
        os.chown(path, owner.uid, owner.gid)


def _write_private(path: Path, text: str) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(text)
    os.chmod(path, 0o600)
    return path
