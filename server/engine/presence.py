"""Which connection each device is on, and which devices are online without having joined: the decisions a
device's status frames drive, with the time ``now`` passed in (no I/O)."""
from __future__ import annotations

REJOIN_GRACE_S = 3.0
"""An online device that has not joined within this long (it joined before the server listened) is asked to."""


class Presence:
    """Devices' connections (the nonce of the one each last opened) and online devices without a plan."""

    def __init__(self) -> None:
        self.connections: dict[str, str] = {}  # device -> nonce of the connection its last online opened
        self.unjoined: dict[str, float] = {}  # online devices without a plan -> when their status said online

    def known_connection(self, device_id: str, nonce: str) -> bool:
        """Whether this online is of the connection already known (a retained frame handed out again, or
        re-published by anyone on the broker): it changes nothing."""
        return self.connections.get(device_id) == nonce

    def online(self, device_id: str, nonce: str, now: float, *, has_plan: bool) -> None:
        self.connections[device_id] = nonce
        if has_plan:
            self.unjoined.pop(device_id, None)
        else:
            self.unjoined.setdefault(device_id, now)

    def offline(self, device_id: str) -> None:
        self.connections.pop(device_id, None)
        self.unjoined.pop(device_id, None)

    def joined(self, device_id: str) -> None:
        self.unjoined.pop(device_id, None)

    def to_ask_to_join(self, now: float) -> list[str]:
        """Online devices that have not joined within REJOIN_GRACE_S, each once (until it says online again)."""
        due = [d for d, since in self.unjoined.items() if now - since >= REJOIN_GRACE_S]
        for device_id in due:
            del self.unjoined[device_id]
        return due
