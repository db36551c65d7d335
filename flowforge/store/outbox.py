"""The publisher's statements: hand pending outbox rows to the broker, stamp the confirmed."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from flowforge.domain.model import Dispatch
from flowforge.store import rows
from flowforge.store.part import Part, Tx

#: Publishes a batch; returns the outbox ids the broker confirmed.
Send = Callable[[Sequence[Dispatch]], Collection[int]]
#: Pending rows of a higher priority than the sweep's lowest, locked into the sweep.
More = Callable[[], list[Dispatch]]
#: Told the sweep's ``More`` before ``send`` runs (None once it is done).
Lane = Callable[[More | None], None]

#: Rows that join a sweep in flight at one time (the priority lane).
LANE_ROWS = 100


class Outbox(Part):
    """The transactional outbox, read and stamped by the publisher."""

    def publish_outbox(
        self, limit: int, send: Send, skip: Sequence[str] = (), lane: Lane | None = None
    ) -> tuple[int, int]:
        """Lock up to ``limit`` pending outbox rows, but none bound for a queue in ``skip``,
        and hand them to ``send``.

        ``send`` publishes them and returns the outbox ids the broker *confirmed*; only those
        are stamped, in the same transaction. If ``send`` raises, nothing is stamped and every
        row stays pending. Returns (rows handed over, rows stamped).

        ``lane`` is first given a function that locks (up to :data:`LANE_ROWS`) pending rows
        of a higher priority than the batch's lowest into this transaction and returns them:
        ``send`` may publish them too (while it waits for the confirms) and counts them in.
        """
        # pipelined: BEGIN goes with the lock, the stamp with the COMMIT (two round trips fewer
        # per sweep, and one fewer before a woken sweep's first message goes out)
        return self._pipelined(_publish, limit, send, list(skip), lane)


def _publish(tx: Tx, limit: int, send: Send, skip: list[str], lane: Lane | None) -> tuple[int, int]:
    locked = tx.all("lock_outbox", {"limit": limit, "skip": skip})
    if not locked:
        return 0, 0
    batch = [rows.dispatch(r) for r in locked]
    joined: list[Dispatch] = []
    above = min(d.priority for d in batch)

    def more() -> list[Dispatch]:
        taken = [d.outbox_id for d in (*batch, *joined)]
        params = {"above": above, "taken": taken, "skip": skip, "limit": LANE_ROWS}
        found = [rows.dispatch(r) for r in tx.all("lock_outbox_above", params)]
        joined.extend(found)
        return found

    if lane is not None:
        lane(more)
    try:
        sent = set(send(batch))
    finally:
        if lane is not None:
            lane(None)
    confirmed = sorted(sent & {d.outbox_id for d in (*batch, *joined)})
    if confirmed:
        late = [d.outbox_id for d in joined]
        tx.send("stamp_outbox", {"ids": confirmed, "joined": late})
    return len(batch) + len(joined), len(confirmed)
