"""How an aggregator process reads the updates routed to it (server/aggregator.py, server/mqtt/read_budgets.py): as
the server does. Past its memory budget a burst's authenticated half-received updates wait in files of its workdir
instead of being pushed out (lost there: nothing asks their devices again), the budgets follow the round's brief, and
the spill folder goes when the process exits. The updates it verified await the engine's verdict in memory up to a
few largest updates, in files past that (server/awaiting_updates.py)."""
from __future__ import annotations

import _thread
import signal
import subprocess
import sys
import threading
from argparse import Namespace
from pathlib import Path

import numpy as np
import paho.mqtt.publish
import pytest
import torch

from device_runtime.auth import KeyRing
from device_runtime.envelope import Message, MessageType
from device_runtime.framing import DEFAULT_MAX_FRAME_BYTES, FRAME_HEADER_BYTES, Reassembler, chunk
from device_runtime.messages import update_message
from device_runtime.spill import FileSpill
from device_runtime.task import Update
from device_runtime.topics import Topics
from device_runtime.transport import BrokerURL
from server import aggregator
from server.aggregator import Aggregator, Shell, member_budgets, member_endpoint
from server.awaiting_updates import AWAITING_DIR
from server.engine import folding_records as folding
from server.mqtt import aggregation_wire as wire
from server.mqtt.admission import aggregator_admission
from server.mqtt.enrollment import save_enrollment
from server.mqtt.read_budgets import PENDING_UPDATES_BUDGETED, QUEUED_UPDATES_BUDGETED, SPILL_DIR
from tests.support.processes import child_env
from tests.support.engine import RUN, join, make_engine
from tests.support.sealing import KEY, OPEN_MAX, read, seal_up
from tests.support.waiting import wait_for

PREFIX, NAME = "fedara", "agg-0"
DEVICES = tuple(f"dev_{i:03d}" for i in range(12))
SERVER_KEY = bytes(range(100, 132))
UPDATE_BYTES = 12_000
"""Each device's update tensor: 12 of them (~148 KB sealed) are more than the memory budget of MAX_INBOUND."""
MAX_INBOUND = 16_000
BRIEF_BYTES = 20_000
"""The members' BRIEF_BYTES in these tests (16 MiB in a run): what a member takes of any kind."""
FRAME_1K = FRAME_HEADER_BYTES + 1000
WAIT_S = 20.0


@pytest.fixture(autouse=True)
def small_briefs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(aggregator, "BRIEF_BYTES", BRIEF_BYTES)


def brief(max_inbound: int = MAX_INBOUND) -> folding.Brief:
    return folding.Brief("run-1", 1, {}, {}, {}, max_inbound)


def update_of(device_id: str) -> bytes:
    """``device_id``'s UPDATE, sealed under its key (every device's here: KEY)."""
    return seal_up(Message(MessageType.UPDATE, "run-1", 1, device_id, f"update-{device_id}", {},
                           tensors={"w": np.arange(UPDATE_BYTES, dtype=np.uint8)}))


def member_reassembler(spill: FileSpill) -> Reassembler:
    """The reassembler a member's endpoint holds once round 1's brief came (``member_budgets``)."""
    budgets = member_budgets(len(DEVICES), brief())
    admit, vouch = aggregator_admission(PREFIX, NAME, KeyRing(dict.fromkeys(DEVICES, KEY)), SERVER_KEY)
    return Reassembler(budgets["max_message_bytes"], 60.0, budgets["max_pending_messages"],
                       budgets["max_pending_bytes"], admit=admit, vouch=vouch,
                       max_pending_per_sender=budgets["max_pending_per_sender"],
                       max_pending_bytes_per_sender=budgets["max_pending_bytes_per_sender"], spill=spill,
                       max_spill_bytes=budgets["max_spill_bytes"])


def interleaved(updates: dict[str, bytes], frame_bytes: int) -> list[tuple[str, bytes]]:
    """(topic, frame) of every device's update, one frame of each in turn (as mosquitto forwards a burst)."""
    frames = {Topics(PREFIX, d).update_via(NAME): chunk(p, frame_bytes, f"update-{d}") for d, p in updates.items()}
    return [(topic, fs[i]) for i in range(max(map(len, frames.values()))) for topic, fs in frames.items()
            if i < len(fs)]


def test_past_its_memory_budget_a_member_spills_a_bursts_updates_and_every_one_completes(tmp_path: Path):
    r = member_reassembler(FileSpill(tmp_path))
    updates = {d: update_of(d) for d in DEVICES}
    done = [bytes(out) for topic, frame in interleaved(updates, FRAME_1K)
            if (out := r.feed(frame, 0.0, stream=topic)) is not None]
    assert sorted(done) == sorted(updates.values()) and r.evicted == []
    assert r.spills >= 1 and r.pending_bytes == 0 and list(tmp_path.iterdir()) == []


def test_a_members_budgets_follow_its_briefs_largest_update():
    before, small, large = (member_budgets(len(DEVICES), b) for b in (None, brief(), brief(4 * BRIEF_BYTES)))
    assert before["max_spill_bytes"] == 0 and before["max_message_bytes"] == BRIEF_BYTES  # no update awaited yet
    for budgets, largest in ((small, MAX_INBOUND), (large, 4 * BRIEF_BYTES)):
        assert budgets["max_pending_bytes"] == PENDING_UPDATES_BUDGETED * largest
        assert budgets["max_spill_bytes"] == len(DEVICES) * largest
        assert budgets["max_queued_bytes"] == QUEUED_UPDATES_BUDGETED * largest
    assert small["max_message_bytes"] == BRIEF_BYTES and large["max_message_bytes"] == 4 * BRIEF_BYTES


class BudgetedEndpoint:
    """What a Shell uses of its endpoint: the budgets it was given, what it published."""

    def __init__(self) -> None:
        self.budgets: dict[str, int] | None = None
        self.sent: list[str] = []

    def set_budgets(self, **budgets: int) -> None:
        self.budgets = budgets

    def publish(self, topic: str, payload: bytes, msg_id: str) -> None:
        self.sent.append(topic)


def test_a_brief_sets_the_members_budgets_for_its_largest_update(tmp_path: Path):
    engine_side = wire.engine_link(SERVER_KEY, tmp_path / "engine", OPEN_MAX)
    member_link = wire.aggregator_link(SERVER_KEY, tmp_path / "member", OPEN_MAX)
    engine_side.open(member_link.seal(wire.message(wire.READY, NAME)), "run-1", device_id=NAME)  # binds its session
    endpoint = BudgetedEndpoint()
    shell = Shell(Namespace(prefix=PREFIX), Aggregator(NAME, KeyRing(dict.fromkeys(DEVICES, KEY))), endpoint,
                  member_link, len(DEVICES))
    shell.handle(wire.down_topic(PREFIX, NAME), engine_side.seal(wire.brief_message(brief(3 * BRIEF_BYTES), NAME)))
    assert endpoint.budgets == member_budgets(len(DEVICES), brief(3 * BRIEF_BYTES))
    assert endpoint.sent == [wire.up_topic(PREFIX, NAME)]  # READY for the brief


def test_new_budgets_hold_from_the_next_frame_on(tmp_path: Path):
    r = Reassembler(1_000, 60.0, 4, spill=FileSpill(tmp_path))
    frames = chunk(bytes(3_000), FRAME_1K, "m")
    with pytest.raises(Exception, match="over 1000"):
        r.feed(frames[0], 0.0)
    r.set_budgets(4_000, 4, 4_000, max_spill_bytes=4_000)
    assert [r.feed(f, 0.0) for f in frames][-1] == bytes(3_000)
    with pytest.raises(ValueError, match="max_pending_bytes_per_sender"):
        r.set_budgets(4_000, 4, 4_000, max_pending_bytes_per_sender=1_000)


def member_args(broker: str) -> Namespace:
    return Namespace(prefix=PREFIX, name=NAME, broker=broker, username=None, password=None, tls_ca=None, tls_cert=None,
                     tls_key=None, max_message_bytes=DEFAULT_MAX_FRAME_BYTES)


def test_a_members_endpoint_over_mosquitto_spills_a_burst_and_pushes_out_nothing(mosquitto_broker, tmp_path: Path):
    """The member's own endpoint, budgets set as a brief sets them: every update of an interleaved burst completes,
    some through the spill, none pushed out (the server's twin: tests/wire/test_transport.py)."""
    endpoint = member_endpoint(member_args(mosquitto_broker.url), KeyRing(dict.fromkeys(DEVICES, KEY)), SERVER_KEY,
                               FileSpill(tmp_path / SPILL_DIR))
    endpoint.start()
    try:
        wait_for(endpoint.connected.is_set, WAIT_S, "the member connected")
        endpoint.set_budgets(**member_budgets(len(DEVICES), brief()))
        updates = {Topics(PREFIX, d).update_via(NAME): update_of(d) for d in DEVICES}
        url = BrokerURL.parse(mosquitto_broker.url)
        paho.mqtt.publish.multiple([(topic, frame, 1, False) for topic, frame in
                                    interleaved({d: updates[Topics(PREFIX, d).update_via(NAME)] for d in DEVICES},
                                                FRAME_1K)], hostname=url.host, port=url.port)
        got = dict(endpoint.get(WAIT_S) for _ in updates)
        assert got == updates
        assert endpoint.stats["messages_spilled"] >= 1 and endpoint.stats["messages_evicted"] == 0
    finally:
        endpoint.stop()


def test_the_spill_folder_is_removed_when_the_member_is_interrupted(mosquitto_broker, tmp_path: Path):
    """In-process, as SIGTERM ends it (``main`` makes it a KeyboardInterrupt): the twin below runs the process."""
    workdir = tmp_path / "work"
    args = Namespace(**vars(member_args(mosquitto_broker.url)), broker_connect_timeout=WAIT_S, workdir=str(workdir),
                     enroll=str(save_enrollment(tmp_path / "enrollment.json", dict.fromkeys(DEVICES, KEY))))

    def interrupt_once_reading() -> None:
        wait_for(lambda: (workdir / SPILL_DIR).is_dir(), WAIT_S, "the spill folder made")
        _thread.interrupt_main()

    threading.Thread(target=interrupt_once_reading, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        aggregator.run(args)
    assert workdir.is_dir() and not (workdir / SPILL_DIR).exists()


@pytest.mark.slow
def test_the_spill_folder_is_removed_when_the_member_is_ended_with_sigterm(mosquitto_broker, tmp_path: Path):
    enrollment = save_enrollment(tmp_path / "enrollment.json", dict.fromkeys(DEVICES, KEY))
    workdir, log = tmp_path / "work", tmp_path / "member.log"
    with open(log, "w") as out:
        member = subprocess.Popen([sys.executable, "-m", "server.aggregator", "--broker", mosquitto_broker.url,
                                   "--name", NAME, "--prefix", PREFIX, "--enroll", str(enrollment), "--workdir",
                                   str(workdir)], stderr=out, env=child_env(PYTHONUNBUFFERED="1"))
    try:
        wait_for(lambda: "aggregator on" in log.read_text(), 60.0, "the member connected")
        assert (workdir / SPILL_DIR).is_dir()
        member.send_signal(signal.SIGTERM)
        assert member.wait(WAIT_S) == 0
        assert not (workdir / SPILL_DIR).exists()
    finally:
        if member.poll() is None:
            member.kill()


def framed(topic: str, payload: bytes) -> list[tuple[str, bytes, int, bool]]:
    """``payload``'s frames on ``topic``, as paho.mqtt.publish.multiple takes them."""
    return [(topic, frame, 1, False) for frame in chunk(payload, DEFAULT_MAX_FRAME_BYTES, read(payload).msg_id)]


def serve_until(shell: Shell, endpoint, condition, what: str) -> None:
    """The member's loop (``aggregator.serve``'s) until ``condition`` holds."""
    def step() -> bool:
        item = endpoint.get(0.1)
        if item is not None:
            shell.handle(*item)
        return condition()
    wait_for(step, WAIT_S, what, poll_s=0.0)


def test_a_members_burst_past_its_awaiting_budget_over_mosquitto_holds_the_budget_and_folds_every_update(
        mosquitto_broker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Five 2.3 MB updates read before any verdict (the engine's verdicts queue behind a burst): two await in
    memory, three in files; once the verdicts and the close come, all five are folded, bit for bit as a member
    holding them all in memory folds them."""
    monkeypatch.setattr(aggregator, "AWAITING_UPDATES_BUDGETED", 2)
    devices, max_inbound = DEVICES[:5], 3 << 20
    engine = make_engine(remote=True)
    for device_id in devices:
        join(engine, device_id)
    tasks = engine.open_round(1, 0.0)
    round_brief = engine.brief(max_inbound)
    payloads = {d: seal_up(update_message(Update(1, {k: v * np.float32(1 + i / 7) for k, v in tasks[d].weights.items()},
                                                 50, 1.0, 0.5, {}), plan_hash=engine.plan_info(d).hash,
                                          device_id=d, run_id=RUN)) for i, d in enumerate(devices)}
    ring = KeyRing(dict.fromkeys(DEVICES, KEY))
    engine_side = wire.engine_link(SERVER_KEY, tmp_path / "engine", OPEN_MAX)
    member_link = wire.aggregator_link(SERVER_KEY, tmp_path / "member", OPEN_MAX)
    engine_side.open(member_link.seal(wire.message(wire.READY, NAME)), RUN, device_id=NAME)  # binds its session
    args, spill = member_args(mosquitto_broker.url), tmp_path / "work" / SPILL_DIR
    endpoint = member_endpoint(args, ring, SERVER_KEY, FileSpill(spill))
    core = Aggregator(NAME, ring, FileSpill(spill / AWAITING_DIR))
    shell, url = Shell(args, core, endpoint, member_link, len(DEVICES)), BrokerURL.parse(mosquitto_broker.url)
    down = wire.down_topic(PREFIX, NAME)
    endpoint.start()
    try:
        wait_for(endpoint.connected.is_set, WAIT_S, "the member connected")
        paho.mqtt.publish.multiple(framed(down, engine_side.seal(wire.brief_message(round_brief, NAME))),
                                   hostname=url.host, port=url.port)
        serve_until(shell, endpoint, lambda: core.brief is not None, "the brief taken")
        burst = [f for d, p in payloads.items() for f in framed(Topics(PREFIX, d).update_via(NAME), p)]
        paho.mqtt.publish.multiple(burst, hostname=url.host, port=url.port)
        serve_until(shell, endpoint, lambda: core.forwarded == set(devices), "a receipt for every update")
        assert core.awaiting.peak_in_memory <= 2 * max_inbound and core.awaiting.spilled == 3
        assert len(list((spill / AWAITING_DIR).iterdir())) == 3
        said = [wire.verdict_message(NAME, 1, d, True, "") for d in devices] + [wire.close_message(NAME, 1, devices)]
        paho.mqtt.publish.multiple([f for msg in said for f in framed(down, engine_side.seal(msg))],
                                   hostname=url.host, port=url.port)
        serve_until(shell, endpoint, lambda: core.last_partial is not None, "the partial")
    finally:
        endpoint.stop()
    assert core.last_partial.devices == devices and list((spill / AWAITING_DIR).iterdir()) == []
    holding = Aggregator("agg-1", ring)  # every update in memory, folded in the same order
    holding.on_brief(round_brief)
    for d, payload in payloads.items():
        assert not isinstance(holding.on_update(d, read(payload)), str)
    for d in devices:
        holding.on_verdict(1, d, True, "")
    held = holding.on_close(1, devices)
    for name, tensor in held.sum.sums.items():
        assert torch.equal(core.last_partial.sum.sums[name], tensor), name
