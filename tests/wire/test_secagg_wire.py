"""SecAgg+'s exchanges on the wire (``device_runtime.secagg_wire``, protocol 5) and a secure TASK's parameters: every
message through a sealed envelope and back gives the server the same sum as the state machines in process; what a
round's parameters do not allow (another run or round, a stranger, a wrong size or kind) is refused by the parser."""
from __future__ import annotations

import numpy as np
import pytest

from device_runtime import secagg_wire as wire
from device_runtime.auth import Direction
from device_runtime.envelope import decode, seal
from device_runtime.messages import MessageError, parse_task, task_message
from device_runtime.secagg_client import MASK_KEY, SELF_SEED, AdvertisedKeys, SecAggClient, SecureSpec
from device_runtime.secagg_quantize import plain_quantizer
from device_runtime.task import Phase, Task
from server.engine.secure_aggregation import SecAggServer

IDS = tuple(f"dev_{i:03d}" for i in range(5))
RUN = "run7"
D = 8
KEY = bytes(range(32))


def spec(ids: tuple[str, ...] = IDS, context: bytes = f"{RUN}|2".encode()) -> SecureSpec:
    return SecureSpec(context, ids, 4, 3, 3, bytes(range(32)), plain_quantizer(8.0, len(ids)), 8.0, False, 0.0,
                      {"fe.w": (2, 4)}, 0.25)


def wired(msg):
    """``msg`` sealed and decoded again, as it arrives."""
    return decode(seal(msg, KEY, Direction.UP, 1), max_bytes=1 << 20)


def task(s: SecureSpec | None) -> Task:
    return Task(round=2, weights={}, lam=0.0, mu=0.0, lr=0.1, phases=(Phase("all", 1),), batch_size=8, seed=1,
                secure=s)


def test_a_secure_tasks_parameters_survive_the_wire():
    _, parsed = parse_task(wired(task_message(task(spec()), plan_hash="a" * 64, device_id="dev_001", run_id=RUN)))
    assert parsed.secure == spec()


@pytest.mark.parametrize("device_id,run_id,says", [
    ("dev_009", RUN, "do not name dev_009"),
    ("dev_001", "run8", "is not this task's run and round"),
])
def test_a_secure_task_for_another_device_or_run_is_refused(device_id, run_id, says):
    msg = task_message(task(spec()), plan_hash="a" * 64, device_id=device_id, run_id=run_id)
    with pytest.raises(MessageError, match=says):
        parse_task(wired(msg))


def test_the_four_exchanges_through_sealed_envelopes_give_the_sum_and_recover_a_dropped_device():
    s = spec()
    rng = np.random.default_rng(3)
    xs = {d: rng.integers(0, 1000, D).astype(np.uint64) for d in IDS}
    clients, server = {d: SecAggClient(d, s) for d in IDS}, SecAggServer(s, D)
    graph = server.graph
    for d, c in clients.items():
        msg = wired(wire.keys_message(c.advertise(), device_id=d, run_id=RUN, round_index=2))
        assert server.receive_keys(d, wire.parse_keys(msg)) is None
    for d, keys in server.close_keys(1.0).items():
        relayed = wired(wire.neighbour_keys_message(keys, device_id=d, run_id=RUN, round_index=2))
        sealed = clients[d].share_keys(wire.parse_neighbour_keys(relayed, graph[d]))
        msg = wired(wire.shares_message(sealed, device_id=d, run_id=RUN, round_index=2))
        assert server.receive_shares(d, wire.parse_shares(msg, graph[d])) is None
    dropped = IDS[-1]
    for d, sealed in server.close_shares(2.0).items():
        relayed = wired(wire.shares_message(sealed, device_id=d, run_id=RUN, round_index=2))
        y = clients[d].masked_input(xs[d], wire.parse_shares(relayed, graph[d]))
        update = task_message(task(None), plan_hash="a" * 64, device_id=d, run_id=RUN)  # any message carries it
        update.blobs[wire.MASKED_BLOB] = wire.masked_blob(y, s.quantizer.bits)
        if d != dropped:
            assert server.receive_masked(d, wire.masked_of(wired(update), D, s.quantizer.bits)) is None
    survivors = server.close_masked(3.0)
    for d in survivors:
        asked = wire.parse_survivors(wired(wire.survivors_message(survivors, device_id=d, run_id=RUN,
                                                                  round_index=2)), IDS)
        msg = wired(wire.unmasking_message(clients[d].unmask(asked), device_id=d, run_id=RUN, round_index=2))
        assert server.receive_unmasking(d, wire.parse_unmasking(msg, (*graph[d], d))) is None
    total = server.finish(4.0)
    expected = sum(xs[d] for d in survivors) % (1 << s.quantizer.bits)
    assert np.array_equal(total, expected) and server.recovered == (dropped,)


def test_keys_of_the_wrong_size_are_refused():
    msg = wire.keys_message(AdvertisedKeys(bytes(32), bytes(31)), device_id="dev_000", run_id=RUN, round_index=2)
    with pytest.raises(MessageError, match="not 32 bytes"):
        wire.parse_keys(wired(msg))


def test_shares_for_a_stranger_or_of_the_wrong_size_are_refused():
    good = bytes(wire.SEALED_SHARE_BYTES)
    with pytest.raises(MessageError, match="not this round's neighbours"):
        wire.parse_shares(wired(wire.shares_message({"dev_004": good}, device_id="dev_000", run_id=RUN,
                                                    round_index=2)), ["dev_001"])
    with pytest.raises(MessageError, match="not 160 bytes"):
        wire.parse_shares(wired(wire.shares_message({"dev_001": good + b"x"}, device_id="dev_000", run_id=RUN,
                                                    round_index=2)), ["dev_001"])


def test_an_unmasking_share_of_no_known_kind_is_refused():
    msg = wire.unmasking_message({"dev_001": (SELF_SEED, 5)}, device_id="dev_000", run_id=RUN, round_index=2)
    msg.meta["kinds"] = {"dev_001": "both"}
    with pytest.raises(MessageError, match=f"opens {MASK_KEY} or {SELF_SEED}"):
        wire.parse_unmasking(wired(msg), ["dev_001"])


def test_a_masked_input_of_another_size_is_refused():
    msg = task_message(task(None), plan_hash="a" * 64, device_id="dev_000", run_id=RUN)
    msg.blobs[wire.MASKED_BLOB] = bytes(4 * (D - 1))
    with pytest.raises(MessageError, match=f"not {D} integers"):
        wire.masked_of(wired(msg), D, 32)
