"""A publisher channel the broker nacks whole, batch after batch, is given up (the role then
reconnects): a RabbitMQ channel's quorum-queue client can go on refusing every publish after
the queue's leader died while a fresh channel publishes at once. A batch with any message
acked keeps the channel, and restarts the count (flowforge/broker/publish.py)."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
from pika.spec import Basic

from flowforge.broker.publish import NACK_STREAK_LIMIT, ConfirmingPublisher
from flowforge.config import BrokerConfig
from flowforge.domain.model import Dispatch
from flowforge.errors import BrokerUnavailableError

#: How the broker answers one batch: "nack" every message, "ack" every one, or "part"
#: (the first message acked, the rest nacked).
Answer = str


class Channel:
    def basic_publish(self, **_message: Any) -> None:
        pass  # the broker's answer comes from the test, through _on_confirm


def publisher(answers: list[Answer]) -> ConfirmingPublisher:
    """A publisher on a stand-in channel whose n-th batch the broker answers ``answers[n]``."""
    found = ConfirmingPublisher(BrokerConfig())
    found._conn = SimpleNamespace(is_open=True)  # type: ignore[assignment]
    found._channel = Channel()  # type: ignore[assignment]
    found._ready = True
    found._declared = {found._config.queue}  # connected: its queue declared
    batches = iter(answers)

    def answer(done: Callable[[], bool], _timeout_s: float, _failure: bool = True) -> bool:
        kind = next(batches)
        for n, tag in enumerate(sorted(found._pending)):
            acked = kind == "ack" or (kind == "part" and n == 0)
            method = Basic.Ack(delivery_tag=tag) if acked else Basic.Nack(delivery_tag=tag)
            found._on_confirm(SimpleNamespace(method=method))
        return done()

    found._run_until = answer  # type: ignore[method-assign]
    return found


def batch(first: int, size: int = 4) -> list[Dispatch]:
    return [Dispatch(i, uuid.uuid4(), 1) for i in range(first, first + size)]


def test_batches_nacked_whole_give_the_channel_up_at_the_limit() -> None:
    refusing = publisher(["nack"] * NACK_STREAK_LIMIT)
    for n in range(NACK_STREAK_LIMIT - 1):
        assert refusing.publish(batch(10 * n)) == set()  # rows stay pending, channel kept
        assert refusing.is_open
    with pytest.raises(BrokerUnavailableError, match="nacked every message of 3 batches"):
        refusing.publish(batch(100))
    assert not refusing.is_open  # nothing publishes on it again: the role reconnects


@pytest.mark.parametrize("kind", ["ack", "part"])
def test_a_batch_acked_even_in_part_keeps_the_channel_and_restarts_the_count(kind: str) -> None:
    answers = ["nack"] * (NACK_STREAK_LIMIT - 1) + [kind] + ["nack"] * (NACK_STREAK_LIMIT - 1)
    found = publisher(answers)
    acked = {"ack": range(4), "part": range(1), "nack": range(0)}
    for n, expected in enumerate(answers):
        assert found.publish(batch(10 * n)) == {10 * n + i for i in acked[expected]}
    assert found.is_open


def test_an_empty_batch_is_no_refusal() -> None:
    found = publisher(["nack"] * (NACK_STREAK_LIMIT + 2))
    for n in range(NACK_STREAK_LIMIT - 1):
        found.publish(batch(10 * n))
    assert found.publish([]) == set()
    assert found.is_open
