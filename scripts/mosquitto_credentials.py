"""Write a complete mosquitto set-up for a FedARA federation: mosquitto.conf, passwd, acl (and TLS material).

    sudo .venv/bin/python scripts/mosquitto_credentials.py --out /etc/mosquitto/fedara --devices 5
    sudo /usr/sbin/mosquitto -c /etc/mosquitto/fedara/mosquitto.conf

Every device logs in as its device id (dev_000, dev_001, ... as python -m server.shards names their shards, or
--device-id ID repeated) and may use only its own topics; the server logs in as --server-user. Passwords: the
server's from $FEDARA_MQTT_PASSWORD, any user's from --passwords FILE ("user:password" lines), the rest
generated. All of them are written to OUT/passwords (mode 0600, for the operator; pass it as --passwords to
keep them when running this again). Run as root, the files mosquitto reads are handed to --user (Debian's
mosquitto starts as root and drops to user `mosquitto` before reading them). The command prints how to start
mosquitto and how to run the server and a device against it. It also enrolls the devices (server/mqtt/enrollment.py):
OUT/enrollment.json (the server's --enroll; devices already enrolled keep their keys) and OUT/keys/<id>.key (each
device's --key-file, to install on that device only).
"""
from __future__ import annotations

import argparse
import grp
import os
import pwd
import shutil
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from device_runtime.framing import DEFAULT_MAX_FRAME_BYTES  # noqa: E402
from device_runtime.help_format import DefaultsHelpFormatter  # noqa: E402
from device_runtime.messages import DEFAULT_TOPIC_PREFIX  # noqa: E402
from server.mqtt.mosquitto_config import (PASSWORDS_FILENAME, MosquittoSetup, Owner, generate_password,  # noqa: E402
                                     parse_passwords, unreadable_ancestor, write_mosquitto_setup)
from server.mqtt.enrollment import LOCAL_ENROLLMENT, LOCAL_KEYS_DIR, enroll_devices  # noqa: E402
from server.data.shards import DEVICE_ID  # noqa: E402

PASSWORD_ENV = "FEDARA_MQTT_PASSWORD"
DEMO_TRAINING = "--rounds 5 --local-epochs 1"
"""The printed server command's training: a first run in minutes (the paper's is 100 rounds of 5 epochs)."""
EXIT_BAD_INPUT = 2
ALL_INTERFACES = "0.0.0.0"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="scripts/mosquitto_credentials.py", description=__doc__.splitlines()[0],
                                formatter_class=DefaultsHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="folder for mosquitto.conf, passwd, acl, passwords")
    p.add_argument("--devices", type=int, default=0, help="devices dev_000 .. dev_{N-1}")
    p.add_argument("--device-id", action="append", default=[], metavar="ID",
                   help="a further device id (its MQTT username); repeat per device")
    p.add_argument("--passwords", type=Path, default=None,
                   help="user:password lines to use (default: $FEDARA_MQTT_PASSWORD for the server, others generated)")
    p.add_argument("--server-user", default="server", help="the server's MQTT username (its --username)")
    p.add_argument("--prefix", default=DEFAULT_TOPIC_PREFIX, help="topic prefix of server and devices (--prefix)")
    p.add_argument("--bind", default=ALL_INTERFACES, help="address the listener binds (127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=None, help="listener port (default: 1883, or 8883 with --tls-host)")
    p.add_argument("--tls-host", default=None,
                   help="make a CA and a broker certificate for this host name or IP and listen with TLS only")
    p.add_argument("--user", default="mosquitto", help="the user mosquitto drops to (its conf's `user`)")
    p.add_argument("--max-message-bytes", type=int, default=DEFAULT_MAX_FRAME_BYTES,
                   help="frames the broker must take (server's and devices' --max-message-bytes or more); its "
                        "max_packet_size is this plus 64 KiB for the MQTT header and topic")
    return p


def device_ids(args: argparse.Namespace) -> list[str]:
    """dev_000 .. for --devices, then every --device-id; raises ValueError when none or one repeats."""
    ids = [DEVICE_ID.format(i) for i in range(args.devices)] + args.device_id
    if not ids:
        raise ValueError("no devices: pass --devices N or --device-id ID")
    repeated = sorted({d for d in ids if ids.count(d) > 1})
    if repeated:
        raise ValueError(f"device ids given more than once: {repeated}")
    if args.server_user in ids:
        raise ValueError(f"--server-user {args.server_user} is also a device id")
    return ids


def resolve_passwords(args: argparse.Namespace, users: list[str]) -> tuple[dict[str, str], list[str]]:
    """Every user's password and the users whose password was generated here."""
    given = parse_passwords(args.passwords.read_text(), f"--passwords {args.passwords}") if args.passwords else {}
    if os.environ.get(PASSWORD_ENV) and args.server_user not in given:
        given[args.server_user] = os.environ[PASSWORD_ENV]
    generated = [u for u in users if u not in given]
    return {u: given[u] if u in given else generate_password() for u in users}, generated


def owner_of(user: str) -> tuple[Owner, set[int]]:
    """uid/gid of ``user`` and every group it is in; raises ValueError when there is no such user."""
    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        raise ValueError(f"--user {user}: no such user here (install Debian's mosquitto, which creates it, "
                         f"or name the user your mosquitto runs as)") from None
    groups = {g.gr_gid for g in grp.getgrall() if user in g.gr_mem} | {entry.pw_gid}
    return Owner(entry.pw_uid, entry.pw_gid), groups


def instructions(setup: MosquittoSetup, args: argparse.Namespace, port: int, devices: list[str],
                 generated: list[str]) -> str:
    """What to run next: mosquitto on the set-up, the server and a device against it."""
    host = args.tls_host or (socket.gethostname() if args.bind == ALL_INTERFACES else args.bind)
    url = f"{'mqtts' if setup.tls else 'mqtt'}://{host}:{port}"
    tls = f" --tls-ca {setup.tls.cafile}" if setup.tls else ""
    secret = f"$(grep '^{{user}}:' {setup.passwords} | cut -d: -f2-)"
    lines = [f"wrote {setup.conf}, {setup.passwd}, {setup.acl} ({len(devices)} devices)"]
    if setup.tls:
        lines.append(f"wrote {setup.tls.cafile} (give it to every device), {setup.tls.certfile}, {setup.tls.keyfile}")
    lines += [f"wrote {setup.passwords} (mode 0600): every user's password"
              + (f", generated for {', '.join(generated)}" if generated else ""),
              "",
              "Start mosquitto on it (as root; it drops to user "
              f"{args.user} as its conf says):",
              f"  sudo /usr/sbin/mosquitto -c {setup.conf}",
              f"Run the server against it (it starts when all {len(devices)} enrolled devices have joined; "
              f"--dataset as the devices' shards; each run gets a new folder under runs/):",
              f"  FEDARA_MQTT_PASSWORD={secret.format(user=args.server_user)} .venv/bin/python -m server.broker_loop "
              f"--broker {url} --username {args.server_user}{tls} --prefix {args.prefix} "
              f"--min-devices {len(devices)} --enroll {args.out / LOCAL_ENROLLMENT} --dataset fmnist "
              f"{DEMO_TRAINING}",
              f"  # a short demo: for a real run drop {DEMO_TRAINING} (the paper's 100 rounds of 5 epochs) and set "
              f"--min-devices to the devices a round needs",
              f"Run device {devices[0]} (its username is its id; its shard from python -m server.shards):",
              f"  FEDARA_MQTT_PASSWORD={secret.format(user=devices[0])} .venv/bin/python -m device_runtime "
              f"--broker {url} --device-id {devices[0]}{tls} --prefix {args.prefix} "
              f"--data shards/{devices[0]}.npz --workdir devices/{devices[0]} "
              f"--key-file {args.out / LOCAL_KEYS_DIR / devices[0]}.key"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    port = args.port or (8883 if args.tls_host else 1883)
    try:
        if not 0 < port < 65536:
            raise ValueError(f"--port must be in 1..65535, got {port}")
        if args.tls_host and shutil.which("openssl") is None:
            raise ValueError("--tls-host needs the openssl command (Debian package 'openssl')")
        devices = device_ids(args)
        passwords, generated = resolve_passwords(args, [args.server_user, *devices])
        owner = None
        if os.geteuid() == 0:
            owner, groups = owner_of(args.user)
            blocked = unreadable_ancestor(args.out, owner.uid, groups)
            if blocked is not None:
                raise ValueError(f"--out {args.out}: user {args.user} cannot enter {blocked} (mode "
                                 f"{blocked.stat().st_mode & 0o777:o}), so mosquitto could not read its files; "
                                 f"choose a folder it can reach, e.g. /etc/mosquitto/fedara")
        setup = write_mosquitto_setup(args.out, server_user=args.server_user, passwords=passwords,
                                      device_ids=devices, prefix=args.prefix, port=port, bind=args.bind,
                                      max_frame_bytes=args.max_message_bytes,
                                      run_as_user=args.user if owner else None, owner=owner, tls_host=args.tls_host)
        enrolled = enroll_devices(args.out / LOCAL_ENROLLMENT, devices, args.out / LOCAL_KEYS_DIR)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(enrolled)
    print(instructions(setup, args, port, devices, generated))
    if owner is None:
        print(f"(not root: the files stay yours and mosquitto started by you reads them; {PASSWORDS_FILENAME} "
              f"holds the passwords)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
