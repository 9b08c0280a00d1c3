"""What a reader of devices' updates holds: the server's endpoint and each aggregator process's take the same budgets.

Hundreds of devices answering at once reach a reader as that many updates half-received (mosquitto forwards one frame
of each publisher in turn). The reader holds a few of them in memory; past that the authenticated ones wait in files
(``device_runtime/spill.py``) instead of being pushed out, which loses them (their devices are asked again: each
such update is sent twice; an aggregator names its lost ones to the engine, which asks for them the same way). Complete
updates wait for the reader's main loop in a bounded queue; past it the broker holds them (backpressure), so the
reader's memory does not grow with the fleet. ``reader_budgets`` is that rule, in the ``MqttEndpoint`` arguments
(and ``MqttEndpoint.set_budgets``'s, for an aggregator that learns the largest update at the round's brief).
"""
from __future__ import annotations

from server.mqtt.admission import PENDING_PER_SENDER

PENDING_UPDATES_BUDGETED = 8
"""A reader's reassembly budget in memory, in largest inbound updates (over all topics together). Hundreds of devices
answering at once have that many updates half-received: past this budget the authenticated ones go to the spill
instead of being pushed out and asked for again (``Federation._ask_again_lost``: each such update was sent twice, ~270
of 1,000 in a round at K = 1,000), so the budget trades memory for page cache, never for updates or re-sends."""
SPILL_DIR = "spill"
"""Folder of the reader's run folder (the server's, an aggregator's workdir) where incomplete updates past the memory
budget wait, removed when the reader exits: at most one largest update per enrolled device, what every device's answer
half-received at once needs."""
PENDING_MESSAGES = 512
"""Incomplete inbound messages a reader holds in memory at once, at most (within the budget above)."""
QUEUED_UPDATES_BUDGETED = 2
"""Complete messages waiting for the reader's main loop, in largest inbound updates: past that the broker holds them
(backpressure, ``inbox.Inbox(wait=True)``)."""
AWAITING_UPDATES_BUDGETED = 4
"""An aggregator member's verified updates awaiting the engine's verdict in memory, in largest inbound updates: past
that they wait in files of its spill folder (``server.awaiting_updates``), at most one per device a round."""


def reader_budgets(max_inbound: int, senders: int, largest: int | None = None) -> dict[str, int]:
    """The budgets of an endpoint that reads the updates of ``senders`` enrolled devices, each at most ``max_inbound``
    bytes; ``largest``: the largest message it takes of any kind, where that is more (an aggregator's brief)."""
    largest = max(max_inbound, largest or 0)
    return {"max_message_bytes": largest,
            "max_pending_bytes": max(PENDING_UPDATES_BUDGETED * max_inbound, largest),
            "max_pending_messages": PENDING_MESSAGES,
            "max_pending_per_sender": PENDING_PER_SENDER,
            "max_pending_bytes_per_sender": largest,
            "max_spill_bytes": senders * max_inbound,
            "max_queued_bytes": max(QUEUED_UPDATES_BUDGETED * max_inbound, largest)}
