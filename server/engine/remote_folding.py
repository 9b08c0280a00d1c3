"""Remote folding: the engine's side of the aggregator processes (``server/aggregator.py``), apart from the round
logic. Which members are alive this round and which device each takes (``folding_records.route``), which of
their receipts counted (told to fold), the partial sums they sent, and what a lost member leaves to ask again.
The engine judges every receipt with the one update rule; this object only keeps the books."""
from __future__ import annotations

import logging
from collections.abc import Callable

from device_runtime.task import Update
from server.engine.aggregate import StreamingAverage
from server.engine.folding_records import Partial, Receipt, route
from server.engine.coordinator import Verdict

LOG = logging.getLogger("fedara.engine")


class RemoteFolding:
    """One run's aggregator bookkeeping; the round's state is cleared by :meth:`open_round`."""

    def __init__(self, dense_shapes: dict[str, tuple[int, ...]]):
        self.dense_shapes = dense_shapes
        self.members: tuple[str, ...] = ()  # the aggregators alive this round: each takes its devices' updates
        self._update_counters: dict[str, int] = {}  # device -> counter of its last update accepted from a receipt
        self._told: dict[str, dict[str, tuple[Update, int]]] = {}  # aggregator -> device -> (update, bytes) to fold
        self._partials: dict[str, Partial] = {}

    def open_round(self) -> None:
        self._told, self._partials = {}, {}

    def set_members(self, members: list[str] | tuple[str, ...] | set[str]) -> None:
        self.members = tuple(sorted(members))

    def route(self, device_id: str) -> str | None:
        return route(device_id, self.members)

    def receive_receipt(self, aggregator: str, receipt: Receipt, judge: Callable[[], Verdict],
                        trains: bool) -> Verdict:
        """A receipt from ``aggregator``: refused from a non-member or below the device's last counter, else
        ``judge()``'s verdict; an accepted training update is one the member is told to fold."""
        device_id = receipt.device_id
        if aggregator not in self.members:
            return Verdict(False, f"{aggregator} is not a member of round {receipt.round}'s aggregation")
        last = self._update_counters.get(device_id, 0)
        if receipt.counter <= last:
            return Verdict(False, f"replay: counter {receipt.counter} is not above the last accepted {last}")
        verdict = judge()
        if verdict.accepted:
            self._update_counters[device_id] = receipt.counter
            if trains:
                self._told.setdefault(aggregator, {})[device_id] = (verdict.update, receipt.nbytes)
        return verdict

    def member_lost(self, aggregator: str) -> list[str] | None:
        """``aggregator`` stopped answering: it is no member for the rest of the round. Returns the devices whose
        updates it was told to fold (to be awaited again), or None when it was no member."""
        if aggregator not in self.members:
            return None
        self.members = tuple(m for m in self.members if m != aggregator)
        return sorted(self._told.pop(aggregator, {}))

    def partials_missing(self) -> list[str]:
        """Aggregators told to fold updates this round whose partial sums have not come."""
        return sorted(set(self._told) - set(self._partials))

    def fold_list(self, aggregator: str) -> list[str]:
        """The devices whose updates ``aggregator`` was told to fold this round, as its CLOSE names them."""
        return sorted(self._told.get(aggregator, {}))

    def told_to_fold(self) -> dict[str, int]:
        """Aggregator -> how many of the open round's updates it was told to fold."""
        return {aggregator: len(told) for aggregator, told in self._told.items()}

    def receive_partial(self, aggregator: str, partial: Partial, open_round: int | None) -> str | None:
        """Take ``aggregator``'s partial sums of the open round; returns why they do not count, or None. They count
        only over exactly the updates it was told to fold, with their sample counts and the model's tensors."""
        if open_round is None or partial.round != open_round:
            open_now = "no round" if open_round is None else f"round {open_round}"
            return f"partial of round {partial.round}, {open_now} is open"
        if aggregator in self._partials:
            return "its partial for this round was already taken"
        told = self._told.get(aggregator, {})
        if sorted(partial.devices) != sorted(told):
            return f"it folded {sorted(partial.devices)}, it was told to fold {sorted(told)}"
        weight = sum(update.num_samples for update, _ in told.values())
        if partial.sum.count != len(told) or partial.sum.total_weight != weight:
            return (f"{partial.sum.count} updates of weight {partial.sum.total_weight:g}, expected {len(told)} of "
                    f"weight {weight:g}")
        shapes = {k: tuple(v.shape) for k, v in partial.sum.sums.items()}
        if shapes != self.dense_shapes or not all(bool(v.isfinite().all()) for v in partial.sum.sums.values()):
            return "its sums do not have the model's tensors, or hold NaN or infinity"
        self._partials[aggregator] = partial
        return None

    def merge(self, round_index: int, average: StreamingAverage
              ) -> tuple[dict[str, tuple[Update, int]], dict[str, str]]:
        """Merge the partials that came into ``average`` (in aggregator order). Returns the updates behind them
        (device -> (update, bytes)) and the devices whose member sent no partial, with why they count as not
        delivered."""
        merged: dict[str, tuple[Update, int]] = {}
        lost: dict[str, str] = {}
        for aggregator in sorted(self._told):
            told = self._told[aggregator]
            partial = self._partials.get(aggregator)
            if partial is None:
                LOG.warning("round %d: no partial sums from aggregator %s: its %d update(s) from %s count as not "
                            "delivered", round_index, aggregator, len(told), ", ".join(sorted(told)))
                lost.update(dict.fromkeys(sorted(told), f"aggregator {aggregator} sent no partial sums"))
                continue
            average.merge(partial.sum)
            merged.update(told)
        return merged, lost
