"""Refused inbound messages counted by a bounded set of labels: what the status page and ``/metrics`` show of them.

An update verdict's reason can name tensors or carry a hostile device's text: it is mapped to one of a fixed set of
labels, and the number of labels is bounded, so neither the label set nor memory grows with what arrives.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

MAX_REFUSAL_KINDS = 64
"""Distinct refusal labels kept; any further kind counts as "other" (the label set, and memory, stay bounded)."""
UPDATE_REFUSALS = (("stale", "stale"), ("late", "late"), ("duplicate", "duplicate"), ("replay", "replay"),
                   ("not asked", "not asked"), ("malformed", "malformed"), ("unknown device", "unknown device"),
                   ("a message of", "wrong topic"), ("update of run", "wrong run"),
                   ("update for plan", "wrong plan"), ("tensor", "bad tensors"), ("num_samples", "sample count"),
                   ("metrics lack", "bad evaluation"), ("eval", "bad evaluation"), ("update is", "norm bound"),
                   ("non-finite", "non-finite"))
"""Prefixes of the engine's update verdicts (server.engine.coordinator, server.engine.robust) and their refusal label."""


def update_refusal(reason: str) -> str:
    """The refusal label of an update verdict's reason: one of a fixed set (the reason's text can name tensors)."""
    for prefix, label in UPDATE_REFUSALS:
        if reason.startswith(prefix):
            return f"update {label}"
    return "update other"


def count_refusal(counts: Counter, label: str) -> None:
    """Count one refusal under ``label``; once MAX_REFUSAL_KINDS - 1 labels are taken, new ones under "other"."""
    counts[label if label in counts or len(counts) < MAX_REFUSAL_KINDS - 1 else "other"] += 1


TRANSPORT_REFUSALS = (("frames_rejected", "frame rejected"), ("frames_repeated", "frame repeated"),
                      ("frames_unadmitted", "frame from no sender"),
                      ("messages_expired", "message expired"))
"""The endpoint's counters of frames it refused, and their refusal label."""


def all_refusals(snapshot: Mapping[str, Any]) -> dict[str, int]:
    out = dict(snapshot["refusals"])
    for key, label in TRANSPORT_REFUSALS:
        out[label] = out.get(label, 0) + snapshot["transport"].get(key, 0)
    return out
