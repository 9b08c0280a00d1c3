"""Datasets read from local files, their partitions over clients, and the per-device shards.

``DATASETS`` is here, torch-free, so the flags can name the choices before anything heavy loads."""
from __future__ import annotations

import argparse
import os

DATASETS = ("digits", "fmnist", "cifar10", "cifar100", "synthetic")
"""What server/data/datasets.py reads from files on this machine."""
NPZ_PREFIX = "npz:"
"""``--dataset npz:PATH``: a user's own arrays (server/data/datasets.py ``load_npz``)."""


def dataset_arg(text: str) -> str:
    """--dataset's type: a name of DATASETS, or npz:PATH with the path made absolute (it travels to a resumed run
    whatever its working directory)."""
    if text.startswith(NPZ_PREFIX):
        path = text[len(NPZ_PREFIX):]
        if not path:
            raise argparse.ArgumentTypeError(f"{text!r} names no file; write npz:PATH")
        return NPZ_PREFIX + os.path.abspath(path)
    if text not in DATASETS:
        raise argparse.ArgumentTypeError(f"{text!r} is unknown; choose one of {', '.join(DATASETS)}, or "
                                         f"{NPZ_PREFIX}PATH for your own arrays")
    return text
