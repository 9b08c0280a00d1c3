"""BatchNorm's tensors by name, for every side of a federation (torch-free): the running statistics
(``<layer>.running_mean`` / ``.running_var``), which a forward in train mode updates and no gradient touches, and
the batch counter (``.num_batches_tracked``), which nothing needs once a BatchNorm has a momentum (a model
without one is refused) and so is never sent, stored or averaged.

Under ``--bn-stats personal`` the server sends no statistics: a device keeps its own (FedBN) and sends none back;
under ``shared`` they travel with the FE and are averaged by samples, as its weights are (FedAvg-BN)."""
from __future__ import annotations

STATISTIC_SUFFIXES = (".running_mean", ".running_var")
COUNTER_SUFFIX = ".num_batches_tracked"


def is_statistic(name: str) -> bool:
    """A BatchNorm running mean or variance."""
    return name.endswith(STATISTIC_SUFFIXES)


def is_counter(name: str) -> bool:
    """A BatchNorm batch counter (never federated)."""
    return name.endswith(COUNTER_SUFFIX)
