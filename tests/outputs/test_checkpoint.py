import numpy as np
import pytest

from server.outputs.checkpoint import Checkpoint, CheckpointError, load_checkpoint, save_checkpoint


def test_checkpoint_roundtrips_round_tensors_and_state(tmp_path):
    tensors = {"fe.fc1.weight": np.arange(6, dtype=np.float32).reshape(2, 3)}
    save_checkpoint(tmp_path / "c.npz", Checkpoint(4, tensors, {"devices": {"d1": 3}}))
    loaded = load_checkpoint(tmp_path / "c.npz")
    assert loaded.round == 4 and loaded.state == {"devices": {"d1": 3}}
    np.testing.assert_array_equal(loaded.tensors["fe.fc1.weight"], tensors["fe.fc1.weight"])


def test_checkpoint_write_leaves_no_temporary_file(tmp_path):
    save_checkpoint(tmp_path / "c.npz", Checkpoint(1, {}, {}))
    assert [p.name for p in tmp_path.iterdir()] == ["c.npz"]


def test_garbage_file_is_refused_with_a_clear_error(tmp_path):
    (tmp_path / "c.npz").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="cannot read"):
        load_checkpoint(tmp_path / "c.npz")


def test_plain_npz_without_state_is_refused(tmp_path):
    np.savez(tmp_path / "c.npz", a=np.zeros(1))
    with pytest.raises(CheckpointError, match="not a FedARA checkpoint"):
        load_checkpoint(tmp_path / "c.npz")
