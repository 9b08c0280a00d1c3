"""Joining the Ray cluster a run names (``--ray [ADDRESS]``, docs/cluster.md): connect for the run's duration and
leave it as found.

ADDRESS is the head's host:port (``ray start --head`` prints it) or a ``ray://`` Ray Client address; without one
(``server.cli.LOCAL_RAY``) the run joins the Ray this machine runs (``ray start`` wrote its address under the temp
folder, or ``RAY_ADDRESS`` names it), else starts one of its own, which ``ray.shutdown`` stops when the run ends.
Usage statistics stay off (``RAY_USAGE_STATS_ENABLED=0``). Ray is imported only here and in the modules that hand it
work (``server.ray_devices``, ``server.sweep_runner``): a run without --ray never loads it.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from server.cli import LOCAL_RAY

log = logging.getLogger("fedara.ray")


class RayUnavailable(ValueError):
    """No Ray cluster answers at the address given, or the cluster cannot run what the run asks for."""


def ray_module() -> Any:
    """The ``ray`` package, with its usage statistics off (set before it is imported)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    return ray


@contextmanager
def connected(address: str) -> Iterator[Any]:
    """Ray, connected to the cluster at ``address`` (``LOCAL_RAY``: this machine's, or a new one) for the block; a
    connection this process already holds is used and kept."""
    ray = ray_module()
    if ray.is_initialized():
        yield ray
        return
    try:
        ray.init(address=None if address == LOCAL_RAY else address, logging_level=logging.WARNING,
                 log_to_driver=True, configure_logging=False)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        where = "this machine's Ray" if address == LOCAL_RAY else f"a Ray head at {address}"
        raise RayUnavailable(f"--ray {'' if address == LOCAL_RAY else address}: cannot join {where} "
                             f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}); start one with "
                             "`ray start --head` (docs/cluster.md)") from None
    try:
        resources = ray.cluster_resources()
        log.info("joined Ray at %s: %d node(s), %s", ray.get_runtime_context().gcs_address, len(alive_nodes()),
                 {k: v for k, v in resources.items() if k in ("CPU", "GPU")})
        yield ray
    finally:
        ray.shutdown()


def alive_nodes() -> list[dict]:
    """The cluster's nodes that are alive now (Ray's node records)."""
    return [n for n in ray_module().nodes() if n.get("Alive")]


def require_resources(cpus: float, gpus: float) -> None:
    """Raise RayUnavailable where no node of the cluster has ``cpus`` CPUs and ``gpus`` GPUs (a task asking for
    them would wait forever)."""
    for node in alive_nodes():
        have = node.get("Resources", {})
        if have.get("CPU", 0) >= cpus and have.get("GPU", 0) >= gpus:
            return
    what = f"{cpus:g} CPU(s)" + (f" and {gpus:g} GPU(s)" if gpus else "")
    raise RayUnavailable(f"--ray: no node of the cluster has {what} for one task "
                         f"(nodes: {[n.get('Resources', {}) for n in alive_nodes()]}); lower --threads, or add a "
                         "node that has them" + (" (ray start --num-gpus N)" if gpus else ""))
