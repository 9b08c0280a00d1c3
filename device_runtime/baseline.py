"""What an accuracy is read beside: the majority-class baseline, and whether a model answers one class only.

On a skewed shard a model that answers its most common label for everything scores that label's share (129 of
149 test samples of one class: 0.8658), which looks like a good model. Every place that shows a device's
accuracy (``predict``, model.json, report.md, the status page) shows this baseline beside it and flags a model
whose predictions hold one class: the figures come from here, once. numpy only (the device imports it).
"""
from __future__ import annotations

import numpy as np


def majority(labels: np.ndarray) -> tuple[int | None, int]:
    """(the most common label, its count) of ``labels``; (None, 0) when there are none (ties: the smallest id)."""
    labels = np.asarray(labels)
    if labels.size == 0:
        return None, 0
    counts = np.bincount(labels.astype(np.int64, copy=False).ravel())
    return int(counts.argmax()), int(counts.max())


def predicted_classes(predictions: np.ndarray) -> int:
    """How many distinct classes ``predictions`` (class ids) hold."""
    return int(np.unique(np.asarray(predictions)).size)


def one_class(classes: int | None, total: int) -> bool:
    """Whether a model that answered ``classes`` distinct classes over ``total`` > 1 samples is trivial."""
    return classes == 1 and total > 1


def describe(correct: int, total: int, majority_count: int | None, classes: int | None) -> str:
    """One line: the accuracy, the majority-class baseline beside it, and the one-class flag."""
    text = f"{correct}/{total} correct ({correct / total:.4f})" if total else "no samples"
    if majority_count is not None and total:
        text += f", majority-class baseline {majority_count / total:.4f}"
    if one_class(classes, total):
        text += ": ONE CLASS predicted for every sample (a trivial model)"
    return text
