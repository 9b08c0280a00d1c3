"""Datasets as normalized float32 arrays (N×C×H×W images; a user's ``npz:`` arrays of any per-sample shape),
read from local files only.

Every loader returns ALL samples (official train and test concatenated): the
partitioner splits each client's share 75/25 itself, as PFLlib does. Nothing is
ever downloaded: Fashion-MNIST comes from Debian's package, digits from
scikit-learn, CIFAR from a folder the user provides, synthetic from a seed.
"""

from __future__ import annotations

import gzip
import pickle
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from server.data import DATASETS, NPZ_PREFIX


FMNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
FMNIST_PACKAGE = "dataset-fashion-mnist"
FMNIST_FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}
CIFAR10_FOLDER = "cifar-10-batches-py"
CIFAR10_FILES = tuple(f"data_batch_{i}" for i in range(1, 6)) + ("test_batch",)
CIFAR100_FOLDER = "cifar-100-python"
CIFAR100_FILES = ("train", "test")
CIFAR_SIDE = 32
MNIST_SIDE = 28
DIGITS_SIDE = 8
DIGITS_MAX = 16.0
PIXEL_MAX = 255.0
DATA_DIR_OPTION = "--data-dir"

NUM_CLASSES = {"digits": 10, "fmnist": 10, "cifar10": 10, "cifar100": 100}
SYNTHETIC_CLASSES = 10
SYNTHETIC_SAMPLES = 6000
SYNTHETIC_COARSE_SIDE = 7
SYNTHETIC_MAX_SHIFT = 3
SYNTHETIC_MAX_MIX = 0.45
SYNTHETIC_NOISE = 0.6

# Per-channel (mean, std) of pixels scaled to [0, 1], over all samples of each
# dataset (digits after upsampling to 28×28, synthetic at its default settings).
CHANNEL_STATS = {
    "digits": ((0.3368,), (0.3227,)),
    "fmnist": ((0.2860,), (0.3530,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "synthetic": ((0.505,), (0.387,)),
}

IDX_DTYPES = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
IDX_HEADER_BYTES = 4
IDX_DIM_BYTES = 4


class DatasetUnavailable(FileNotFoundError):
    """The dataset's files are not on this machine (and will not be downloaded)."""


class DatasetFormatError(ValueError):
    """A dataset file exists but does not have the expected layout."""


@dataclass
class LabeledData:
    """All samples of one dataset: x normalized float32 (N, *sample shape), y int64 in [0, num_classes); for a
    user's arrays also the (mean, std) the samples were normalized with, to normalize a device's own data alike."""

    x: np.ndarray
    y: np.ndarray
    num_classes: int
    name: str
    normalization: tuple[np.ndarray, np.ndarray] | None = None

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Per-sample shape: (C, H, W) for images, (C, T), (T, D) or (D,) for a user's arrays."""
        return tuple(self.x.shape[1:])


def parse_idx(raw: bytes) -> np.ndarray:
    """Decode an IDX buffer (MNIST format): 2 zero bytes, dtype code, ndim, big-endian dims, data.

    Returns a native-endian copy shaped by the header's dims.
    """
    if len(raw) < IDX_HEADER_BYTES:
        raise DatasetFormatError(f"IDX data is {len(raw)} bytes, shorter than its 4-byte magic")
    zero_a, zero_b, code, ndim = raw[:IDX_HEADER_BYTES]
    if zero_a or zero_b or code not in IDX_DTYPES or ndim == 0:
        raise DatasetFormatError(f"bad IDX magic {raw[:IDX_HEADER_BYTES].hex()}")
    data_start = IDX_HEADER_BYTES + IDX_DIM_BYTES * ndim
    if len(raw) < data_start:
        raise DatasetFormatError(f"IDX header announces {ndim} dims but the data ends before them")
    dims = tuple(int(d) for d in np.frombuffer(raw, ">u4", count=ndim, offset=IDX_HEADER_BYTES))
    dtype = IDX_DTYPES[code]
    expected = int(np.prod(dims)) * dtype.itemsize
    if len(raw) - data_start != expected:
        raise DatasetFormatError(
            f"IDX dims {dims} of {dtype} need {expected} data bytes, found {len(raw) - data_start}"
        )
    values = np.frombuffer(raw, dtype, offset=data_start).reshape(dims)
    return values.astype(dtype.newbyteorder("="))


def read_idx(path: Path) -> np.ndarray:
    """Read a gzip-compressed (.gz) or raw IDX file."""
    raw = path.read_bytes()
    return parse_idx(gzip.decompress(raw) if path.suffix == ".gz" else raw)


def standardize(pixels01: np.ndarray, name: str) -> np.ndarray:
    """Per-channel standardize N×C×H×W pixels in [0, 1] with the dataset's fixed constants."""
    mean, std = (np.asarray(s, np.float32).reshape(1, -1, 1, 1) for s in CHANNEL_STATS[name])
    if pixels01.shape[1] != mean.shape[1]:
        raise DatasetFormatError(
            f"{name} expects {mean.shape[1]} channels, got images of shape {pixels01.shape[1:]}"
        )
    return ((pixels01.astype(np.float32) - mean) / std).astype(np.float32)


def _checked_labels(labels: np.ndarray, num_classes: int, source: str) -> np.ndarray:
    labels = np.asarray(labels).astype(np.int64)
    if labels.ndim != 1:
        raise DatasetFormatError(f"{source}: labels must be 1-D, got shape {labels.shape}")
    if len(labels) and (labels.min() < 0 or labels.max() >= num_classes):
        raise DatasetFormatError(
            f"{source}: labels span [{labels.min()}, {labels.max()}], outside [0, {num_classes})"
        )
    return labels


def _fmnist_folder(data_dir: Path) -> Path:
    """``data_dir`` if it holds the four Fashion-MNIST files; raises DatasetUnavailable naming the missing ones."""
    missing = [f for pair in FMNIST_FILES.values() for f in pair if not (data_dir / f).is_file()]
    if missing:
        raise DatasetUnavailable(
            f"Fashion-MNIST files {missing} not found in {data_dir}: install the Debian package "
            f"'{FMNIST_PACKAGE}' (apt-get install {FMNIST_PACKAGE}) or pass {DATA_DIR_OPTION} "
            f"pointing to a folder with the four *-ubyte.gz files"
        )
    return data_dir


NPZ_ARRAYS = ("x_train", "y_train", "x_test", "y_test")
NPZ_STATS = ("mean", "std")
NPZ_VOCABULARY = "vocabulary"
"""An npz holding ``vocabulary`` (a scalar V) declares its samples token ids 0..V-1: kept as they are (float32,
exact below MAX_TOKEN), never normalized; for a model whose FE embeds them (fedcore.tokens, docs/your_model.md)."""
MAX_TOKEN = 2 ** 24
"""Token ids must lie below this: float32 holds every integer up to it exactly."""
MAX_SAMPLE_DIMS = 4
"""A sample has 1 to 4 dimensions (what a device's HELLO can state)."""


def _npz_file(name: str) -> Path:
    """The file of ``npz:PATH`` if it is a .npz archive holding the four arrays; raises DatasetUnavailable or
    DatasetFormatError naming what is missing (reads the archive's directory, not its arrays)."""
    path = Path(name[len(NPZ_PREFIX):])
    if not path.is_file():
        raise DatasetUnavailable(f"no file {path}; write your arrays with numpy.savez(PATH, x_train=..., "
                                 "y_train=..., x_test=..., y_test=...)")
    try:
        with zipfile.ZipFile(path) as archive:
            members = {n.removesuffix(".npy") for n in archive.namelist()}
    except zipfile.BadZipFile:
        raise DatasetFormatError(f"{path} is not a .npz archive (numpy.savez writes one)") from None
    missing = [k for k in NPZ_ARRAYS if k not in members]
    if missing:
        raise DatasetFormatError(f"{path} lacks {missing}; it holds {sorted(members)} (needed: {list(NPZ_ARRAYS)}, "
                                 f"optional: {list(NPZ_STATS)})")
    return path


def load_npz(name: str) -> LabeledData:
    """A user's arrays (``npz:PATH``): x_train, y_train, x_test, y_test with samples of any shape of 1 to 4
    dimensions and labels 0..K-1 (K the largest label + 1), train and test concatenated as every dataset here is
    (the partition splits each device's share itself). Normalized with the file's ``mean`` and ``std`` (any shape
    that broadcasts to a sample) where it holds them, else with the training split's mean and std over all its
    values (one scalar each, right for any shape)."""
    path = _npz_file(name)
    with np.load(path, allow_pickle=False) as archive:
        arrays = {k: archive[k] for k in NPZ_ARRAYS}
        stats = {k: archive[k].astype(np.float32) for k in NPZ_STATS if k in archive.files}
        vocabulary = archive[NPZ_VOCABULARY] if NPZ_VOCABULARY in archive.files else None
    for split in ("train", "test"):
        x, y = arrays[f"x_{split}"], arrays[f"y_{split}"]
        if not np.issubdtype(x.dtype, np.number) or not 2 <= x.ndim <= MAX_SAMPLE_DIMS + 1:
            raise DatasetFormatError(f"{path}: x_{split} must be numbers of shape (N, sample dims...) with 1 to "
                                     f"{MAX_SAMPLE_DIMS} sample dims, got {x.dtype} {x.shape}")
        if len(x) != len(y) or not len(x):
            raise DatasetFormatError(f"{path}: x_{split} has {len(x)} samples and y_{split} {len(y)} labels")
        if not np.issubdtype(y.dtype, np.integer):
            raise DatasetFormatError(f"{path}: y_{split} must be integer labels 0..K-1, got {y.dtype}")
    sample = arrays["x_train"].shape[1:]
    if arrays["x_test"].shape[1:] != sample:
        raise DatasetFormatError(f"{path}: x_train samples are {sample} but x_test samples are "
                                 f"{arrays['x_test'].shape[1:]}")
    labels = np.concatenate([arrays["y_train"], arrays["y_test"]])
    num_classes = int(labels.max()) + 1
    if vocabulary is not None:
        return LabeledData(_token_samples(arrays, vocabulary, stats, path),
                           _checked_labels(labels, num_classes, str(path)), num_classes, name,
                           (np.zeros(sample, np.float32), np.ones(sample, np.float32)))
    if set(stats) == set(NPZ_STATS):
        mean, std = stats["mean"], stats["std"]
    elif stats:
        raise DatasetFormatError(f"{path} holds {sorted(stats)} without {sorted(set(NPZ_STATS) - set(stats))}: "
                                 "state both mean and std, or neither (then they come from x_train)")
    else:
        train = arrays["x_train"].astype(np.float64)
        mean, std = np.float32(train.mean()), np.float32(train.std())
    try:
        mean, std = (np.broadcast_to(s, sample).astype(np.float32) for s in (mean, std))
    except ValueError:
        raise DatasetFormatError(f"{path}: mean {np.shape(mean)} and std {np.shape(std)} do not broadcast to a "
                                 f"sample {sample}") from None
    if not (np.isfinite(std).all() and (std > 0).all()):
        raise DatasetFormatError(f"{path}: the std to normalize with must be positive and finite (a constant "
                                 "x_train? state mean and std in the file)")
    x = (np.concatenate([arrays["x_train"], arrays["x_test"]]).astype(np.float32) - mean) / std
    if not np.isfinite(x).all():
        raise DatasetFormatError(f"{path}: x_train or x_test holds NaN or infinite values")
    return LabeledData(x.astype(np.float32), _checked_labels(labels, num_classes, str(path)), num_classes,
                       name, (mean, std))


def _token_samples(arrays: dict[str, np.ndarray], vocabulary: np.ndarray, stats: dict, path: Path) -> np.ndarray:
    """x_train and x_test of a file that states its ``vocabulary``: integer ids 0..V-1, as float32."""
    if stats:
        raise DatasetFormatError(f"{path} states a {NPZ_VOCABULARY} (token ids) and {sorted(stats)}: token ids are "
                                 "not normalized, leave mean and std out")
    if vocabulary.ndim != 0 or not np.issubdtype(vocabulary.dtype, np.integer) \
            or not 1 <= int(vocabulary) <= MAX_TOKEN:
        raise DatasetFormatError(f"{path}: {NPZ_VOCABULARY} must be one integer from 1 to {MAX_TOKEN}, got "
                                 f"{vocabulary.dtype} {vocabulary.shape}")
    x = np.concatenate([arrays["x_train"], arrays["x_test"]])
    if not np.issubdtype(x.dtype, np.integer) or x.min() < 0 or x.max() >= int(vocabulary):
        raise DatasetFormatError(f"{path}: with {NPZ_VOCABULARY} {int(vocabulary)} the samples must be integer token "
                                 f"ids 0..{int(vocabulary) - 1}, got {x.dtype} from {x.min()} to {x.max()}")
    return x.astype(np.float32)


def check_available(name: str, data_dir: str | Path | None = None) -> None:
    """Raise DatasetUnavailable when ``name``'s files are not where :func:`load_dataset` would read them, without
    reading them: the drivers ask before they import torch, so a wrong --data-dir answers at once."""
    folder = Path(data_dir) if data_dir is not None else None
    if name.startswith(NPZ_PREFIX):
        _npz_file(name)
    elif name == "fmnist":
        _fmnist_folder(folder or FMNIST_DIR)
    elif name == "cifar10":
        _cifar_folder(folder, "CIFAR-10", CIFAR10_FOLDER, CIFAR10_FILES)
    elif name == "cifar100":
        _cifar_folder(folder, "CIFAR-100", CIFAR100_FOLDER, CIFAR100_FILES)


def _fmnist(data_dir: Path) -> tuple[np.ndarray, np.ndarray]:
    data_dir = _fmnist_folder(data_dir)
    images, labels = [], []
    for image_file, label_file in FMNIST_FILES.values():
        split_images = read_idx(data_dir / image_file)
        split_labels = read_idx(data_dir / label_file)
        if split_images.shape[1:] != (MNIST_SIDE, MNIST_SIDE) or split_images.dtype != np.uint8:
            raise DatasetFormatError(
                f"{image_file}: expected uint8 N×{MNIST_SIDE}×{MNIST_SIDE} images, "
                f"got {split_images.dtype} {split_images.shape}"
            )
        if len(split_images) != len(split_labels):
            raise DatasetFormatError(
                f"{image_file} has {len(split_images)} images but {label_file} "
                f"has {len(split_labels)} labels"
            )
        images.append(split_images)
        labels.append(_checked_labels(split_labels, NUM_CLASSES["fmnist"], label_file))
    pixels = np.concatenate(images)[:, None].astype(np.float32) / PIXEL_MAX
    return pixels, np.concatenate(labels)


def _digits() -> tuple[np.ndarray, np.ndarray]:
    from scipy.ndimage import zoom  # scipy and scikit-learn load with the datasets that use them, not with the flags
    from sklearn.datasets import load_digits

    bunch = load_digits()
    factor = MNIST_SIDE / DIGITS_SIDE
    upsampled = zoom(bunch.images / DIGITS_MAX, (1, factor, factor), order=1)
    return np.clip(upsampled, 0.0, 1.0)[:, None].astype(np.float32), bunch.target


def _cifar_folder(data_dir: Path | None, name: str, folder: str, files: tuple[str, ...]) -> Path:
    """The folder holding the batches: data_dir/folder, or data_dir itself if it holds them."""
    hint = (
        f"{name} is not bundled and is never downloaded: extract the python version of the "
        f"archive yourself and pass {DATA_DIR_OPTION} pointing to the folder that contains "
        f"'{folder}/'"
    )
    if data_dir is None:
        raise DatasetUnavailable(f"no data directory given; {hint}")
    for candidate in (data_dir / folder, data_dir):
        if all((candidate / f).is_file() for f in files):
            return candidate
    raise DatasetUnavailable(f"{name} batches {list(files)} not found under {data_dir}; {hint}")


def _unpickle_batch(path: Path, label_key: str) -> tuple[np.ndarray, np.ndarray]:
    """Read one CIFAR batch. The official format is a pickle: only load folders you trust."""
    with path.open("rb") as handle:
        batch = pickle.load(handle, encoding="bytes")
    entries = {(k.decode() if isinstance(k, bytes) else k): v for k, v in batch.items()}
    if "data" not in entries or label_key not in entries:
        raise DatasetFormatError(f"{path} lacks 'data' or '{label_key}' (keys: {sorted(entries)})")
    data = np.asarray(entries["data"], dtype=np.uint8)
    labels = np.asarray(entries[label_key])
    if data.ndim != 2 or data.shape[1] != 3 * CIFAR_SIDE * CIFAR_SIDE or len(data) != len(labels):
        raise DatasetFormatError(
            f"{path}: expected data N×{3 * CIFAR_SIDE * CIFAR_SIDE} with N labels, "
            f"got data {data.shape} and {len(labels)} labels"
        )
    return data.reshape(-1, 3, CIFAR_SIDE, CIFAR_SIDE), labels


def _cifar(data_dir: Path | None, name: str) -> tuple[np.ndarray, np.ndarray]:
    if name == "cifar10":
        folder = _cifar_folder(data_dir, "CIFAR-10", CIFAR10_FOLDER, CIFAR10_FILES)
        batches = [_unpickle_batch(folder / f, "labels") for f in CIFAR10_FILES]
    else:
        folder = _cifar_folder(data_dir, "CIFAR-100", CIFAR100_FOLDER, CIFAR100_FILES)
        batches = [_unpickle_batch(folder / f, "fine_labels") for f in CIFAR100_FILES]
    pixels = np.concatenate([images for images, _ in batches]).astype(np.float32) / PIXEL_MAX
    labels = _checked_labels(np.concatenate([lab for _, lab in batches]), NUM_CLASSES[name], name)
    return pixels, labels


def synthetic_pixels(
    num_samples: int, num_classes: int, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Seeded class-conditional images in [0, 1], 1×28×28, balanced labels.

    Each class has a smooth random prototype; a sample is its class prototype blended
    with up to 45% of another class's, shifted by up to 3 pixels, plus heavy Gaussian
    noise: a linear model reaches ~70-80%, so there is room for a CNN to learn.
    """
    if num_samples < num_classes or num_classes < 2:
        raise ValueError(
            f"synthetic data needs at least 2 classes and one sample per class, "
            f"got {num_samples} samples for {num_classes} classes"
        )
    from scipy.ndimage import zoom

    rng = np.random.default_rng(seed)
    coarse = rng.random((num_classes, SYNTHETIC_COARSE_SIDE, SYNTHETIC_COARSE_SIDE))
    factor = MNIST_SIDE / SYNTHETIC_COARSE_SIDE
    prototypes = zoom(coarse, (1, factor, factor), order=1)
    offsets = range(-SYNTHETIC_MAX_SHIFT, SYNTHETIC_MAX_SHIFT + 1)
    shifted = np.stack(
        [np.roll(prototypes, (dy, dx), axis=(1, 2)) for dy in offsets for dx in offsets], axis=1
    )
    labels = rng.permutation(np.arange(num_samples) % num_classes)
    others = rng.integers(0, num_classes, num_samples)
    shifts = rng.integers(0, shifted.shape[1], num_samples)
    mix = rng.uniform(0.0, SYNTHETIC_MAX_MIX, num_samples)[:, None, None]
    noise = rng.normal(0.0, SYNTHETIC_NOISE, (num_samples, MNIST_SIDE, MNIST_SIDE))
    images = (1 - mix) * shifted[labels, shifts] + mix * shifted[others, shifts] + noise
    return np.clip(images, 0.0, 1.0)[:, None].astype(np.float32), labels


def load_dataset(
    name: str,
    data_dir: str | Path | None = None,
    *,
    synthetic_samples: int = SYNTHETIC_SAMPLES,
    synthetic_classes: int = SYNTHETIC_CLASSES,
    seed: int = 0,
) -> LabeledData:
    """Load every sample of ``name`` (one of DATASETS), normalized, from local files.

    ``data_dir`` overrides where fmnist is read and says where CIFAR lives; digits and
    synthetic ignore it. ``seed`` and ``synthetic_*`` only affect the synthetic set.
    """
    if name.startswith(NPZ_PREFIX):
        return load_npz(name)
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; choose one of {DATASETS}")
    folder = Path(data_dir) if data_dir is not None else None
    if name == "fmnist":
        pixels, labels = _fmnist(folder or FMNIST_DIR)
    elif name == "digits":
        pixels, labels = _digits()
    elif name == "synthetic":
        pixels, labels = synthetic_pixels(synthetic_samples, synthetic_classes, seed)
    else:
        pixels, labels = _cifar(folder, name)
    num_classes = synthetic_classes if name == "synthetic" else NUM_CLASSES[name]
    return LabeledData(
        x=standardize(pixels, name),
        y=labels.astype(np.int64),
        num_classes=num_classes,
        name=name,
    )
