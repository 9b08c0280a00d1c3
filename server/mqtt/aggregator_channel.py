"""The round engine's conversation with its aggregator processes over the broker, for the broker loop.

The engine decides (who is a member, what to fold, whether a partial is taken); this channel carries it: it
briefs the members at a round's open, passes their receipts to the engine and its verdicts back, asks for the
partial sums at the close, and tends members that fall silent (a member silent for ``--aggregator-timeout`` is
lost and its devices are asked again; one silent for a while is sent again what it should answer), and hands on the
devices whose updates a member lost half-received (``lost``: the server asks them again, ``server.mqtt.lost_updates``).
The wire encoding is ``aggregation_wire``'s.
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from device_runtime.envelope import Message
from device_runtime.link import Link, Refused
from device_runtime.transport import MqttEndpoint
from server.engine import folding_records as folding
from server.engine.round_engine import RoundEngine
from server.engine.run_config import RunError
from server.mqtt import aggregation_wire as wire
from server.outputs.refusals import count_refusal, update_refusal

LOG = logging.getLogger("fedara.server")
PROBE_MAX_S = 5.0
"""The longest a member stays unasked while the server waits on it."""


class AggregatorChannel:
    """The engine's side of the conversation with the aggregators ``names`` (none: the server reads every update)."""

    def __init__(self, engine: RoundEngine, endpoint: MqttEndpoint, link: Link | None, *, prefix: str,
                 names: tuple[str, ...], timeout_s: float, join_timeout_s: float, max_inbound: int, logs: Path,
                 pump: Callable[..., bool], send_task: Callable[[str], None], lost: Callable[[list[str]], None],
                 refusals: Counter[str]) -> None:
        """``lost``: takes the devices whose updates a member lost half-received (to be asked again)."""
        self.engine, self.endpoint, self.link, self.prefix, self.names = engine, endpoint, link, prefix, names
        self.timeout_s, self.join_timeout_s, self.max_inbound, self.logs = timeout_s, join_timeout_s, max_inbound, logs
        self.pump, self.send_task, self.lost, self.refusals = pump, send_task, lost, refusals
        self.at: dict[str, int] = {}  # aggregator -> the round whose brief it holds (0: started)
        self.heard: dict[str, float] = {}  # aggregator -> when it last said anything (monotonic)
        self.asked: dict[str, float] = {}  # aggregator -> when it was last sent its brief or asked for its partial
        self.brief: folding.Brief | None = None  # the open round's, as last sent
        self.merged: set[tuple[str, int]] = set()  # (aggregator, round) of every partial taken
        self.probe_s = min(PROBE_MAX_S, timeout_s / 4)

    def persist(self) -> None:
        """Make the partials accepted so far durable on the aggregators' link (before a checkpoint folds them)."""
        if self.link is not None:
            self.link.persist()

    def sender(self, topic: str) -> str | None:
        """The aggregator that ``topic`` is the up topic of, None for any other topic (or without aggregators)."""
        return wire.aggregator_from_topic(self.prefix, topic) if self.names else None

    def handle(self, aggregator: str, payload: bytes) -> None:
        """A sealed message from an aggregator: started or briefed, a receipt to judge, updates it lost, or its partial
        sums."""
        if aggregator not in self.names:
            LOG.warning("dropped a message from %s: not an aggregator of this run", aggregator)
            return
        try:
            msg = self.link.open(payload, self.engine.run_id, device_id=aggregator)
            kind = wire.kind_of(msg)
            self.heard[aggregator] = time.monotonic()
            if kind == wire.READY:
                self.at[aggregator] = msg.round
                if msg.meta.get("reconnected") is True and self.engine.opened is not None:
                    self._ask_again(aggregator)
            elif kind == wire.RECEIPT:
                receipt = wire.parse_receipt(msg)
                verdict = self.engine.receive_receipt(aggregator, receipt, time.monotonic())
                if not verdict.accepted:
                    LOG.warning("dropped an update from %s (round %d, via %s): %s", receipt.device_id, receipt.round,
                                aggregator, verdict.reason)
                    count_refusal(self.refusals, update_refusal(verdict.reason))
                self._to(aggregator, wire.verdict_message(aggregator, receipt.round, receipt.device_id,
                                                                     verdict.accepted, verdict.reason))
            elif kind == wire.LOST:
                self._lost_by(aggregator, msg)
            elif kind == wire.PARTIAL:
                partial = wire.parse_partial(msg)
                problem = self.engine.receive_partial(aggregator, partial)
                if problem is None:
                    self.merged.add((aggregator, partial.round))
                    LOG.info("round %d: partial sums of %s over %d update(s)", partial.round, aggregator,
                             len(partial.devices))
                elif (aggregator, partial.round) in self.merged:  # it answered a request sent again, too
                    LOG.info("round %d: the partial sums of %s came again; taken once", partial.round, aggregator)
                else:
                    LOG.warning("round %d: refused the partial sums of %s: %s", partial.round, aggregator, problem)
            else:
                LOG.warning("dropped a %s message from aggregator %s", kind, aggregator)
        except (Refused, wire.WireError) as exc:
            LOG.warning("dropped a message from aggregator %s: %s", aggregator, exc)
            count_refusal(self.refusals, "aggregator message")

    def _lost_by(self, aggregator: str, msg: Message) -> None:
        """``aggregator`` lost these devices' updates of the open round half-received: those the round awaits from it
        go to ``lost``; any other (another member's, one whose answer came, another round's) is ignored, logged."""
        brief, opened = self.brief, self.engine.opened
        if brief is None or opened is None or not msg.round == brief.round == opened.round:
            LOG.warning("ignored the updates %s lost in round %d: %s is open", aggregator, msg.round,
                        f"round {opened.round}" if opened is not None else "no round")
            return
        devices = wire.parse_lost(msg, len(brief.devices))
        routed = set(self.engine.routed_to(aggregator))
        ignored = [d for d in devices if d not in routed]
        if ignored:
            LOG.warning("ignored %d update(s) %s says it lost in round %d (%s): the round awaits none of them from it",
                        len(ignored), aggregator, msg.round, ", ".join(ignored[:8]))
        asked = [d for d in devices if d in routed]
        if asked:
            LOG.info("round %d: %s lost %d update(s) half-received: %s", msg.round, aggregator, len(asked),
                     ", ".join(asked))
            self.lost(asked)

    def _to(self, aggregator: str, msg: Message) -> None:
        self.endpoint.publish(wire.down_topic(self.prefix, aggregator), self.link.seal(msg),
                              msg.msg_id)

    def wait_for_start(self) -> None:
        """Every aggregator subscribed, before any device gets a task (an update no member reads is lost)."""
        if not self.pump(lambda: set(self.names) <= set(self.at),
                          time.monotonic() + self.join_timeout_s):
            missing = sorted(set(self.names) - set(self.at))
            raise RunError(f"aggregators {missing} did not start within --join-timeout {self.join_timeout_s:g} s; "
                           f"see {self.logs}/*.log")

    def send_brief(self) -> folding.Brief:
        """The open round's brief to every aggregator (the members, and the others: they may take it and join)."""
        self.brief = self.engine.brief(self.max_inbound)
        now = time.monotonic()
        for aggregator in self.names:
            self._to(aggregator, wire.brief_message(self.brief, aggregator))
            self.asked[aggregator] = now
        return self.brief

    def brief_members(self) -> None:
        """Send every aggregator the open round's brief; wait (bounded) until each member of the last round holds
        it. Those that hold it are this round's members: the devices are routed over them."""
        expected = set(self.engine.members) or set(self.names)
        self.engine.set_members(())  # until they hold it: a task sent meanwhile names none (the engine reads it)
        brief = self.send_brief()
        briefed = lambda: {a for a in self.names if self.at.get(a) == brief.round}  # noqa: E731
        if not self.pump(lambda: expected <= briefed(), time.monotonic() + self.timeout_s):
            LOG.warning("round %d: aggregators %s did not take its brief within --aggregator-timeout %g s: their "
                        "devices go to the others", brief.round, sorted(expected - briefed()),
                        self.timeout_s)
        members = briefed()
        if not members:
            LOG.warning("round %d: no aggregator holds its brief: the server reads the updates itself", brief.round)
        self.engine.set_members(members)
        self.heard.update(dict.fromkeys(members, time.monotonic()))

    def collect_partials(self, round_index: int) -> None:
        """Ask each aggregator told to fold updates for its partial sums; wait for them (bounded), or until a lost
        member's devices are awaited again."""
        for aggregator in self.engine.partials_missing():
            self._to(aggregator, wire.close_message(aggregator, round_index, self.engine.fold_list(aggregator)))
            self.asked[aggregator] = time.monotonic()
        reopened = lambda: self.engine.closing(time.monotonic()) is None  # noqa: E731 (a lost member's devices)
        if not self.pump(lambda: not self.engine.partials_missing() or reopened(),
                          time.monotonic() + self.timeout_s):
            LOG.warning("round %d: no partial sums from %s within --aggregator-timeout %g s (their logs: %s)",
                        round_index, self.engine.partials_missing(), self.timeout_s,
                        self.logs)

    def tend(self, now: float) -> None:
        """While a round is open: a member silent for --aggregator-timeout is lost (its devices are asked again, to
        the others); one silent for a while is sent what it should answer (the brief, or the request for its
        partial: either may have been lost while it or the server changed broker)."""
        if self.brief is None or self.engine.opened is None or self.brief.round != self.engine.opened.round:
            return
        missing = self.engine.partials_missing()
        for aggregator in self.names:
            member = aggregator in self.engine.members
            if member and now - self.heard.get(aggregator, now) > self.timeout_s:
                for device_id in self.engine.member_lost(aggregator):
                    self.send_task(device_id)
                continue
            if now - max(self.heard.get(aggregator, 0.0), self.asked.get(aggregator, 0.0)) < self.probe_s:
                continue
            if aggregator in missing and self.engine.closing(now) is not None:
                self._to(aggregator, wire.close_message(aggregator, self.brief.round,
                                                                     self.engine.fold_list(aggregator)))
            elif member or self.at.get(aggregator) != self.brief.round:
                self._to(aggregator, wire.brief_message(self.brief, aggregator))
            self.asked[aggregator] = now

    def _ask_again(self, aggregator: str) -> None:
        """``aggregator`` connected again: what its devices sent while it was away is lost; send them their task again
        (a device that answered re-sends its answer)."""
        devices = self.engine.routed_to(aggregator)
        if devices:
            LOG.info("aggregator %s connected again: asking %s again", aggregator, ", ".join(devices))
        for device_id in devices:
            self.send_task(device_id)
