"""Part._pipelined: a pipelined transaction where libpq has pipeline mode, a plain one where not;
Tx.send and Tx.notify in a transaction that is not pipelined run at once, in it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from flowforge.store import part
from flowforge.store.part import Part, Tx


class FakeCursor:
    def __init__(self) -> None:
        self.executed: list[bytes] = []

    def execute(self, query: bytes, params: object = None) -> FakeCursor:
        self.executed.append(query)
        return self


class FakeDatabase:
    """Records which kind of transaction a part asked for."""

    def __init__(self) -> None:
        self.kinds: list[str] = []
        self.cursor = FakeCursor()

    def run(self, work: Callable[..., Any], *args: Any) -> Any:
        self.kinds.append("plain")
        return work(self.cursor, *args)

    def run_pipelined(self, work: Callable[..., Any], *args: Any) -> Any:
        self.kinds.append("pipelined")
        raise AssertionError("not reached in these tests")


class Probe(Part):
    def notify_in_pipeline(self) -> str:
        def work(tx: Tx) -> str:
            tx.send("notify_outbox")
            tx.notify("notify_scheduler")
            return "done"

        return self._pipelined(work)


def test_without_pipeline_mode_a_pipelined_part_runs_a_plain_transaction(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(part, "PIPELINES", False)
    db = FakeDatabase()
    assert Probe(db).notify_in_pipeline() == "done"  # type: ignore[arg-type]
    assert db.kinds == ["plain"]
    # send and notify ran at once, in the transaction, in order
    assert [b"pg_notify('flowforge_outbox'" in q for q in db.cursor.executed] == [True, False]
    assert b"pg_notify('flowforge_scheduler'" in db.cursor.executed[1]


def test_with_pipeline_mode_a_pipelined_part_asks_for_a_pipelined_transaction(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(part, "PIPELINES", True)
    db = FakeDatabase()
    with pytest.raises(AssertionError, match="not reached"):
        Probe(db).notify_in_pipeline()  # type: ignore[arg-type]
    assert db.kinds == ["pipelined"]
