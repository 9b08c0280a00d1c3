"""Dataset loaders: local files only, all samples, normalized N×C×H×W float32."""

import gzip
import pickle

import numpy as np
import pytest

from server.data.datasets import (
    CHANNEL_STATS,
    FMNIST_PACKAGE,
    DatasetFormatError,
    DatasetUnavailable,
    load_dataset,
    parse_idx,
    read_idx,
)
from tests.support.machine import missing_fmnist, needs


def _idx_bytes(array: np.ndarray, code: int = 0x08) -> bytes:
    header = bytes([0, 0, code, array.ndim]) + np.array(array.shape, ">u4").tobytes()
    return header + array.tobytes()


def _write_fmnist(folder, train_labels, test_labels):
    """Write a tiny Fashion-MNIST folder; image pixel values equal the sample's label·20."""
    for prefix, labels in (("train", train_labels), ("t10k", test_labels)):
        labels = np.array(labels, dtype=np.uint8)
        images = np.repeat(labels * 20, 28 * 28).reshape(-1, 28, 28).astype(np.uint8)
        (folder / f"{prefix}-images-idx3-ubyte.gz").write_bytes(gzip.compress(_idx_bytes(images)))
        (folder / f"{prefix}-labels-idx1-ubyte.gz").write_bytes(gzip.compress(_idx_bytes(labels)))


def _pickle(path, entries):
    with path.open("wb") as handle:
        pickle.dump({k.encode(): v for k, v in entries.items()}, handle)


def _cifar_data(num, label_offset):
    """num CHW images whose red, green, blue planes hold 10, 20, 30 (plus the sample index)."""
    planes = np.array([10, 20, 30], dtype=np.uint8)[None, :, None] + np.arange(num)[:, None, None]
    images = np.broadcast_to(planes, (num, 3, 32 * 32)).astype(np.uint8)
    return images.reshape(num, -1), [label_offset + i for i in range(num)]


def _write_cifar10(root):
    folder = root / "cifar-10-batches-py"
    folder.mkdir()
    for i, name in enumerate([f"data_batch_{b}" for b in range(1, 6)] + ["test_batch"]):
        data, labels = _cifar_data(2, label_offset=i % 5)
        _pickle(folder / name, {"data": data, "labels": labels, "batch_label": "x"})


def _write_cifar100(root):
    folder = root / "cifar-100-python"
    folder.mkdir()
    for name, offset in (("train", 97), ("test", 0)):
        data, labels = _cifar_data(3, label_offset=offset)
        _pickle(folder / name, {"data": data, "fine_labels": labels, "coarse_labels": [0, 0, 0]})


def test_parse_idx_reads_dims_and_values_from_header():
    array = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    np.testing.assert_array_equal(parse_idx(_idx_bytes(array)), array)


def test_parse_idx_decodes_big_endian_int32():
    array = np.array([1, -2, 70000], dtype=">i4")
    parsed = parse_idx(_idx_bytes(array, code=0x0C))
    assert parsed.dtype == np.int32
    np.testing.assert_array_equal(parsed, [1, -2, 70000])


def test_parse_idx_rejects_bad_magic():
    raw = bytearray(_idx_bytes(np.zeros(3, dtype=np.uint8)))
    raw[0] = 1
    with pytest.raises(DatasetFormatError, match="bad IDX magic"):
        parse_idx(bytes(raw))


def test_parse_idx_rejects_truncated_data():
    raw = _idx_bytes(np.zeros((2, 5), dtype=np.uint8))[:-1]
    with pytest.raises(DatasetFormatError, match="need 10 data bytes, found 9"):
        parse_idx(raw)


def test_read_idx_decompresses_gz_file(tmp_path):
    array = np.arange(6, dtype=np.uint8).reshape(2, 3)
    path = tmp_path / "tiny-idx2-ubyte.gz"
    path.write_bytes(gzip.compress(_idx_bytes(array)))
    np.testing.assert_array_equal(read_idx(path), array)


def test_fmnist_concatenates_train_then_test_as_1x28x28(tmp_path):
    _write_fmnist(tmp_path, train_labels=[3, 1, 4], test_labels=[9, 0])
    data = load_dataset("fmnist", tmp_path)
    assert data.x.shape == (5, 1, 28, 28) and data.x.dtype == np.float32
    assert data.y.tolist() == [3, 1, 4, 9, 0] and data.y.dtype == np.int64
    assert data.num_classes == 10 and data.input_shape == (1, 28, 28)


def test_fmnist_pixels_are_scaled_then_standardized(tmp_path):
    _write_fmnist(tmp_path, train_labels=[5], test_labels=[0])
    (mean,), (std,) = CHANNEL_STATS["fmnist"]
    data = load_dataset("fmnist", tmp_path)
    np.testing.assert_allclose(data.x[0], (100 / 255 - mean) / std, rtol=1e-6)


def test_missing_fmnist_names_debian_package_and_option(tmp_path):
    with pytest.raises(DatasetUnavailable, match=FMNIST_PACKAGE) as error:
        load_dataset("fmnist", tmp_path)
    assert "--data-dir" in str(error.value)


@needs(missing_fmnist())
def test_debian_fmnist_has_70000_standardized_samples():
    data = load_dataset("fmnist")
    assert data.x.shape == (70000, 1, 28, 28)
    assert np.bincount(data.y).tolist() == [7000] * 10
    assert abs(float(data.x.mean())) < 0.01 and abs(float(data.x.std()) - 1) < 0.01


def test_digits_are_upsampled_to_1x28x28_and_standardized():
    data = load_dataset("digits")
    assert data.x.shape == (1797, 1, 28, 28) and data.x.dtype == np.float32
    assert data.num_classes == 10 and set(data.y.tolist()) == set(range(10))
    assert abs(float(data.x.mean())) < 0.01 and abs(float(data.x.std()) - 1) < 0.01


def test_cifar10_reads_all_six_batches_in_channel_first_layout(tmp_path):
    _write_cifar10(tmp_path)
    data = load_dataset("cifar10", tmp_path)
    assert data.x.shape == (12, 3, 32, 32) and data.num_classes == 10
    assert data.y.tolist() == [0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 0, 1]
    means, stds = CHANNEL_STATS["cifar10"]
    expected = [(v / 255 - m) / s for v, m, s in zip((10, 20, 30), means, stds)]
    np.testing.assert_allclose(data.x[0, :, 7, 9], expected, rtol=1e-5)


def test_cifar10_accepts_the_batches_folder_itself(tmp_path):
    _write_cifar10(tmp_path)
    assert len(load_dataset("cifar10", tmp_path / "cifar-10-batches-py").y) == 12


def test_cifar100_uses_fine_labels(tmp_path):
    _write_cifar100(tmp_path)
    data = load_dataset("cifar100", tmp_path)
    assert data.x.shape == (6, 3, 32, 32) and data.num_classes == 100
    assert data.y.tolist() == [97, 98, 99, 0, 1, 2]


@pytest.mark.parametrize("name", ["cifar10", "cifar100"])
def test_missing_cifar_folder_is_unavailable_with_data_dir_hint(tmp_path, name):
    with pytest.raises(DatasetUnavailable, match="never downloaded.*--data-dir"):
        load_dataset(name, tmp_path)


def test_cifar_without_data_dir_is_unavailable():
    with pytest.raises(DatasetUnavailable, match="no data directory given"):
        load_dataset("cifar10")


def test_synthetic_is_identical_for_the_same_seed():
    first = load_dataset("synthetic", synthetic_samples=200, seed=3)
    second = load_dataset("synthetic", synthetic_samples=200, seed=3)
    np.testing.assert_array_equal(first.x, second.x)
    np.testing.assert_array_equal(first.y, second.y)


def test_synthetic_differs_between_seeds():
    first = load_dataset("synthetic", synthetic_samples=200, seed=3)
    second = load_dataset("synthetic", synthetic_samples=200, seed=4)
    assert not np.array_equal(first.x, second.x)


def test_synthetic_has_balanced_classes_in_1x28x28():
    data = load_dataset("synthetic", synthetic_samples=300, synthetic_classes=5)
    assert data.x.shape == (300, 1, 28, 28) and data.num_classes == 5
    assert np.bincount(data.y).tolist() == [60] * 5


def test_synthetic_is_learnable_but_not_trivial():
    data = load_dataset("synthetic", synthetic_samples=2000, seed=0)
    x = data.x.reshape(len(data.x), -1)
    train, test = slice(0, 1500), slice(1500, None)
    centroids = np.stack([x[train][data.y[train] == c].mean(0) for c in range(10)])
    distances = ((x[test][:, None, :] - centroids[None]) ** 2).sum(-1)
    accuracy = float((distances.argmin(1) == data.y[test]).mean())
    assert 0.5 < accuracy < 0.95


def test_unknown_dataset_lists_the_choices():
    with pytest.raises(ValueError, match="cifar100"):
        load_dataset("mnist")
