"""MQTT endpoint shared by server and device: chunked QoS 1 messages over paho-mqtt 2.x.

Every message goes out as protocol frames of at most `max_frame_bytes` (checked before paho
sees them: paho re-sends a frame the broker rejected forever) and comes back whole through one
Reassembler whose memory is bounded in total over all topics (a flood of frames on many topics
evicts the oldest incomplete messages instead of growing). MQTT 3.1.1, so the embedded amqtt broker, NATS and
mosquitto all serve it; with ``mqtt5`` (where ``speaks_mqtt5`` found the broker speaks it: mosquitto does) MQTT 5,
announcing a Maximum Packet Size in CONNECT (the frame size and ``PACKET_HEADROOM_BYTES``), so the broker never sends
this client a larger packet (MQTT 5 §3.1.2.11.4: it discards it): a 50 MB junk packet is never read here. Under 3.1.1
paho reads any packet whole before this endpoint refuses it (docs/scale.md measures that cost).
The paho network thread reconnects on its own and re-subscribes on every connect. Given a list of brokers (the nodes
of one cluster, ``mqtt://h1:p1,mqtt://h2:p2``), each lost connection or failed attempt moves it to the next one,
with paho's backoff between attempts; what the endpoint holds (inbox, pending chunks, queued QoS 1 frames) stays.
"""

from __future__ import annotations

import logging
import os
import socket
import ssl
import struct
import threading
import time
import uuid
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote, urlsplit

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion, MQTTErrorCode
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.exception import MalformedPacket
from paho.mqtt.properties import Properties, VariableByteIntegers

from device_runtime.auth import new_nonce
from device_runtime.framing import (DEFAULT_MAX_FRAME_BYTES, FRAME_HEADER_BYTES, Admit, Check, NotAdmitted,
                                   Reassembler, RepeatedFrame, Spill, Vouch, chunk)
from device_runtime.inbox import Inbox, Screen
from device_runtime.protocol import ProtocolError
from device_runtime.topics import frame_stream

LOG = logging.getLogger("fedara.transport")

DEFAULT_PORTS = {"mqtt": 1883, "mqtts": 8883}
KEEPALIVE_S = 30
RECONNECT_MIN_DELAY_S = 0.2
RECONNECT_MAX_DELAY_S = 5.0
RESUBSCRIBE_MAX_DELAY_S = 5.0
SUBSCRIBE_BATCH = 128
"""Filters a SUBSCRIBE packet carries at most (~4 KB of them): far below any broker's packet cap."""
TEND_S = 1.0
"""How often a read that the socket keeps busy stops to tend the keepalive (``_Client.loop_read``)."""
DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024
DEFAULT_REASSEMBLY_TIMEOUT_S = 120.0
DEFAULT_MAX_PENDING_MESSAGES = 64
DEFAULT_PUBLISH_TIMEOUT_S = 30.0
STOP_STATUS_TIMEOUT_S = 2.0
EXPIRE_INTERVAL_S = 1.0
MAX_LOST_TOPICS = 4096
"""Topics of pushed-out messages an endpoint keeps for ``take_lost``, at most."""
StatusFrames = Callable[[bool, str], bytes]
"""(online, connection nonce) -> the sealed status payload (status.StatusSigner)."""
STAT_KEYS = ("frames_in", "frames_rejected", "frames_repeated", "frames_unadmitted", "messages_in", "messages_expired",
             "messages_evicted", "messages_spilled", "bytes_out", "bytes_in", "reconnects", "sessions_lost")
"""``sessions_lost`` counts the reconnects whose broker held no session of this client (CONNACK session present
0): what was published to it while it was away is gone, where a kept session queued it. ``messages_spilled``
counts the incomplete messages moved to the reassembler's spill past its memory budget (``spill``).
``frames_unadmitted`` counts the frames admitted for no sender (``framing.NotAdmitted``), dropped at the frame, one
log line per UNADMITTED_LOG_EVERY."""
PACKET_HEADROOM_BYTES = 64 * 1024
"""What an MQTT packet may carry beyond its frame (fixed header, topic, packet id, properties): the Maximum Packet Size
an MQTT 5 endpoint announces is its frame size plus this, and server/mqtt/mosquitto_config.py caps the broker's packets
at the same."""
SESSION_NEVER_EXPIRES = 0xFFFFFFFF
"""MQTT 5's Session Expiry Interval for a persistent session: kept as long as 3.1.1's clean_session=False keeps it."""
OUTBOUND_WINDOW = 1000
"""QoS 1 frames an endpoint has unacknowledged at once (paho's default, 20, sends a 142-frame payload in 8 windows,
each waiting for PUBACKs that the broker queues behind whatever it holds for this endpoint: a flood's backlog); an MQTT
5 broker that announces a smaller Receive Maximum in CONNACK is held to it (server/mqtt/mosquitto_config.py's configs
announce this one)."""
RECEIVE_MAXIMUM = 0xFFFF
"""The unacknowledged QoS 1 messages an MQTT 5 endpoint lets the broker send it (MQTT 5's largest Receive Maximum).
Without it mosquitto sends an endpoint 20 at a time (its max_inflight_messages): behind a QoS 0 flood it may queue
ahead of them, each window of 20 honest frames then waits for the whole backlog. What is in flight stays bounded by
TCP's window and the endpoint's own budgets (an endpoint with ``backpressure`` stops reading)."""
PUBACK = 0x40
PUBACK_BYTES = 4
"""An MQTT PUBACK without a reason code (3.1.1, and MQTT 5's success): its type, remaining length 2, packet id."""
READ_BYTES = 64 * 1024
"""An endpoint reads its socket this many bytes at a time (``_Client``)."""
PROBE_TIMEOUT_S = 3.0
"""How long ``speaks_mqtt5`` waits for the broker's CONNACK (a 3.1.1-only broker may never answer a v5 CONNECT)."""
UNADMITTED_LOG_EVERY = 1000
"""A flood of frames from no sender is logged once per this many (the counter counts each)."""


class TransportError(RuntimeError):
    """Base class of the errors MqttEndpoint raises."""


class FrameTooLargeError(TransportError):
    """A frame would exceed max_frame_bytes; nothing of the message was published."""


class PublishError(TransportError):
    """paho refused to queue a frame, or the broker did not acknowledge it in time."""


class BrokerRefusedError(TransportError):
    """The broker answered CONNECT with a refusal (bad credentials, not authorised...)."""


class ConnectTimeoutError(TransportError):
    """No connection to the broker within the time asked for."""


@dataclass(frozen=True)
class BrokerURL:
    """Parsed broker address: mqtt://[user[:pass]@]host[:port] or mqtts://... (TLS)."""

    scheme: str
    host: str
    port: int
    username: str | None
    password: str | None
    tls: bool

    def __str__(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"

    @classmethod
    def parse(cls, url: str) -> BrokerURL:
        """Parse `url`; raises ValueError naming what is wrong with it."""
        parts = urlsplit(url)
        if parts.scheme not in DEFAULT_PORTS:
            raise ValueError(f"broker URL {url!r}: scheme must be one of {sorted(DEFAULT_PORTS)}")
        if not parts.hostname:
            raise ValueError(f"broker URL {url!r} has no host")
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            raise ValueError(f"broker URL {url!r} must not have a path, query or fragment")
        try:
            port = parts.port or DEFAULT_PORTS[parts.scheme]
        except ValueError as exc:
            raise ValueError(f"broker URL {url!r} has an invalid port: {exc}") from exc
        return cls(scheme=parts.scheme, host=parts.hostname, port=port,
                   username=unquote(parts.username) if parts.username is not None else None,
                   password=unquote(parts.password) if parts.password is not None else None,
                   tls=parts.scheme == "mqtts")


def parse_brokers(text: str) -> tuple[BrokerURL, ...]:
    """The brokers of a ``--broker`` value: one URL, or several separated by commas (nodes of one cluster, tried
    in turn). Raises ValueError naming --broker, the bad entry and the fix."""
    entries = [entry.strip() for entry in str(text).split(",")]
    if not text or not all(entries):
        raise ValueError(f"--broker {text!r}: expected mqtt://HOST:PORT or a comma-separated list of them "
                         "(mqtt://h1:1883,mqtt://h2:1883), with no empty entry")
    try:
        brokers = tuple(BrokerURL.parse(entry) for entry in entries)
    except ValueError as exc:
        raise ValueError(f"--broker: {exc}; expected mqtt://HOST:PORT or mqtts://HOST:PORT, comma-separated for "
                         "several") from None
    if len({b.tls for b in brokers}) > 1:
        raise ValueError(f"--broker {text!r} mixes mqtt:// and mqtts:// brokers; use one scheme for every node")
    return brokers


def rotate_brokers(text: str, by: int) -> str:
    """The ``--broker`` list rotated left by ``by`` (local device i starts on node i mod N, then tries the next)."""
    entries = [entry.strip() for entry in text.split(",")]
    by %= len(entries)
    return ",".join(entries[by:] + entries[:by])


class _Adopt:
    """paho's packet buffer while a body read whole (``_Client._read_body``) is handed over: paho's
    ``packet += body`` then takes ``body`` itself (a copy of every byte less)."""

    def __iadd__(self, data: bytearray) -> bytearray:
        return data


class _Client(mqtt.Client):
    """paho's client, reading its socket ``READ_BYTES`` at a time. paho reads a packet's fixed header byte by byte
    and its body in a call of its own (five ``recv`` calls for a small frame); this hands those reads out of one
    buffer filled by one ``recv``, and goes on reading packets while the buffer holds more (paho would otherwise
    wait for the socket's next readiness, which never comes for bytes already read). Between those packets it writes
    what is queued (the PUBACKs it owes, what was published meanwhile) and, every ``TEND_S``, tends the keepalive:
    a flood that keeps the buffer full would otherwise hold all of it back, and the broker sends a client only so
    many unacknowledged QoS 1 messages (mosquitto: 20), so every honest frame past them would wait until the
    keepalive's silence ended the connection.

    A body longer than ``READ_BYTES`` (a frame of an update: up to the frame size) is read into one buffer of its
    size (``recv_into``) and handed to paho whole (adopted as the packet: ``_Adopt``), and a PUBLISH is decoded in
    place (``_handle_publish``): its payload is the packet's own buffer past its header. paho appended each 64 KiB
    read to the packet, then cut the payload out with three copies more (``_packet.decode_publish``): reading a 2.2 MB
    update's frames cost 3.9–4.1 CPU ms, now 0.42–0.52 (scripts/bench_packet_reads.py, docs/scale.md)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._read_ahead = memoryview(b"")
        self._starved = False  # the last read found the buffer empty and the socket too
        self._body: bytearray | None = None  # the packet body being read (``_read_body``)
        self._body_filled = 0

    def _sock_recv(self, bufsize: int) -> bytes:
        if bufsize > READ_BYTES and bufsize > len(self._read_ahead):
            return self._read_body(bufsize)
        if not self._read_ahead:
            try:
                data = super()._sock_recv(READ_BYTES)
            except BlockingIOError:
                self._starved = True
                raise
            self._starved = False
            if not data:
                return data
            self._read_ahead = memoryview(data)
        taken, self._read_ahead = self._read_ahead[:bufsize], self._read_ahead[bufsize:]
        return bytes(taken)

    def _read_body(self, size: int) -> bytearray:
        """The ``size`` bytes paho asks for (the rest of a packet: it asks again with the same size until it gets
        some), read into one buffer; BlockingIOError until all are in, so paho takes them at once. The buffer is
        allocated at the size the packet's header declares, as paho would have held it once read: a broker forwards a
        packet only once it holds it whole, and an MQTT 5 broker none over this endpoint's Maximum Packet Size."""
        body = self._body
        if body is None:
            body = self._body = bytearray(size)
            ahead = len(self._read_ahead)
            body[:ahead] = self._read_ahead
            self._read_ahead, self._body_filled = memoryview(b""), ahead
        view = memoryview(body)
        while self._body_filled < size:
            try:
                received = self._sock_recv_into(view[self._body_filled:])
            except BlockingIOError:
                self._starved = True
                raise
            except OSError:
                self._body = None
                raise
            if received == 0:  # the connection closed: paho reads it as lost
                self._body = None
                return bytearray()
            self._body_filled += received
            with self._msgtime_mutex:  # paho's keepalive counts bytes received, not packets
                self._last_bytes_received = time.monotonic()
        view.release()
        self._body, self._starved = None, False
        if not self._in_packet["packet"]:  # paho appends what this returns to the packet: it takes the body instead
            self._in_packet["packet"] = _Adopt()
        return body

    def _sock_recv_into(self, view: memoryview) -> int:
        """paho's ``_sock_recv`` into ``view`` (TLS's want-read and want-write as BlockingIOError, as paho has them)."""
        if self._sock is None:
            raise ConnectionError("self._sock is None")
        try:
            return self._sock.recv_into(view)
        except ssl.SSLWantReadError as err:
            raise BlockingIOError() from err
        except ssl.SSLWantWriteError as err:
            self._call_socket_register_write()
            raise BlockingIOError() from err

    def _sock_close(self) -> None:
        """paho's, and what was read of the closed connection's stream is dropped (the next one starts afresh)."""
        self._read_ahead, self._body, self._starved = memoryview(b""), None, False
        super()._sock_close()

    def _handle_publish(self) -> MQTTErrorCode:
        """paho's PUBLISH handling, the packet decoded in place: topic, packet id and (MQTT 5) properties read from
        the header, the payload the packet's buffer past it (no copy; paho copies the rest of the packet once for
        each of them). Properties are parsed only where the packet has some (``None`` otherwise)."""
        packet = self._in_packet["packet"]
        header = self._in_packet["command"]
        qos = (header & 0x06) >> 1
        view = memoryview(packet)
        try:
            if len(view) < 2:
                raise MalformedPacket("PUBLISH shorter than its topic length")
            end = 2 + int.from_bytes(view[:2], "big")
            topic = bytes(view[2:end])
            if len(topic) != end - 2 or (self._protocol != mqtt.MQTTv5 and not topic):
                raise MalformedPacket("PUBLISH topic truncated, or empty under MQTT 3.1.1")
            mid = 0
            if qos > 0:
                if len(view) < end + 2:
                    raise MalformedPacket("PUBLISH truncated before its packet id")
                mid, end = int.from_bytes(view[end:end + 2], "big"), end + 2
            properties = None
            if self._protocol == mqtt.MQTTv5:
                length, length_bytes = VariableByteIntegers.decode(view[end:end + 4])
                if length:
                    properties = Properties(PacketTypes.PUBLISH)
                    properties.unpack(bytes(view[end:end + length_bytes + length]))
                end += length_bytes + length
                if end > len(view):
                    raise MalformedPacket("PUBLISH properties run past the packet")
        finally:
            view.release()
        del packet[:end]  # a bytearray drops its head without moving the rest
        message = mqtt.MQTTMessage(mid=mid, topic=topic)
        message.dup, message.qos, message.retain = bool(header & 0x08), qos, bool(header & 0x01)
        message.properties, message.payload, message.timestamp = properties, packet, time.monotonic()
        if qos == 0:
            self._handle_on_message(message)
            return MQTTErrorCode.MQTT_ERR_SUCCESS
        if qos == 1:
            self._handle_on_message(message)
            return MQTTErrorCode.MQTT_ERR_SUCCESS if self._manual_ack else self._send_puback(mid)
        if qos == 2:
            rc = self._send_pubrec(mid)
            message.state = mqtt.mqtt_ms_wait_for_pubrel
            with self._in_message_mutex:
                self._in_messages[mid] = message
            return rc
        return MQTTErrorCode.MQTT_ERR_PROTOCOL

    def _send_puback(self, mid: int) -> MQTTErrorCode:
        """The PUBACK of a QoS 1 PUBLISH, queued (paho calls this on its network thread, handling the PUBLISH)
        without paho's wake-up byte to that same thread's select, a ``send`` and a ``recv`` an acknowledgement:
        the loop's next turn finds it queued and writes it."""
        self._out_packet.append({"command": PUBACK, "mid": mid, "qos": 1, "pos": 0, "to_process": PUBACK_BYTES,
                                 "packet": struct.pack("!BBH", PUBACK, PUBACK_BYTES - 2, mid), "info": None})
        return MQTTErrorCode.MQTT_ERR_SUCCESS

    def loop_read(self, max_packets: int = 1) -> MQTTErrorCode:
        rc = super().loop_read(max_packets)
        tended = time.monotonic()
        while rc == MQTTErrorCode.MQTT_ERR_SUCCESS and self._read_ahead and not self._starved:
            if self.want_write():
                rc = self.loop_write()
                if rc != MQTTErrorCode.MQTT_ERR_SUCCESS:
                    return rc
            if time.monotonic() - tended >= TEND_S:
                tended = time.monotonic()
                rc = self.loop_misc()
                if rc != MQTTErrorCode.MQTT_ERR_SUCCESS:
                    return rc
            rc = super().loop_read(max_packets)
        return rc


class MqttEndpoint:
    """One MQTT client: chunked publish with optional PUBACK wait, reassembled inbound queue.

    `status=(status_topic, frames)` gives every CONNECT a fresh nonce, sets a retained last will saying offline under
    that nonce, and publishes a retained online frame with it once the subscriptions are acknowledged, so a peer that
    answers the status reaches this endpoint (and the offline frame on a clean stop()). `max_pending_bytes` bounds the
    chunks held for incomplete messages over all topics together (default: `max_message_bytes`); `admit`, `check` and
    `vouch` name each frame's sender, check its header's claims and rank a sender's messages, and
    `max_pending_per_sender`, `max_pending_bytes_per_sender` bound what one sender holds (framing.Reassembler); with
    `spill` (spill.FileSpill) an authenticated incomplete message past `max_pending_bytes` is kept in a file, up to
    `max_spill_bytes`, instead of being pushed out.
    Complete messages wait in an Inbox (device_runtime/inbox.py): with `screen`, what it drops never queues and the
    queue keeps the newest message per kind, within `max_queued_bytes` (None: no bound). With `backpressure` the queue
    drops nothing: past `max_queued_bytes` the network thread waits for the reader, so the broker holds what this
    process has no room for (a server's updates: none may be lost). `inbox` replaces that queue (a process hosting
    many simulated devices hands all their messages to one). `unsubscriptions` are filters this endpoint must not
    hold: each CONNECT drops them first, since a persistent session (same client id, clean_session False) keeps an
    earlier run's subscriptions. An incomplete message pushed out of the reassembly budget is lost: its topic waits in
    ``take_lost`` for the owner to ask its sender again. `broker_url` may list several brokers (``parse_brokers``): a
    lost connection or a failed attempt moves to the next. Credentials given as arguments take precedence over those
    in the URL. `connected` is set while the broker has accepted the connection and acknowledged the subscriptions."""

    def __init__(self, client_id: str, broker_url: str, *, subscriptions: list[str] | tuple[str, ...] = (),
                 unsubscriptions: list[str] | tuple[str, ...] = (), status: tuple[str, StatusFrames] | None = None,
                 username: str | None = None, password: str | None = None,
                 tls_ca: str | os.PathLike[str] | None = None, tls_cert: str | os.PathLike[str] | None = None,
                 tls_key: str | os.PathLike[str] | None = None, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 reassembly_timeout_s: float = DEFAULT_REASSEMBLY_TIMEOUT_S,
                 max_pending_messages: int = DEFAULT_MAX_PENDING_MESSAGES,
                 max_pending_bytes: int | None = None, admit: Admit | None = None, check: Check | None = None,
                 vouch: Vouch | None = None,
                 max_pending_per_sender: int | None = None, max_pending_bytes_per_sender: int | None = None,
                 spill: Spill | None = None, max_spill_bytes: int = 0, clean_session: bool = False, qos: int = 1,
                 screen: Screen | None = None, max_queued_bytes: int | None = None, backpressure: bool = False,
                 inbox: Inbox | None = None, mqtt5: bool = False) -> None:
        if not client_id:
            raise ValueError("client_id must not be empty (persistent sessions are keyed by it)")
        if qos not in (0, 1):
            raise ValueError(f"qos must be 0 or 1, got {qos}")
        if max_frame_bytes <= FRAME_HEADER_BYTES:
            raise ValueError(f"max_frame_bytes must exceed the {FRAME_HEADER_BYTES}-byte frame header, "
                             f"got {max_frame_bytes}")
        self.brokers = parse_brokers(broker_url)
        self._broker_index = 0
        self._credentials = (username, password)
        if not self.url.tls and (tls_ca or tls_cert or tls_key):
            raise ValueError(f"TLS files given but broker URL {broker_url!r} is not mqtts://")
        if (tls_cert is None) != (tls_key is None):
            raise ValueError("tls_cert and tls_key must be given together")
        self.client_id = client_id
        self.mqtt5 = mqtt5
        self._clean_session = clean_session
        self.subscriptions = tuple(subscriptions)
        self.unsubscriptions = tuple(f for f in unsubscriptions if f not in self.subscriptions)
        self.max_frame_bytes = max_frame_bytes
        self.qos = qos
        self.connected = threading.Event()
        self._status = status
        self._armed_nonce: str | None = None  # nonce of the will registered for the next CONNECT
        self._nonce: str | None = None  # nonce of the current connection
        self._reassembler = Reassembler(max_message_bytes, reassembly_timeout_s, max_pending_messages,
                                        max_pending_bytes, admit=admit, check=check, vouch=vouch,
                                        max_pending_per_sender=max_pending_per_sender,
                                        max_pending_bytes_per_sender=max_pending_bytes_per_sender,
                                        spill=spill, max_spill_bytes=max_spill_bytes)
        self._next_expiry = 0.0
        self._inbox = inbox if inbox is not None else Inbox(max_queued_bytes, screen, wait=backpressure)
        self._lost: dict[str, None] = {}  # topics of incomplete messages pushed out, until the owner takes them
        self._stats = dict.fromkeys(STAT_KEYS, 0)
        self._stats_lock = threading.Lock()
        self._acks = threading.Condition()
        self._ack_seq = 0
        self._acked_at: dict[int, int] = {}
        self._state = threading.Condition()
        self._refusal: str | None = None
        self._ever_connected = False
        self._subscribing: dict[int, tuple[tuple[str, ...], bool]] = {}  # SUBSCRIBE mid -> (filters, marks ready)
        self._granted: dict[str, float] = {}  # filter -> when this connection's broker granted it (monotonic)
        self._awaited: set[str] = set()  # filters of this connection's first SUBSCRIBEs not granted yet
        self._subs = threading.RLock()  # the two above: the caller's thread (follow) and the network thread
        self._refused_subscriptions = 0  # SUBSCRIBEs refused in a row (a cluster node that lost a peer does that)
        self._connection = 0  # counts CONNACKs: a retry scheduled on an earlier connection is dropped
        self._started = False
        self._client = self._make_client(clean_session, tls_ca, tls_cert, tls_key)

    @property
    def url(self) -> BrokerURL:
        """The broker this endpoint is connected to, or tries next."""
        return self.brokers[self._broker_index]

    def _make_client(self, clean_session: bool, tls_ca: str | os.PathLike[str] | None,
                     tls_cert: str | os.PathLike[str] | None, tls_key: str | os.PathLike[str] | None) -> mqtt.Client:
        if self.mqtt5:  # the session's lifetime goes in CONNECT (_connect_properties)
            client = _Client(CallbackAPIVersion.VERSION2, client_id=self.client_id, protocol=mqtt.MQTTv5)
        else:
            client = _Client(CallbackAPIVersion.VERSION2, client_id=self.client_id, clean_session=clean_session,
                             protocol=mqtt.MQTTv311)
        _set_credentials(client, self.url, *self._credentials)
        if self.url.tls:
            client.tls_set(ca_certs=_path_or_none(tls_ca), certfile=_path_or_none(tls_cert),
                           keyfile=_path_or_none(tls_key))
        self._arm_will(client)
        client.max_inflight_messages_set(OUTBOUND_WINDOW)
        client.reconnect_delay_set(RECONNECT_MIN_DELAY_S, RECONNECT_MAX_DELAY_S)
        client.on_socket_open = _set_tcp_nodelay
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_connect_fail = self._on_connect_fail
        client.on_subscribe = self._on_subscribe
        client.on_message = self._on_message
        client.on_publish = self._on_publish
        return client

    def _connect_properties(self) -> Properties:
        """MQTT 5 CONNECT: the largest packet this endpoint takes, how many unacknowledged QoS 1 messages it takes at
        once, and a session kept as 3.1.1's would be."""
        properties = Properties(PacketTypes.CONNECT)
        properties.MaximumPacketSize = self.max_frame_bytes + PACKET_HEADROOM_BYTES
        properties.ReceiveMaximum = RECEIVE_MAXIMUM
        properties.SessionExpiryInterval = 0 if self._clean_session else SESSION_NEVER_EXPIRES
        return properties

    def _next_broker(self, client: mqtt.Client) -> None:
        """Aim the next (re)connect attempt at the next broker of the list (the network thread's backoff stays)."""
        if len(self.brokers) == 1:
            return
        self._broker_index = (self._broker_index + 1) % len(self.brokers)
        # paho's host/port setters refuse while its state is "connection lost"; its reconnect reads these two
        # (paho-mqtt 2.x; tests/wire/test_transport.py's failover tests would catch a rename)
        client._host, client._port = self.url.host, self.url.port  # noqa: SLF001
        _set_credentials(client, self.url, *self._credentials)
        LOG.info("%s: next attempt on %s", self.client_id, self.url)

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Start the network thread; it connects (and later reconnects) in the background."""
        if self._started:
            raise RuntimeError(f"endpoint {self.client_id!r} already started")
        self._started = True
        if self.mqtt5:  # paho re-sends these properties on every reconnect
            self._client.connect_async(self.url.host, self.url.port, keepalive=KEEPALIVE_S,
                                       clean_start=self._clean_session, properties=self._connect_properties())
        else:
            self._client.connect_async(self.url.host, self.url.port, keepalive=KEEPALIVE_S)
        self._client.loop_start()

    def stop(self) -> None:
        """Publish the offline status (when a will is set), disconnect and join the network thread."""
        if not self._started:
            return
        self._started = False
        self._inbox.release()  # the network thread may wait for room: it must see the disconnect through
        if self._status is not None and self._nonce is not None and self.connected.is_set():
            topic, frames = self._status
            try:
                self.publish(topic, frames(False, self._nonce), self._status_msg_id("offline"), retain=True,
                             wait=True, timeout=STOP_STATUS_TIMEOUT_S)
            except TransportError as exc:
                LOG.warning("%s: offline status not acknowledged before stop: %s", self.client_id, exc)
        self._client.disconnect()
        self._client.loop_stop()
        self._client._reset_sockets(sockpair_only=True)  # paho closes the wake-up pair only once collected
        self.connected.clear()

    def __enter__(self) -> MqttEndpoint:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def wait_connected(self, timeout: float) -> None:
        """Block until connected and subscribed (SUBACK received).

        Raises BrokerRefusedError when the broker refused the last attempt, else ConnectTimeoutError.
        """
        with self._state:
            self._state.wait_for(lambda: self.connected.is_set() or self._refusal is not None, timeout)
            if self.connected.is_set():
                return
            if self._refusal is not None:
                raise BrokerRefusedError(f"{self.client_id}: broker {self.url.host}:{self.url.port} "
                                         f"refused the connection: {self._refusal}")
        raise ConnectTimeoutError(f"{self.client_id}: not connected to {','.join(map(str, self.brokers))} "
                                  f"within {timeout} s")

    # -- outbound ---------------------------------------------------------------------------

    def publish(self, topic: str, payload: bytes, msg_id: str, retain: bool = False, *,
                wait: bool = False, timeout: float = DEFAULT_PUBLISH_TIMEOUT_S) -> None:
        """Publish `payload` as frames of at most max_frame_bytes.

        While disconnected, frames queue in paho and go out on reconnect. With `wait`, block until
        the broker acknowledged every frame, raising PublishError after `timeout` seconds.
        A retained message must fit in one frame (a broker retains only the last frame).
        """
        frames = chunk(payload, self.max_frame_bytes, msg_id)
        oversize = [len(frame) for frame in frames if len(frame) > self.max_frame_bytes]
        if oversize:
            raise FrameTooLargeError(f"message {msg_id!r} to {topic!r}: frame of {max(oversize)} bytes "
                                     f"exceeds max_frame_bytes={self.max_frame_bytes}; nothing published")
        if retain and len(frames) != 1:
            raise ValueError(f"retained message {msg_id!r} to {topic!r} needs {len(frames)} frames; "
                             "retained messages must fit in one frame")
        with self._acks:
            start_seq = self._ack_seq
        mids = [self._publish_frame(topic, frame, retain, msg_id) for frame in frames]
        if wait:
            self._wait_acked(mids, start_seq, timeout, topic, msg_id)

    def publish_retained(self, topic: str, payload: bytes, msg_id: str) -> int:
        """Publish ``payload`` retained, frame i on ``topic/i`` (a broker retains one message per topic), so that a
        subscriber to ``topic/+`` gets it whenever it subscribes; returns the number of frames. The receiver joins
        them as one stream (``topics.frame_stream``)."""
        frames = chunk(payload, self.max_frame_bytes, msg_id)
        for i, frame in enumerate(frames):
            self._publish_frame(f"{topic}/{i}", frame, True, msg_id)
        return len(frames)

    def clear_retained(self, topic: str, frames: int) -> None:
        """Delete what :meth:`publish_retained` left on the broker under ``topic`` (an empty retained message)."""
        for i in range(frames):
            self._client.publish(f"{topic}/{i}", b"", qos=self.qos, retain=True)

    def follow(self, topic_filter: str) -> None:
        """Subscribe to ``topic_filter`` now and on every later connect (the broker sends its retained messages); a
        refused subscription is asked for again with backoff. ``granted_at`` says when the broker granted it."""
        if topic_filter not in self.subscriptions:
            self.subscriptions += (topic_filter,)
        with self._subs:
            self._granted.pop(topic_filter, None)
            self._subscribe(self._client, (topic_filter,), ready=False)

    def unfollow(self, topic_filter: str) -> None:
        """Stop receiving ``topic_filter`` (now and after reconnects)."""
        self.subscriptions = tuple(f for f in self.subscriptions if f != topic_filter)
        with self._subs:
            self._granted.pop(topic_filter, None)
        self._client.unsubscribe(topic_filter)

    def granted_at(self, topic_filter: str) -> float | None:
        """When (time.monotonic) the broker of this connection granted the subscription to ``topic_filter``; None
        while it is not granted (not yet, refused, or the connection is gone): nothing published there reaches us."""
        with self._subs:
            return self._granted.get(topic_filter)

    def _publish_frame(self, topic: str, frame: bytes, retain: bool, msg_id: str) -> int:
        info = self._client.publish(topic, frame, qos=self.qos, retain=retain)
        queued_offline = info.rc == MQTTErrorCode.MQTT_ERR_NO_CONN and self.qos > 0
        if info.rc != MQTTErrorCode.MQTT_ERR_SUCCESS and not queued_offline:
            raise PublishError(f"message {msg_id!r} to {topic!r}: paho refused a frame: "
                               f"{mqtt.error_string(info.rc)}")
        self._bump("bytes_out", len(frame))
        return info.mid

    def _wait_acked(self, mids: list[int], start_seq: int, timeout: float, topic: str, msg_id: str) -> None:
        def missing() -> int:
            return sum(1 for mid in mids if self._acked_at.get(mid, -1) <= start_seq)

        with self._acks:
            if self._acks.wait_for(lambda: missing() == 0, timeout):
                return
            unacked = missing()
        state = "connected" if self.connected.is_set() else "disconnected"
        raise PublishError(f"message {msg_id!r} to {topic!r}: {unacked} of {len(mids)} frames not "
                           f"acknowledged within {timeout} s ({state}); they stay queued for resend")

    def _arm_will(self, client: mqtt.Client) -> None:
        """Set the last will for the next CONNECT: offline under a fresh nonce (that connection's), in a frame
        with a fresh msg_id (receivers drop a msg_id they delivered recently)."""
        if self._status is not None:
            topic, frames = self._status
            self._armed_nonce = new_nonce()
            client.will_set(topic, self._single_frame(frames(False, self._armed_nonce), "will"), qos=self.qos,
                            retain=True)

    def _single_frame(self, payload: bytes, kind: str) -> bytes:
        frames = chunk(payload, self.max_frame_bytes, self._status_msg_id(kind))
        if len(frames) != 1 or len(frames[0]) > self.max_frame_bytes:
            raise ValueError(f"{kind} payload of {len(payload)} bytes does not fit in one frame "
                             f"of max_frame_bytes={self.max_frame_bytes}")
        return frames[0]

    def _status_msg_id(self, kind: str) -> str:
        return f"{kind}-{uuid.uuid4().hex}"

    # -- inbound ----------------------------------------------------------------------------

    def get(self, timeout: float | None = None) -> tuple[str, bytes] | None:
        """Next complete (topic, payload), or None when none arrives within `timeout` seconds."""
        return self._inbox.get(timeout)

    @property
    def stats(self) -> dict[str, int]:
        """Snapshot of the traffic counters (frames, messages, bytes, reconnects)."""
        with self._stats_lock:
            return dict(self._stats, messages_dropped=self._inbox.dropped, inbox_peak_bytes=self._inbox.peak_bytes)

    def take_lost(self) -> list[str]:
        """The topics of the incomplete messages pushed out of the reassembly budget, or expired incomplete, since the
        last call (their senders are to be asked again: nothing else brings them back)."""
        with self._stats_lock:
            lost, self._lost = list(self._lost), {}
        return lost

    def _bump(self, key: str, amount: int = 1) -> None:
        with self._stats_lock:
            self._stats[key] += amount

    # -- paho callbacks (network thread) ----------------------------------------------------

    def _on_connect(self, client: mqtt.Client, userdata: Any, flags: Any, reason_code: Any,
                    properties: Any) -> None:
        if reason_code.is_failure:
            LOG.warning("%s: broker refused connection: %s", self.client_id, reason_code)
            with self._state:
                self._refusal = str(reason_code)
                self._state.notify_all()
            return
        if self._ever_connected:
            self._bump("reconnects")
            if not flags.session_present:
                self._bump("sessions_lost")
        self._ever_connected = True
        self._connection += 1
        # paho leaves its window as set; an MQTT 5 broker's Receive Maximum bounds it (paho-mqtt 2.x's attribute: its
        # setter refuses on an open connection, and a lower bound only holds back the next sends)
        window = min(OUTBOUND_WINDOW, getattr(properties, "ReceiveMaximum", None) or OUTBOUND_WINDOW)
        client._max_inflight_messages = window  # noqa: SLF001
        if window < OUTBOUND_WINDOW:
            LOG.info("%s: the broker's Receive Maximum bounds this endpoint to %d unacknowledged messages (not %d)",
                     self.client_id, window, OUTBOUND_WINDOW)
        self._nonce = self._armed_nonce
        self._arm_will(client)
        LOG.info("%s: connected to %s:%d", self.client_id, self.url.host, self.url.port)
        if self.unsubscriptions:  # the broker handles it before the SUBSCRIBE below, whose ack marks us ready
            client.unsubscribe(list(self.unsubscriptions))
        with self._subs:
            self._subscribing.clear()
            self._granted.clear()
            self._awaited = set(self.subscriptions)
            if self.subscriptions:
                self._subscribe(client, self.subscriptions, ready=True)
                return
        self._mark_ready()

    def _subscribe(self, client: mqtt.Client, filters: tuple[str, ...] | list[str], ready: bool) -> None:
        """SUBSCRIBE ``filters``, at most SUBSCRIBE_BATCH a packet (a server of many enrolled devices subscribes to
        each one's topics: one packet of them all could pass the broker's packet cap); with ``ready``, the SUBACK
        that grants the last of the connect's own filters marks the endpoint ready."""
        with self._subs:  # held until the mids are noted: their SUBACKs wait for them on the network thread
            for start in range(0, len(filters), SUBSCRIBE_BATCH):
                batch = tuple(filters[start:start + SUBSCRIBE_BATCH])
                code, mid = client.subscribe([(topic, self.qos) for topic in batch])
                if code == MQTTErrorCode.MQTT_ERR_SUCCESS:
                    self._subscribing[mid] = (batch, ready)

    def _on_subscribe(self, client: mqtt.Client, userdata: Any, mid: int, reason_codes: list[Any],
                      properties: Any) -> None:
        """Ready once every subscription is granted: a refused one is asked for again, with backoff, and this
        endpoint says online only then (NATS's MQTT refuses some while its cluster lost a node; an ACL that denies
        one keeps it from ever being ready, and says so every time)."""
        now = time.monotonic()
        with self._subs:
            filters, ready = self._subscribing.pop(mid, ((), False))
            if not filters:
                return
            denied = [topic for topic, code in zip(filters, reason_codes) if code.is_failure]
            granted = [topic for topic, code in zip(filters, reason_codes) if not code.is_failure]
            self._granted.update((topic, now) for topic in granted if topic in self.subscriptions)
            self._awaited.difference_update(granted)
            all_granted = self._all_granted()
        if not denied:
            self._refused_subscriptions = 0
            if ready and all_granted:
                self._mark_ready()
            return
        self._refused_subscriptions += 1
        delay = min(RESUBSCRIBE_MAX_DELAY_S, RECONNECT_MIN_DELAY_S * 2 ** self._refused_subscriptions)
        LOG.warning("%s: broker %s refused subscriptions to %s; asking again in %.1f s", self.client_id, self.url,
                    denied, delay)
        retry = threading.Timer(delay, self._resubscribe, (client, denied, self._connection, ready))
        retry.daemon = True
        retry.start()

    def _resubscribe(self, client: mqtt.Client, filters: list[str], connection: int, ready: bool) -> None:
        if self._started and connection == self._connection and client.is_connected():
            wanted = [topic for topic in filters if topic in self.subscriptions]  # not one unfollowed since
            if wanted:
                self._subscribe(client, wanted, ready)
            elif ready:
                with self._subs:
                    all_granted = self._all_granted()
                if all_granted:
                    self._mark_ready()

    def _all_granted(self) -> bool:
        """Whether every filter of the connect's SUBSCRIBEs still followed is granted (``_subs`` held)."""
        return self._awaited.isdisjoint(self.subscriptions)

    def _mark_ready(self) -> None:
        """Connected and subscribed: say online (a peer that reacts to it reaches this endpoint) and wake waiters."""
        if self._status is not None and self._nonce is not None:
            topic, frames = self._status
            self._client.publish(topic, self._single_frame(frames(True, self._nonce), "online"), qos=self.qos,
                                 retain=True)
        with self._state:
            self._refusal = None
            self.connected.set()
            self._state.notify_all()

    def _on_disconnect(self, client: mqtt.Client, userdata: Any, flags: Any, reason_code: Any,
                       properties: Any) -> None:
        self.connected.clear()
        with self._subs:
            self._granted.clear()
        if self._started:
            LOG.info("%s: disconnected from %s (%s); reconnecting", self.client_id, self.url, reason_code)
            self._next_broker(client)

    def _on_connect_fail(self, client: mqtt.Client, userdata: Any) -> None:
        if self._started:
            self._next_broker(client)

    def _on_publish(self, client: mqtt.Client, userdata: Any, mid: int, reason_code: Any,
                    properties: Any) -> None:
        with self._acks:
            self._ack_seq += 1
            self._acked_at[mid] = self._ack_seq
            self._acks.notify_all()

    def _on_message(self, client: mqtt.Client, userdata: Any, message: mqtt.MQTTMessage) -> None:
        now = time.monotonic()
        topic, frame = frame_stream(message.topic), message.payload
        with self._stats_lock:  # one lock a frame, not two
            self._stats["frames_in"] += 1
            self._stats["bytes_in"] += len(frame)
        if not frame and topic != message.topic:
            return  # a payload's retained frame deleted by its publisher (clear_retained): nothing to read
        try:
            payload = self._reassembler.feed(frame, now, stream=topic)
        except NotAdmitted as exc:
            with self._stats_lock:
                self._stats["frames_unadmitted"] += 1
                unadmitted = self._stats["frames_unadmitted"]
            if unadmitted % UNADMITTED_LOG_EVERY == 1:
                LOG.warning("%s: dropped frame on %s: %s (%d so far)", self.client_id, topic, exc, unadmitted)
            payload = None
        except RepeatedFrame as exc:
            LOG.info("%s: ignored a frame on %s: %s", self.client_id, topic, exc)
            self._bump("frames_repeated")
            payload = None
        except ProtocolError as exc:
            LOG.warning("%s: dropped frame on %s: %s", self.client_id, topic, exc)
            self._bump("frames_rejected")  # after the log line: a reader of the count finds it logged
            payload = None
        if self._reassembler.evicted:
            evicted, self._reassembler.evicted = self._reassembler.evicted, []
            LOG.warning("%s: %d incomplete message(s) pushed out to make room (%d pending, at most %d; %d bytes held, "
                        "at most %d): %s lost", self.client_id, len(evicted), len(self._reassembler.pending_ids),
                        self._reassembler.max_pending, self._reassembler.pending_bytes,
                        self._reassembler.max_pending_bytes, ", ".join(msg_id for _, msg_id in evicted[:3]))
            self._bump("messages_evicted", len(evicted))
            self._note_lost(evicted)
        if self._reassembler.spills:
            spills, self._reassembler.spills = self._reassembler.spills, 0
            self._bump("messages_spilled", spills)
        if payload is not None:
            self._bump("messages_in")
            self._inbox.put(topic, payload)
        if now >= self._next_expiry:
            self._next_expiry = now + EXPIRE_INTERVAL_S
            self._expire(now)

    def _note_lost(self, lost: list[tuple[str, str]]) -> None:
        with self._stats_lock:  # each topic once, the newest MAX_LOST_TOPICS (an owner that never asks stays bounded)
            self._lost.update(dict.fromkeys(stream for stream, _ in lost))
            for stale in list(self._lost)[:-MAX_LOST_TOPICS]:
                del self._lost[stale]

    def _expire(self, now: float) -> None:
        for msg_id in self._reassembler.expire(now):
            LOG.warning("%s: incomplete message %s expired", self.client_id, msg_id)
            self._bump("messages_expired")
        if self._reassembler.expired_lost:  # their senders are asked again, as for those pushed out (take_lost)
            lost, self._reassembler.expired_lost = self._reassembler.expired_lost, []
            self._note_lost(lost)

    @property
    def pending_bytes(self) -> int:
        """Bytes held for incomplete inbound messages, over all topics."""
        return self._reassembler.pending_bytes

    def set_max_message_bytes(self, max_message_bytes: int) -> None:
        """Accept inbound messages of at most this size from now on (at most max_pending_bytes): a device
        lowers it to its model's size once its plan is known."""
        self._reassembler.set_max_message_bytes(max_message_bytes)

    def set_budgets(self, *, max_message_bytes: int, max_pending_messages: int, max_pending_bytes: int | None = None,
                    max_pending_per_sender: int | None = None, max_pending_bytes_per_sender: int | None = None,
                    max_spill_bytes: int = 0, max_queued_bytes: int | None = None) -> None:
        """New inbound budgets from now on, the constructor's arguments of those names (an aggregator learns the
        largest update at its round's brief): the reassembler's (``Reassembler.set_budgets``) and, given
        ``max_queued_bytes``, the inbox's."""
        self._reassembler.set_budgets(max_message_bytes, max_pending_messages, max_pending_bytes,
                                      max_pending_per_sender=max_pending_per_sender,
                                      max_pending_bytes_per_sender=max_pending_bytes_per_sender,
                                      max_spill_bytes=max_spill_bytes)
        if max_queued_bytes is not None:
            self._inbox.set_budget(max_queued_bytes)


def _set_tcp_nodelay(client: mqtt.Client, userdata: Any, sock: Any) -> None:
    """Disable Nagle on the broker socket: with TLS, small messages otherwise stall ~40 ms."""
    if isinstance(sock, socket.socket):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _set_credentials(client: mqtt.Client, url: BrokerURL, username: str | None, password: str | None) -> None:
    """The given credentials, else the broker URL's."""
    username = username if username is not None else url.username
    password = password if password is not None else url.password
    if username is not None:
        client.username_pw_set(username, password)


def _path_or_none(path: str | os.PathLike[str] | None) -> str | None:
    return None if path is None else os.fspath(path)


def speaks_mqtt5(broker_url: str, *, username: str | None = None, password: str | None = None,
                 tls_ca: str | os.PathLike[str] | None = None, tls_cert: str | os.PathLike[str] | None = None,
                 tls_key: str | os.PathLike[str] | None = None, timeout: float = PROBE_TIMEOUT_S) -> bool:
    """Whether the (first) broker of ``broker_url`` accepts an MQTT 5 CONNECT: a throwaway clean session, answered
    within ``timeout`` seconds. A 3.1.1-only broker refuses it (NATS: unacceptable protocol version) or never
    answers (amqtt 0.12): False, and the endpoints speak 3.1.1 there."""
    url = parse_brokers(broker_url)[0]
    answered, accepted = threading.Event(), []
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"fedara-probe-{uuid.uuid4().hex[:12]}",
                         protocol=mqtt.MQTTv5)
    _set_credentials(client, url, username, password)
    if url.tls:
        client.tls_set(ca_certs=_path_or_none(tls_ca), certfile=_path_or_none(tls_cert), keyfile=_path_or_none(tls_key))

    def on_connect(_client: mqtt.Client, _userdata: Any, _flags: Any, reason_code: Any, _properties: Any) -> None:
        accepted.append(not reason_code.is_failure)
        answered.set()

    client.on_connect = on_connect
    client.on_connect_fail = lambda *_: answered.set()
    client.on_disconnect = lambda *_: answered.set()
    try:
        client.connect_async(url.host, url.port, keepalive=KEEPALIVE_S, clean_start=True)
        client.loop_start()
        answered.wait(timeout)
    finally:
        client.disconnect()
        client.loop_stop()
    return accepted == [True]
