"""How a round's evaluations and traffic are summed: the accuracy over devices and the byte directions a tier counts.

The round records (``round_record``) and the engine's byte book use them; ``server.outputs.report`` draws them.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from server.engine.coordinator import Evaluation
from server.engine.sampling import weighted_accuracy

TIER_DIRECTIONS = ("down", "up", "artifacts")
"""The training traffic of a tier, what the table's down/up/artifacts columns and the summary count."""
EVAL_DIRECTION = "eval"
"""Evaluation-only downloads (the task after the last round, devices not selected for training): counted apart."""


def evaluation_summary(evaluations: Iterable[Evaluation]) -> dict[str, Any]:
    """accuracy (Σ correct / Σ total), accuracy_std over devices, mean eval loss, and how many devices."""
    evaluations = list(evaluations)
    total = sum(e.total for e in evaluations)
    if total == 0:
        return {"accuracy": None, "accuracy_std": None, "eval_loss": None, "evaluated": len(evaluations)}
    accuracy, std = weighted_accuracy([e.correct for e in evaluations], [e.total for e in evaluations])
    loss = sum(e.loss * e.total for e in evaluations) / total
    return {"accuracy": accuracy, "accuracy_std": std, "eval_loss": loss, "evaluated": len(evaluations)}
