"""A scripted MQTT client for tests: handles every inbound message on a background thread until closed."""
from __future__ import annotations

import threading

from device_runtime.transport import MqttEndpoint

WAIT_S = 20.0
POLL_S = 0.1


class MqttPeer:
    """Subclasses build ``self.endpoint`` and implement ``on_message``; ``with`` connects and serves."""

    endpoint: MqttEndpoint

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)

    def on_connected(self) -> None:
        """Called once connected, before serving (e.g. to join)."""

    def on_message(self, topic: str, payload: bytes) -> None:
        raise NotImplementedError

    def __enter__(self):
        self.endpoint.start()
        self.endpoint.wait_connected(WAIT_S)
        self.on_connected()
        self.thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop.set()
        self.thread.join(WAIT_S)
        self.endpoint.stop()

    def _serve(self) -> None:
        while not self.stop.is_set():
            item = self.endpoint.get(POLL_S)
            if item is not None:
                self.on_message(*item)
