"""Datasets read from local files, their partitions over clients, and the per-device shards.

``DATASETS`` is here, torch-free, so the flags can name the choices before anything heavy loads."""

DATASETS = ("digits", "fmnist", "cifar10", "cifar100", "synthetic")
"""What server/data/datasets.py reads from files on this machine."""
