"""One colour per rank tier, the same in report.md's plots and on the status page: matplotlib's tab10 cycle in
tier order (largest ratio first), so tier 1 is blue, the next orange, then green, wherever a run is looked at."""
from __future__ import annotations

from collections.abc import Iterable

TAB10 = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")
ALL_DEVICES = "#222222"
"""The line of every device pooled (the page's "all"), apart from any tier's colour."""


def tier_order(tier: str) -> tuple[int, float, str]:
    """Largest ratio first; a tier that is not a number goes last."""
    try:
        return (0, -float(tier), tier)
    except ValueError:
        return (1, 0.0, tier)


def tier_colors(tiers: Iterable[str]) -> dict[str, str]:
    """Each of ``tiers`` (labels such as "1", "0.5") -> its colour, by its place in tier order."""
    ordered = sorted(set(map(str, tiers)), key=tier_order)
    return {tier: TAB10[i % len(TAB10)] for i, tier in enumerate(ordered)}
