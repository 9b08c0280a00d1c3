"""``python -m tests.support.tight_member ARGS``: ``python -m server.aggregator ARGS`` on a tight read budget, for
tests of what a member does when even its spill cannot take an update (a full disk, its spill budget used up).

Its endpoint holds at most ``PENDING_UPDATES`` incomplete messages in memory and has no spill (budget 0), so a burst of
more updates half-received at once pushes the newest out: they are lost there (``MqttEndpoint.take_lost``)."""
from __future__ import annotations

import sys

from server import aggregator

PENDING_UPDATES = 2
"""Incomplete messages the member holds at once (the budget in messages; its bytes stay ``member_budgets``')."""

_member_budgets = aggregator.member_budgets


def tight_budgets(senders: int, brief) -> dict[str, int]:
    """``member_budgets`` with room for PENDING_UPDATES incomplete messages and no spill."""
    return {**_member_budgets(senders, brief), "max_pending_messages": PENDING_UPDATES,
            "max_pending_per_sender": PENDING_UPDATES, "max_spill_bytes": 0}


if __name__ == "__main__":
    aggregator.member_budgets = tight_budgets
    sys.exit(aggregator.main())
