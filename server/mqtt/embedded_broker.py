"""In-process MQTT 3.1.1 broker (amqtt) on loopback: the one-machine default when no mosquitto runs.

amqtt runs on its own asyncio loop in a daemon thread, so synchronous server code can start it,
point MqttEndpoints at the returned URL and stop it again. Sessions, queued QoS 1 messages and
retained messages live in memory only: they survive client reconnects, not a broker stop.

The TCP listener is ours (amqtt's "external" listener type), not amqtt's: amqtt 0.12's
shutdown can hang forever on Python 3.11 while clients are connected (a client handler's
cancelled reader never finishes), so stop() first closes the listener and aborts every client
connection itself, then gives amqtt a bounded time to shut down.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterator
from types import TracebackType
from typing import Any

from amqtt.adapters import StreamReaderAdapter, StreamWriterAdapter
from amqtt.broker import Broker
from amqtt.plugins.base import BaseAuthPlugin
from amqtt.session import Session

LOG = logging.getLogger("fedara.transport")
LOOPBACK_HOST = "127.0.0.1"
START_TIMEOUT_S = 10.0
SHUTDOWN_GRACE_S = 3.0
STOP_TIMEOUT_S = SHUTDOWN_GRACE_S + 5.0
_LISTENER = "default"


class LoopbackAuthPlugin(BaseAuthPlugin):
    """Accept every client without marking it anonymous.

    amqtt's own AnonymousAuthPlugin flags sessions as anonymous, and amqtt then neither keeps
    their persistent sessions nor queues QoS 1 messages for them while they are offline. The
    broker listens on loopback only, so accepting every local client is the same trust model.
    """

    async def authenticate(self, *, session: Session) -> bool:
        """Every loopback client is accepted."""
        return True


def broker_config() -> dict[str, Any]:
    """amqtt 0.12 BrokerConfig dict: one externally served listener, persistent sessions,
    no $SYS topics or packet logging.

    amqtt has no message size limit of its own (MQTT's 256 MiB applies), so any frame size fits.
    """
    return {
        "listeners": {_LISTENER: {"type": "external", "bind": "served-by-EmbeddedBroker"}},
        "plugins": {f"{__name__}.{LoopbackAuthPlugin.__qualname__}": {}},
    }


class Mqtt5ProbeRefusal(logging.Filter):
    """amqtt 0.12 speaks MQTT 3.1.1 only, and warns twice about each MQTT 5 CONNECT it refuses ("Invalid connection
    from ...", then "Failed to initialize client session: Invalid protocol from ...: 5"). Every endpoint's
    ``speaks_mqtt5`` probe sends one, so those two are expected: logged at DEBUG. The reason line of any other
    refused connection stays a warning."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith("Invalid connection from") or (
                message.startswith("Failed to initialize client session: Invalid protocol") and message.endswith(": 5")):
            record.levelno, record.levelname = logging.DEBUG, logging.getLevelName(logging.DEBUG)
        return True


AMQTT_LOG = logging.getLogger("amqtt.broker")
if not any(isinstance(f, Mqtt5ProbeRefusal) for f in AMQTT_LOG.filters):
    AMQTT_LOG.addFilter(Mqtt5ProbeRefusal())


class SubscriptionTable(dict):
    """amqtt's table of topic filter -> subscribers, iterated over a snapshot of its filters. amqtt 0.12 loops over
    the table with an ``await`` inside (sending a connecting session its retained messages, which may be a plan's
    payload in many frames); a subscribe or a disconnect of another client meanwhile changed the table and raised
    "dictionary changed size during iteration", which ended the connecting client's session (seen: a publish of
    that client lost)."""

    def __iter__(self) -> Iterator[str]:
        return iter(list(dict.keys(self)))


class EmbeddedBroker:
    """amqtt broker bound to `host`:`port` (port 0 picks a free one) in a background thread."""

    def __init__(self, host: str = LOOPBACK_HOST, port: int = 0) -> None:
        if not 0 <= port < 65536:
            raise ValueError(f"port must be in 0..65535, got {port}")
        self.host = host
        self.port = port
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._broker: Broker | None = None
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        """mqtt:// URL of the running broker."""
        if self._broker is None:
            raise RuntimeError("EmbeddedBroker is not running")
        return f"mqtt://{self.host}:{self.port}"

    def start(self) -> str:
        """Start the broker and return its URL once it accepts connections; a stopped broker
        restarts on the same port."""
        if self._thread is not None:
            raise RuntimeError("EmbeddedBroker is already running")
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="fedara-embedded-broker", daemon=True)
        thread.start()
        self._loop, self._thread = loop, thread
        try:
            asyncio.run_coroutine_threadsafe(self._start(), loop).result(START_TIMEOUT_S)
        except BaseException:
            self.stop()
            raise
        LOG.info("embedded broker listening on %s", self.url)
        return self.url

    async def _start(self) -> None:
        server = await asyncio.start_server(self._serve, self.host, self.port, reuse_address=True,
                                            start_serving=False)
        self.port = server.sockets[0].getsockname()[1]
        self._server = server
        self._broker = Broker(broker_config())
        self._broker._subscriptions = SubscriptionTable()  # amqtt iterates it across awaits: see SubscriptionTable
        await self._broker.start()
        await server.start_serving()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            await self._broker.external_connected(StreamReaderAdapter(reader), StreamWriterAdapter(writer),
                                                  _LISTENER)
        except OSError as exc:  # the client hung up first (an MQTT 5 probe amqtt refused: speaks_mqtt5): reset, or
            # not connected any more when amqtt shuts its side (errno 107), as the timing falls
            LOG.debug("embedded broker: a client closed its connection before amqtt answered it (%s)", exc)
        finally:
            self._writers.discard(writer)

    def stop(self) -> None:
        """Close the listener, drop every client connection, shut amqtt down and join the thread."""
        if self._thread is None:
            return
        try:
            asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(STOP_TIMEOUT_S)
        finally:
            self._stop_loop()

    async def _stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.transport.abort()
        if self._broker is not None:
            try:
                await asyncio.wait_for(self._broker.shutdown(), SHUTDOWN_GRACE_S)
            except TimeoutError:
                LOG.warning("embedded broker: amqtt shutdown took over %s s; abandoning it", SHUTDOWN_GRACE_S)
        pending = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending, timeout=SHUTDOWN_GRACE_S)

    def _stop_loop(self) -> None:
        loop, thread = self._loop, self._thread
        self._loop = self._thread = self._broker = self._server = None
        self._writers.clear()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(STOP_TIMEOUT_S)
        loop.close()

    def __enter__(self) -> EmbeddedBroker:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
