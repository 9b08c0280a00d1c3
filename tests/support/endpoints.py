"""Device-runtime MQTT endpoints for transport tests: the topics of two devices and a connect factory (the
``connect`` fixture in tests/conftest.py wraps it)."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from device_runtime.topics import Topics
from device_runtime.transport import MqttEndpoint

PREFIX = "fedtest"
WAIT_S = 10.0
"""Upper bound for events that take milliseconds; only a failing test waits this long."""
DEV1, DEV2 = Topics(PREFIX, "dev1"), Topics(PREFIX, "dev2")


@contextmanager
def endpoint_factory() -> Iterator[Callable[..., MqttEndpoint]]:
    """Factory: connect(client_id, url, **kwargs) -> started endpoint, connected unless wait=False; every
    endpoint started is stopped on leaving."""
    started: list[MqttEndpoint] = []

    def make(client_id: str, url: str, *, wait: bool = True, **kwargs: object) -> MqttEndpoint:
        endpoint = MqttEndpoint(client_id, url, **kwargs)
        endpoint.start()
        started.append(endpoint)
        if wait:
            endpoint.wait_connected(WAIT_S)
        return endpoint

    try:
        yield make
    finally:
        for endpoint in reversed(started):
            endpoint.stop()
