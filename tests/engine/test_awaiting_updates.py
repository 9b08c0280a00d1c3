"""An aggregator member's updates awaiting the engine's verdict (server/awaiting_updates.py): past its memory budget
each waits in a file, read back bit for bit on its verdict, so a burst costs the member its budget, not the burst,
and what it folds is what it folded holding them all in memory."""
from __future__ import annotations

import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from device_runtime.auth import KeyRing
from device_runtime.spill import FileSpill
from server import aggregator
from server.aggregator import Aggregator
from server.awaiting_updates import AwaitingUpdates
from tests.engine.test_aggregator import device_update
from tests.support.engine import join, make_engine
from tests.support.sealing import KEY

DEVICES = tuple(f"dev_{i:03d}" for i in range(5))


def weights_of(i: int) -> dict[str, np.ndarray]:
    """A small update of several dtypes and shapes, each array distinct (a 0-d one and an empty one included)."""
    rng = np.random.default_rng(i)
    return {"w": rng.standard_normal((3, 4)).astype(np.float32), "b": rng.standard_normal(5),
            "n": np.array(i, dtype=np.int64), "e": np.zeros((0, 2), dtype=np.float32)}


def nbytes(weights: dict[str, np.ndarray]) -> int:
    return sum(a.nbytes for a in weights.values())


def test_past_its_budget_each_update_waits_in_a_file_and_comes_back_bit_for_bit(tmp_path: Path):
    updates = {f"dev_{i}": weights_of(i) for i in range(6)}
    budget = 2 * nbytes(updates["dev_0"])
    store = AwaitingUpdates(budget, FileSpill(tmp_path))
    for i, (device_id, weights) in enumerate(updates.items()):
        store.put(device_id, weights, 10 + i)
    assert store.peak_in_memory <= budget and len(store) == 6
    assert store.spilled == 4 and len(list(tmp_path.iterdir())) == 4
    for i, (device_id, weights) in enumerate(updates.items()):
        back, num_samples = store.take(device_id)
        assert num_samples == 10 + i and back.keys() == weights.keys()
        for name, array in weights.items():
            assert back[name].dtype == array.dtype and back[name].shape == array.shape
            assert back[name].tobytes() == array.tobytes()
    assert len(store) == 0 and store.in_memory == 0 and list(tmp_path.iterdir()) == []


def test_a_new_round_drops_the_files_of_what_still_awaits(tmp_path: Path):
    store = AwaitingUpdates(0, FileSpill(tmp_path))
    store.put("dev_0", weights_of(0), 1)
    assert "dev_0" in store and len(list(tmp_path.iterdir())) == 1
    store.clear()
    assert "dev_0" not in store and store.take("dev_0") is None and list(tmp_path.iterdir()) == []


def test_an_update_whose_file_cannot_be_written_is_held_in_memory_and_logged(tmp_path: Path, caplog):
    spill = FileSpill(tmp_path / "spill")
    shutil.rmtree(spill.folder)  # every write now fails
    store = AwaitingUpdates(0, spill)
    with caplog.at_level(logging.WARNING, "fedara.aggregator"):
        store.put("dev_0", weights_of(0), 1)
    assert "dev_0" in caplog.text and store.spilled == 0
    assert store.take("dev_0")[0]["w"].tobytes() == weights_of(0)["w"].tobytes()


def burst_through(member: Aggregator, engine, tasks, budget: int):
    """Every device's update to ``member`` before any verdict (as a burst queues them ahead of the verdicts), then the
    verdicts and the close: the awaiting budget at its most, and the partial."""
    for i, device_id in enumerate(DEVICES):
        receipt = member.on_update(device_id, device_update(engine, device_id, tasks[device_id], 1.0 + i / 7))
        assert not isinstance(receipt, str), receipt
    peak = member.awaiting.peak_in_memory
    assert peak <= budget
    for device_id in DEVICES:
        member.on_verdict(1, device_id, True, "")
    partial = member.on_close(1, DEVICES)
    assert not isinstance(partial, str) and partial.devices == DEVICES
    return peak, partial


def test_a_burst_past_the_awaiting_budget_holds_the_budget_and_folds_every_update_bit_identically(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(aggregator, "AWAITING_UPDATES_BUDGETED", 2)
    engine = make_engine(remote=True)
    for device_id in DEVICES:
        join(engine, device_id)
    tasks = engine.open_round(1, 0.0)
    max_inbound = 3 << 20  # a 2.3 MB update each: 2 fit the budget, 3 wait in files
    ring = KeyRing(dict.fromkeys(DEVICES, KEY))
    filing, holding = Aggregator("agg-0", ring, FileSpill(tmp_path)), Aggregator("agg-1", ring)
    for member in (filing, holding):
        member.on_brief(engine.brief(max_inbound))
    peak, partial = burst_through(filing, engine, tasks, 2 * max_inbound)
    assert filing.awaiting.spilled == 3 and list(tmp_path.iterdir()) == []
    held_peak, held = burst_through(holding, engine, tasks, 5 * max_inbound)
    assert held_peak > 2 * max_inbound > peak  # held in memory, the burst needs more than the budget
    assert partial.sum.count == held.sum.count == len(DEVICES)
    for name, tensor in held.sum.sums.items():
        assert torch.equal(partial.sum.sums[name], tensor), name


def test_an_update_put_again_replaces_the_one_held_and_its_file(tmp_path: Path):
    store = AwaitingUpdates(0, FileSpill(tmp_path))
    store.put("dev_0", weights_of(0), 1)
    store.put("dev_0", weights_of(1), 2)
    assert len(store) == 1 and len(list(tmp_path.iterdir())) == 1
    back, num_samples = store.take("dev_0")
    assert num_samples == 2 and back["w"].tobytes() == weights_of(1)["w"].tobytes()
