"""Write mosquitto's password file and ACL for the FedARA server and its devices.

    python scripts/mosquitto_credentials.py --out DIR --prefix fedara \
        --server-user server --server-password S --device dev01:P1 --device dev02:P2

Then point mosquitto.conf at DIR/passwd and DIR/acl (password_file / acl_file).
With --enroll-file FILE, also enroll the devices (server/enrollment.py): FILE gets a key per new device id
(enrolled ids keep theirs) and DIR/keys/<id>.key the key to install on each device.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from server.enrollment import enroll_devices  # noqa: E402
from server.mosquitto_config import write_mosquitto_auth  # noqa: E402


def parse_device(spec: str) -> tuple[str, str]:
    """Split "ID:PASSWORD" into (id, password)."""
    device_id, sep, password = spec.partition(":")
    if not sep or not device_id or not password:
        raise argparse.ArgumentTypeError(f"--device expects ID:PASSWORD, got {spec!r}")
    return device_id, password


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="directory for passwd and acl")
    parser.add_argument("--prefix", required=True, help="topic prefix shared by server and devices")
    parser.add_argument("--server-user", required=True)
    parser.add_argument("--server-password", required=True)
    parser.add_argument("--device", action="append", type=parse_device, default=[], metavar="ID:PASS",
                        help="a device's id (its MQTT username) and password; repeat per device")
    parser.add_argument("--enroll-file", type=Path, help="also enroll the devices in this enrollment file")
    args = parser.parse_args(argv)
    devices = dict(args.device)
    if len(devices) != len(args.device):
        parser.error("a device id is given more than once")
    try:
        passwd_file, acl_file = write_mosquitto_auth(args.out, args.server_user, args.server_password,
                                                     devices, args.prefix)
    except ValueError as exc:
        parser.error(str(exc))
    print(f"wrote {passwd_file} and {acl_file} ({len(devices)} devices)")
    if args.enroll_file is not None:
        print(enroll_devices(args.enroll_file, devices, args.out / "keys"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
