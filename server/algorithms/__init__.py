"""The federated algorithms, one file each, behind one small interface (``base.Algorithm``).

An algorithm decides what each client trains (the phases of its task, λ and μ), what it sends back and
whether the server aggregates; it never touches the network. The round engine (``server.engine.round_engine``) runs any of
them with in-process devices (``python -m server.simulate``) or MQTT devices (``python -m server.broker_loop``).
"""
from __future__ import annotations

from server.algorithms.base import Algorithm, Settings
from server.algorithms.fedara import FedAra
from server.algorithms.fedavg import FedAvg
from server.algorithms.fedrep import FedRep
from server.algorithms.local import Local

REGISTRY: dict[str, type[Algorithm]] = {"fedara": FedAra, "fedavg": FedAvg, "fedrep": FedRep, "local": Local}


def get_algorithm(name: str, settings: Settings) -> Algorithm:
    """The algorithm called ``name``, built with the run's ``settings`` (ValueError naming the choices otherwise)."""
    if name not in REGISTRY:
        raise ValueError(f"unknown algorithm {name!r}; choose one of {', '.join(REGISTRY)}")
    return REGISTRY[name].from_settings(settings)
