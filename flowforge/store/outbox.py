"""The publisher's statements: hand pending outbox rows to the broker, stamp the confirmed."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from flowforge.domain.model import Dispatch
from flowforge.store import rows
from flowforge.store.part import Part, Tx

#: Publishes a batch; returns the outbox ids the broker confirmed.
Send = Callable[[Sequence[Dispatch]], Collection[int]]


class Outbox(Part):
    """The transactional outbox, read and stamped by the publisher."""

    def publish_outbox(self, limit: int, send: Send, skip: Sequence[str] = ()) -> tuple[int, int]:
        """Lock up to ``limit`` pending outbox rows, but none bound for a queue in ``skip``,
        and hand them to ``send``.

        ``send`` publishes them and returns the outbox ids the broker *confirmed*; only those
        are stamped, in the same transaction. If ``send`` raises, nothing is stamped and every
        row stays pending. Returns (rows handed over, rows stamped).
        """
        return self._transaction(_publish, limit, send, list(skip))


def _publish(tx: Tx, limit: int, send: Send, skip: list[str]) -> tuple[int, int]:
    locked = tx.all("lock_outbox", {"limit": limit, "skip": skip})
    if not locked:
        return 0, 0
    batch = [rows.dispatch(r) for r in locked]
    confirmed = sorted(set(send(batch)) & {d.outbox_id for d in batch})
    if confirmed:
        tx.all("stamp_outbox", {"ids": confirmed})
    return len(batch), len(confirmed)
