"""--dataset npz:PATH: a user's own arrays, samples of any shape of 1 to 4 dimensions, normalized from the file's
stated mean and std or from the training split, partitioned into device shards like every dataset."""
from __future__ import annotations

import argparse

import numpy as np
import pytest

from server.data import dataset_arg
from server.data.datasets import DatasetFormatError, DatasetUnavailable, check_available, load_dataset
from server.data.partition import make_client_shards


def write(path, sample, n=80, classes=4, **extra) -> str:
    rng = np.random.default_rng(1)
    x = rng.normal(3.0, 2.0, size=(n, *sample)).astype(np.float32)
    y = np.arange(n) % classes
    np.savez(path, x_train=x[:60], y_train=y[:60], x_test=x[60:], y_test=y[60:], **extra)
    return f"npz:{path}"


@pytest.mark.parametrize("sample", [(12,), (3, 16), (2, 6, 6)])
def test_samples_of_one_two_and_three_dimensions_load_and_partition(tmp_path, sample):
    data = load_dataset(write(tmp_path / "d.npz", sample))
    assert data.input_shape == sample and data.num_classes == 4 and len(data.y) == 80
    shards = make_client_shards(data, "dirichlet", 2, 0, alpha=1.0, min_samples=10)
    assert all(s.input_shape == sample for s in shards)


def test_without_stated_statistics_the_training_split_normalizes(tmp_path):
    data = load_dataset(write(tmp_path / "d.npz", (3, 16)))
    train = np.load(tmp_path / "d.npz")["x_train"].astype(np.float64)
    mean, std = data.normalization
    assert np.allclose(mean, train.mean()) and np.allclose(std, train.std())
    assert abs(float(data.x[:60].mean())) < 1e-5 and abs(float(data.x[:60].std()) - 1) < 1e-5


def test_stated_statistics_normalize_per_feature(tmp_path):
    mean, std = np.array([1.0, 2.0, 3.0]), np.array([2.0, 4.0, 8.0])
    data = load_dataset(write(tmp_path / "d.npz", (3,), mean=mean, std=std))
    raw = np.load(tmp_path / "d.npz")["x_train"]
    assert np.allclose(data.x[:60], (raw - mean) / std, atol=1e-6)


@pytest.mark.parametrize("extra, message", [
    ({"mean": np.zeros(3)}, "without \\['std'\\]"),
    ({"mean": np.zeros(5), "std": np.ones(5)}, "do not broadcast to a sample"),
    ({"mean": np.zeros(1), "std": np.zeros(1)}, "must be positive and finite"),
])
def test_bad_stated_statistics_are_refused(tmp_path, extra, message):
    with pytest.raises(DatasetFormatError, match=message):
        load_dataset(write(tmp_path / "d.npz", (3,), **extra))


def test_a_file_without_the_four_arrays_is_refused_before_it_is_read(tmp_path):
    np.savez(tmp_path / "d.npz", x_train=np.zeros((2, 3)), y_train=np.zeros(2, int))
    with pytest.raises(DatasetFormatError, match=r"lacks \['x_test', 'y_test'\]"):
        check_available(f"npz:{tmp_path / 'd.npz'}")
    with pytest.raises(DatasetUnavailable, match="no file"):
        check_available(f"npz:{tmp_path / 'missing.npz'}")


def test_float_labels_and_scalar_samples_are_refused(tmp_path):
    np.savez(tmp_path / "a.npz", x_train=np.zeros((4, 2)), y_train=np.zeros(4), x_test=np.zeros((2, 2)),
             y_test=np.zeros(2))
    with pytest.raises(DatasetFormatError, match="integer labels"):
        load_dataset(f"npz:{tmp_path / 'a.npz'}")
    np.savez(tmp_path / "b.npz", x_train=np.zeros(4), y_train=np.zeros(4, int), x_test=np.zeros(2),
             y_test=np.zeros(2, int))
    with pytest.raises(DatasetFormatError, match="1 to 4 sample dims"):
        load_dataset(f"npz:{tmp_path / 'b.npz'}")


def test_the_flag_makes_the_path_absolute_and_names_the_choices_otherwise(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert dataset_arg("npz:d.npz") == f"npz:{tmp_path}/d.npz" and dataset_arg("fmnist") == "fmnist"
    with pytest.raises(argparse.ArgumentTypeError, match="or npz:PATH for your own arrays"):
        dataset_arg("mydata")


def test_the_shards_command_writes_the_normalization_beside_the_shards(tmp_path):
    from server.data.shards import main

    dataset = write(tmp_path / "d.npz", (3, 16))
    assert main(["--dataset", dataset, "--clients", "2", "--min-samples", "10", "--out", str(tmp_path / "s")]) == 0
    stats = np.load(tmp_path / "s" / "normalization.npz")
    train = np.load(tmp_path / "d.npz")["x_train"].astype(np.float64)
    assert stats["mean"].shape == (3, 16) and np.allclose(stats["mean"], train.mean())


def write_tokens(path, vocabulary=10, **extra) -> str:
    ids = np.arange(80 * 6).reshape(80, 6) % vocabulary
    y = np.arange(80) % 4
    np.savez(path, x_train=ids[:60], y_train=y[:60], x_test=ids[60:], y_test=y[60:], vocabulary=np.int64(vocabulary),
             **extra)
    return f"npz:{path}"


def test_a_stated_vocabulary_keeps_integer_token_ids_as_they_are(tmp_path):
    data = load_dataset(write_tokens(tmp_path / "t.npz"))
    ids = np.concatenate([np.load(tmp_path / "t.npz")[k] for k in ("x_train", "x_test")])
    assert data.x.dtype == np.float32 and np.array_equal(data.x, ids) and data.input_shape == (6,)


@pytest.mark.parametrize("vocabulary, extra, message", [
    (5, {}, "token ids 0..4, got int64 from 0 to 9"),
    (10, {"mean": np.zeros(1), "std": np.ones(1)}, "leave mean and std out"),
])
def test_token_ids_outside_the_vocabulary_or_with_statistics_are_refused(tmp_path, vocabulary, extra, message):
    path = tmp_path / "t.npz"
    write_tokens(path, 10, **extra)
    archive = dict(np.load(path))
    np.savez(path, **(archive | {"vocabulary": np.int64(vocabulary)}))
    with pytest.raises(DatasetFormatError, match=message):
        load_dataset(f"npz:{path}")
