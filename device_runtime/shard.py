"""A client's local data on disk: one .npz per client, readable with numpy alone.

The server writes shards; the device loads its own. The format is a plain
``np.savez`` archive (no pickled objects), so a shard can be read safely with
``allow_pickle=False`` and without torch.
"""

from __future__ import annotations

import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SHARD_KEYS = ("x_train", "y_train", "x_test", "y_test", "num_classes")
FEATURE_DTYPE = np.float32
LABEL_DTYPE = np.int64
SHARD_FILENAME = "client_{:03d}.npz"
ZIP_MAGIC = b"PK\x03\x04"


class ShardError(ValueError):
    """A shard is malformed: missing keys, wrong dtypes or shapes, bad labels."""


@dataclass(frozen=True, eq=False)
class Shard:
    """One client's data: images N×C×H×W (float32) and labels (int64), split train/test.

    Construction validates, so a Shard that exists is well formed.
    """

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int

    def __post_init__(self) -> None:
        _check_num_classes(self.num_classes)
        _check_split("train", self.x_train, self.y_train, self.num_classes)
        _check_split("test", self.x_test, self.y_test, self.num_classes)
        if len(self.x_train) == 0:
            raise ShardError("shard has no training samples")
        if self.x_train.shape[1:] != self.x_test.shape[1:]:
            raise ShardError(
                f"x_train samples are {self.x_train.shape[1:]} but x_test samples are "
                f"{self.x_test.shape[1:]}; both splits must share C×H×W"
            )

    @property
    def input_shape(self) -> tuple[int, int, int]:
        """Per-sample shape (C, H, W)."""
        return tuple(self.x_train.shape[1:])


def _check_num_classes(num_classes: object) -> None:
    if isinstance(num_classes, bool) or not isinstance(num_classes, (int, np.integer)):
        raise ShardError(f"num_classes must be an integer, got {type(num_classes).__name__}")
    if num_classes < 1:
        raise ShardError(f"num_classes must be at least 1, got {num_classes}")


def _check_split(split: str, x: object, y: object, num_classes: int) -> None:
    if not isinstance(x, np.ndarray) or not isinstance(y, np.ndarray):
        raise ShardError(f"x_{split} and y_{split} must be numpy arrays")
    if x.dtype != FEATURE_DTYPE:
        raise ShardError(f"x_{split} must be float32, got {x.dtype}")
    if y.dtype != LABEL_DTYPE:
        raise ShardError(f"y_{split} must be int64, got {y.dtype}")
    if x.ndim != 4:
        raise ShardError(f"x_{split} must be 4-D (N, C, H, W), got shape {x.shape}")
    if y.ndim != 1:
        raise ShardError(f"y_{split} must be 1-D, got shape {y.shape}")
    if len(x) != len(y):
        raise ShardError(f"x_{split} has {len(x)} samples but y_{split} has {len(y)} labels")
    if not np.isfinite(x).all():
        raise ShardError(f"x_{split} contains NaN or infinite values")
    if len(y) and (y.min() < 0 or y.max() >= num_classes):
        raise ShardError(
            f"y_{split} labels span [{y.min()}, {y.max()}], outside [0, {num_classes})"
        )


def save_shard(path: str | Path, shard: Shard) -> None:
    """Write ``shard`` to exactly ``path`` as an uncompressed, pickle-free .npz."""
    with open(path, "wb") as handle:
        np.savez(
            handle,
            x_train=shard.x_train,
            y_train=shard.y_train,
            x_test=shard.x_test,
            y_test=shard.y_test,
            num_classes=np.int64(shard.num_classes),
        )


def load_shard(path: str | Path) -> Shard:
    """Read and validate a shard written by ``save_shard``; raise ShardError naming the file and its problem.

    A file that is not a zip archive is refused by its first bytes (numpy would read a text file as a pickle and
    blame ``allow_pickle``); a damaged archive (truncated, bad CRC) is reported as corrupt, in one line.
    """
    with open(path, "rb") as handle:
        head = handle.read(len(ZIP_MAGIC))
    if head != ZIP_MAGIC:
        what = "is empty" if not head else f"starts with {head!r}"
        raise ShardError(f"{path} is not a .npz archive: it {what}, not a zip header (a shard is written by "
                         f"python -m server.shards)")
    try:
        with np.load(path, allow_pickle=False) as archive:
            missing = [key for key in SHARD_KEYS if key not in archive.files]
            if missing:
                raise ShardError(f"shard {path} lacks keys {missing}; expected {list(SHARD_KEYS)}")
            arrays = {key: archive[key] for key in SHARD_KEYS}
    except ShardError:
        raise
    except (zipfile.BadZipFile, zlib.error, EOFError, OSError) as error:
        raise ShardError(f"shard {path} is corrupt ({error}); write it again") from error
    except ValueError as error:
        raise ShardError(f"shard {path} holds an array that is not a plain numpy array: {error}") from error
    num_classes = arrays.pop("num_classes")
    if num_classes.shape != () or not np.issubdtype(num_classes.dtype, np.integer):
        raise ShardError(
            f"num_classes in {path} must be an integer scalar, got "
            f"{num_classes.dtype} of shape {num_classes.shape}"
        )
    return Shard(num_classes=int(num_classes), **arrays)
