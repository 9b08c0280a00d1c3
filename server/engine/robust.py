"""Norm-bounded updates, an optional robust-aggregation rule (off by default).

A client's FE is reconstructed to full rank and measured by its L2 distance from the current global FE
(all FE tensors taken as one vector). Within the bound it counts as sent. Beyond it, ``clip`` scales it back
onto the bound along the same direction (ω + (W − ω)·bound/distance); ``reject`` leaves it out of the
round. Since the new global FE is a weighted mean of the counted FEs, no single client can then move it
further than the bound, whatever it sends.

The distance includes what a low-rank client cannot express: an untrained client at ratio r < 1 already
sits at the global FE's truncation error from it. Choose the bound above that floor (the broker loop logs
every measured distance while the rule is on).
"""
from __future__ import annotations

import math
from dataclasses import replace

import torch

from device_runtime.task import Update
from fedcore.lowrank import reconstruct_state
from server.engine.run_config import NormAction, NormBound
from server.engine.sampling import to_numpy, to_torch




def fe_distance(client_dense: dict[str, torch.Tensor], global_fe: dict[str, torch.Tensor]) -> float:
    """‖W − ω‖₂ over every FE tensor, in float64; both must hold the same names and shapes."""
    if client_dense.keys() != global_fe.keys():
        raise ValueError(f"client FE names {sorted(client_dense)} differ from the global FE's {sorted(global_fe)}")
    squares = sum(float(((client_dense[k].double() - g.double()) ** 2).sum()) for k, g in global_fe.items())
    return math.sqrt(squares)


def clip_to_bound(client_dense: dict[str, torch.Tensor], global_fe: dict[str, torch.Tensor],
                  bound: float) -> dict[str, torch.Tensor]:
    """The client FE moved towards the global FE until it is at most ``bound`` away (unchanged if already)."""
    distance = fe_distance(client_dense, global_fe)
    if distance <= bound:
        return client_dense
    scale = bound / distance
    return {k: (g.double() + (client_dense[k].double() - g.double()) * scale).to(g.dtype) for k, g in global_fe.items()}


def bound_update(update: Update, global_fe: dict[str, torch.Tensor],
                 rule: NormBound) -> tuple[Update | None, float]:
    """(the update to aggregate, or None when ``reject`` refuses it; its distance from the global FE).

    Within the bound the update is returned as sent; clipped, it carries the dense, clipped FE."""
    shapes = {k: tuple(v.shape) for k, v in global_fe.items()}
    dense = reconstruct_state(to_torch(update.weights), shapes)
    distance = fe_distance(dense, global_fe)
    if distance <= rule.bound:
        return update, distance
    if rule.action == NormAction.REJECT:
        return None, distance
    return replace(update, weights=to_numpy(clip_to_bound(dense, global_fe, rule.bound))), distance


def rejection_reason(distance: float, rule: NormBound) -> str:
    return f"update is {distance:.6g} from the global FE, over the norm bound {rule.bound:g}"


