"""Enrollment: which device ids the server admits, and each one's secret key.

The enrollment file (JSON, mode 0600) maps device ids to 32-byte keys in hex:

    {"version": 1, "devices": {"dev_000": "<64 hex digits>", ...}, "server_key": "<64 hex digits>"}

The server key seals what the round engine and its aggregator processes (``server/aggregator.py``) say to each
other over the broker: no device holds it. It is made when the file is first written and kept on every rewrite.

Each device holds only its own key, in a key file of 64 hex digits (``--key-file`` of the device). The server
is started with ``--enroll FILE`` and admits exactly those ids; ``--enroll open`` admits any id, all under one
shared run key (``--run-key FILE``), and says so loudly in its log.

Open mode uses a shared key rather than trust on first use. Trust on first use on an open broker gives a key to
whoever speaks first, and the key would cross the broker in the clear, so anyone who captured that first JOIN
could forge the device later. A shared key keeps outsiders out (without it nothing is accepted, replays
included), but every holder of it can speak for every device id: open mode is for a lab whose devices are all
trusted, never for devices that might turn hostile.

Key rotation (one device): ``python -m server.enrollment rotate FILE --keys-dir DIR ID`` writes a new key for
ID into FILE and DIR/ID.key; install that key file on the device and restart the server and the device. Messages
under the old key are refused from then on. Counters need no reset: they depend on the device's epoch, not its
key, and keep increasing.
Revocation: ``python -m server.enrollment revoke FILE ID`` removes ID and restart the server; every message of
ID is then refused as unknown_device, whatever key it carries. Rotating the shared run key of open mode means a
new key file on the server and every device.
"""
from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

from device_runtime.atomic_file import write_atomic
from device_runtime.auth import KeyRing, new_key, parse_key, read_key_file, write_json_atomic
from device_runtime.help_format import CommandParser
from device_runtime.protocol import check_device_id

LOG = logging.getLogger("fedara.enrollment")
ENROLL_OPEN = "open"
FILE_VERSION = 1
KEY_FILE_SUFFIX = ".key"


class EnrollmentError(ValueError):
    """An enrollment or key file that cannot be used; the message names the file and the fix."""


def load_enrollment(path: str | Path) -> dict[str, bytes]:
    """The enrolled ids and their keys from ``path``."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise EnrollmentError(f"enrollment file {path} does not exist: write it with scripts/mosquitto_credentials.py "
                              "--out DIR --device-id ID (it writes DIR/enrollment.json) or python -m server.enrollment "
                              "add FILE ID --keys-dir DIR, or pass --enroll open") from None
    except (OSError, ValueError) as exc:
        raise EnrollmentError(f"enrollment file {path} is unreadable: {exc}") from None
    if not isinstance(data, dict) or data.get("version") != FILE_VERSION or not isinstance(data.get("devices"), dict):
        raise EnrollmentError(f"enrollment file {path}: expected {{\"version\": {FILE_VERSION}, \"devices\": {{...}}}}")
    return {_checked_id(device_id, path): parse_key(key, f"{path}: key of {device_id!r}")
            for device_id, key in data["devices"].items()}


def save_enrollment(path: str | Path, keys: Mapping[str, bytes]) -> Path:
    """Write ``keys`` as the enrollment file ``path`` (mode 0600, atomically), with the file's server key (a
    fresh one when it has none yet)."""
    path = Path(path)
    try:
        server = load_server_key(path).hex()
    except EnrollmentError:
        server = new_key().hex()
    write_json_atomic(path, {"version": FILE_VERSION, "devices": {d: k.hex() for d, k in sorted(keys.items())},
                             "server_key": server})
    return path


def load_server_key(path: str | Path) -> bytes:
    """The server key of the enrollment file ``path`` (what the engine and its aggregators seal with)."""
    path = Path(path)
    load_enrollment(path)
    data = json.loads(path.read_text())
    if "server_key" not in data:
        raise EnrollmentError(f"enrollment file {path} has no server key (it predates aggregators): rewrite it with "
                              f"python -m server.enrollment add {path} ID --keys-dir DIR for an enrolled ID")
    return parse_key(data["server_key"], f"{path}: server_key")


def enroll(keys: Mapping[str, bytes], device_ids: Iterable[str]) -> dict[str, bytes]:
    """``keys`` plus a fresh key for every id not yet enrolled (enrolled ids keep theirs)."""
    updated = dict(keys)
    for device_id in device_ids:
        updated.setdefault(check_device_id(device_id), new_key())
    return updated


def rotate(keys: Mapping[str, bytes], device_id: str) -> dict[str, bytes]:
    """``keys`` with a fresh key for the enrolled ``device_id``."""
    if device_id not in keys:
        raise EnrollmentError(f"device {device_id!r} is not enrolled: enroll it instead of rotating its key")
    return {**keys, device_id: new_key()}


def revoke(keys: Mapping[str, bytes], device_id: str) -> dict[str, bytes]:
    """``keys`` without ``device_id``."""
    if device_id not in keys:
        raise EnrollmentError(f"device {device_id!r} is not enrolled")
    return {d: k for d, k in keys.items() if d != device_id}


def write_key_file(path: str | Path, key: bytes) -> Path:
    """Write one key file (64 hex digits, mode 0600)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, (key.hex() + "\n").encode(), mode=0o600)
    return path


def write_device_keys(keys_dir: str | Path, keys: Mapping[str, bytes]) -> list[Path]:
    """One key file per device: ``keys_dir/<id>.key``, to install on that device."""
    return [write_key_file(Path(keys_dir) / f"{device_id}{KEY_FILE_SUFFIX}", key) for device_id, key in keys.items()]


def enroll_devices(path: str | Path, device_ids: Iterable[str], keys_dir: str | Path) -> str:
    """Enroll ``device_ids`` in the file ``path`` (created if missing), write their key files into
    ``keys_dir``; returns a line saying what was written."""
    path = Path(path)
    keys = enroll(load_enrollment(path) if path.exists() else {}, device_ids)
    save_enrollment(path, keys)
    written = write_device_keys(keys_dir, {d: keys[d] for d in device_ids})
    return f"enrolled {len(written)} devices in {path}; their key files are in {keys_dir}"


def key_ring(enroll_arg: str, run_key_file: str | Path | None) -> KeyRing:
    """The server's KeyRing from ``--enroll FILE|open`` and ``--run-key FILE``; open mode is logged loudly."""
    if enroll_arg == ENROLL_OPEN:
        if run_key_file is None:
            raise EnrollmentError("--enroll open needs --run-key FILE: the key shared by every device of the run "
                                  "(write one with: python -m server.enrollment new-key FILE)")
        LOG.warning("OPEN ENROLLMENT: any device id holding the shared run key %s is admitted, and any holder "
                    "of that key can speak for any device; use --enroll FILE outside a trusted lab", run_key_file)
        return KeyRing({}, shared_key=read_key_file(run_key_file, "--run-key"))
    if run_key_file is not None:
        raise EnrollmentError("--run-key is only used with --enroll open; enrolled devices have their own keys")
    keys = load_enrollment(enroll_arg)
    if not keys:
        raise EnrollmentError(f"enrollment file {enroll_arg} enrolls no device: add some with "
                              "python -m server.enrollment add")
    return KeyRing(keys)


LOCAL_ENROLLMENT = "enrollment.json"
LOCAL_KEYS_DIR = "keys"
STATE_SUFFIX = ".state"


def run_key_ring(enroll_arg: str | None, run_key_file: str | Path | None, local_ids: Iterable[str],
                 out_dir: Path) -> tuple[KeyRing, Path]:
    """The KeyRing of a server run and the directory of its authentication state, with a key file for each
    local device under ``out_dir/keys``.

    Without ``--enroll``, the run's own local devices are enrolled in ``out_dir/enrollment.json`` (created
    once, kept for --resume) and nobody else is admitted. The state (the server's counter epoch and the last
    counter accepted from each device) lives beside the enrollment or run key file, in ``<file>.state/``: every
    run of one deployment then refuses what an earlier run accepted (a JOIN captured from last week's run)."""
    local_ids = list(local_ids)
    if enroll_arg is None:
        if not local_ids:
            raise EnrollmentError("no devices are enrolled: pass --enroll FILE (written by "
                                  "scripts/mosquitto_credentials.py --out DIR as DIR/enrollment.json, or by "
                                  "python -m server.enrollment add) or "
                                  "--enroll open --run-key FILE")
        path = out_dir / LOCAL_ENROLLMENT
        save_enrollment(path, enroll(load_enrollment(path) if path.exists() else {}, local_ids))
        enroll_arg = str(path)
    ring = key_ring(enroll_arg, run_key_file)
    key_source = Path(run_key_file if enroll_arg == ENROLL_OPEN else enroll_arg)
    missing = [d for d in local_ids if not ring.enrolled(d)]
    if missing:
        raise EnrollmentError(f"--local-devices {missing} are not enrolled in --enroll {enroll_arg}: add them with "
                              f"python -m server.enrollment add {enroll_arg} ID... --keys-dir DIR")
    for device_id in local_ids:
        write_key_file(out_dir / LOCAL_KEYS_DIR / f"{device_id}{KEY_FILE_SUFFIX}", ring.key_for(device_id))
    return ring, key_source.with_name(key_source.name + STATE_SUFFIX)


def _checked_id(device_id: object, path: Path) -> str:
    try:
        return check_device_id(device_id)
    except ValueError as exc:
        raise EnrollmentError(f"enrollment file {path}: {exc}") from None


def main(argv: list[str] | None = None) -> int:
    """``python -m server.enrollment add|rotate|revoke|list|new-key``; exit 2 on a bad file or id."""
    parser = CommandParser(prog="python -m server.enrollment", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("add", "enroll ids (new keys; enrolled ids keep theirs)"),
                            ("rotate", "give ids new keys"), ("revoke", "remove ids")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("file", type=Path, help="the enrollment file")
        p.add_argument("device_ids", nargs="+", metavar="ID")
        if name != "revoke":
            p.add_argument("--keys-dir", type=Path, required=True, help="where to write <ID>.key for the devices")
    sub.add_parser("list", help="print the enrolled ids").add_argument("file", type=Path)
    sub.add_parser("new-key", help="write a fresh key file (the shared run key of --enroll open)").add_argument(
        "file", type=Path)
    args = parser.parse_args(argv)
    try:
        if args.command == "new-key":
            print(f"wrote {write_key_file(args.file, new_key())}")
            return 0
        if args.command == "add":
            print(enroll_devices(args.file, list(dict.fromkeys(args.device_ids)), args.keys_dir))
            return 0
        keys = load_enrollment(args.file)
        if args.command == "list":
            print("\n".join(sorted(keys)))
            return 0
        changed = list(dict.fromkeys(args.device_ids))
        for device_id in changed:
            keys = rotate(keys, device_id) if args.command == "rotate" else revoke(keys, device_id)
        save_enrollment(args.file, keys)
        if args.command == "rotate":
            write_device_keys(args.keys_dir, {d: keys[d] for d in changed})
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{args.command}: {', '.join(changed)} ({len(keys)} enrolled in {args.file})")
    return 0
