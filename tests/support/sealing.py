"""Keys and sealing for tests that speak the protocol directly (scripted servers, devices and impostors), and the
frame header's documented layout."""
from __future__ import annotations

import struct
import time
from dataclasses import replace
from pathlib import Path

from device_runtime.auth import SESSION_KEY, CounterSource, Direction, KeyRing
from device_runtime.envelope import Message, decode, seal
from device_runtime.envelope import encode as encode_with_key
from device_runtime.link import Link

KEY = bytes(range(32))
"""The key of every device in these tests, unless a test says otherwise."""
OPEN_MAX = 1 << 28
SESSION = "5e55" * 8
"""The session of every device link these tests make (device_link), which seal_down names by default."""
FRAME_LAYOUT = struct.Struct("<4sBB64sIIQ32s")  # the frame header as documented
_COUNTERS = CounterSource(int(time.time()))


def encode(msg: Message) -> bytes:
    """``msg`` as an envelope under KEY (no direction, no counter: the envelope layer alone)."""
    return encode_with_key(msg, key=KEY)


def seal_down(msg: Message, key: bytes = KEY, session: str | None = SESSION,
              counters: CounterSource = _COUNTERS) -> bytes:
    """``msg`` as the server would send it to a device of ``session`` (None: bound to none); ``counters``: those of
    the server process start that sends it (default: the one these tests stand for)."""
    if session is not None:
        msg = replace(msg, meta={**msg.meta, SESSION_KEY: session})
    return seal(msg, key, Direction.DOWN, counters.next())


def resumed_server() -> CounterSource:
    """The counters of the server process started after the one seal_down stands for (killed and resumed): its next
    epoch. A device that took a message from it refuses the earlier process's later ones as replays."""
    return CounterSource(_COUNTERS.epoch + 1)


def seal_up(msg: Message, key: bytes = KEY) -> bytes:
    """``msg`` as its device would send it."""
    return seal(msg, key, Direction.UP, _COUNTERS.next())


def read(payload: bytes) -> Message:
    """What a sealed payload says, unverified: for tests inspecting what a peer sent."""
    return decode(payload, max_bytes=OPEN_MAX, allow_nonfinite=True)


def write_key(path: Path, key: bytes = KEY) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(key.hex())
    return path


def enrollment_file(path: Path, device_ids: list[str], key: bytes = KEY) -> Path:
    """An enrollment file giving every id ``key``."""
    from server.mqtt.enrollment import save_enrollment

    return save_enrollment(path, dict.fromkeys(device_ids, key))


def device_link(device_id: str, state_dir: Path, key: bytes = KEY) -> Link:
    return Link.device(device_id, key, state_dir, OPEN_MAX, session=SESSION)


def server_link(device_ids: list[str], state_dir: Path, key: bytes = KEY) -> Link:
    return Link.server(KeyRing(dict.fromkeys(device_ids, key)), state_dir, OPEN_MAX)


def memory_server_link(device_ids: list[str], max_inbound: int, key: bytes = KEY) -> Link:
    """A server Link that keeps its state in memory only: for tests that build thousands of servers."""
    from device_runtime.auth import Verifier
    from device_runtime.link import SERVER_RUN_FREE

    keys = KeyRing(dict.fromkeys(device_ids, key))
    return Link(keys, CounterSource(1), Direction.DOWN, Verifier(keys, {Direction.UP, Direction.STATUS}),
                SERVER_RUN_FREE, max_inbound, allow_nonfinite=True)
