"""One side's authenticated link: seal what it sends, open (decode and verify) what it receives.

This is the thin shell around auth.Verifier that the server loop and the device agent call: ``seal`` on every
outbound message, ``open`` on every inbound payload before anything else looks at it. ``open`` raises Refused
for anything not to be believed, and only an accepted message advances the Verifier's counters (journaled under
``state_dir`` after each accept by auth.VerifierStore and made durable before anything is sealed or ``persist``
is called, so a restarted receiver still refuses what it accepted and acted on before).

Sessions (auth module docstring): a device's link has a session nonce fresh at every process start, names it in
everything it seals and opens only what names it; the server's link names, in what it seals for a device, the
session that device's freshest message named.

Which run a message must belong to depends on its type. A server takes a JOIN (a device announces itself with
the run it last knew) and a STATUS from any run, everything else only from its current run. A device takes every
message from any run: the server's counters are fresh across runs, so an old run's message is refused as a
replay anyway, and the agent itself compares a TASK's run with its own (a TASK of another run makes it rejoin;
only a PLAN starts a new run). Counters alone make run-free messages fresh.
"""
from __future__ import annotations

import os
from collections.abc import Collection
from dataclasses import replace

from device_runtime.auth import (SESSION_KEY, CounterSource, Direction, KeyRing, Refusal, Verifier, VerifierStore,
                                 new_nonce, start_counters)
from device_runtime.envelope import Message, MessageType, decode, seal
from device_runtime.protocol import ProtocolError, Reason
from device_runtime.status import Status, StatusError, StatusSigner, parse_status
from device_runtime.topics import TopicKind, check_topic_device

SERVER_RUN_FREE = frozenset((MessageType.JOIN, MessageType.STATUS))
DEVICE_RUN_FREE = frozenset(MessageType)


class Refused(Exception):
    """An inbound payload not to be believed; ``reason`` is a protocol Reason or an auth Refusal."""

    def __init__(self, reason: Reason | Refusal | str, detail: str, device_id: str | None = None) -> None:
        super().__init__(reason, detail)
        self.reason, self.detail, self.device_id = reason, detail, device_id

    def __str__(self) -> str:
        return f"{self.detail} [{getattr(self.reason, 'value', self.reason)}]"


class Link:
    """Seals with this side's counters and opens with its Verifier (see the module docstring)."""

    def __init__(self, keys: KeyRing, counters: CounterSource, sends: Direction, verifier: Verifier,
                 run_free: Collection[MessageType], max_inbound: int, *, store: VerifierStore | None = None,
                 allow_nonfinite: bool = False) -> None:
        self.keys, self.counters, self.sends, self.verifier = keys, counters, sends, verifier
        self.run_free, self.max_inbound, self.allow_nonfinite = frozenset(run_free), max_inbound, allow_nonfinite
        self.store = store  # where each accept is journaled; None: in memory only

    @classmethod
    def on_disk(cls, keys: KeyRing, sends: Direction, takes: Collection[Direction],
                run_free: Collection[MessageType], max_inbound: int, state_dir: str | os.PathLike[str], *,
                allow_nonfinite: bool = False, session: str | None = None) -> Link:
        """A link whose counters and last accepted counters live in ``state_dir``: a fresh epoch for this start,
        and whatever an earlier start there accepted stays refused. ``session``: this side's own session nonce
        (see the module docstring), None on a side that learns its peers' sessions."""
        store = VerifierStore(state_dir)
        verifier = Verifier(keys, takes, store.load(), session=session)
        return cls(keys, start_counters(state_dir), sends, verifier, run_free, max_inbound, store=store,
                   allow_nonfinite=allow_nonfinite)

    @classmethod
    def server(cls, keys: KeyRing, state_dir: str | os.PathLike[str], max_inbound: int) -> Link:
        """The server's link: sends down, takes up and status; non-finite tensors reach its own checks."""
        return cls.on_disk(keys, Direction.DOWN, {Direction.UP, Direction.STATUS}, SERVER_RUN_FREE, max_inbound,
                           state_dir, allow_nonfinite=True)

    @classmethod
    def device(cls, device_id: str, key: bytes, state_dir: str | os.PathLike[str], max_inbound: int, *,
               session: str | None = None) -> Link:
        """A device's link: sends up (and status), takes down messages addressed to it and bound to its session
        (default: a fresh one, for this process start)."""
        return cls.on_disk(KeyRing({device_id: key}), Direction.UP, {Direction.DOWN}, DEVICE_RUN_FREE, max_inbound,
                           state_dir, session=session or new_nonce())

    @property
    def session(self) -> str | None:
        """This side's own session nonce (a device's), or None."""
        return self.verifier.session

    def persist(self) -> None:
        """Make every accept so far durable (the store's group commit): before a checkpoint that folds what was
        accepted, and, by ``seal``, before anything is sent."""
        if self.store is not None:
            self.store.sync()

    def seal(self, msg: Message) -> bytes:
        """``msg`` as an envelope under its device's key with this side's next counter, bound to the session (this
        side's own, else the one its peer last named; none before the peer named one). What was accepted before
        is durable first: nothing sent can rest on an accept a crash would forget."""
        self.persist()
        key = self.keys.key_for(msg.device_id)
        if key is None:
            raise ValueError(f"no key for device {msg.device_id!r}: enroll it before sending to it")
        session = self.verifier.session or self.verifier.session_of(msg.device_id)
        if session is not None:
            msg = replace(msg, meta={**msg.meta, SESSION_KEY: session})
        return seal(msg, key, self.sends, self.counters.next())

    def reseal(self, payload: bytes) -> bytes:
        """A message this side sealed earlier (a saved answer), sealed again with a fresh counter: the receiver
        refuses the old counter once it accepted anything newer."""
        return self.seal(decode(payload, max_bytes=len(payload), allow_nonfinite=True))

    def status_signer(self, device_id: str) -> StatusSigner:
        """The status frames of ``device_id`` (for MqttEndpoint's ``status``), on this side's counters."""
        key = self.keys.key_for(device_id)
        if key is None:
            raise ValueError(f"no key for device {device_id!r}")
        return StatusSigner(device_id, key, self.counters, self.verifier.session)

    def open(self, payload: bytes, current_run: str, *, device_id: str, kind: TopicKind = TopicKind.UP,
             commit: bool = True) -> Message:
        """Decode and verify ``payload`` received on the ``kind`` topic of ``device_id``; raises Refused.

        STATUS frames belong on the status topic and UPDATEs on the update topic, each nowhere else. With
        ``commit=False`` nothing changes: it says whether ``payload`` would be taken now (a screen)."""
        return self.open_with_status(payload, current_run, device_id=device_id, kind=kind, commit=commit)[0]

    def open_with_status(self, payload: bytes, current_run: str, *, device_id: str, kind: TopicKind = TopicKind.UP,
                         commit: bool = True) -> tuple[Message, Status | None]:
        """``open``, and the Status a STATUS frame says (read here, once, for the Verifier); None for any other
        message."""
        try:
            msg = decode(payload, max_bytes=self.max_inbound, allow_nonfinite=self.allow_nonfinite)
            check_topic_device(device_id, msg.device_id)
        except ProtocolError as exc:
            raise Refused(exc.reason, exc.message, device_id) from None
        for only_type, topic_kind in ((MessageType.STATUS, TopicKind.STATUS), (MessageType.UPDATE, TopicKind.UPDATE)):
            if (msg.type == only_type) != (kind == topic_kind):
                raise Refused(Reason.BAD_TOPIC, f"a {msg.type.value} message on the {kind.value} topic", device_id)
        status = state = nonce = None
        if msg.type == MessageType.STATUS:
            try:
                status = parse_status(msg)
            except StatusError as exc:
                raise Refused(Reason.BAD_META, str(exc), device_id) from None
            state, nonce = status.state, status.nonce
        runs = None if msg.type in self.run_free else {current_run}
        session = msg.meta.get(SESSION_KEY)
        verdict = self.verifier.check(msg, runs, status=state, nonce=nonce,
                                      session=session if isinstance(session, str) else None, commit=commit)
        if not verdict.accepted:
            raise Refused(verdict.reason or Refusal.BAD_TAG, f"{msg.type.value} {msg.msg_id}: {verdict.detail}",
                          device_id)
        if self.store is not None and commit:
            self.store.record(self.verifier, msg.device_id)
        return msg, status
