"""SecAgg+ end to end between the device's state machine (``device_runtime.secagg_client``) and the server's
(``server.engine.secure_aggregation``), in process: masks cancel, dropped devices are recovered from their
neighbours' shares, a round short of survivors reveals nothing, late and misaddressed messages are refused."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from device_runtime.dense_delta import reconstruct
from device_runtime.secagg_client import MASK_KEY, SecAggClient, SecAggRefusal, SecureSpec, secure_input
from device_runtime.secagg_quantize import plain_quantizer
from fedcore.lowrank import decompose, reconstruct_state
from server.engine.secure_aggregation import SecAggServer

IDS = tuple(f"d{i:02d}" for i in range(10))
D = 6


def spec(k: int = 8, t: int = 5, min_survivors: int = 5, ids: tuple[str, ...] = IDS) -> SecureSpec:
    return SecureSpec(b"run|3", ids, k, t, min_survivors, b"graph", plain_quantizer(8.0, len(ids)), 8.0, False, 0.0,
                      {"w": (D,)})


def inputs(ids=IDS) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(5)
    return {d: rng.integers(0, 1000, D).astype(np.uint64) for d in ids}


def exchanged(s: SecureSpec):
    """Clients and server after the first two exchanges, every participant taking part."""
    clients = {d: SecAggClient(d, s) for d in s.participants}
    server = SecAggServer(s, D)
    for d, c in clients.items():
        assert server.receive_keys(d, c.advertise()) is None
    keys = server.close_keys(1.0)
    for d, c in clients.items():
        assert server.receive_shares(d, c.share_keys(keys[d])) is None
    return clients, server, server.close_shares(2.0)


def run(s: SecureSpec, xs: dict[str, np.ndarray], drop_after_sharing=frozenset()):
    clients, server, shares = exchanged(s)
    masked = {d: c.masked_input(xs[d], shares[d]) for d, c in clients.items()}
    for d, y in masked.items():
        if d not in drop_after_sharing:
            assert server.receive_masked(d, y) is None
    survivors = server.close_masked(3.0)
    for d in survivors:
        assert server.receive_unmasking(d, clients[d].unmask(survivors)) is None
    return server, server.finish(4.0) if survivors else None, clients, masked


def test_the_masks_cancel_and_the_server_gets_the_exact_sum():
    xs = inputs()
    server, total, _, masked = run(spec(), xs)
    assert np.array_equal(total, sum(xs.values()) & np.uint64(2 ** 32 - 1))
    assert not any(np.array_equal(masked[d], xs[d]) for d in IDS)
    assert server.summary()["aggregated"] and server.summary()["dropped"] == 0


def test_devices_dropping_after_sharing_are_recovered_from_their_neighbours_shares():
    xs = inputs()
    dropped = {"d01", "d04", "d08"}
    server, total, _, _ = run(spec(), xs, dropped)
    assert np.array_equal(total, sum(xs[d] for d in IDS if d not in dropped))
    summary = server.summary()
    assert (summary["survivors"], summary["dropped"], summary["recovered"]) == (7, 3, 3)


def test_fewer_survivors_than_needed_aggregates_nothing_and_asks_for_no_share():
    xs = inputs()
    server, total, clients, _ = run(spec(min_survivors=8), xs, {"d01", "d04", "d08"})
    assert total is None and server.phase == "failed" and "below the 8" in server.failure
    assert server.revealed == {} and all(c.step == "unmask" for c in clients.values())


def test_a_neighbourhood_below_the_threshold_fails_the_round_before_unmasking():
    server, total, _, _ = run(spec(k=4, t=3, min_survivors=3), inputs(), {"d01", "d02", "d03", "d04"})
    assert total is None and "fewer than t = 3 surviving holders" in server.failure


def test_on_the_complete_graph_every_round_with_t_survivors_is_unmasked_and_one_fewer_is_not():
    """k = n − 1 and each device holds a share of its own secrets: exactly the rounds with >= t survivors open
    (n = 10, t = 6: 4 drop, any 4; then 5 drop)."""
    xs = inputs()
    rng = np.random.default_rng(1)
    for _ in range(3):
        dropped = set(rng.choice(IDS, 4, replace=False))
        server, total, clients, _ = run(spec(k=9, t=6, min_survivors=6), xs, dropped)
        assert np.array_equal(total, sum(xs[d] for d in IDS if d not in dropped))
        assert server.summary()["recovered"] == 4
        survivor = next(d for d in IDS if d not in dropped)
        assert server.revealed[survivor][survivor][0] == "self_seed"  # its own share of its own seed
    server, total, _, _ = run(spec(k=9, t=6, min_survivors=6), xs, set(IDS[:5]))
    assert total is None and "5 of 10 devices survived, below the 6" in server.failure and server.revealed == {}


def test_a_masked_input_after_the_unmasking_began_is_refused():
    clients, server, shares = exchanged(spec())
    late = clients["d00"].masked_input(inputs()["d00"], shares["d00"])
    for d in IDS[1:]:
        server.receive_masked(d, clients[d].masked_input(inputs()[d], shares[d]))
    server.close_masked(0.0)
    assert "closed" in server.receive_masked("d00", late)
    assert "d00" not in server.masked


def test_refusals_name_their_reason_and_change_nothing():
    s = spec()
    clients = {d: SecAggClient(d, s) for d in IDS}
    server = SecAggServer(s, D)
    ad = clients["d00"].advertise()
    assert server.receive_keys("d00", ad) is None
    assert "second keys" in server.receive_keys("d00", ad)
    assert "not in this phase" in server.receive_keys("intruder", ad)
    assert "not open yet" in server.receive_masked("d00", np.zeros(D, np.uint64))
    for d in IDS[1:]:
        server.receive_keys(d, clients[d].advertise())
    keys = server.close_keys(0.0)
    shares = clients["d00"].share_keys(keys["d00"])
    wrong = dict(shares)
    wrong["d99"] = wrong.pop(next(iter(wrong)))
    assert "not its neighbours" in server.receive_shares("d00", wrong)
    assert "d00" not in server.sealed


def test_a_share_sealed_for_another_device_does_not_open():
    clients, server, shares = exchanged(spec())
    target = "d00"
    sender = next(iter(shares[target]))
    other = next(v for v in shares if v != target and sender in shares[v])
    forged = dict(shares[target], **{sender: shares[other][sender]})
    with pytest.raises(SecAggRefusal, match="does not open"):
        clients[target].masked_input(inputs()[target], forged)


def test_a_device_unmasks_once_and_never_reveals_both_secrets_of_a_neighbour():
    xs = inputs()
    server, _, clients, _ = run(spec(), xs, {"d01"})
    survivor = next(d for d in server.masked if "d01" in clients[d].mine)
    with pytest.raises(SecAggRefusal, match="out of order"):
        clients[survivor].unmask(IDS)
    assert server.revealed[survivor]["d01"][0] == MASK_KEY


def test_a_forged_unmasking_request_naming_too_few_survivors_is_refused():
    s = spec(min_survivors=9)
    client = SecAggClient("d00", s)
    client.step = "unmask"
    with pytest.raises(SecAggRefusal, match="below the 9"):
        client.unmask(IDS[:5])


def test_the_device_reconstructs_like_the_engine():
    torch.manual_seed(0)
    conv, fc = torch.randn(8, 3, 5, 5, dtype=torch.float64), torch.randn(20, 12, dtype=torch.float64)
    shapes = {"fe.conv.weight": (8, 3, 5, 5), "fe.fc.weight": (20, 12), "fe.fc.bias": (20,)}
    cu, cv = decompose(conv, 3)
    fu, fv = decompose(fc, 4)
    client = {"fe.conv.u": cu, "fe.conv.v": cv, "fe.fc.u": fu, "fe.fc.v": fv, "fe.fc.bias": torch.ones(20)}
    ours = reconstruct({k: v.numpy() for k, v in client.items()}, shapes)
    theirs = reconstruct_state(client, shapes)
    for key in shapes:
        np.testing.assert_allclose(ours[key], theirs[key].double().numpy(), rtol=0, atol=1e-12)


def test_the_secure_sum_of_weighted_changes_equals_the_plain_mean_within_the_bound():
    """Each device sends p_i·Δ_i quantized; the decoded sum over survivors / Σ p equals the plain mean within
    n/(γ·Σp)."""
    rng = np.random.default_rng(6)
    shapes = {"w": (D,)}
    sent = {"w": rng.normal(size=D)}
    returned = {d: {"w": sent["w"] + rng.normal(scale=0.1, size=D)} for d in IDS}
    samples = {d: int(rng.integers(20, 200)) for d in IDS}
    base = spec()
    weights = {d: samples[d] / sum(samples.values()) for d in IDS}
    xs = {d: secure_input(returned[d], sent, base.for_device(weights[d]), rng) for d in IDS}
    dropped = {"d02", "d05"}
    server, total, _, _ = run(base, xs, dropped)
    alive = [d for d in IDS if d not in dropped]
    share = sum(weights[d] for d in alive)
    secure = base.quantizer.decode(total) / share
    plain = sum(samples[d] * (reconstruct(returned[d], shapes)["w"] - reconstruct(sent, shapes)["w"]) for d in alive)
    plain = plain / sum(samples[d] for d in alive)
    bound = base.quantizer.sum_error(len(alive)) / share
    assert np.all(np.abs(secure - plain) <= bound + 1e-12)
    assert bound < 1e-7


def test_a_masked_input_from_outside_the_round_or_malformed_is_refused():
    clients, server, shares = exchanged(spec())
    assert "not in this phase" in server.receive_masked("intruder", np.zeros(D, np.uint64))
    assert "integers below 2^32" in server.receive_masked("d00", np.full(D, 2 ** 40, np.uint64))
    assert "integers below 2^32" in server.receive_masked("d00", np.zeros(D + 1, np.uint64))
    y = clients["d00"].masked_input(inputs()["d00"], shares["d00"])
    assert server.receive_masked("d00", y) is None
    assert "second masked" in server.receive_masked("d00", y)  # a replay
    assert list(server.masked) == ["d00"]


def test_unmasking_shares_of_the_wrong_kind_or_from_a_non_survivor_are_refused():
    clients, server, shares = exchanged(spec())
    for d in IDS[1:]:
        server.receive_masked(d, clients[d].masked_input(inputs()[d], shares[d]))
    survivors = server.close_masked(0.0)
    assert "d00" not in survivors
    honest = clients["d01"].unmask(survivors)
    forged = {v: ("self_seed", share) for v, (_, share) in honest.items()}  # asks for the dropped device's seed
    assert "wrong kind" in server.receive_unmasking("d01", forged)
    assert "not in this phase" in server.receive_unmasking("d00", honest)
    assert server.revealed == {}
    assert server.receive_unmasking("d01", honest) is None


def test_mixed_rank_changes_sum_securely_to_the_plain_mean_of_their_reconstructions():
    """Devices at different ranks send factors' changes at full rank: the secure mean equals the float64 mean of
    reconstruct(returned) − reconstruct(sent) within the quantization bound."""
    rng = np.random.default_rng(8)
    shapes = {"fe.fc.weight": (3, 2)}  # d = 6, as the round's vectors
    ranks = {d: 1 + i % 2 for i, d in enumerate(IDS)}
    sent = {d: {"fe.fc.u": rng.normal(size=(3, ranks[d])), "fe.fc.v": rng.normal(size=(2, ranks[d]))} for d in IDS}
    returned = {d: {k: v + rng.normal(scale=0.05, size=v.shape) for k, v in sent[d].items()} for d in IDS}
    base = SecureSpec(b"run|4", IDS, 8, 5, 5, b"graph", plain_quantizer(8.0, len(IDS)), 8.0, False, 0.0, shapes)
    xs = {d: secure_input(returned[d], sent[d], base.for_device(1 / len(IDS)), rng) for d in IDS}
    _, total, _, _ = run(base, xs, {"d03"})
    alive = [d for d in IDS if d != "d03"]
    secure = base.quantizer.decode(total) / (len(alive) / len(IDS))
    plain = np.mean([(reconstruct(returned[d], shapes)["fe.fc.weight"] - reconstruct(sent[d], shapes)["fe.fc.weight"])
                     .ravel() for d in alive], axis=0)
    assert np.all(np.abs(secure - plain) <= base.quantizer.sum_error(len(alive)) / (len(alive) / len(IDS)) + 1e-12)
