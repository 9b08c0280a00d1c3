"""Client partitions: seeded, complete, disjoint, with minimum sizes; shards per client."""

import numpy as np
import pytest

from device_runtime.shard import load_shard
from server.data.datasets import LabeledData
from server.data.partition import (
    PartitionError,
    dirichlet_partition,
    make_client_shards,
    partition_summary,
    pathological_partition,
    split_train_test,
    write_shards,
)

LABELS = np.repeat(np.arange(10), 200)


def _data(num_per_class=60, num_classes=10):
    labels = np.repeat(np.arange(num_classes), num_per_class).astype(np.int64)
    sample_ids = np.arange(len(labels), dtype=np.float32)[:, None, None, None]
    x = np.broadcast_to(sample_ids, (len(labels), 1, 2, 2)).copy()
    return LabeledData(x=x, y=labels, num_classes=num_classes, name="toy")


def _assert_each_sample_once(parts, num_samples):
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(num_samples))


def test_dirichlet_same_seed_gives_identical_partition():
    first = dirichlet_partition(LABELS, 10, alpha=0.1, seed=7)
    second = dirichlet_partition(LABELS, 10, alpha=0.1, seed=7)
    assert all(np.array_equal(a, b) for a, b in zip(first, second))


def test_dirichlet_different_seed_gives_different_partition():
    first = dirichlet_partition(LABELS, 10, alpha=0.1, seed=7)
    second = dirichlet_partition(LABELS, 10, alpha=0.1, seed=8)
    assert not all(np.array_equal(a, b) for a, b in zip(first, second))


def test_dirichlet_assigns_every_sample_exactly_once():
    parts = dirichlet_partition(LABELS, 10, alpha=0.5, seed=0)
    assert len(parts) == 10
    _assert_each_sample_once(parts, len(LABELS))


def test_dirichlet_clients_hold_at_least_min_samples():
    parts = dirichlet_partition(LABELS, 10, alpha=0.1, seed=1, min_samples=100)
    assert min(len(p) for p in parts) >= 100


def test_dirichlet_small_alpha_skews_labels_more_than_large_alpha():
    def mean_classes(alpha):
        parts = dirichlet_partition(LABELS, 10, alpha=alpha, seed=0)
        return np.mean([len(np.unique(LABELS[p])) for p in parts])

    assert mean_classes(0.1) < mean_classes(100.0)


def test_dirichlet_rejects_more_demand_than_samples():
    with pytest.raises(PartitionError, match="need 2040 samples, but the dataset has 2000"):
        dirichlet_partition(LABELS, 51, alpha=0.1, seed=0, min_samples=40)


def test_dirichlet_gives_up_after_bounded_draws():
    with pytest.raises(PartitionError, match="in 3 draws"):
        dirichlet_partition(LABELS, 20, alpha=0.01, seed=0, min_samples=100, max_draws=3)


def test_dirichlet_rejects_non_positive_alpha():
    with pytest.raises(PartitionError, match="alpha must be positive"):
        dirichlet_partition(LABELS, 4, alpha=0.0, seed=0)


def test_partition_rejects_float_labels():
    with pytest.raises(PartitionError, match="1-D integer"):
        dirichlet_partition(LABELS.astype(float), 4, alpha=0.5, seed=0)


def test_pathological_gives_each_client_exactly_classes_per_client():
    parts = pathological_partition(LABELS, 20, classes_per_client=3, seed=0)
    assert [len(np.unique(LABELS[p])) for p in parts] == [3] * 20


def test_pathological_assigns_every_sample_exactly_once():
    parts = pathological_partition(LABELS, 20, classes_per_client=3, seed=0)
    _assert_each_sample_once(parts, len(LABELS))


def test_pathological_depends_on_seed_only():
    first = pathological_partition(LABELS, 8, 2, seed=5)
    again = pathological_partition(LABELS, 8, 2, seed=5)
    other = pathological_partition(LABELS, 8, 2, seed=6)
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert not all(np.array_equal(a, b) for a, b in zip(first, other))


def test_pathological_rejects_clients_that_cannot_cover_all_classes():
    with pytest.raises(PartitionError, match="cover fewer than the 10 classes"):
        pathological_partition(LABELS, 4, classes_per_client=2, seed=0)


def test_pathological_rejects_clients_below_min_samples():
    labels = np.concatenate([np.zeros(30, np.int64), np.repeat(np.arange(1, 10), 200)])
    with pytest.raises(PartitionError, match="only 30 samples"):
        pathological_partition(labels, 10, classes_per_client=1, seed=0, min_samples=40)


def test_split_train_test_is_a_shuffled_75_25_partition():
    indices = np.arange(100, 140)
    train, test = split_train_test(indices, seed=0)
    assert (len(train), len(test)) == (30, 10)
    np.testing.assert_array_equal(np.sort(np.concatenate([train, test])), indices)
    assert not np.array_equal(train, indices[:30])


def test_split_train_test_is_deterministic_per_seed():
    indices = np.arange(40)
    first, second = split_train_test(indices, seed=2), split_train_test(indices, seed=2)
    np.testing.assert_array_equal(first[0], second[0])


def test_make_client_shards_splits_each_client_75_25_and_keeps_every_sample():
    data = _data()
    shards = make_client_shards(data, "dirichlet", num_clients=5, seed=0, alpha=0.5, min_samples=40)
    assert len(shards) == 5
    for shard in shards:
        total = len(shard.y_train) + len(shard.y_test)
        assert len(shard.y_train) == round(0.75 * total)
        assert shard.num_classes == 10 and shard.input_shape == (1, 2, 2)
    sample_ids = np.concatenate([np.concatenate([s.x_train, s.x_test])[:, 0, 0, 0] for s in shards])
    np.testing.assert_array_equal(np.sort(sample_ids), np.arange(600))


def test_make_client_shards_keeps_images_with_their_labels():
    data = _data()
    shard = make_client_shards(data, "pathological", num_clients=5, seed=0, min_samples=40)[0]
    sample_ids = shard.x_train[:, 0, 0, 0].astype(int)
    np.testing.assert_array_equal(shard.y_train, data.y[sample_ids])


def test_make_client_shards_rejects_unknown_partition():
    with pytest.raises(PartitionError, match="choose one of"):
        make_client_shards(_data(), "iid", num_clients=2, seed=0)


def test_write_shards_names_files_by_client_and_round_trips(tmp_path):
    shards = make_client_shards(_data(), "pathological", num_clients=5, seed=0, min_samples=40)
    paths = write_shards(shards, tmp_path / "shards")
    assert [p.name for p in paths] == [f"client_00{i}.npz" for i in range(5)]
    np.testing.assert_array_equal(load_shard(paths[3]).x_test, shards[3].x_test)


def test_write_shards_removes_shard_files_of_an_earlier_larger_run(tmp_path):
    shards = make_client_shards(_data(), "pathological", num_clients=5, seed=0, min_samples=40)
    write_shards(shards, tmp_path)
    (tmp_path / "notes.txt").write_text("kept")
    write_shards(shards[:2], tmp_path)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["client_000.npz", "client_001.npz", "notes.txt"]


def test_write_shards_with_another_name_pattern_removes_only_files_of_that_pattern(tmp_path):
    shards = make_client_shards(_data(), "pathological", num_clients=5, seed=0, min_samples=40)
    write_shards(shards[:1], tmp_path)
    write_shards(shards, tmp_path, filename="dev_{:03d}.npz")
    write_shards(shards[:2], tmp_path, filename="dev_{:03d}.npz")
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["client_000.npz", "dev_000.npz", "dev_001.npz"]


def test_partition_summary_counts_samples_per_class():
    shards = make_client_shards(_data(), "pathological", num_clients=5, seed=0, min_samples=40)
    summary = partition_summary(shards)
    assert summary["num_clients"] == 5 and summary["num_classes"] == 10
    client = summary["clients"][0]
    assert client["train_per_class"] == np.bincount(shards[0].y_train, minlength=10).tolist()
    assert client["classes"] == 2
    assert sum(c["train"] + c["test"] for c in summary["clients"]) == 600


def test_runs_of_one_partition_share_one_copy_of_each_shard_through_the_cache(tmp_path):
    shards = make_client_shards(_data(), "pathological", num_clients=5, seed=0, min_samples=40)
    first = write_shards(shards, tmp_path / "run1", cache=tmp_path / "cache")
    second = write_shards(shards, tmp_path / "run2", cache=tmp_path / "cache")
    assert len(list((tmp_path / "cache").iterdir())) == 5
    assert all(a.stat().st_ino == b.stat().st_ino for a, b in zip(first, second))  # one file, linked twice
    np.testing.assert_array_equal(load_shard(second[2]).x_train, shards[2].x_train)
    other = make_client_shards(_data(), "pathological", num_clients=5, seed=1, min_samples=40)
    write_shards(other, tmp_path / "run3", cache=tmp_path / "cache")
    assert len(list((tmp_path / "cache").iterdir())) == 10  # another partition: other contents, other files
