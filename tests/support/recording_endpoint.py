"""An endpoint that stands in for the device's MqttEndpoint in-process: it keeps what the agent publishes."""
from __future__ import annotations

from device_runtime.envelope import Message, decode

MAX_BYTES = 1 << 26


class RecordingEndpoint:
    """Keeps every payload the agent publishes, in order; decodes them on request."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []
        self.followed: list[str] = []  # the topic filters the agent listens to beyond its own (a plan's payload)

    def follow(self, topic_filter: str) -> None:
        if topic_filter not in self.followed:
            self.followed.append(topic_filter)

    def unfollow(self, topic_filter: str) -> None:
        self.followed.remove(topic_filter)

    def granted_at(self, topic_filter: str) -> float | None:
        """A followed filter counts as granted from the start (time 0): no broker here refuses one."""
        return 0.0 if topic_filter in self.followed else None

    def publish(self, topic: str, payload: bytes, msg_id: str, retain: bool = False, **kwargs: object) -> None:
        self.sent.append(payload)

    def set_max_message_bytes(self, max_message_bytes: int) -> None:
        self.max_message_bytes = max_message_bytes

    def messages(self) -> list[Message]:
        return [decode(payload, max_bytes=MAX_BYTES) for payload in self.sent]

    def last(self) -> Message:
        return decode(self.sent[-1], max_bytes=MAX_BYTES)
