"""The MQTT side of a secure round: the broker loop relays SecAgg+'s exchanges between the devices and the engine's
``SecAggServer`` (``engine.secure_round``, the state machine the simulator drives in process), and closes each
phase when everyone it waits for answered or at the phase's deadline.

- ``keys``: every participant's advertised keys, until all advertised or ``phase_timeout`` after the round opened;
  then each device that advertised gets its neighbours' keys.
- ``shares``: the sealed shares of each device that advertised, until all shared or ``phase_timeout`` later; then
  each device that shared gets the sealed shares addressed to it. A device that misses this phase is out.
- ``masked``: the masked inputs (in the devices' UPDATEs, ``secagg_wire.masked_of``), until every device that shared
  sent its input or went offline, or the round's deadline; then the survivors are named to each of them.
- ``unmask``: each survivor's unmasking shares, until all came or ``phase_timeout`` later; the engine then unmasks
  the sum when the round closes (``SecureRounds.step``), or says in one line why it cannot.

A device gone offline (its last will) is not waited for in any phase: the phase closes without it.

What arrives for another phase, from a device outside the phase, twice, of the wrong size or kind, is refused with a
logged reason and changes nothing; in particular a masked input after the unmasking began never counts. Each message
is size-checked against the round's parameters before it is kept (``device_runtime.secagg_wire``).
"""
from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Container, Iterable

from device_runtime import secagg_wire
from device_runtime.envelope import Message
from device_runtime.messages import MessageError
from server.engine.round_engine import RoundEngine
from server.engine.secure_aggregation import SecAggServer
from server.outputs.refusals import count_refusal

LOG = logging.getLogger("fedara.server")


class SecureRelay:
    """One run's relay of its secure rounds (see the module docstring)."""

    def __init__(self, engine: RoundEngine, send: Callable[[str, Message], None], phase_timeout: float,
                 refusals: Counter):
        self.engine, self.send, self.phase_timeout, self.refusals = engine, send, phase_timeout, refusals
        self.round = 0
        self.phase_deadline = 0.0
        self.unmask_asked = False

    @property
    def server(self) -> SecAggServer | None:
        """The open round's SecAgg+ server side, or None (not a secure round)."""
        return self.engine.secure_round

    def open(self, round_index: int, now: float) -> None:
        """A round opened (its tasks went out): the keys phase runs until ``phase_timeout`` from now."""
        self.round, self.phase_deadline, self.unmask_asked = round_index, now + self.phase_timeout, False

    def _refuse(self, device_id: str, round_index: int, what: str, problem: str) -> None:
        LOG.warning("refused %s from %s for secure aggregation (round %d): %s", what, device_id, round_index, problem)
        count_refusal(self.refusals, f"secagg {what}")

    # -- inbound --------------------------------------------------------------------------------

    def on_message(self, device_id: str, msg: Message) -> None:
        """A SECAGG message from a device: its keys, its sealed shares or its unmasking shares."""
        server = self.server
        try:
            phase = secagg_wire.phase_of(msg)
        except MessageError as exc:
            self._refuse(device_id, msg.round, "a message", str(exc))
            return
        if server is None or msg.round != self.round:
            self._refuse(device_id, msg.round, phase, f"round {msg.round} has no secure exchange under way")
            return
        neighbours = server.graph.get(device_id, ())
        try:
            if phase == secagg_wire.KEYS:
                problem = server.receive_keys(device_id, secagg_wire.parse_keys(msg))
            elif phase == secagg_wire.SHARES:
                problem = server.receive_shares(device_id, secagg_wire.parse_shares(msg, neighbours))
            else:
                holds = (*neighbours, device_id)  # a device holds a share of its own secrets (classic SecAgg)
                problem = server.receive_unmasking(device_id, secagg_wire.parse_unmasking(msg, holds))
        except MessageError as exc:
            problem = str(exc)
        if problem is not None:
            self._refuse(device_id, msg.round, phase, problem)

    def takes_masked(self, device_id: str, msg: Message) -> bool:
        """Whether an UPDATE of the open round is a secure participant's (its masked input goes to ``on_masked``)."""
        server = self.server
        return server is not None and msg.round == self.round and device_id in server.spec.participants

    def on_masked(self, device_id: str, msg: Message) -> bool:
        """A participant's UPDATE: whether its masked input counts (else refused, with its reason logged, and the
        update must not count either)."""
        server = self.server
        try:
            y = secagg_wire.masked_of(msg, server.dimension, server.spec.quantizer.bits)
            problem = server.receive_masked(device_id, y)
        except MessageError as exc:
            problem = str(exc)
        if problem is not None:
            self._refuse(device_id, msg.round, "a masked input", problem)
        return problem is None

    # -- the phases -----------------------------------------------------------------------------

    def tend(self, now: float) -> bool:
        """Close the phases that are due (everyone answered, or the deadline) and relay what they give; True once
        the exchanges are over (the round may close: the engine unmasks)."""
        server = self.server
        if server is None:
            return True
        while True:
            phase = server.phase
            if phase == "keys" and self._due(server.spec.participants, server.keys, now):
                self._close_keys(server, now)
            elif phase == "shares" and self._due(server.keys, server.sealed, now):
                self._close_shares(server, now)
            elif phase == "masked" and self._masked_done(server, now):
                self._close_masked(server, now)
            elif phase == "unmask":
                return self._due(server.masked, server.revealed, now)
            else:
                return phase not in ("keys", "shares", "masked")

    def _due(self, members: Iterable[str], answered: Container[str], now: float) -> bool:
        """A phase may close: every member answered or is offline (its last will), or the phase's deadline passed."""
        registry = self.engine.registry()
        return now >= self.phase_deadline or not any(d not in answered and registry[d].online for d in members)

    def _close_keys(self, server: SecAggServer, now: float) -> None:
        relay = server.close_keys(now)
        missing = sorted(set(server.spec.participants) - set(server.keys))
        if missing:
            LOG.warning("round %d: %d device(s) did not advertise keys in time (%s): they are out of the secure round",
                        self.round, len(missing), ", ".join(missing[:3]))
        for device_id, keys in relay.items():
            self.send(device_id, secagg_wire.neighbour_keys_message(keys, device_id=device_id,
                                                                    run_id=self.engine.run_id, round_index=self.round))
        self.phase_deadline = now + self.phase_timeout

    def _close_shares(self, server: SecAggServer, now: float) -> None:
        relay = server.close_shares(now)
        missing = sorted(set(server.keys) - set(server.sealed))
        if missing:
            LOG.warning("round %d: %d device(s) did not share in time (%s): they are out of the secure round",
                        self.round, len(missing), ", ".join(missing[:3]))
        for device_id, sealed in relay.items():
            self.send(device_id, secagg_wire.shares_message(sealed, device_id=device_id, run_id=self.engine.run_id,
                                                            round_index=self.round))

    def _masked_done(self, server: SecAggServer, now: float) -> bool:
        """Every device that shared sent its masked input or is offline, or the round's deadline passed."""
        registry = self.engine.registry()
        opened = self.engine.opened
        return (opened is None or now >= opened.deadline
                or not any(d not in server.masked and registry[d].online for d in server.sealed))

    def _close_masked(self, server: SecAggServer, now: float) -> None:
        survivors = server.close_masked(now)
        dropped = sorted(set(server.sealed) - set(server.masked))
        if dropped:
            LOG.info("round %d: %d device(s) dropped after sharing (%s)", self.round, len(dropped),
                     ", ".join(dropped[:3]))
        for device_id in survivors:  # () when the round cannot be unmasked: nobody is asked for a share
            self.send(device_id, secagg_wire.survivors_message(survivors, device_id=device_id,
                                                               run_id=self.engine.run_id, round_index=self.round))
        self.phase_deadline = now + self.phase_timeout
